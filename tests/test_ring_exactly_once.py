"""Exactly once under kills at the worst instants, placed deterministically with crash points.

Crash points (common/crash_points.py) make a real worker process SIGKILL itself exactly between
two steps of the ring protocol, so each window is hit on every run, not once in a thousand kills.
"""

from __future__ import annotations

import json
import signal
from collections import Counter

from support import wait_exit, wait_for


def crashing(run, monkeypatch, at: str, role: str, index: int, *extra: str):
    with monkeypatch.context() as m:
        m.setenv("DFLASH_RING_CRASH_AT", at)
        return run.worker(role, index, *extra)


def test_kills_between_cas_and_numbering_or_counting_lose_nothing_and_repeat_nothing(run, monkeypatch):
    """Item 1: a producer killed after CASing a slot to WRITING but before numbering the item, on the slot it
    last published into, used to have its cursor rolled back a batch (that batch published twice).
    Item 2: kills between a CAS and its count used to leave produced/consumed/row items short."""
    items = 6
    run.write_config(1, 1, slots=1)  # one slot: the producer's next claim is always the slot it last published
    go = run.tmp / "go"
    sup = run.supervisor()
    consumer = crashing(run, monkeypatch, "released@4", "consumer", 0)  # dies right after freeing item k=3
    producer = crashing(run, monkeypatch, "claimed@2", "producer", 0, "--items", str(items), "--ring-cursor")
    assert wait_exit(producer) == -signal.SIGKILL  # claimed the slot again after k=0, died before numbering
    producer = crashing(run, monkeypatch, "published@2", "producer", 0, "--items", str(items), "--ring-cursor")
    assert wait_exit(producer) == -signal.SIGKILL  # published k=2, died before counting it
    producer = run.worker("producer", 0, "--items", str(items), "--ring-cursor", "--wait-file", str(go))
    assert wait_exit(consumer) == -signal.SIGKILL
    run.worker("consumer", 0)

    status = lambda: json.loads(run.cli("status", "--config", str(run.config), "--json").stdout)
    wait_for(
        lambda: len(run.ledger_lines("C")) >= items - 1 and status()["slots_by_state"]["free"] == 1,
        timeout=60,
        what="every item consumed",
    )
    st = status()
    published = Counter(int(f[2]) for f in run.ledger_lines("P"))
    consumed = Counter(int(f[3]) for f in run.ledger_lines("C"))
    assert max(published.values()) == 1, f"published twice: {published}"
    assert max(consumed.values()) == 1, f"consumed twice: {consumed}"
    # The two kills after a CAS leave one line unwritten each (k=2 unpublished in P, k=3 in C): the union is all.
    assert set(published) | set(consumed) == set(range(items)) and len(published) == len(consumed) == items - 1
    c = st["counters"]
    assert (c["produced"], c["consumed"], c["reclaimed"], c["redelivered"]) == (items, items, 1, 0), c
    rows = {(r["role"], r["index"]): r["items"] for r in st["rows"]}
    assert rows[("producer", 0)] == items and rows[("consumer", 0)] == items, rows
    go.touch()
    assert wait_exit(producer) == 0 and wait_exit(sup) == 0
    assert f"{items} items produced, {items} consumed" in sup.stderr.read()
    assert run.leftovers() == []
