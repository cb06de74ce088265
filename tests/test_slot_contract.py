"""The producer/drafter data contract: one list of tensors, checked by name at the reader."""

from __future__ import annotations

import pytest
import torch

from dflash_ring.common.slot_contract import (
    FEATURES,
    FINAL_HIDDEN,
    SlotContractError,
    check_fits,
    item_sources,
    item_tensors,
    read_item,
)


def test_items_carry_ids_masks_boundaries_samples_sources_and_features_in_that_order():
    specs = item_tensors(10, 3, 8, None, torch.bfloat16)
    assert [(n, d, s) for n, d, s in specs] == [
        ("input_ids", torch.int32, (10,)),
        ("loss_mask", torch.uint8, (10,)),
        ("cu_seqlens", torch.int32, (4,)),
        ("sample_ids", torch.int64, (3,)),
        ("source_ids", torch.int32, (3,)),
        (FEATURES, torch.bfloat16, (10, 8)),
    ]
    assert item_tensors(10, 3, 8, 4, torch.float32)[-1] == (FINAL_HIDDEN, torch.float32, (10, 4))


def test_the_reader_names_a_missing_tensor():
    tensors = {
        name: torch.zeros(shape, dtype=dtype) for name, dtype, shape in item_tensors(4, 1, 2, None, torch.float32)
    }
    view = read_item(tensors, {"producer": 0, "sources": ["code", "chat"]})
    assert view.features.shape == (4, 2) and view.final_hidden is None and view.source_ids.shape == (1,)
    assert item_sources(view.meta) == ["code", "chat"]
    with pytest.raises(SlotContractError, match="source names"):
        item_sources({"producer": 0})
    del tensors["loss_mask"]
    with pytest.raises(SlotContractError, match="loss_mask"):
        read_item(tensors, {})


def test_a_batch_too_large_for_a_slot_is_refused_at_start():
    check_fits(1 << 20, 4096, 128, 64, None, torch.float32)
    with pytest.raises(SlotContractError, match="max_tokens_per_batch = 4096"):
        check_fits(1 << 20, 4096, 4096, 64, None, torch.float32)
