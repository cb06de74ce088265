"""Removing a run's leftovers: segment, semaphores and lock files.

Liveness never rests on the caller's config alone: a run is live while a lock is held in the
lock directory its header records, or in the caller's, or while any process maps its segment
(common/ring_users.py). A damaged header still leaves the other two, so a dead run with a
damaged header can be judged dead and removed.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from dflash_ring.common.layout import RingHeaderError
from dflash_ring.common.lifecycle.liveness import LockFile
from dflash_ring.common.ring import HalfCreatedRingError, Ring, RingNotFound
from dflash_ring.common.ring_users import ring_users
from dflash_ring.supervisor.unfinished import save_unfinished

log = logging.getLogger(__name__)


class RunIsLiveError(RuntimeError):
    pass


def recorded_lock_dir(run: str) -> Path | None:
    """The lock directory the run's ring header records, if the ring exists and its header is readable."""
    try:
        with Ring.open(run) as ring:
            return ring.lock_dir
    except (RingNotFound, RingHeaderError):
        return None


def users_of(run: str, lock_dir: Path, ignore: set[Path] = frozenset()) -> list[str]:
    """Who uses the run's ring now: held locks (recorded lock directory and the caller's), then mappers."""
    recorded = recorded_lock_dir(run)
    return ring_users(run, [d for d in (recorded, lock_dir) if d is not None], ignore)


def remove_run(run: str, lock_dir: Path, keep: Path | None = None) -> list[str]:
    """Unlink the run's IPC objects and the lock files nobody holds (all but `keep`); return what was removed."""
    removed = Ring.unlink(run)
    if lock_dir.is_dir():
        for p in sorted(lock_dir.glob("*.lock")):
            if p == keep:
                continue
            lock = LockFile.try_acquire(p, create=False)  # held by us while unlinked: nobody takes it meanwhile
            if lock is None:
                continue  # a live process keeps its lock file, whatever happens
            lock.release(unlink=True)
            removed.append(str(p))
    return removed


def clean(run: str, lock_dir: Path, state_dir: str, checkpoint_dir: str) -> list[str]:
    """`dflash-ring clean`: remove a dead run, refuse a live one (whatever config the caller has).

    What the dead run's ring still held, and what its dead drafters trained after their checkpoints (under
    `checkpoint_dir`), goes to its producers' replay lists under `state_dir` first."""
    recorded = recorded_lock_dir(run)
    live = ring_users(run, [d for d in (recorded, lock_dir) if d is not None])
    if live:
        raise RunIsLiveError(
            f"run {run!r} is live: in use by {', '.join(live)}. "
            f"Stop it with `dflash-ring stop {run}` (or `--now`), not clean"
        )
    try:
        with Ring.open(run) as ring:
            save_unfinished(ring, state_dir, checkpoint_dir)
    except RingNotFound:
        pass
    except HalfCreatedRingError as e:
        log.warning("%s; it never held an item, so nothing is lost with it", e)
    except RingHeaderError as e:
        log.error("%s: the items the ring held cannot be produced again", e)
    removed = remove_run(run, lock_dir)
    if recorded is not None and recorded != Path(lock_dir).absolute():
        removed += remove_run(run, recorded)
    for d in {lock_dir, recorded} - {None}:
        with contextlib.suppress(OSError):
            d.rmdir()
    return removed
