"""The reaper: returns what dead processes held to the ring.

A slot is attributed to a dead process only through its owner row's lock
file, which the kernel frees on any death. The reaper takes that lock while
it cleans, so a restarted successor cannot slip in between the look and the
compare-and-swap; the CAS itself fences off any stale state word.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from dflash_ring.common.layout import Role, RowStatus
from dflash_ring.common.lifecycle.liveness import LockFile, lock_path
from dflash_ring.common.ring import CorruptSlot, Ring
from dflash_ring.common.lifecycle.trained_journal import seal_drafter

log = logging.getLogger(__name__)


@dataclass
class Reaped:
    row: int
    role: str
    index: int
    freed: int
    redelivered: int


def reap(ring: Ring, lock_dir: Path, checkpoint_dir: str | None = None) -> list[Reaped]:
    """Undo what dead rows held. A dead drafter's journal (under `checkpoint_dir`) is sealed first, while the slots
    it held are still its own: what it trained after its checkpoint is produced again, what it held redelivered."""
    repair_words(ring)  # first: a word owned by no process that can die would never be reaped below
    rows = ring.rows()
    suspects = {i for i, r in enumerate(rows) if i and r["status"] == RowStatus.RUNNING}
    suspects |= {row for row in ring.owned_slots() if row < len(rows)}
    reaped = []
    for row in sorted(suspects):
        r = rows[row]
        if r["role"] == Role.NONE:
            continue
        role = Role(int(r["role"]))
        lock = LockFile.try_acquire(lock_path(lock_dir, role, int(r["index"])))
        if lock is None:
            continue  # alive
        try:
            was_running = ring.row_status(row) == RowStatus.RUNNING
            if role == Role.CONSUMER and checkpoint_dir is not None:
                seal_drafter(checkpoint_dir, int(r["index"]), ring.identity.created_ns, ring.unfinished_item_numbers())
            freed, redelivered = ring.reclaim_slots_of(row)
            if was_running:
                ring.set_row_status(row, RowStatus.DEAD)
        finally:
            lock.release(unlink=True)
        if not (was_running or freed or redelivered):
            continue  # it left cleanly between our two looks
        name = role.name.lower()
        log.warning(
            "%s %d (pid %d) died: %d slot(s) freed, %d redelivered",
            name,
            int(r["index"]),
            int(r["pid"]),
            freed,
            redelivered,
        )
        reaped.append(Reaped(row, name, int(r["index"]), freed, redelivered))
    return reaped


def repair_words(ring: Ring) -> list[CorruptSlot]:
    """Slots whose state word no process of the protocol can have written (another process wrote into the
    segment): counted corrupt, their items redelivered, and each named, so the run still ends and says why. Those are
    words the protocol cannot produce at all, and holding words (WRITING, READING) that name a plausible row, the
    live process's own included, but no claim of it stated (Ring.repair_unstated_words)."""
    found = ring.repair_impossible_words()
    found += ring.repair_unstated_words()
    for c in found:
        log.error(
            "slot %d (item %d) is corrupt: its state word %#x %s: the ring protocol cannot produce that; "
            "%s (counted corrupt: `dflash-ring status`, dflash_ring_items_corrupt_total). Something other "
            "than the protocol wrote it: look for another process that maps /dev/shm%s "
            "(fuser -v /dev/shm%s)",
            c.slot,
            c.item,
            c.word,
            c.why,
            c.outcome,
            ring.name,
            ring.name,
        )
    return found
