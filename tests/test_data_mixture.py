"""Weighted data mixtures (issue 15 item 2): proportions, at most once per epoch, repeats, exact resume, refusals."""

from __future__ import annotations

import json
import os
from collections import Counter as Tally
from pathlib import Path

import numpy as np
import pytest

from dflash_ring.common.config.dump import dump_toml
from dflash_ring.common.config.load import load_config
from dflash_ring.common.config.schema import ConfigError
from dflash_ring.common.config.data import DataConfig, DataError
from dflash_ring.common.layout import Role
from dflash_ring.common.lifecycle.resume_state import CursorFile, ResumeState
from dflash_ring.common.ring import Ring
from dflash_ring.common.ring_spec import ring_spec
from dflash_ring.embedded.tiny_tokenizer import tiny_chat_tokenizer
from dflash_ring.producer.batching import Batch, ShardBatcher, epoch_counts
from dflash_ring.producer.pretokenized import SourceData, TokenizedData, load_sources, load_tokenized
from dflash_ring.producer.resume import PlanMismatchError, resume_point
from support import mixture, synthetic

BUDGET = 256


def epoch(sources, world: int = 1, epochs: int = 1, seed: int = 5) -> list[list[Batch]]:
    return [
        list(
            ShardBatcher(
                sources, rank=r, world_size=world, max_tokens_per_batch=BUDGET, epochs=epochs, seed=seed
            ).batches()
        )
        for r in range(world)
    ]


def drawn(batches, e: int = 0) -> Tally:
    """(source, row) -> times trained in epoch e."""
    return Tally(
        (int(s), int(r)) for b in batches if b.epoch == e for s, r in zip(b.source_ids.tolist(), b.sample_ids.tolist())
    )


def test_weights_3_to_1_give_those_shares_of_every_epoch():
    """Tolerance: floor rounding, under one row per source; here 400 rows split exactly 300:100."""
    sources = mixture(("code", 300, 3.0, False), ("chat", 200, 1.0, False))
    (batches,) = epoch(sources, epochs=2)
    for e in (0, 1):
        per_source = Tally(s for s, _ in drawn(batches, e).elements())
        assert per_source == {0: 300, 1: 100}
    # 2:1 over sources whose sizes do not divide: still within one row of the weights.
    counts = epoch_counts([1000, 7], [2.0, 1.0], [False, False], ["a", "b"])
    assert counts == [14, 7] and abs(counts[0] / sum(counts) - 2 / 3) < 1 / sum(counts)


def test_no_row_twice_in_an_epoch_without_repeat_and_a_fresh_subset_each_epoch():
    sources = mixture(("code", 300, 3.0, False), ("chat", 200, 1.0, False))
    (batches,) = epoch(sources, epochs=2)
    subsets = []
    for e in (0, 1):
        got = drawn(batches, e)
        assert max(got.values()) == 1
        assert {r for s, r in got if s == 0} == set(sources[0].data.row_ids.tolist())  # code limits the epoch
        subsets.append({r for s, r in got if s == 1})
    assert len(subsets[0]) == len(subsets[1]) == 100 and subsets[0] != subsets[1]


def test_a_repeating_source_is_cycled_to_meet_its_weight():
    """40 rows at weight 3 against 100 at weight 1: 300 draws, 7 or 8 of each row."""
    sources = mixture(("small", 40, 3.0, True), ("big", 100, 1.0, False))
    (batches,) = epoch(sources)
    got = drawn(batches)
    small = [n for (s, _), n in got.items() if s == 0]
    assert sum(small) == 300 and len(small) == 40 and set(small) == {7, 8}
    assert sorted(r for (s, r), n in got.items() if s == 1 and n == 1) == sources[1].data.row_ids.tolist()
    # Every source repeating: the epoch is as long as all rows together, split by weight.
    assert epoch_counts([40, 100], [3.0, 1.0], [True, True], ["a", "b"]) == [105, 35]


def test_a_source_given_no_row_is_an_error():
    with pytest.raises(DataError, match="'tiny' .* gets no row"):
        epoch_counts([10, 1000], [1.0, 0.001], [False, False], ["big", "tiny"])


def test_batches_hold_their_sources_tokens():
    sources = mixture(("code", 50, 1.0, False), ("chat", 50, 1.0, True), ("math", 20, 2.0, True))
    (batches,) = epoch(sources)
    assert {int(s) for b in batches for s in b.source_ids} == {0, 1, 2}
    for b in batches:
        for j, (k, row) in enumerate(zip(b.source_ids.tolist(), b.sample_ids.tolist())):
            data, i = sources[k].data, row // 2
            piece = slice(b.cu_seqlens[j], b.cu_seqlens[j + 1])
            whole = slice(data.offsets[i], data.offsets[i + 1])
            assert np.array_equal(b.input_ids[piece], data.tokens[whole])
            assert np.array_equal(b.loss_mask[piece], data.loss_mask[whole])
        assert b.num_tokens <= BUDGET


