"""What a drafter trained since its last durable checkpoint, on disk: a crash then loses no batch from the model.

A drafter releases a slot once the step that used it has returned, but its checkpoint comes only every
train.checkpoint_every_steps. A drafter killed in between takes the updates of the batches it released since
with it, and its successor resumes from the checkpoint: those batches would be in no surviving state. So
before each release the drafter appends the batch's identity to its journal, and the batches of a dead
drafter's journal that its checkpoint does not cover are produced again (the producers' replay lists):

    <train.checkpoint_dir>/drafter-<j>/journal/
      open-<S>-<pid>-<ring>.jsonl   written by drafter pid: the batches it trained into steps after S (the
                                    step of the checkpoint whose state was taken last), in ring <ring>
      lost-<S>-<pid>-<ring>.jsonl   sealed, once pid is dead and no checkpoint after S covers them: to be
                                    produced again (each producer takes its own entries once, by name)

The writer rotates to a new open segment when a checkpoint's state is taken and deletes the segments every kept
checkpoint covers once that checkpoint is durable. Whoever undoes a dead drafter's row seals its open segments
first (the reaper, the drafter's successor, the removal of the ring), while the slots it still held are in the
ring: those are redelivered or replayed by the ring, so their entries are left out of the sealed segment, and a
batch is never both redelivered and replayed. Sealing is idempotent (the first seal of a segment wins).

One `write(2)` per line on an O_APPEND descriptor: a SIGKILL cannot cut a line. There is no fsync per line: a
host that loses its page cache loses its /dev/shm too, which README states as the one loss of a host crash.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_ring.common.lifecycle.checkpoint_choice import resume_step
from dflash_ring.common.damaged_file import keep_aside, write_atomic

log = logging.getLogger(__name__)

SEGMENT = re.compile(r"^(open|lost)-(\d{8})-(\d+)-(\d+)\.jsonl$")


@dataclass(frozen=True)
class Entry:
    """A trained batch: its identity (producer, epoch, position) and, in its ring, the item number it had."""

    producer: int
    epoch: int
    position: int
    item: int


@dataclass(frozen=True)
class Segment:
    path: Path
    kind: str  # open | lost
    after_step: int
    pid: int
    ring: int

    @property
    def key(self) -> str:
        """Its name across drafters: what a producer records once it has taken its entries."""
        return f"{self.path.parent.parent.name}/{self.path.name}"


def journal_dir(checkpoint_dir: str | os.PathLike, index: int) -> Path:
    return Path(checkpoint_dir) / f"drafter-{index}" / "journal"


def segments(directory: Path, kind: str | None = None) -> list[Segment]:
    if not directory.is_dir():
        return []
    out = []
    for p in sorted(directory.iterdir()):
        if (m := SEGMENT.match(p.name)) and (kind is None or m.group(1) == kind):
            out.append(Segment(p, m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4))))
    return out


def _entry(line: bytes) -> Entry | None:
    """One line's entry, or None when it is not one: exactly the line `Journal.append` writes, each field a
    non-negative JSON integer (a float such as 1e400, a bool, a repeated key, bytes that are not UTF-8 or any
    byte the writer would not have written make the line damaged, never a guess)."""
    try:
        r = json.loads(line.decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return None
    if not isinstance(r, dict) or set(r) != {"p", "e", "q", "i"}:
        return None
    values = [r[k] for k in ("p", "e", "q", "i")]
    if any(type(v) is not int or v < 0 for v in values):  # noqa: E721 (a bool is no number here)
        return None
    e = Entry(*values)
    return e if _line(e) == line + b"\n" else None


def read_entries(path: Path) -> list[Entry]:
    """A segment's entries. A segment with a line that is not an entry (a flipped byte, a hand edit, a line cut by
    a host crash) is rebuilt from its readable lines and the damaged copy kept aside (common/damaged_file.py),
    with one warning: the reader never crashes on it (the drafter at join, the supervisor at teardown, `clean`),
    and the batches of the unreadable lines are named as possibly missing from the model, not skipped silently."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []  # sealed or covered meanwhile by another process
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline
    out, bad = [], [n for n, x in enumerate(lines, 1) if not x]
    for n, line in enumerate(lines, 1):
        if line and (e := _entry(line)) is not None:
            out.append(e)
        elif line:
            bad.append(n)
    if tail:
        bad.append(len(lines) + 1)
    if bad and path.exists() and path.read_bytes() == data:  # another reader may have rebuilt it already
        keep_aside(
            path,
            f"{len(bad)} journal line(s) unreadable (line {', '.join(map(str, sorted(bad)[:5]))}"
            f"{', ...' if len(bad) > 5 else ''}), {len(out)} kept: the batches those lines named "
            "cannot be produced again and may be missing from the drafter's model",
        )
        write_atomic(path, b"".join(_line(e) for e in out))
    return out


