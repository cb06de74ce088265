"""Shards, epochs, token budgets and exact resume for producer batches."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_ring.producer.batching import Batch, Cursor, ShardBatcher, plan_epoch
from dflash_ring.common.config.data import DataConfig
from dflash_ring.producer.pretokenized import TokenizedData, load_tokenized
from dflash_ring.embedded.tiny_tokenizer import tiny_chat_tokenizer


def synthetic(lengths: list[int] | np.ndarray, seed: int = 0) -> TokenizedData:
    """Materialized arrays without a tokenizer: token values encode (sample, position) for checking gathers."""
    lengths = np.asarray(lengths, dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    sample_of = np.repeat(np.arange(len(lengths)), lengths)
    tokens = (sample_of * 10_000 + np.arange(offsets[-1]) - offsets[sample_of]).astype(np.int32)
    loss_mask = np.random.default_rng(seed).integers(0, 2, offsets[-1]).astype(np.uint8)
    return TokenizedData(
        tokens=tokens,
        loss_mask=loss_mask,
        offsets=offsets,
        # Skipped rows leave gaps: sample i came from row 3 * i.
        row_ids=np.arange(len(lengths), dtype=np.int64) * 3,
        num_rows=3 * len(lengths),
        bad_rows=(),
        directory=Path("."),
        from_cache=False,
    )


@pytest.fixture(scope="module")
def data() -> TokenizedData:
    return synthetic(np.random.default_rng(1).integers(1, 300, 600))


def shards(data: TokenizedData, world: int, **kw) -> list[list[Batch]]:
    kw = {"max_tokens_per_batch": 1024, "epochs": 2, "seed": 7, **kw}
    return [list(ShardBatcher(data, rank=r, world_size=world, **kw).batches()) for r in range(world)]


def test_three_producers_cover_every_sample_once_per_epoch(data):
    per_rank = shards(data, 3)
    assert all(per_rank)
    orders = []
    for epoch in (0, 1):
        ids = np.concatenate([b.sample_ids for batches in per_rank for b in batches if b.epoch == epoch])
        assert sorted(ids.tolist()) == data.row_ids.tolist()
        orders.append(np.concatenate([b.sample_ids for b in per_rank[0] if b.epoch == epoch]))
    assert not np.array_equal(orders[0][:50], orders[1][:50])
    # Each producer's share is within one batch of the others'.
    counts = [sum(b.epoch == 0 for b in batches) for batches in per_rank]
    assert max(counts) - min(counts) <= 1


def test_same_seed_same_batches_other_seed_other_order(data):
    first, again = shards(data, 2), shards(data, 2)
    assert [[b.sample_ids.tolist() for b in bs] for bs in first] == [
        [b.sample_ids.tolist() for b in bs] for bs in again
    ]
    other = shards(data, 2, seed=8)
    assert [b.sample_ids.tolist() for b in other[0]] != [b.sample_ids.tolist() for b in first[0]]


@pytest.mark.parametrize("packing", [True, False])
def test_token_budget_and_padding(data, packing):
    budget = 1024
    for batches in shards(data, 2, max_tokens_per_batch=budget, packing=packing):
        for b in batches:
            real = int(b.lengths.sum())
            laid_out = real if packing else len(b.lengths) * int(b.lengths.max())
            assert b.num_tokens == real <= laid_out <= budget
            assert b.padding_fraction == pytest.approx(1 - real / laid_out)
            if packing:
                assert b.padding_fraction == 0.0


def test_length_bucketing_reduces_padding(data):
    def padding(window: int) -> float:
        batches = [b for bs in shards(data, 1, packing=False, bucket_window=window, epochs=1) for b in bs]
        real = sum(b.num_tokens for b in batches)
        return 1 - real / sum(len(b.lengths) * int(b.lengths.max()) for b in batches)

    assert padding(256) < padding(1) / 2


def test_batch_holds_the_samples_tokens(data):
    b = shards(data, 1)[0][3]
    assert b.input_ids.dtype == np.int32 and b.loss_mask.dtype == np.uint8
    assert b.cu_seqlens[0] == 0 and b.cu_seqlens[-1] == b.num_tokens
    assert np.array_equal(np.diff(b.cu_seqlens), b.lengths)
    for j, row in enumerate(b.sample_ids):
        i = int(row) // 3
        piece = slice(b.cu_seqlens[j], b.cu_seqlens[j + 1])
        whole = slice(data.offsets[i], data.offsets[i + 1])
        assert np.array_equal(b.input_ids[piece], data.tokens[whole])
        assert np.array_equal(b.loss_mask[piece], data.loss_mask[whole])
    ids, attention, loss = b.padded(pad_id=-1)
    assert ids.shape == (len(b.lengths), int(b.lengths.max()))
    assert np.array_equal(attention.sum(1), b.lengths) and np.array_equal(ids[attention == 1], b.input_ids)
    assert (ids[attention == 0] == -1).all() and np.array_equal(loss[attention == 1], b.loss_mask)


def key(b: Batch) -> tuple:
    return b.epoch, b.position, b.cursor, tuple(b.sample_ids.tolist())


def test_resume_from_any_committed_cursor_yields_exactly_the_rest(data):
    batcher = ShardBatcher(data, rank=1, world_size=3, max_tokens_per_batch=1024, epochs=2, seed=7)
    everything = [key(b) for b in batcher.batches()]
    # Across the epoch boundary too: the last batch of epoch 0 commits Cursor(1, 0).
    assert Cursor(1, 0) in [k[2] for k in everything]
    for i, (_, _, cursor, _) in enumerate(everything):
        fresh = ShardBatcher(data, rank=1, world_size=3, max_tokens_per_batch=1024, epochs=2, seed=7)
        assert [key(b) for b in fresh.batches(from_cursor=cursor)] == everything[i + 1 :]
    assert everything[-1][2] == Cursor(2, 0)
    assert [key(b) for b in batcher.batches(Cursor(0, 0))] == everything
    assert [k[2] for k in everything] == sorted(k[2] for k in everything)


def test_cursor_past_the_plan_is_refused(data):
    batcher = ShardBatcher(data, rank=0, world_size=3, max_tokens_per_batch=1024, epochs=1)
    with pytest.raises(ValueError, match="past"):
        next(batcher.batches(Cursor(0, len(batcher.epoch_plan(0)) + 1)))


def test_more_producers_than_batches():
    small = synthetic([5, 6, 7])
    per_rank = shards(small, 4, max_tokens_per_batch=10, epochs=1)
    assert sorted(i for bs in per_rank for b in bs for i in b.sample_ids.tolist()) == small.row_ids.tolist()
    assert [] in per_rank


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 64), min_size=1, max_size=200),
    budget=st.integers(64, 300),
    packing=st.booleans(),
    window=st.integers(1, 64),
    epoch=st.integers(0, 3),
)
def test_plan_is_a_partition_within_budget(lengths, budget, packing, window, epoch):
    lengths = np.asarray(lengths)
    plan = plan_epoch(lengths, seed=3, epoch=epoch, max_tokens=budget, packing=packing, bucket_window=window)
    assert sorted(np.concatenate(plan).tolist()) == list(range(len(lengths)))
    for batch in plan:
        cost = lengths[batch].sum() if packing else len(batch) * lengths[batch].max()
        assert len(batch) and cost <= budget


def test_end_to_end_from_jsonl(tmp_path):
    tokenizer = tiny_chat_tokenizer(tmp_path / "tok")
    rows = [{"prompt": f"question {i}", "response": "answer " * (1 + i % 7)} for i in range(30)]
    rows[4] = {"prompt": "no response"}
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(
        path=str(tmp_path / "rows.jsonl"), cache_dir=str(tmp_path / "cache"), max_length=64, max_tokens_per_batch=256
    )
    data = load_tokenized(cfg, tokenizer)
    seen = []
    for rank in range(3):
        for b in ShardBatcher.from_config(data, cfg, rank=rank, world_size=3).batches():
            assert b.num_tokens <= cfg.max_tokens_per_batch and b.loss_mask.any()
            seen += b.sample_ids.tolist()
    assert sorted(seen) == [i for i in range(30) if i != 4]