def key(b: Batch) -> tuple:
    return b.epoch, b.position, b.cursor, tuple(b.source_ids.tolist()), tuple(b.sample_ids.tolist())


def test_deterministic_and_exact_resume_from_mid_epoch_cursors_across_three_producers():
    sources = mixture(("code", 120, 3.0, False), ("chat", 90, 1.0, False), ("math", 15, 1.0, True))
    everything = [[key(b) for b in batches] for batches in epoch(sources, world=3, epochs=2)]
    assert everything == [[key(b) for b in batches] for batches in epoch(sources, world=3, epochs=2)]
    assert everything != [[key(b) for b in batches] for batches in epoch(sources, world=3, epochs=2, seed=6)]
    for rank, mine in enumerate(everything):
        for i in (len(mine) // 3, len(mine) // 2, len(mine) - 1):  # mid-epoch 0, around the boundary, the end
            fresh = ShardBatcher(sources, rank=rank, world_size=3, max_tokens_per_batch=BUDGET, epochs=2, seed=5)
            assert [key(b) for b in fresh.batches(from_cursor=mine[i][2])] == mine[i + 1 :]
    # Across the ranks every sample of the epoch's draw comes exactly once: the ranks split one plan.
    one = ShardBatcher(sources, rank=0, world_size=1, max_tokens_per_batch=BUDGET, epochs=2, seed=5)
    for e in (0, 1):
        split = Tally((s, r) for mine in everything for k in mine if k[0] == e for s, r in zip(k[3], k[4]))
        assert split == drawn(list(one.batches()), e)
        assert sum(split.values()) == sum(one.counts)


# The plan of one data set, as the code before mixtures computed it (rows 2i + 1 of 15 samples; seed 7,
# budget 24, bucket_window 4, two producers; epochs 0 and 1): a single data.path must keep it exactly.
LENGTHS = [5, 9, 3, 12, 7, 4, 8, 6, 10, 2, 11, 1, 13, 5, 6]
BEFORE = {
    (True, 0): [
        (0, 0, [25, 19, 27]),
        (0, 1, [11, 15, 3]),
        (0, 2, [1, 29, 17]),
        (1, 0, [9, 17]),
        (1, 1, [7, 15]),
        (1, 2, [23, 5, 3]),
    ],
    (True, 1): [(0, 0, [9, 21, 5]), (0, 1, [23, 13, 7]), (1, 0, [25, 27, 29]), (1, 1, [13]), (1, 2, [21, 19, 11, 1])],
    (False, 0): [
        (0, 0, [1, 29]),
        (0, 1, [25]),
        (0, 2, [17, 11]),
        (0, 3, [23, 13]),
        (1, 0, [15, 9]),
        (1, 1, [19, 11, 1]),
        (1, 2, [25]),
        (1, 3, [17, 21]),
    ],
    (False, 1): [
        (0, 0, [7]),
        (0, 1, [15, 3]),
        (0, 2, [21, 5]),
        (0, 3, [19, 27, 9]),
        (1, 0, [27, 29, 13]),
        (1, 1, [3, 7]),
        (1, 2, [23, 5]),
    ],
}
# plan_key of that plan's shard 1 before mixtures, for data tokenized into tokenized-0123456789abcdef01234567.
KEY_BEFORE = "41e44c2fb70936d6fe8c36b5"


def single(lengths=LENGTHS) -> TokenizedData:
    data = synthetic(0, lengths)
    return TokenizedData(
        **{
            **data.__dict__,
            "row_ids": np.arange(len(lengths), dtype=np.int64) * 2 + 1,
            "directory": Path("/c/tokenized-0123456789abcdef01234567"),
        }
    )


@pytest.mark.parametrize("packing", [True, False])
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("as_source", [False, True])
def test_one_data_set_plans_exactly_as_before_mixtures(packing, rank, as_source):
    data = single()
    given = [SourceData("only", "/d/x.jsonl", 3.0, True, data)] if as_source else data  # weight/repeat: no effect
    batcher = ShardBatcher(
        given, rank=rank, world_size=2, max_tokens_per_batch=24, epochs=2, seed=7, packing=packing, bucket_window=4
    )
    assert [(b.epoch, b.position, b.sample_ids.tolist()) for b in batcher.batches()] == BEFORE[packing, rank]
    if packing and rank == 1:
        assert batcher.plan_key() == KEY_BEFORE  # so a resume across the upgrade keeps its cursor


def test_a_single_data_path_keeps_its_cache(tmp_path):
    tokenizer = tiny_chat_tokenizer(tmp_path / "tok")
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "response": "a " * (i + 1)}) + "\n" for i in range(6)))
    cfg = DataConfig(path=str(path), cache_dir=str(tmp_path / "cache"), max_length=64)
    before = load_tokenized(cfg, tokenizer)
    (source,) = load_sources(cfg, tokenizer)
    assert source.data.from_cache and source.data.directory == before.directory
    assert (source.name, source.weight, source.repeat) == ("rows", 1.0, False)


