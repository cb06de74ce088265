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

Nothing read back is trusted because it is well-formed (issue 46): a line is

    {"p":<producer>,"e":<epoch>,"q":<position>,"i":<item>,"s":<step>,"c":"<crc32 of the rest>"}

where `s` is the optimizer step whose update holds the batch, and a sealed segment ends in a seal line,
{"sealed":<entries>,"d":"<their set digest>","c":"<crc32>"}. So a changed digit is damage, not another batch; a
segment is a set (a repeated line counts once); a line whose step the segment's checkpoint covers names a batch that
checkpoint holds and is not produced again; a line added to a sealed segment (even a valid, in-plan one) or removed
from it is found by the seal line. Each is named and the file kept aside (`read_entries`), and what producers take is
checked against their other records (`owed_once`). Segments written before (lines without step or checksum, sealed
ones without a seal line) are still read, checked line by line and as a set only: a fleet restarting a drafter
mid-run onto this version keeps what its predecessors' journals hold, and each segment's format is its writer's
(a line without a checksum among lines that have one is damage).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import stat
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_ring.common.bounded_read import JOURNAL_BYTES, read_own
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
    # The optimizer step whose update holds the batch (None: a line of a version before lines carried it). A line
    # of the segment after the checkpoint of step S holds a step > S; one with a step <= S names a batch that
    # checkpoint already holds.
    step: int | None = None

    @property
    def batch(self) -> tuple[int, int, int]:
        return (self.producer, self.epoch, self.position)


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
    """One line's entry, or None when it is not one: exactly the line `Journal.append` writes, its checksum the
    crc32 of the rest, each field a non-negative JSON integer (a float such as 1e400, a bool, a repeated key, bytes
    that are not UTF-8, a changed digit or any byte the writer would not have written make the line damaged, never
    a guess). A line of an earlier version (no step, no checksum) is read too; `_check` decides where it may be."""
    try:
        r = json.loads(line.decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return None
    if not isinstance(r, dict) or set(r) not in ({"p", "e", "q", "i"}, {"p", "e", "q", "i", "s", "c"}):
        return None
    values = [r[k] for k in ("p", "e", "q", "i", "s") if k in r]
    if any(type(v) is not int or v < 0 for v in values):  # noqa: E721 (a bool is no number here)
        return None
    e = Entry(*values)
    return e if _line(e) == line + b"\n" else None


def _seal_line(line: bytes) -> tuple[int, int] | None:
    """A sealed segment's last line, (entries, set digest), or None when the line is not one."""
    try:
        r = json.loads(line.decode("utf-8"))
    except (ValueError, RecursionError):
        return None
    if not isinstance(r, dict) or set(r) != {"sealed", "d", "c"} or type(r["sealed"]) is not int:  # noqa: E721
        return None
    if not isinstance(r["d"], str) or not re.fullmatch(r"[0-9a-f]{16}", r["d"]):
        return None
    sealed = (r["sealed"], int(r["d"], 16))
    return sealed if _seal_bytes(*sealed) == line + b"\n" else None


def _seal_bytes(count: int, digest: int) -> bytes:
    content = json.dumps({"sealed": count, "d": f"{digest:016x}"}, separators=(",", ":")).encode()
    return content[:-1] + b',"c":"%08x"}\n' % zlib.crc32(content)


def _hash(e: Entry) -> int:
    return int.from_bytes(hashlib.blake2b(_line(e), digest_size=8).digest(), "big")


def _set_digest(entries: Iterable[Entry]) -> int:
    """The digest of a set of entries, whatever their order: the sum of their lines' hashes (mod 2**64). One entry
    added is found by its hash, the difference of two sums."""
    return sum(map(_hash, entries)) % (1 << 64)


def segment_bytes(entries: list[Entry], sealed: bool) -> bytes:
    """A segment's bytes: its lines and, sealed, the seal line that counts and digests them (not for the lines of an
    earlier version, which had none: nothing would check it)."""
    body = b"".join(_line(e) for e in entries)
    if sealed and all(e.step is not None for e in entries):
        body += _seal_bytes(len(entries), _set_digest(entries))
    return body


def _lines(numbers: list[int]) -> str:
    numbers = sorted(numbers)
    return f"line {', '.join(map(str, numbers[:5]))}{', ...' if len(numbers) > 5 else ''}"


@dataclass
class _Read:
    """What `_check` made of a segment's bytes: the entries to trust, and why the file is damaged ("" if it is not)."""

    entries: list[Entry]
    why: str = ""


def _check(data: bytes, sealed: bool, after: int) -> _Read:
    """A segment's bytes against every rule a read-back entry is held to (issue 46): each line checks itself (its
    checksum); a segment is one writer's, in one format; it is a set (a repeated entry counts once); no line names a
    batch the checkpoint it comes after already holds (its step at or before `after`); and a sealed segment's lines
    are exactly those its seal line counts and digests (a line added after sealing, even a valid one naming a batch
    of the plan, is found and left out; one removed is named)."""
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline
    bad: list[int] = []
    found: list[tuple[int, Entry]] = []
    seal: tuple[int, int] | None = None
    seal_at = 0  # the seal line's number
    for n, line in enumerate(lines, 1):
        if sealed and seal is None and (s := _seal_line(line)) is not None:
            seal, seal_at = s, n
        elif not line or (e := _entry(line)) is None:
            bad.append(n)
        else:
            found.append((n, e))
    if tail:
        bad.append(len(lines) + 1)
    if any(e.step is not None for _, e in found) or seal is not None:  # this version's: a line without a checksum
        bad += [n for n, e in found if e.step is None]  # is one whose checksum was lost, never an older line
        found = [(n, e) for n, e in found if e.step is not None]
    repeated, held, kept, batches = [], [], [], set()
    for n, e in found:
        if e.batch in batches:
            repeated.append(n)
        elif e.step is not None and e.step <= after:
            held.append(n)
        else:
            batches.add(e.batch)
            kept.append((n, e))
    # Lines after the seal line were added since (`>>` onto a sealed segment), unless with them the entries are the
    # very set the seal line digests (the seal line moved, nothing else).
    out, after_seal = [e for _, e in kept], []
    if seal is not None and (len(out), _set_digest(out)) != seal:
        after_seal = [n for n, _ in kept if n > seal_at]
        out = [e for n, e in kept if n < seal_at]
    why = []
    if bad:
        why.append(f"{len(bad)} journal line(s) unreadable ({_lines(bad)})")
    if repeated:
        why.append(f"{len(repeated)} line(s) repeat an entry of the segment ({_lines(repeated)})")
    if held:
        why.append(f"{len(held)} line(s) name a batch the checkpoint of step {after} already holds ({_lines(held)})")
    if after_seal:
        why.append(f"{len(after_seal)} line(s) added after its seal line ({_lines(after_seal)})")
    gone, doubt = 0, False
    if sealed and seal is None and out and all(e.step is not None for e in out):
        doubt = True
        why.append("its seal line is missing")
    elif seal is not None and (len(out), _set_digest(out)) != seal:
        count, digest = seal
        extra = (_set_digest(out) - digest) % (1 << 64)
        if len(out) == count + 1 and (added := [e for e in out if _hash(e) == extra]):
            out.remove(added[0])
            e = added[0]
            why.append(
                f"1 line added after it was sealed (producer {e.producer} epoch {e.epoch} position {e.position})"
            )
        elif len(out) < count:
            gone = count - len(out)
            why.append(f"{gone} of its {count} sealed entries gone (removed since it was sealed, or unreadable)")
        else:
            doubt = True
            why.append(f"its {len(out)} entries are not the {count} its seal line digests (edited since it was sealed)")
    if not why:
        return _Read(out)
    if bad or gone:
        outcome = "the batches those lines named cannot be produced again and may be missing from the drafter's model"
    elif doubt:
        outcome = "they cannot be checked as a set: a batch among them may be trained twice"
    else:
        outcome = "the lines left out are not produced (their batches are in a checkpoint, or owed once already)"
    return _Read(out, "; ".join(why) + f", {len(out)} kept: {outcome}")


def read_entries(path: Path) -> list[Entry]:
    """A segment's entries, checked (`_check`). A segment with a line that is not an entry (a flipped byte, a changed
    digit, a hand edit, a line cut by a host crash) or that contradicts the rest (a repeat, a batch the checkpoint
    holds, a line added to a sealed segment) is rebuilt from the entries it can trust and the damaged copy kept aside
    (common/damaged_file.py), with one warning: the reader never crashes on it (the drafter at join, the supervisor
    at teardown, `clean`), and the batches of the unreadable lines are named as possibly missing from the model, not
    skipped silently.

    Segments written before lines carried a checksum and a step (and sealed ones a seal line) are read as they were,
    checked only line by line and as a set: a fleet that restarts a drafter mid-run onto this version must not lose
    what its predecessors' journals hold. The format is the segment's, never the line's: in a segment of this
    version, a line without a checksum is damage."""
    if (data := read_own(path, JOURNAL_BYTES, "journal segment")) is None:
        return []  # sealed or covered meanwhile by another process, or not a file (kept aside: read_own)
    m = SEGMENT.match(path.name)
    sealed = m is not None and m.group(1) == "lost"
    read = _check(data, sealed, int(m.group(2)) if m else -1)
    if read.why and read_own(path, JOURNAL_BYTES, "journal segment") == data:  # another reader may have rebuilt it
        keep_aside(path, read.why)
        write_atomic(path, segment_bytes(read.entries, sealed))
    return read.entries


def _remove(path: Path) -> None:
    """Unlink a segment; a directory in its name (nothing a drafter wrote) is kept aside instead of failing the
    remover (the reaper, `clean`, a successor)."""
    try:
        path.unlink(missing_ok=True)
    except IsADirectoryError:
        with contextlib.suppress(FileNotFoundError):
            keep_aside(path, "a journal segment's name is taken by a directory")


def _line(e: Entry) -> bytes:
    """The line of entry `e`: its fields and the crc32 of them, so that a changed digit is damage, not another
    batch (an entry of an earlier version, without a step, has neither)."""
    fields = {"p": e.producer, "e": e.epoch, "q": e.position, "i": e.item}
    if e.step is None:
        return json.dumps(fields, separators=(",", ":")).encode() + b"\n"
    content = json.dumps(fields | {"s": e.step}, separators=(",", ":")).encode()
    return content[:-1] + b',"c":"%08x"}\n' % zlib.crc32(content)


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

    def append(self, meta: dict[str, Any], item: int, step: int | None = None) -> None:
        """Before the batch's slot is released: once released, only this line can bring the batch back. `step`: the
        optimizer step whose update holds the batch (the step under way while its micro-batch accumulates); None
        means the first after this segment's checkpoint, for writers that count no steps."""
        if self._fd is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            path = self.directory / f"open-{self.after_step:08d}-{self._pid}-{self.ring}.jsonl"
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        held_by = self.after_step + 1 if step is None else int(step)
        entry = Entry(int(meta["producer"]), int(meta["epoch"]), int(meta["position"]), int(item), held_by)
        os.write(self._fd, _line(entry))

    def rotate(self, step: int) -> None:
        """A checkpoint's state was taken at `step`: what is trained from now on goes into the next segment."""
        self._close()
        self.after_step = step

    def covered(self, oldest_kept: int) -> None:
        """A checkpoint is durable: delete this process's segments that every kept checkpoint covers (those
        before the oldest kept one; a resume that falls back to an older kept checkpoint still finds the rest)."""
        for s in segments(self.directory, "open"):
            if s.pid == self._pid and s.after_step < oldest_kept:
                _remove(s.path)

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
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISREG(os.lstat(lost).st_mode):  # no seal wrote it: kept aside, this seal writes it
                keep_aside(lost, "a sealed segment's name is taken by something not a regular file")
        if not lost.exists():  # the first seal wins: the ring has moved on since
            entries = [e for e in read_entries(s.path) if not (s.ring == ring and e.item in still)]
            write_atomic(lost, segment_bytes(entries, sealed=True))
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
        _remove(s.path)
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
            _remove(s.path)


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


def owed_once(
    producer: int,
    owed: list[tuple[str, list[Entry]]],
    pending: Iterable[tuple[int, int]],
    cursor: tuple[int, int],
) -> list[tuple[int, int]]:
    """The batches (epoch, position) of `owed` (`owed_to`'s segments) to add to producer `producer`'s replay list,
    each once, against the other records: `pending`, its replay list's entries not yet published again, and
    `cursor`, where its plan goes on. A batch owed by two segments at once, or still pending, cannot have been lost
    twice (it would have had to be published again in between): it is owed once. A batch at or past the cursor was
    never published, so nobody trained it: the plan produces it, a replay would make it train twice. Each
    contradiction is named in one error line, never taken in silence."""
    out, seen, again, ahead = [], set(pending), [], []
    for _, entries in owed:
        for e in entries:
            x = (e.epoch, e.position)
            if x >= cursor:
                ahead.append(x)
            elif x in seen:
                again.append(x)
            else:
                seen.add(x)
                out.append(x)
    keys = ", ".join(key for key, _ in owed)
    if ahead:
        log.error(
            "sealed journal segment(s) %s name %d batch(es) producer %d has not yet published (its cursor is at "
            "epoch %d position %d: %s): not produced again, its plan produces them",
            keys,
            len(ahead),
            producer,
            *cursor,
            ", ".join(f"epoch {e} position {q}" for e, q in ahead[:5]),
        )
    if again:
        log.error(
            "sealed journal segment(s) %s name %d batch(es) already owed to producer %d (%s): produced once",
            keys,
            len(again),
            producer,
            ", ".join(f"epoch {e} position {q}" for e, q in again[:5]),
        )
    return out


def remove_all(checkpoint_dir: str | os.PathLike) -> list[str]:
    """A complete run's end: every drafter's journal is void."""
    removed = []
    root = Path(checkpoint_dir)
    for d in sorted(root.glob("drafter-*/journal")) if root.is_dir() else []:
        for s in segments(d):
            _remove(s.path)
            removed.append(str(s.path))
    return removed
