"""The chaos run's journal fuzzer: edits to drafters' journals between kills that exactly once must survive.

After each SIGKILL of a drafter, `edit_after_kill` edits what the dead process left (its open journal segments) and
one sealed segment not edited before, the way the issue's adversary did (issue 46): a line repeated, a line naming a
batch a checkpoint already holds copied into the segment after it, a valid line (its checksum right, its step after
the segment's checkpoint) naming a batch trained elsewhere added inside or after a sealed segment's lines, or an
entry repeated there. Each is well-formed; none may make a batch train twice or vanish: the readers
(common/lifecycle/trained_journal.py) name each and leave it out, and the chaos ledger check (tools/reconcile.py)
then proves every batch was trained exactly once with the edits in. Damage that costs a batch (a flipped byte, a line
cut or dropped: named as possibly missing, by rule) is left to tests/test_read_back_damage.py's fuzzer, since the
ledger would count that batch as lost.

Only a dead process's open segments are edited (a live writer appends through its descriptor to the file it
opened, which a replacement would leave behind), and one edit per sealed segment: two lines added to one sealed
segment are no longer told from its own (named, not resolved), which the ledger would count as trained twice.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

from dflash_ring.common.lifecycle.trained_journal import SEGMENT, Entry, _entry, _line, _seal_line


def _lines(path: Path) -> list[bytes] | None:
    try:
        return path.read_bytes().splitlines(keepends=True)
    except OSError:  # sealed, covered or kept aside meanwhile
        return None


def _replace(path: Path, lines: list[bytes]) -> None:
    """Whole, by rename: a reader sees the segment before or after the edit, never half of it."""
    tmp = path.with_name(f".{path.name}.edit")
    tmp.write_bytes(b"".join(lines))
    os.replace(tmp, path)


def _entries(lines: list[bytes]) -> list[Entry]:
    return [e for line in lines if (e := _entry(line.rstrip(b"\n"))) is not None and e.step is not None]


def edit_after_kill(checkpoint_dir: str | Path, pid: int, rng: random.Random, edited: set[str]) -> list[dict[str, str]]:
    """Edit the open segments drafter process `pid` (just killed) left, and one sealed segment whose name is not in
    `edited` (added to it). Returns the edits made: {"kind", "segment"}."""
    root, done = Path(checkpoint_dir), []
    for path in sorted(root.glob(f"drafter-*/journal/open-*-{pid}-*.jsonl")):
        after = int(SEGMENT.match(path.name).group(2))
        if not (lines := _lines(path)) or not _entries(lines):
            continue
        # A line of an earlier segment whose step this segment's checkpoint covers: a batch that checkpoint holds.
        held = [
            _line(e)
            for older in sorted(path.parent.glob("open-*.jsonl"))
            if (m := SEGMENT.match(older.name)) and int(m.group(2)) < after
            for e in _entries(_lines(older) or [])
            if e.step <= after
        ]
        kind = rng.choice(["repeat", "held"]) if held else "repeat"
        line = rng.choice(held) if kind == "held" else rng.choice([_line(e) for e in _entries(lines)])
        lines.insert(rng.randint(0, len(lines)), line)
        _replace(path, lines)
        done.append({"kind": f"open-{kind}", "segment": str(path)})
    sealed = [p for p in sorted(root.glob("drafter-*/journal/lost-*.jsonl")) if str(p) not in edited]
    rng.shuffle(sealed)
    for path in sealed:
        lines = _lines(path)
        if not lines or _seal_line(lines[-1].rstrip(b"\n")) is None or not (mine := _entries(lines[:-1])):
            continue  # gone, of an earlier version, or already rebuilt without entries
        after = int(SEGMENT.match(path.name).group(2))
        ours = {e.batch for e in mine}
        # A batch trained elsewhere (in another segment), as a valid line of this segment: its step after `after`.
        others = [
            Entry(*e.batch, e.item, after + 1)
            for seg in sorted(root.glob("drafter-*/journal/*.jsonl"))
            if seg != path
            for e in _entries(_lines(seg) or [])
            if e.batch not in ours
        ]
        kind = rng.choice(["repeat", "added-inside", "added-after"] if others else ["repeat"])
        if kind == "repeat":
            lines.insert(rng.randint(0, len(lines) - 1), _line(rng.choice(mine)))
        elif kind == "added-inside":
            lines.insert(rng.randint(0, len(lines) - 1), _line(rng.choice(others)))
        else:
            lines.append(_line(rng.choice(others)))
        _replace(path, lines)
        edited.add(str(path))
        done.append({"kind": f"sealed-{kind}", "segment": str(path)})
        break
    return done
