"""A producer's replay list while it runs: the batches a dead drafter trained after its checkpoint come back here.

The list starts as the cursor file's (what a removed ring held, and what earlier drafters lost); while the
producer runs it grows by the sealed journal segments of dead drafters (common/lifecycle/trained_journal.py): each
segment's entries for this producer are appended once, and the segment's name is recorded with them, in one
durable write of the cursor file, before any of them is published. Publishing commits how many entries are
done (`replayed`, in the ring row with the cursor), so a producer killed anywhere resumes with the same list
and the same count: every entry is published once.

The main thread commits publishes (`commit`); the loader thread asks for the next entries (`entries_from`)
and polls for new segments between batches (`poll`): one lock keeps the list and the file in step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from dflash_ring.common.damaged_file import keep_aside
from dflash_ring.common.lifecycle.ledger import Ledger
from dflash_ring.common.lifecycle.ledger_events import Intake
from dflash_ring.common.lifecycle.resume_state import CursorFile, ResumeState
from dflash_ring.common.lifecycle.trained_journal import owed_once, owed_to

log = logging.getLogger(__name__)

POLL_S = 1.0  # how often a producer looks for sealed segments: a drafter's death is rare, a listing cheap


class LiveReplay:
    def __init__(
        self,
        index: int,
        start: ResumeState,
        cursor_file: CursorFile,
        checkpoint_dir: str | Path,
        in_plan: Callable[[int, int], bool],
        ledger: Ledger | None = None,
    ):
        self.index, self.cursor_file, self.checkpoint_dir, self.ledger = index, cursor_file, checkpoint_dir, ledger
        self.in_plan = in_plan  # (epoch, position) -> whether this shard's plan has that batch
        self._replay = list(start.replay)
        self._taken = list(start.taken)
        self._committed = (start.epoch, start.position, start.replayed)
        self._lock = threading.Lock()
        self._polled = 0.0
        kept, seen, outside, repeated, ahead = [], set(), [], [], []
        for x in start.replay[start.replayed :]:
            if not in_plan(*x):
                outside.append(x)
            elif x >= (start.epoch, start.position):
                ahead.append(x)
            elif x in seen:
                repeated.append(x)
            else:
                seen.add(x)
                kept.append(x)
        if outside or repeated or ahead:
            # Saved by an older version, or edited: nothing of them is published yet (they are after `replayed`), so
            # the list is rebuilt without them, the damaged file kept aside. Kept, a batch outside the plan would be
            # owed for ever; a repeated one would train twice (the pending list is a set: a batch cannot be lost
            # twice before it is published again), and so would one past the cursor (the plan publishes it too).
            why = []
            if outside:
                why.append(f"{len(outside)} batch(es) not in producer {index}'s plan ({_named(outside)})")
            if repeated:
                why.append(f"{len(repeated)} repeat(s) of a batch it holds ({_named(repeated)})")
            if ahead:
                why.append(
                    f"{len(ahead)} batch(es) at or past its cursor, epoch {start.epoch} position {start.position}, "
                    f"never published ({_named(ahead)})"
                )
            keep_aside(
                cursor_file.path,
                f"its replay list names {'; '.join(why)}: they are not produced again",
                copy=True,
            )
            self._replay = self._replay[: start.replayed] + kept
            self._save(durable=True)

    def __len__(self) -> int:
        with self._lock:
            return len(self._replay)

    def entries_from(self, j: int) -> list[tuple[int, int]]:
        with self._lock:
            return self._replay[j:]

    def poll(self, force: bool = False) -> int:
        """Take new sealed segments' entries for this producer into the list, durably; returns how many."""
        if not force and time.monotonic() - self._polled < POLL_S:
            return 0
        self._polled = time.monotonic()
        with self._lock:
            owed = owed_to(self.index, self.checkpoint_dir, self._taken)
            if not owed:
                return 0
            in_plan = [(key, [e for e in entries if self.in_plan(e.epoch, e.position)]) for key, entries in owed]
            epoch, position, replayed = self._committed
            added = owed_once(self.index, in_plan, self._replay[replayed:], (epoch, position))
            # Checked before the list is saved: a saved entry that no batch of the plan has would stop this producer
            # at every start. The segment is taken all the same (its other entries are), and the entries refused.
            for key, entries in owed:
                if outside := [(e.epoch, e.position) for e in entries if not self.in_plan(e.epoch, e.position)]:
                    log.error(
                        "sealed journal segment %s names %d batch(es) that are not in producer %d's plan (%s): "
                        "refused, not produced (the segment belongs to another data plan, or was edited)",
                        key,
                        len(outside),
                        self.index,
                        ", ".join(f"epoch {e} position {q}" for e, q in outside[:5]),
                    )
            self._replay += added
            self._taken += [key for key, _ in owed]
            self._save(durable=True)  # before any of them can be published
        if self.ledger is not None:
            self.ledger.write(Intake([key for key, _ in owed], [list(x) for x in added]))
        if not added:
            return 0
        log.warning(
            "producing again %d batch(es) that dead drafters trained after their last checkpoint (%s)",
            len(added),
            ", ".join(key for key, _ in owed),
        )
        return len(added)

    def commit(self, epoch: int, position: int, replayed: int) -> None:
        """After a publish: the cursor file follows the ring's record (not fsynced: the ring holds it meanwhile)."""
        with self._lock:
            self._committed = (epoch, position, replayed)
            self._save(durable=False)

    def finish(self, epochs: int) -> None:
        """The shard's end (every plan batch and every entry so far published), durably: a drained run started
        again must not redo it, and entries taken later are still owed on top of it."""
        with self._lock:
            self._committed = (epochs, 0, self._committed[2])
            self._save(durable=True)

    @property
    def pending(self) -> bool:
        with self._lock:
            return len(self._replay) > self._committed[2]

    def _save(self, durable: bool) -> None:
        epoch, position, replayed = self._committed
        self.cursor_file.save(
            ResumeState(epoch, position, tuple(self._replay), replayed, tuple(self._taken)), durable=durable
        )


def _named(batches: list[tuple[int, int]]) -> str:
    return ", ".join(f"epoch {e} position {q}" for e, q in batches[:5]) + (", ..." if len(batches) > 5 else "")
