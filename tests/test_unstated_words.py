"""Issue 46, goal 2: ownership that a plausible write cannot fake, for slot words.

A same-user process can write a WRITING or READING word naming a row the protocol would accept, the live process's
own included. Before, nothing told it from a real claim: a READY item set READING by the live drafter's row was never
trained and the run never ended; set WRITING by the live producer's row it hung the run, and `stop --now` dropped it as
an unpublished write. Now every claim is stated (Slots._claim: the row names it before its CAS, the descriptor names
the holder after), and the supervisor's pass puts back a holding word no claim stated, counted corrupt and named
(Repair.repair_unstated_words). A claim cut short between its CAS and its holder is a dead row's, not a forgery.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from collections import Counter

import numpy as np
import pytest
import torch

from support import wait_exit, wait_for
from test_ring_words import corrupt_a_ready_slot, open_ring
from dflash_ring.common.config.load import load_config
from dflash_ring.common.layout import Counter as RingCounter, Role, RowStatus, SlotState, pack_state
from dflash_ring.common.ring import Ring
from dflash_ring.common.ring_spec import ring_spec

ITEMS = 8
PRODUCER_ROW, CONSUMER_ROW = 1, 2  # one producer, one consumer: rows 0 supervisor, 1 producer, 2 consumer


def _reading_by_the_live_drafter_row(word: int) -> int:
    return pack_state(word >> 24, CONSUMER_ROW, SlotState.READING)


def _writing_by_the_live_producer_row(word: int) -> int:
    return pack_state(word >> 24, PRODUCER_ROW, SlotState.WRITING)


FORGERIES = {
    "reading-by-the-live-drafter-row": (_reading_by_the_live_drafter_row, "READING by consumer 0 (row 2"),
    "writing-by-the-live-producer-row": (_writing_by_the_live_producer_row, "WRITING by producer 0 (row 1"),
}


def status(run) -> dict:
    return json.loads(run.cli("status", "--config", str(run.config), "--json").stdout)


@pytest.mark.processes
@pytest.mark.parametrize("how", list(FORGERIES))
def test_a_holding_word_no_claim_stated_is_put_back_named_and_its_item_trained_once(run, how):
    forge, named = FORGERIES[how]
    run.write_config(1, 1, slots=4)
    go = run.tmp / "go"
    sup = run.supervisor()
    producer = run.worker("producer", 0, "--items", str(ITEMS), "--wait-file", str(go))
    consumer = run.worker("consumer", 0, "--work-s", "0.3")  # slow: READY items wait while both rows live
    with open_ring(run.name) as ring:
        wait_for(
            lambda: ring.row_status(CONSUMER_ROW) == RowStatus.RUNNING and ring.slot_counts()["ready"] >= 2,
            what="items waiting while the drafter works",
        )
        slot, item = corrupt_a_ready_slot(ring, forge)
        del ring
    wait_for(
        lambda: len(run.ledger_lines("C")) >= ITEMS,
        timeout=60,
        what=f"every item trained, the one under the forged word in slot {slot} (item {item}) included",
    )
    assert status(run)["counters"]["corrupt"] == 1
    go.touch()
    assert wait_exit(producer) == 0 and wait_exit(consumer) == 0 and wait_exit(sup) == 0
    consumed = run.ledger_lines("C")
    assert all(f[6] == "ok" for f in consumed), consumed
    assert Counter(int(f[3]) for f in consumed) == Counter(range(ITEMS)), "each planned batch trained once"
    log = sup.stderr.read()
    assert f"slot {slot} (item {item}) is corrupt" in log and named in log and "which never claimed it" in log, log
    assert "made READY again: redelivered" in log, log[-3000:]
    assert run.leftovers() == []


@pytest.mark.processes
def test_a_claim_cut_short_before_its_holder_is_named_is_a_dead_rows_not_a_forgery(run, monkeypatch):
    """Killed between the CAS and the descriptor's holder (crash point "stated"), a producer and a consumer leave
    slots their claims alone state: undone as a dead row's (reclaimed, redelivered), never as corrupt, and every
    item is trained once."""
    run.write_config(1, 1, slots=2)
    go = run.tmp / "go"
    sup = run.supervisor()
    with monkeypatch.context() as m:
        m.setenv("DFLASH_RING_CRASH_AT", "stated@2")
        consumer = run.worker("consumer", 0)  # trains k=0, dies claiming k=1
        m.setenv("DFLASH_RING_CRASH_AT", "stated@3")
        producer = run.worker("producer", 0, "--items", str(ITEMS), "--ring-cursor")  # publishes 2, dies claiming
        assert wait_exit(consumer) == -signal.SIGKILL and wait_exit(producer) == -signal.SIGKILL
    producer = run.worker("producer", 0, "--items", str(ITEMS), "--ring-cursor", "--wait-file", str(go))
    consumer = run.worker("consumer", 0)
    wait_for(lambda: len(run.ledger_lines("C")) >= ITEMS, timeout=60, what="every item trained")
    c = status(run)["counters"]
    assert (c["corrupt"], c["reclaimed"], c["redelivered"]) == (0, 1, 1), c
    go.touch()
    assert wait_exit(producer) == 0 and wait_exit(consumer) == 0 and wait_exit(sup) == 0
    assert Counter(int(f[3]) for f in run.ledger_lines("C")) == Counter(range(ITEMS)), "each trained once"
    assert "never claimed it" not in sup.stderr.read()
    assert run.leftovers() == []


def _publish(port, position: int) -> None:
    w = port.try_acquire()
    w.tensor("x", torch.float32, (4,)).fill_(float(position))
    w.meta = {"producer": 0, "epoch": 0, "position": position}
    port.publish(w)


def _forge(ring: Ring, slot: int, word: int) -> None:
    old = int(ring.segment.desc["state"][slot])
    assert ring.segment.states[slot].cmpxchg_strong(expected=old, desired=word)


def test_where_a_forged_word_sends_its_slot_follows_the_item_not_the_word(run):
    """READY again only for a published item nobody finished: over a trained item (its holder released it) or an
    empty slot the slot is freed, so nothing is trained twice; over a READY item, requeued or never claimed, it
    is redelivered. And `stop --now`'s replay list keeps an item under a forged WRITING word, not a real write's."""
    run.write_config(1, 1, slots=3)
    with Ring.create(ring_spec(load_config(run.config))) as ring:
        ring.take_row(PRODUCER_ROW, Role.PRODUCER, 0)
        ring.take_row(CONSUMER_ROW, Role.CONSUMER, 0)
        producer, drafter = ring.producer(PRODUCER_ROW), ring.consumer(CONSUMER_ROW)
        for position in (0, 1):
            _publish(producer, position)
        drafter.release(drafter.try_claim())  # item 0 trained: its header still reads, its holder released it
        drafter.requeue(drafter.try_claim())  # item 1 delivered once and given back: READY, holder not released
        desc = ring.segment.desc
        trained = int(np.flatnonzero((desc["state"] & 0xFF) == SlotState.FREE & (desc["deliveries"] > 0))[0])
        requeued = int(np.flatnonzero((desc["state"] & 0xFF) == SlotState.READY)[0])
        empty = ({0, 1, 2} - {trained, requeued}).pop()
        gen = lambda slot: int(desc["state"][slot]) >> 24  # noqa: E731
        _forge(ring, trained, pack_state(gen(trained), CONSUMER_ROW, SlotState.READING))
        _forge(ring, requeued, pack_state(gen(requeued), CONSUMER_ROW, SlotState.READING))
        _forge(ring, empty, pack_state(gen(empty), PRODUCER_ROW, SlotState.WRITING))
        assert ring.unfinished_items()[0] == [{"producer": 0, "epoch": 0, "position": 1}]
        found = {c.slot: c for c in ring.repair_unstated_words()}
        assert sorted(found) == sorted((trained, requeued, empty))
        assert found[trained].outcome.startswith("freed") and found[empty].outcome.startswith("freed")
        assert found[requeued].outcome == "made READY again: redelivered"
        assert "READING by consumer 0 (row 2, pid" in found[requeued].why
        assert ring.counter(RingCounter.CORRUPT) == 3 and ring.repair_unstated_words() == []
        assert ring.slot_counts() == {"free": 2, "writing": 0, "ready": 1, "reading": 0}
        r = drafter.try_claim()
        assert (r.slot, r.meta["position"]) == (requeued, 1)
        drafter.release(r)
        w = producer.try_acquire()  # a real write in progress: stated, so neither repaired nor kept
        assert ring.repair_unstated_words() == [] and ring.unfinished_items() == ([], [])
        w.tensor("x", torch.float32, (4,)).fill_(2.0)
        w.meta = {"producer": 0, "epoch": 0, "position": 2}
        producer.publish(w)
        ready = int(w.slot)
        _forge(ring, ready, pack_state(gen(ready), PRODUCER_ROW, SlotState.WRITING))  # READY set WRITING
        assert ring.unfinished_items()[0] == [{"producer": 0, "epoch": 0, "position": 2}]  # what `stop --now` keeps
        del w, r
    Ring.unlink(run.name)


def test_no_claim_of_a_busy_ring_is_ever_taken_for_a_forgery(run):
    """The supervisor's look races real claims: a producer's and a consumer's thread (each its own row) claim,
    publish and release 3,000 items while the look runs without pause, threads switching every microsecond. Every
    holding word it meets is stated, by the descriptor or by the claim in flight; none is repaired."""
    run.write_config(1, 1, slots=4)
    stop, looks, windows, repaired = threading.Event(), [0], [0], []
    interval = sys.getswitchinterval()
    with Ring.create(ring_spec(load_config(run.config))) as ring:
        ring.take_row(PRODUCER_ROW, Role.PRODUCER, 0)
        ring.take_row(CONSUMER_ROW, Role.CONSUMER, 0)
        producer, drafter = ring.producer(PRODUCER_ROW), ring.consumer(CONSUMER_ROW)
        trained = []

        def produce() -> None:
            for position in range(3000):
                while (w := producer.try_acquire()) is None:
                    time.sleep(0)
                w.tensor("x", torch.float32, (1,)).fill_(float(position))
                w.meta = {"producer": 0, "epoch": 0, "position": position}
                producer.publish(w)

        def consume() -> None:
            while len(trained) < 3000:
                if (r := drafter.try_claim()) is None:
                    time.sleep(0)
                    continue
                trained.append(r.meta["position"])
                drafter.release(r)

        def look() -> None:
            desc = ring.segment.desc
            while not stop.is_set():
                words = desc["state"].copy()
                holding = np.isin(words & 0xFF, (SlotState.WRITING, SlotState.READING))
                windows[0] += int(np.count_nonzero(holding & (desc["holder"] != words)))
                repaired.extend(ring.repair_unstated_words())
                looks[0] += 1

        workers = [threading.Thread(target=f) for f in (produce, consume)]
        looker = threading.Thread(target=look)
        sys.setswitchinterval(1e-6)  # threads switch between any two steps of a claim, not every 5 ms
        try:
            for t in [looker, *workers]:
                t.start()
            for t in workers:
                t.join(timeout=120)
        finally:
            stop.set()
            looker.join(timeout=10)
            sys.setswitchinterval(interval)
        assert repaired == [] and ring.counter(RingCounter.CORRUPT) == 0
        assert sorted(trained) == list(range(3000)) and looks[0] > 0
        print(f"{looks[0]} looks, {windows[0]} holding words met before their holder was named")
    Ring.unlink(run.name)
