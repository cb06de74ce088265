"""The one data contract between producers and drafters: what a ring item carries.

A producer writes these tensors into a slot (in this order), a drafter reads them back by the same
names; the item's msgpack meta says where the batch came from. A renamed or missing tensor is a
`SlotContractError` naming it at the reader, not a KeyError deep in a prefetch thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dflash_ring.common.slot_format import SlotLayout

if TYPE_CHECKING:
    import torch

INPUT_IDS, LOSS_MASK, CU_SEQLENS, SAMPLE_IDS = "input_ids", "loss_mask", "cu_seqlens", "sample_ids"
SOURCE_IDS, FEATURES, FINAL_HIDDEN = "source_ids", "features", "final_hidden"
# Host-side tensors, copied from the batch's numpy arrays of the same names.
HOST_TENSORS = (INPUT_IDS, LOSS_MASK, CU_SEQLENS, SAMPLE_IDS, SOURCE_IDS)
META_KEYS = ("producer", "epoch", "position", "num_tokens", "num_sequences", "sources", "eval")


class SlotContractError(RuntimeError):
    """An item that does not carry what the contract says; the message names the tensor."""


def item_tensors(
    num_tokens: int, num_sequences: int, width: int, hidden: int | None, dtype: torch.dtype
) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """Every tensor of one item, in slot order. `hidden` is None unless the final state is shipped."""
    import torch

    specs = [
        (INPUT_IDS, torch.int32, (num_tokens,)),
        (LOSS_MASK, torch.uint8, (num_tokens,)),
        (CU_SEQLENS, torch.int32, (num_sequences + 1,)),
        (SAMPLE_IDS, torch.int64, (num_sequences,)),
        (SOURCE_IDS, torch.int32, (num_sequences,)),
        (FEATURES, dtype, (num_tokens, width)),
    ]
    if hidden is not None:
        specs.append((FINAL_HIDDEN, dtype, (num_tokens, hidden)))
    return specs


def check_fits(
    slot_bytes: int, header_bytes: int, max_tokens: int, width: int, hidden: int | None, dtype: torch.dtype
) -> None:
    """Fail at start, not at the first long batch, when the largest possible item overflows a slot."""
    layout = SlotLayout(slot_bytes, header_bytes)
    try:
        for spec in item_tensors(max_tokens, max_tokens, width, hidden, dtype):
            layout.add(*spec)
    except ValueError as e:
        raise SlotContractError(
            f"a full batch of data.max_tokens_per_batch = {max_tokens} tokens does not fit a slot: {e}"
        ) from None


@dataclass
class ItemView:
    """A reader's view of one item's tensors (zero-copy views into the slot) and its meta."""

    input_ids: torch.Tensor  # [T] int32
    loss_mask: torch.Tensor  # [T] uint8
    cu_seqlens: torch.Tensor  # [S + 1] int32
    sample_ids: torch.Tensor  # [S] int64
    source_ids: torch.Tensor  # [S] int32, each sequence's source: an index into meta["sources"]
    features: torch.Tensor  # [T, n * H]
    final_hidden: torch.Tensor | None  # [T, H] when shipped
    meta: dict[str, Any]


def read_item(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> ItemView:
    missing = [name for name in (*HOST_TENSORS, FEATURES) if name not in tensors]
    if missing:
        raise SlotContractError(
            f"ring item lacks {missing} (has {sorted(tensors)}): producer and drafter "
            "run different versions of the slot contract"
        )
    return ItemView(*(tensors[name] for name in (*HOST_TENSORS, FEATURES)), tensors.get(FINAL_HIDDEN), dict(meta))


def item_sources(meta: dict[str, Any]) -> list[str]:
    """The source names an item's `source_ids` index, checked so a bad item fails here by name."""
    names = meta.get("sources")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise SlotContractError(
            f"ring item meta has no list of source names (sources = {names!r}): producer and "
            "drafter run different versions of the slot contract"
        )
    return names