def _line(e: Entry) -> bytes:
    return (
        json.dumps({"p": e.producer, "e": e.epoch, "q": e.position, "i": e.item}, separators=(",", ":")).encode()
        + b"\n"
    )


def successor_step(checkpoint_dir: str | os.PathLike, index: int) -> int:
    """The step drafter `index`'s successor resumes from (0 without a checkpoint), by the store's own rule
    (common/lifecycle/checkpoint_choice.py): the journal is sealed against exactly the state the model goes on from."""
    return resume_step(Path(checkpoint_dir) / f"drafter-{index}")


class Journal:
    """The writer: one drafter process's record of what it trained since the state of its last checkpoint."""

    def __init__(self, directory: Path, ring: int, after_step: int):
        self.directory, self.ring, self.after_step = directory, ring, after_step
        self._fd: int | None = None  # opened with the first entry: a drafter that trains nothing leaves no file
        self._pid = os.getpid()

    def append(self, meta: dict[str, Any], item: int) -> None:
        """Before the batch's slot is released: once released, only this line can bring the batch back."""
        if self._fd is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            path = self.directory / f"open-{self.after_step:08d}-{self._pid}-{self.ring}.jsonl"
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        os.write(self._fd, _line(Entry(int(meta["producer"]), int(meta["epoch"]), int(meta["position"]), int(item))))

    def rotate(self, step: int) -> None:
        """A checkpoint's state was taken at `step`: what is trained from now on goes into the next segment."""
        self._close()
        self.after_step = step

    def covered(self, oldest_kept: int) -> None:
        """A checkpoint is durable: delete this process's segments that every kept checkpoint covers (those
        before the oldest kept one; a resume that falls back to an older kept checkpoint still finds the rest)."""
        for s in segments(self.directory, "open"):
            if s.pid == self._pid and s.after_step < oldest_kept:
                s.path.unlink(missing_ok=True)

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def close(self) -> None:
        self._close()


def seal(directory: Path, resumes_from: int, ring: int, in_ring: Iterable[int], *, mine: int | None = None) -> int:
    """Seal the open segments of dead drafters in `directory`: those after `resumes_from` (the checkpoint a
    successor resumes from) become `lost` segments, without the entries whose items are still in `ring` (ring
    id; `in_ring`: the item numbers still READY or READING there). Call with the dead drafter's row lock held,
    before its slots are undone. `mine`: this process's pid, whose own segments are never sealed.
    Returns the number of entries sealed."""
    still = set(in_ring)
    sealed = 0
    for s in segments(directory, "open"):
        if s.pid == mine or s.after_step < resumes_from:
            continue
        lost = s.path.with_name("lost" + s.path.name[len("open") :])
        if not lost.exists():  # the first seal wins: the ring has moved on since
            entries = [e for e in read_entries(s.path) if not (s.ring == ring and e.item in still)]
            write_atomic(lost, b"".join(_line(e) for e in entries))
            sealed += len(entries)
            if entries:
                log.warning(
                    "drafter journal %s: %d batch(es) trained after checkpoint step %d died with pid %d; "
                    "they are produced again",
                    lost,
                    len(entries),
                    s.after_step,
                    s.pid,
                )
        s.path.unlink(missing_ok=True)
    return sealed


def seal_drafter(checkpoint_dir: str | os.PathLike, index: int, ring: int, in_ring: Iterable[int]) -> int:
    """Seal dead drafter `index`'s journal against the checkpoint its successor resumes from."""
    return seal(
        journal_dir(checkpoint_dir, index), successor_step(checkpoint_dir, index), ring, in_ring, mine=os.getpid()
    )


def drop_covered(directory: Path, resumes_from: int, mine: int) -> None:
    """A successor resumed from `resumes_from`: its predecessors' open segments before it are covered."""
    for s in segments(directory, "open"):
        if s.pid != mine and s.after_step < resumes_from:
            s.path.unlink(missing_ok=True)


def lost_segments(checkpoint_dir: str | os.PathLike) -> list[Segment]:
    """Every drafter's sealed segments under train.checkpoint_dir."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return []
    return [s for d in sorted(root.glob("drafter-*")) for s in segments(d / "journal", "lost")]


def owed_to(producer: int, checkpoint_dir: str | os.PathLike, taken: Iterable[str]) -> list[tuple[str, list[Entry]]]:
    """The sealed segments with entries of `producer` that it has not taken yet: (key, its entries)."""
    done = set(taken)
    out = []
    for s in lost_segments(checkpoint_dir):
        if s.key in done:
            continue
        mine = [e for e in read_entries(s.path) if e.producer == producer]
        if mine:
            out.append((s.key, mine))
    return out


def remove_all(checkpoint_dir: str | os.PathLike) -> list[str]:
    """A complete run's end: every drafter's journal is void."""
    removed = []
    root = Path(checkpoint_dir)
    for d in sorted(root.glob("drafter-*/journal")) if root.is_dir() else []:
        for s in segments(d):
            s.path.unlink(missing_ok=True)
            removed.append(str(s.path))
    return removed
