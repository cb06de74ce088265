"""Ring words are validated where they are read (issue 23 item 3).

Another process of the same user can write anything into the segment. A state word the protocol cannot
produce (an owner row outside the process table or of the wrong role, a state byte that is no state) used
to hang the run (the reaper looked only at rows it knew) or lose the item silently (no state: not counted
anywhere, so the run "finished" without it). Now it is a corrupt slot: counted, named in a log line, and its
item made READY again, or written to the replay list when the ring is removed. And a segment a supervisor
died creating (no magic yet) is named as what it is, and `supervisor --reclaim-stale` removes it.

The words are corrupted from the test through the ring's real mapping, while real processes run.
"""

from __future__ import annotations

import json
import signal
import time
from collections import Counter

import numpy as np
import pytest
import torch

from support import wait_exit, wait_for
from dflash_ring.common.config.load import load_config
from dflash_ring.common.layout import NO_OWNER, Counter as RingCounter, Role, SlotState, pack_state
from dflash_ring.common.lifecycle.resume_state import CursorFile, cursor_path
from dflash_ring.common.ring import Ring, impossible_word, segment_name
from dflash_ring.common.ring.repair import _suspects
from dflash_ring.common.ring_spec import ring_spec

ITEMS = 8


def _owner_outside_the_table(word: int) -> int:
    return pack_state(word >> 24, 999, SlotState.READING)


def _no_state(word: int) -> int:
    return (word & ~0xFF) | 0x7F


def _read_by_the_supervisor_row(word: int) -> int:
    return pack_state(word >> 24, 0, SlotState.READING)


def _written_by_a_drafter_row(word: int) -> int:
    return pack_state(word >> 24, 2, SlotState.WRITING)  # rows: 0 supervisor, 1 producer, 2 consumer


def _free_with_owner_outside_the_table(word: int) -> int:
    return pack_state(word >> 24, 999, SlotState.FREE)  # issue 34: the producer took the slot, the item was lost


def _free(word: int) -> int:
    return pack_state((word >> 24) + 1, NO_OWNER, SlotState.FREE)  # a word the protocol reaches: only the slot tells


CORRUPTIONS = {
    "owner-outside-the-table": _owner_outside_the_table,
    "free-by-a-row-outside-the-table": _free_with_owner_outside_the_table,
    "free": _free,
    "state-that-is-no-state": _no_state,
    "reading-by-the-supervisor-row": _read_by_the_supervisor_row,
    "writing-by-a-drafter-row": _written_by_a_drafter_row,
}


def open_ring(name: str) -> Ring:
    return wait_for(lambda: Ring.exists(name) and Ring.open(name, timeout_s=5), what="the ring")


