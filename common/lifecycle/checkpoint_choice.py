"""Which checkpoint of a drafter's directory a resume takes: one rule, for the store that loads it
(consumer/training/checkpoint.py) and for whoever seals a dead drafter's journal against it
(common/lifecycle/trained_journal.py).

    <train.checkpoint_dir>/drafter-<j>/
      step-NNNNNNNN/    complete checkpoints (each renamed into place whole)
      latest            "step-NNNNNNNN": the one to take first

The directory `latest` names comes first, then the others newest first. Without a pointer (a drafter killed
between renaming its first checkpoint into place and writing the pointer), or with one that names no checkpoint
directory, the newest complete one comes first. Were the two readers to choose differently, a successor would
resume from a checkpoint whose batches the sealed journal also has produced again (trained twice), or from an
older one the journal was not sealed against (batches lost).
"""

from __future__ import annotations

import re
from pathlib import Path

from dflash_ring.common.bounded_read import read_own

STEP_DIR = re.compile(r"^step-(\d{8})$")
POINTER = "latest"
POINTER_BYTES = 4096  # "step-NNNNNNNN\n"


def step_of(path: Path) -> int:
    return int(STEP_DIR.match(path.name).group(1))


def complete_dirs(root: Path) -> list[Path]:
    """The checkpoint directories under `root`, newest first (a temporary directory being written is none)."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)), key=step_of, reverse=True)


def pointer_name(root: Path) -> str | None:
    """The checkpoint `latest` names; None without a pointer, "" for one that names no checkpoint directory (not
    ASCII, not `step-NNNNNNNN`): the newest complete checkpoint comes first then. A pointer that is not a regular
    file (a FIFO, a directory, a symlink loop) is kept aside (common/bounded_read.py's read_own), so the reaper and
    `clean` never block on it and the drafter can write it again: as without a pointer."""
    if (data := read_own(root / POINTER, POINTER_BYTES, "checkpoint pointer")) is None:
        return None
    try:
        name = data.decode("ascii").strip()
    except UnicodeDecodeError:
        return ""
    return name if STEP_DIR.match(name) else ""


def resume_order(root: Path) -> list[Path]:
    """The complete checkpoints in the order a resume tries them (each is verified as it loads: a refused one
    gives way to the next)."""
    name = pointer_name(root)
    return sorted(complete_dirs(root), key=lambda p: p.name != name)  # stable: newest first after the pointer's


def resume_step(root: Path) -> int:
    """The step a successor resumes from (0: from the start, there is no checkpoint)."""
    dirs = resume_order(root)
    return step_of(dirs[0]) if dirs else 0
