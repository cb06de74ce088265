"""The one rule for a damaged file in a role's own directories: rebuilt, with the damaged copy kept aside.

A role reads back files it wrote itself (a drafter's journal segments and record file, the head cache, a
producer's cursor file). A byte flipped on disk, a line edited by hand or a file of another version must not
crash the reader (a crash at start is a crash loop under systemd) nor be read approximately in silence. Where
what the file holds can be rebuilt from what is authoritative (its readable lines, a probe run again), the
reader rebuilds it and the damaged copy is kept beside it as `NAME.damaged-<UTC time>`, with one warning line
saying what was kept and what was not; an operator can look at the copy, and nothing is lost that a person could
still recover. Where nothing can rebuild it, the reader refuses it in one line naming the file and what to do
(e.g. common/lifecycle/resume_state.py's CursorFileError).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from .durable import fsync

log = logging.getLogger(__name__)

SUFFIX = ".damaged-"


def aside_path(path: Path) -> Path:
    """`NAME.damaged-<UTC time>`, unique in its directory (a second damage in the same second gets `-2`, ...)."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside, n = path.with_name(f"{path.name}{SUFFIX}{stamp}"), 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}{SUFFIX}{stamp}-{n}")
    return aside


def keep_aside(path: Path, why: str, *, copy: bool = False) -> Path:
    """Move (or `copy`) the damaged file `path` aside, durably, and warn once naming both and `why`; returns
    where the copy is. Called before the file is rebuilt in place, so the damaged bytes survive the rebuild."""
    aside = aside_path(path)
    if copy:
        shutil.copyfile(path, aside)
        os.chmod(aside, 0o600)
    else:
        os.replace(path, aside)
    fsync(path.parent)
    log.warning("damaged file %s: %s; the damaged copy is kept as %s", path, why, aside)
    return aside


def write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` by `data` (mode 0600) through a temporary file of its own (mkstemp: created, never opened
    where something else already is, so a FIFO in its place cannot block the writer), fsynced with its directory."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync(path.parent)