def corrupt_a_ready_slot(ring: Ring, corrupt) -> tuple[int, int]:
    """CAS one READY slot's state word to corrupt(word), as a foreign writer would; return (slot, item)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for slot, word in enumerate(ring.segment.desc["state"].tolist()):
            if word & 0xFF == SlotState.READY:
                item = int(ring.segment.desc["item"][slot])  # fenced by the CAS below: a new claim changes the word
                if ring.segment.states[slot].cmpxchg_strong(expected=word, desired=corrupt(word)):
                    return slot, item
        time.sleep(0.01)
    raise AssertionError("no READY slot to corrupt")


def status(run) -> dict:
    return json.loads(run.cli("status", "--config", str(run.config), "--json").stdout)


@pytest.mark.processes
@pytest.mark.parametrize("how", list(CORRUPTIONS))
def test_an_impossible_state_word_is_counted_named_and_its_item_trained_exactly_once(run, how):
    run.write_config(1, 1, slots=4)
    go = run.tmp / "go"
    sup = run.supervisor()
    producer = run.worker("producer", 0, "--items", str(ITEMS), "--wait-file", str(go))
    with open_ring(run.name) as ring:
        wait_for(lambda: ring.slot_counts()["ready"] >= 2, what="items waiting in the ring")
        slot, item = corrupt_a_ready_slot(ring, CORRUPTIONS[how])
        del ring
    consumer = run.worker("consumer", 0)
    wait_for(
        lambda: len(run.ledger_lines("C")) >= ITEMS,
        timeout=60,
        what=f"every item trained, the one in corrupted slot {slot} (item {item}) included",
    )
    assert status(run)["counters"]["corrupt"] == 1
    go.touch()
    assert wait_exit(producer) == 0 and wait_exit(consumer) == 0
    assert wait_exit(sup) == 0
    consumed = run.ledger_lines("C")
    assert all(f[6] == "ok" for f in consumed), consumed
    trained = Counter(int(f[3]) for f in consumed)
    assert trained == Counter(range(ITEMS)), f"each planned batch trained once: {trained}"
    log = sup.stderr.read() + producer.stderr.read()  # the supervisor's pass or the producer's claim finds it first
    assert f"slot {slot} (item {item}) is corrupt" in log, log[-3000:]
    assert run.leftovers() == []


@pytest.mark.processes
@pytest.mark.parametrize("how", ["state-that-is-no-state", "free"])
def test_an_item_under_a_word_that_is_no_state_goes_to_the_replay_list_when_the_ring_is_removed(run, how):
    state_dir = run.tmp / "state"
    run.write_config(1, 1, slots=4, target={"state_dir": str(state_dir)})
    sup = run.supervisor()
    producer = run.worker("producer", 0, "--items", "3", "--ring-cursor", "--wait-file", str(run.tmp / "never"))
    with open_ring(run.name) as ring:
        wait_for(lambda: ring.slot_counts()["ready"] == 3, what="three items published")
        for p in (sup, producer):  # the supervisor first: no reaper looks at the ring after this
            p.send_signal(signal.SIGKILL)
            wait_exit(p)
        slot, item = corrupt_a_ready_slot(ring, CORRUPTIONS[how])
        del ring
    out = run.cli("clean", "--config", str(run.config))
    assert segment_name(run.name) in out.stdout
    assert f"slot {slot} (item {item})" in out.stderr, out.stderr
    saved = CursorFile(cursor_path(state_dir, run.name, 0), plan="").read()
    assert saved is not None and saved[2].replay == ((0, 0), (0, 1), (0, 2)), saved
    assert run.leftovers() == []


@pytest.mark.processes
def test_a_segment_whose_supervisor_died_creating_it_is_named_and_reclaimed(run, monkeypatch):
    run.write_config(1, 1)
    with monkeypatch.context() as m:
        m.setenv("DFLASH_RING_CRASH_AT", "ring.prefaulted")  # killed inside ring creation, before the magic
        assert wait_exit(run.supervisor()) == -signal.SIGKILL
    assert Ring.exists(run.name)
    refused = run.supervisor()
    assert wait_exit(refused) == 2
    err = refused.stderr.read()
    assert f"segment {segment_name(run.name)} has no ring header" in err and "died while creating it" in err, err
    assert "--reclaim-stale" in err and f"dflash-ring clean {run.name}" in err, err
    assert "does not exist" not in err, err
    sup = run.supervisor("--reclaim-stale")
    fresh = lambda: run.cli("status", "--config", str(run.config), check=False).returncode == 0  # noqa: E731
    wait_for(fresh, timeout=60, what="the reclaimed run's fresh ring")
    run.cli("stop", "--config", str(run.config), "--now")
    assert wait_exit(sup) == 0
    log = sup.stderr.read()
    assert "reclaimed stale run" in log and "has no ring header" in log, log[-3000:]
    assert run.leftovers() == []


def test_only_words_the_protocol_can_reach_pass():
    roles = np.array([Role.SUPERVISOR, Role.PRODUCER, Role.CONSUMER], dtype="<u4")
    reachable = [
        0,
        pack_state(7, NO_OWNER, SlotState.FREE),
        pack_state(7, 1, SlotState.WRITING),
        pack_state(7, 1, SlotState.READY),
        pack_state(7, NO_OWNER, SlotState.READY),
        pack_state(7, 2, SlotState.READING),
    ]
    assert [impossible_word(w, roles) for w in reachable] == [None] * len(reachable)
    for word, why in [
        (pack_state(7, 2, SlotState.FREE), "FREE with owner row 2"),
        (pack_state(7, 1, SlotState.READING), "READING by row 1, the producer row"),
        (pack_state(7, NO_OWNER, SlotState.WRITING), f"WRITING by row {NO_OWNER}, outside the 3-row"),
        (pack_state(7, 2, SlotState.READY), "READY by row 2, the consumer row"),
        ((7 << 24) | 4, "state 4, which is no slot state"),
    ]:
        assert why in (impossible_word(word, roles) or ""), (hex(word), impossible_word(word, roles))
    assert "a row no process has taken" in impossible_word(
        pack_state(7, 2, SlotState.READING), np.array([1, 2, 0], dtype="<u4")
    )
    # The supervisor's vectorized first look (every pass, every word) objects to exactly these words.
    roles = np.array([Role.SUPERVISOR, Role.PRODUCER, Role.CONSUMER, Role.NONE], dtype="<u4")
    words = [
        (gen << 24) | (owner << 8) | state
        for gen in (0, 7)
        for owner in (0, 1, 2, 3, 4, 999, NO_OWNER)
        for state in (0, 1, 2, 3, 4, 127, 255)
    ]
    objected = set(_suspects(np.array(words, dtype="<u8"), roles).tolist())
    assert objected == {i for i, w in enumerate(words) if impossible_word(w, roles) is not None}


def test_a_corrupted_word_of_an_unpublished_slot_never_passes_off_the_slots_previous_item(run):
    """A claim clears the slot header: else the previous, trained item's header still reads, and a corrupted
    word over a slot being written would be made READY with that old item in it (trained twice)."""
    run.write_config(1, 1, slots=1)
    with Ring.create(ring_spec(load_config(run.config))) as ring:
        producer, drafter = ring.producer(1), ring.consumer(2)
        w = producer.try_acquire()
        w.tensor("x", torch.float32, (4,)).fill_(1.0)
        w.meta = {"producer": 0, "epoch": 0, "position": 0}
        producer.publish(w)
        drafter.release(drafter.try_claim())  # item 0 trained; its header is still in the slot's bytes
        w = producer.try_acquire()  # the same slot, claimed for item 1, nothing written yet
        word = int(ring.segment.desc["state"][w.slot])
        assert ring.segment.states[w.slot].cmpxchg_strong(expected=word, desired=_no_state(word))
        [c] = ring.repair_impossible_words()
        assert (c.slot, c.item) == (w.slot, w.item) and c.outcome.startswith("freed"), c
        assert ring.slot_counts() == {"free": 1, "writing": 0, "ready": 0, "reading": 0}
        assert ring.counter(RingCounter.CORRUPT) == 1 and ring.unfinished_items() == ([], [])
        assert ring.repair_impossible_words() == []
        del w
    Ring.unlink(run.name)


def test_a_ready_word_rewritten_free_is_found_by_the_supervisors_pass_and_by_a_claim_alike(run):
    """The issue's race: the producer takes the slot before the reaper's pass. Both look at the slot itself: a
    published header that no drafter ever claimed (no delivery) is an item still owed, made READY again."""
    run.write_config(1, 1, slots=2)
    with Ring.create(ring_spec(load_config(run.config))) as ring:
        producer, drafter = ring.producer(1), ring.consumer(2)
        for position in (0, 1):
            w = producer.try_acquire()
            w.tensor("x", torch.float32, (4,)).fill_(1.0)
            w.meta = {"producer": 0, "epoch": 0, "position": position}
            producer.publish(w)
        drafter.release(drafter.try_claim())  # item 0 trained: its slot is FREE with its header still in its bytes
        trained = next(s for s, w in enumerate(ring.segment.desc["state"].tolist()) if w & 0xFF == SlotState.FREE)
        slot, item = corrupt_a_ready_slot(ring, _free)
        [c] = ring.repair_impossible_words()  # the supervisor's pass
        assert (c.slot, c.item) == (slot, item) and c.outcome.startswith("made READY again"), c
        assert ring.slot_counts()["ready"] == 1 and ring.counter(RingCounter.CORRUPT) == 1
        assert ring.repair_impossible_words() == []  # a trained item's FREE slot is no suspect
        w = producer.try_acquire()  # the one FREE slot: the trained item's
        assert w is not None and w.slot == trained
        slot, item = corrupt_a_ready_slot(ring, _free_with_owner_outside_the_table)
        assert producer.try_acquire() is None  # a producer first: the one FREE slot is owed, so it is made READY again
        assert ring.slot_counts()["ready"] == 1 and ring.counter(RingCounter.CORRUPT) == 2
        r = drafter.try_claim()
        assert (r.slot, r.item, r.meta["position"]) == (slot, item, 1)
        del w, r
    Ring.unlink(run.name)
