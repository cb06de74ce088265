"""Who is alive: one flock'ed lock file per process, released by the kernel on any death.

A heartbeat cannot tell a dead process from a slow one; an flock can, because
the kernel drops it when the process dies, SIGKILL included (the iceoryx2
pattern). To ask whether another process is alive, try to take its lock
without blocking: success means it is dead, and holding that lock keeps a
restarted successor out while its leftovers are cleaned up.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import time
from pathlib import Path

from dflash_ring.common.damaged_file import keep_aside
from dflash_ring.common.layout import ROLE_NAME, Role
from dflash_ring.common.ownership import ensure_private_dir


def lock_path(lock_dir: Path, role: Role, index: int) -> Path:
    return lock_dir / f"{ROLE_NAME[role]}-{index}.lock"


def ensure_lock_dir(lock_dir: Path) -> None:
    """Create the lock directory (and missing parents) 0700; refuse one another user could swap."""
    ensure_private_dir(lock_dir)


class LockFile:
    """An exclusive flock held for the life of this process (or of a reaper's look)."""

    def __init__(self, path: Path, fd: int):
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def try_acquire(cls, path: Path, create: bool = True) -> LockFile | None:
        """Take the lock if nobody holds it; None if someone does (or, without create, no file). A lock path that
        is not a regular file (a directory, a FIFO, a symlink loop: nothing a process of the run made) is kept aside
        by the damaged-file rule first, so that neither a role's start, the reaper nor `clean` fails on it."""
        flags = os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK | (os.O_CREAT if create else 0)
        try:
            fd = os.open(path, flags, 0o600)
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise IsADirectoryError(errno.EISDIR, "not a regular file")  # handled as one below
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno not in (errno.EISDIR, errno.ELOOP, errno.ENXIO):
                raise
            with contextlib.suppress(FileNotFoundError):
                keep_aside(path, "a lock file's name is taken by something not a regular file")
            return cls.try_acquire(path, create)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return None
            raise
        # The holder we waited on may have unlinked the file as it left: a lock on a
        # removed inode guards nothing, so look again.
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            os.close(fd)
            return None
        return cls(path, fd)

    @classmethod
    def acquire(cls, path: Path, timeout_s: float) -> LockFile:
        """Take the lock, waiting while a predecessor in the same role is still dying."""
        deadline = time.monotonic() + timeout_s
        while True:
            lock = cls.try_acquire(path)
            if lock is not None:
                return lock
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{path} is held by a live process after {timeout_s:.0f}s: another process already has "
                    f"this role and index (see `dflash-ring status`)"
                )
            time.sleep(0.05)

    def write_pid(self) -> None:
        assert self._fd is not None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def release(self, unlink: bool = False) -> None:
        if self._fd is None:
            return
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None


def is_alive(path: Path) -> bool:
    """True while some process holds the lock at path."""
    lock = LockFile.try_acquire(path, create=False)
    if lock is None:
        return path.exists()
    lock.release()
    return False


def live_lock_files(lock_dir: Path) -> list[Path]:
    if not lock_dir.is_dir():
        return []
    return [p for p in sorted(lock_dir.glob("*.lock")) if is_alive(p)]
