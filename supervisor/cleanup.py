"""Removing a run's leftovers: segment, semaphores and lock files.

Liveness comes from the lock files alone, never from the segment's header,
so a run whose header is damaged can still be judged dead and removed.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from dflash_ring.common.liveness import live_lock_files
from dflash_ring.common.ring import Ring


class RunIsLiveError(RuntimeError):
    pass


def remove_run(run: str, lock_dir: Path, keep: Path | None = None) -> list[str]:
    """Unlink the run's IPC objects and lock files (all but `keep`); return what was removed."""
    removed = Ring.unlink(run)
    if lock_dir.is_dir():
        for p in sorted(lock_dir.glob("*.lock")):
            if p != keep:
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
                    removed.append(str(p))
    return removed


def clean(run: str, lock_dir: Path) -> list[str]:
    """`dflash-ring clean`: remove a dead run, refuse a live one."""
    live = live_lock_files(lock_dir)
    if live:
        raise RunIsLiveError(
            f"run {run!r} is live: {', '.join(p.stem for p in live)} still hold their locks in {lock_dir}. "
            f"Stop it with `dflash-ring stop {run}` (or `--now`), not clean"
        )
    removed = remove_run(run, lock_dir)
    with contextlib.suppress(OSError):
        lock_dir.rmdir()
    return removed
