"""Writes that survive crashes and races: fsync by path, and one builder per cache entry."""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)


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


def cache_entry(final: Path, intact: Callable[[Path], bool], build: Callable[[Path], None]) -> Path:
    """`final`, a cached directory, built by `build(tmp)` unless `intact(final)`: one process builds while the others
    wait on its lock and then reuse the result; a crashed build's leftovers and an entry that is not intact are
    removed first; the new entry appears whole (a temporary directory, every file fsynced, renamed into place)."""
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    with exclusive(root / f".{final.name}.lock"):
        if intact(final):
            return final
        for leftover in root.glob(f".{final.name}.*.tmp"):  # a crashed build's; nobody else builds this entry now
            shutil.rmtree(leftover, ignore_errors=True)
        if final.exists():
            logger.warning("%s is incomplete or corrupt; building it again", final)
            shutil.rmtree(final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=root))
        try:
            build(tmp)
            for path in tmp.iterdir():
                if path.is_file():
                    fsync(path)
            fsync(tmp)
            tmp.rename(final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        fsync(root)
    return final
