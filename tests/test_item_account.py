"""A drafter's item settled in the one order exactly once rests on: consumed, journal, ledger, release.

In process, on a real ring, with the real journal and ledger: each step of the settle is seen done, and a step that
fails leaves everything after it undone, the slot above all still READING (so the reaper would redeliver it). The
kills between the steps are the chaos tests' (crash points `trained`, `evaluated`)."""

from __future__ import annotations

import os

import pytest
import torch

from dflash_ring.common.config.load import load_config
from dflash_ring.common.layout import Counter, Role
from dflash_ring.common.lifecycle.ledger import Ledger, read_ledger
from dflash_ring.common.lifecycle.ledger_events import Evaluated, Trained
from dflash_ring.common.ring import Ring
from dflash_ring.common.ring_spec import ring_spec
from dflash_ring.common.slot_contract import CU_SEQLENS, META_KEYS, item_tensors
from dflash_ring.common.lifecycle.trained_journal import Journal, read_entries
from dflash_ring.consumer.training.accounting import Consumed, ItemAccount
from dflash_ring.consumer.training.ring_input import to_device

TOKENS, WIDTH = 6, 4


@pytest.fixture
def ring():
    cfg = load_config(
        None,
        [
            f"run.name=account{os.getpid()}",
            "ring.slots=2",
            "ring.slot_bytes=16384",
            "ring.slot_header_bytes=4096",
            "topology.consumers=1",
        ],
    )
    Ring.unlink(cfg.run.name)
    try:
        with Ring.create(ring_spec(cfg)) as r:
            yield r
    finally:
        Ring.unlink(cfg.run.name)


def claimed(ring: Ring, position: int, eval_: bool = False):
    """A batch published by producer 0 at (epoch 0, `position`), claimed by drafter 0 and copied out as the
    prefetcher does."""
    row = ring.row_of(Role.PRODUCER, 0)
    w = ring.producer(row).try_acquire()
    views = {
        name: w.tensor(name, dtype, shape) for name, dtype, shape in item_tensors(TOKENS, 1, WIDTH, None, torch.float32)
    }
    for view in views.values():
        view.zero_()
    views[CU_SEQLENS].copy_(torch.tensor([0, TOKENS]))
    w.meta = dict(zip(META_KEYS, (0, 0, position, TOKENS, 1, ["data"], eval_), strict=True))
    ring.producer(row).publish(w, cursor=(0, position + 1))
    slot = ring.consumer(ring.row_of(Role.CONSUMER, 0)).try_claim()
    return to_device(slot, torch.device("cpu"), None), slot


def account(ring: Ring, tmp_path, ledger: Ledger) -> ItemAccount:
    return ItemAccount(
        Consumed(),
        Journal(tmp_path / "journal", ring.identity.created_ns, 0),
        ledger,
        ring.consumer(ring.row_of(Role.CONSUMER, 0)).release,
    )


def journaled(tmp_path) -> list[tuple[int, int, int, int]]:
    return [
        (e.producer, e.epoch, e.position, e.item)
        for p in sorted((tmp_path / "journal").glob("*.jsonl"))
        for e in read_entries(p)
    ]


def test_a_trained_item_is_counted_journaled_recorded_and_released(ring, tmp_path):
    ledger = Ledger(tmp_path / "drafter-0.jsonl")
    acc = account(ring, tmp_path, ledger)
    batch, slot = claimed(ring, 3)
    acc.settle(Trained, batch, slot, 1)
    assert (acc.consumed.items, acc.consumed.by_producer) == (1, {"0": [0, 3]})
    assert journaled(tmp_path) == [(0, 0, 3, slot.item)]
    (rec,) = read_ledger(tmp_path / "drafter-0.jsonl").records
    assert {k: rec[k] for k in ("ev", "step", "item", "deliveries", "producer", "epoch", "pos")} == {
        "ev": "train",
        "step": 1,
        "item": slot.item,
        "deliveries": 1,
        "producer": 0,
        "epoch": 0,
        "pos": 3,
    }
    assert "empty" not in rec
    assert ring.slot_counts()["reading"] == 0 and ring.counter(Counter.CONSUMED) == 1


def test_an_empty_or_held_out_item_is_recorded_and_released_but_not_journaled(ring, tmp_path):
    ledger = Ledger(tmp_path / "drafter-0.jsonl")
    acc = account(ring, tmp_path, ledger)
    batch, slot = claimed(ring, 0)
    acc.settle(Trained, batch, slot, 0, empty=True)  # nothing to supervise: no update to lose
    batch, slot = claimed(ring, 1, eval_=True)
    acc.settle(Evaluated, batch, slot, 0)
    assert journaled(tmp_path) == []
    records = read_ledger(tmp_path / "drafter-0.jsonl").records
    assert [(r["ev"], r["pos"], r.get("empty")) for r in records] == [("train", 0, True), ("eval", 1, None)]
    assert acc.consumed.items == 2 and ring.slot_counts()["reading"] == 0 and ring.counter(Counter.CONSUMED) == 2


def test_an_item_whose_ledger_record_fails_is_journaled_but_not_released(ring, tmp_path):
    ledger = Ledger(tmp_path / "drafter-0.jsonl")
    ledger.close()  # its descriptor gone: the record's write(2) fails
    acc = account(ring, tmp_path, ledger)
    batch, slot = claimed(ring, 2)
    with pytest.raises(OSError):
        acc.settle(Trained, batch, slot, 1)
    assert journaled(tmp_path) == [(0, 0, 2, slot.item)]
    assert ring.slot_counts()["reading"] == 1 and ring.counter(Counter.CONSUMED) == 0  # still held: redelivered


def test_an_item_whose_journal_line_fails_is_neither_recorded_nor_released(ring, tmp_path):
    ledger = Ledger(tmp_path / "drafter-0.jsonl")
    (tmp_path / "journal").write_text("")  # a file where the journal's directory should be: the append fails
    acc = account(ring, tmp_path, ledger)
    batch, slot = claimed(ring, 2)
    with pytest.raises(OSError):
        acc.settle(Trained, batch, slot, 1)
    assert read_ledger(tmp_path / "drafter-0.jsonl").records == []
    assert ring.slot_counts()["reading"] == 1 and ring.counter(Counter.CONSUMED) == 0
