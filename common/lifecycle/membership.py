"""A process's seat in a run: its lock file (liveness) and its row in the process table."""

from __future__ import annotations

import logging

from dflash_ring.common.config.schema import RunConfig
from dflash_ring.common.layout import Role, RowStatus
from dflash_ring.common.lifecycle.liveness import LockFile, ensure_lock_dir, lock_path
from dflash_ring.common.ring import Ring
from dflash_ring.common.lifecycle.trained_journal import seal_drafter

log = logging.getLogger(__name__)


class Membership:
    def __init__(self, ring: Ring, lock: LockFile, row: int, role: Role, index: int):
        self.ring = ring
        self.row = row
        self.role = role
        self.index = index
        self._lock = lock

    @classmethod
    def join(
        cls, ring: Ring, run: RunConfig, role: Role, index: int, *, journal_dir: str, lock: LockFile | None = None
    ) -> Membership:
        """Take this role's row, waiting until a predecessor in it is confirmed dead.

        Whatever the predecessor held (a half-written or half-read slot) is
        undone before this process does anything, so a restart needs no help
        from the supervisor. `lock`: the index's lock, already taken (a drafter
        takes its seat before loading its checkpoint, common/lifecycle/seat.py); the
        takeover that follows is the same as a restart's. `journal_dir`: where a drafter's trained journal lives
        (train.checkpoint_dir), sealed for a dead predecessor before its slots are undone.
        """
        row = ring.row_of(role, index)
        if lock is None:
            lock_dir = run.lock_dir()
            ensure_lock_dir(lock_dir)
            lock = LockFile.acquire(lock_path(lock_dir, role, index), run.attach_timeout_s)
        lock.write_pid()
        if role == Role.CONSUMER:  # before its slots are undone: what it trained and released is produced again
            seal_drafter(journal_dir, index, ring.identity.created_ns, ring.unfinished_item_numbers())
        freed, redelivered = ring.reclaim_slots_of(row)
        if freed or redelivered:
            log.warning(
                "took over row %d from a dead predecessor: %d slot(s) freed, %d redelivered", row, freed, redelivered
            )
        ring.take_row(row, role, index)
        return cls(ring, lock, row, role, index)

    def heartbeat(self) -> None:
        self.ring.heartbeat(self.row)

    def leave(self, status: RowStatus = RowStatus.STOPPED) -> None:
        """Give the row up on a clean exit; a finished producer keeps DONE."""
        if self.ring.row_status(self.row) != RowStatus.DONE:
            self.ring.set_row_status(self.row, status)
        self._lock.release(unlink=True)
