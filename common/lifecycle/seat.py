"""Waiting for a seat: one role index's lock file, while someone else may hold it.

A drafter's seat is its index's lock (common/lifecycle/liveness.py): whoever holds it is drafter K, serves K's metrics
port, writes K's checkpoints, journal and tracker series. Two kinds of process wait for one:

- A drafter started for its own index (`dflash-ring drafter --index K`) takes the lock as soon as it is free,
  whatever K's row says: a first start, a restart after a clean stop or after a death. If a live process holds
  it (the warm standby that took K over when this unit's predecessor died, or a second process started for K
  by mistake), it waits, as a standby for K, with no bound: the predecessor's wait in `LockFile.acquire`
  (run.attach_timeout_s) would end in an error, and systemd would restart it into the same wait until it gave
  up, leaving K without a standby.
- A warm standby (`dflash-ring drafter --standby`) takes an index only when its row shows a holder that died:
  RUNNING (not reaped yet) or DEAD (reaped) with its lock free. Never EMPTY (that drafter has not started yet:
  the standby would take its place before it came) nor STOPPED (it left cleanly: the run is ending, or an
  operator stopped it). The row is read again under the lock, so a holder that left cleanly between the two
  looks is not taken over.

Either way the seat comes with its lock held, and `Membership.join` does with it exactly what a restart does (the
dead holder's journal sealed, its slots undone). Waiting ends with no seat when the run shuts down or a stop
signal comes: nothing was taken over, nothing trained. While it waits a process tells systemd it is ready (a
standby may wait for the whole run) and pings the watchdog.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dflash_ring.common.lifecycle import sd_notify
from dflash_ring.common.layout import OPERATOR_NAME, Role, RowStatus
from dflash_ring.common.lifecycle.liveness import LockFile, ensure_lock_dir, lock_path
from dflash_ring.common.ring import Ring

log = logging.getLogger(__name__)

POLL_S = 0.05  # a look is an open and a non-blocking flock per index; this bounds what it adds to a takeover
HOLDER_DIED = (RowStatus.RUNNING, RowStatus.DEAD)


@dataclass
class Seat:
    index: int
    lock: LockFile  # held: hand it to `Membership.join`
    predecessor_pid: int  # the pid K's row named when the seat was taken (0: it never ran)
    # Taken over rather than (re)started: a standby's, or a seat a live process held at the first look.
    takeover: bool


def take_seat(
    ring: Ring, lock_dir: Path, role: Role, indices: Sequence[int], stop: threading.Event, standby: bool
) -> Seat | None:
    """The first seat of `indices` this process may take (module docstring), waiting for one; None when the run
    shuts down or `stop` is set first."""
    ensure_lock_dir(lock_dir)
    name = OPERATOR_NAME[role]
    waited = False
    while True:
        # A standby's, or a drafter's waiting as one for a live holder (waited): a death now is the end of the
        # run's business, the reaper's; and a holder that leaves at the run's end frees a seat in a finished run
        # (taken, its metrics port would still be the leaver's: exit 2, seen in bench pipeline's kill test).
        if (standby or waited) and ring.shutting_down:
            return None
        for index in indices:
            seat = _look(ring, lock_dir, role, index, standby)
            if seat is not None:
                seat.takeover = seat.takeover or waited
                return seat
        if stop.is_set() or ring.shutting_down:
            return None
        if not waited:
            waited = True
            if standby:
                status = f"{name} standby for {', '.join(map(str, indices))}: built, ring attached, waiting"
                log.info("%s", status)
            else:
                (index,) = indices
                holder = _holder_pid(lock_path(lock_dir, role, index))
                status = (
                    f"{name} {index}: its lock is held by a live process (pid {holder}), as after a standby "
                    f"took it over; waiting as its standby"
                )
                log.warning("%s", status)
            sd_notify.ready(status)
        sd_notify.watchdog()
        time.sleep(POLL_S)


def _look(ring: Ring, lock_dir: Path, role: Role, index: int, standby: bool) -> Seat | None:
    row = ring.row_of(role, index)
    if standby and ring.row_status(row) not in HOLDER_DIED:  # first without the lock: no file made for nothing
        return None
    lock = LockFile.try_acquire(lock_path(lock_dir, role, index))
    if lock is None:
        return None
    if standby and ring.row_status(row) not in HOLDER_DIED:  # it left cleanly between the two looks
        lock.release(unlink=True)
        return None
    return Seat(index, lock, int(ring.rows()[row]["pid"]), takeover=standby)


def _holder_pid(path: Path) -> str:
    """The pid a lock's holder wrote into it (`LockFile.write_pid`), for the log; '?' if it is not there yet."""
    try:
        return path.read_text().strip() or "?"
    except OSError:
        return "?"
