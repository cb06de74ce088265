"""Fencing a process the supervisor gives up on: it dies before anyone else is handed what it held.

A drafter stalled past supervisor.exit_timeout_s after shutdown (a GC pause, a debugger, SIGSTOP) still holds
slots. Handing them to the replay lists while it lives would let it wake, train them and checkpoint them, and
the restart would train them again. So the supervisor SIGKILLs the holder of each silent process's lock file
(found in /proc/locks by the file's inode: the lock, not a pid that may have been reused, names it) and hands
over only once the kernel has dropped the lock: a process SIGKILLed runs no further instruction of its own,
and its lock goes only once it has exited, so no write of its can land after the hand-over. A process that
outlives SIGKILL (stuck in the kernel) keeps the ring in place instead of being handed over twice.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

from dflash_ring.common.lifecycle.liveness import is_alive

log = logging.getLogger(__name__)

DEATH_WAIT_S = 30.0


def lock_holders(path: Path) -> set[int]:
    """The pids holding an flock on `path` (not those waiting for one)."""
    try:
        st = os.stat(path)
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return set()
    want = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    pids = set()
    for line in lines:
        fields = line.split()
        if len(fields) < 6 or "->" in fields or fields[1] != "FLOCK":
            continue
        try:
            major, minor, inode = fields[5].split(":")
            if (int(major, 16), int(minor, 16), int(inode)) == want:
                pids.add(int(fields[4]))
        except ValueError:
            continue
    return pids


def has_open(pid: int, path: Path) -> bool:
    """Whether process `pid` (as this namespace numbers it) has `path` open now. /proc/locks gives 0 for a holder
    in another pid namespace, and may name a pid that has since exited and been reused: only a process that
    holds the very file open may be signalled (os.kill(0, ...) would hit our own process group)."""
    if pid <= 0:
        return False
    try:
        want = os.stat(path)
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            st = os.stat(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (want.st_dev, want.st_ino):
            return True
    return False


def fence(lock_dir: Path, names: list[str], wait_s: float = DEATH_WAIT_S) -> list[str]:
    """SIGKILL the holders of these lock files and wait until their locks are free; the names still held."""
    paths = [lock_dir / n for n in names]
    for path in paths:
        for pid in lock_holders(path):
            if pid == os.getpid():
                continue
            if not has_open(pid, path):
                log.error(
                    "%s is locked by pid %d, which has no such file open (another pid namespace, or a pid "
                    "reused): not signalled; it is fenced only once its holder exits",
                    path.name,
                    pid,
                )
                continue
            try:
                os.kill(pid, signal.SIGKILL)
                log.warning("fenced %s: SIGKILL to pid %d", path.name, pid)
            except ProcessLookupError:
                pass
            except PermissionError:
                log.error("cannot SIGKILL pid %d holding %s (another user?)", pid, path)
    deadline = time.monotonic() + wait_s
    while (held := [p for p in paths if p.exists() and is_alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p.name for p in held]
