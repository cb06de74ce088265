"""Checking an output directory before any work: a long export must not fail on its last write."""

from __future__ import annotations

import os
from pathlib import Path


class OutputDirError(RuntimeError):
    """An output directory that cannot be created or written; the message names the path and why."""


def check_output_dir(path: str | os.PathLike) -> Path:
    """Return path if it is (or can be created as) a writable directory, else raise OutputDirError."""
    path = Path(os.path.abspath(path))
    existing = path
    while not existing.exists():
        if existing.is_symlink():
            raise OutputDirError(f"output directory {path}: {existing} is a dangling symlink; choose another path")
        existing = existing.parent
    if not existing.is_dir():
        raise OutputDirError(f"output directory {path}: {existing} is not a directory; choose another path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OutputDirError(
            f"output directory {path}: {existing} is not writable by this user; choose a directory you can write to"
        )
    st = os.statvfs(existing)
    if st.f_flag & os.ST_RDONLY:
        raise OutputDirError(f"output directory {path}: {existing} is on a read-only file system; choose another path")
    return path
