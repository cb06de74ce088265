"""Making a write survive a crash: fsync a file or a directory by path."""

from __future__ import annotations

import os
from pathlib import Path


def fsync(path: str | os.PathLike) -> None:
    """fsync a file, or a directory so that a rename inside it is durable."""
    fd = os.open(Path(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