def test_a_resume_with_another_mix_is_refused_naming_both(tmp_path):
    sources = mixture(("code", 60, 3.0, False), ("chat", 60, 1.0, False))
    other = [sources[0], SourceData("chat", "/d/chat.jsonl", 1.0, True, sources[1].data)]  # only repeat differs

    def cursor_file(srcs) -> CursorFile:
        batcher = ShardBatcher(srcs, rank=0, world_size=1, max_tokens_per_batch=BUDGET, epochs=1)
        return CursorFile(tmp_path / "producer-0.json", batcher.plan_key(), batcher.plan_description())

    old, new = cursor_file(sources), cursor_file(other)
    assert old.plan != new.plan
    assert "code = /d/code.jsonl weight 3 (tokenized" in old.description and "repeat" not in old.description
    assert "chat = /d/chat.jsonl weight 1 repeat (tokenized" in new.description
    cfg = load_config(
        None,
        [
            f"run.name=mix{os.getpid()}",
            "ring.slots=1",
            "ring.slot_bytes=8192",
            "ring.slot_header_bytes=4096",
            "topology.consumers=1",
        ],
    )
    Ring.unlink(cfg.run.name)
    try:
        with Ring.create(ring_spec(cfg)) as ring:
            port = ring.producer(ring.row_of(Role.PRODUCER, 0))
            assert resume_point(port, old) == (ResumeState(), "start")
            port.publish(port.try_acquire(), cursor=(0, 3))
            old.save(ResumeState(0, 3))
            assert resume_point(port, old) == (ResumeState(0, 3), "ring")
            with pytest.raises(PlanMismatchError) as e:
                resume_point(port, new)
    finally:
        Ring.unlink(cfg.run.name)
    assert old.description in str(e.value) and new.description in str(e.value)


@pytest.mark.parametrize(
    "sets, says",
    [
        (['data.path="a.jsonl"', 'data.sources=[{path="b.jsonl"}]'], "are both set"),
        (
            ['data.sources=[{path="a.jsonl"}, {path="b.jsonl", weight=-1}]'],
            "data.sources[1].weight = -1.0: must be a finite number > 0",
        ),
        (
            ['data.sources=[{path="x/a.jsonl"}, {path="y/a.jsonl"}]'],
            "data.sources[0] and data.sources[1] are both named 'a'",
        ),
        (['data.sources=[{path="a.jsonl", wieght=2}]'], "unknown config key 'wieght' in [data.sources[0]]"),
        (['data.sources=[{path="a.jsonl", repeat="yes"}]'], "data.sources[0].repeat = 'yes': expected true or false"),
        (["data.sources=[{weight=2}]"], "[data.sources[0]]: path is empty"),
        (['data.sources=[{path="a.jsonl"}]', 'data.format="jsonl"'], "set them in each source's entry"),
    ],
)
def test_mixture_config_errors_name_the_entry(sets, says):
    with pytest.raises(ConfigError) as e:
        load_config(None, sets)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_mixture_config_round_trips_as_a_list_of_tables(tmp_path):
    cfg = load_config(
        None,
        [
            'data.sources=[{path="/d/code.jsonl", weight=3}, '
            '{path="/d/chat", name="talk", repeat=true, format="disk", split="test"}]'
        ],
    )
    text = dump_toml(cfg)
    assert text.count("[[data.sources]]") == 2 and 'name = "code"' not in text  # derived from the path: left out
    (tmp_path / "c.toml").write_text(text)
    again = load_config(tmp_path / "c.toml")
    assert again == cfg and [s.name for s in again.data.sources] == ["code", "talk"]
    assert [sub.path for _, sub in cfg.data.mixture()] == ["/d/code.jsonl", "/d/chat"]
    assert [(sub.format, sub.split) for _, sub in cfg.data.mixture()] == [("auto", "train"), ("disk", "test")]
