"""Writes that survive crashes and races: fsync by path, and one builder per cache entry."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def fsync(path: str | os.PathLike) -> None:
    """fsync a file, or a directory so that a rename inside it is durable."""
    fd = os.open(Path(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def exclusive(lock_path: str | os.PathLike) -> Iterator[None]:
    """Hold an exclusive flock on lock_path (mode 0600): one process builds a cache entry, the others wait."""
    fd = os.open(Path(lock_path), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the lock
