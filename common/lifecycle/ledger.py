"""An optional per-process ledger of what was committed, consumed and trained (`run.ledger_dir`).

Off by default. When `run.ledger_dir` is set, every process appends JSON lines to
`<ledger_dir>/<role>-<index>.jsonl` (mode 0600), one `write(2)` per record on an O_APPEND
descriptor: no Python buffering, so a record is in the page cache the moment the call returns
and a SIGKILL loses at most the record being written (a power loss can lose more: there is no
fsync). Incarnations of one role append to the same file; every record carries its pid.
Cost: one small write per item or checkpoint, never per token.

The records, their writer and their parser are in common/lifecycle/ledger_events.py.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from dflash_ring.common.bounded_read import open_regular
from dflash_ring.common.damaged_file import keep_aside
from dflash_ring.common.layout import OPERATOR_NAME, Role
from dflash_ring.common.lifecycle.ledger_events import LedgerEvent, encode, parse
from dflash_ring.common.refusal import Refusal

# The longest record a process writes is a few KiB (a start record's plan); a "line" past this is damage, and is
# counted as a cut line without being held in memory whole.
MAX_LINE_BYTES = 1 << 20


class LedgerFileError(Refusal, ValueError):
    """A ledger path that is not a regular file (a FIFO would block the reader, a directory cannot be read): the
    reader (`reconcile`, the chaos ledger check) names it in one line."""


class Ledger:
    def __init__(self, path: Path):
        self.path = path
        self._fd = _open_for_append(path)
        self._pid = os.getpid()

    @classmethod
    def open(cls, ledger_dir: str, role: Role, index: int) -> Ledger | None:
        """This process's ledger (<ledger_dir>/<target|drafter|supervisor>-<index>.jsonl), or None when
        `ledger_dir` (run.ledger_dir) is empty (the default)."""
        if not ledger_dir:
            return None
        directory = Path(ledger_dir).expanduser()
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        return cls(directory / f"{OPERATOR_NAME[role]}-{index}.jsonl")

    def write(self, event: LedgerEvent) -> None:
        os.write(self._fd, encode(event, self._pid, round(time.time(), 4)))  # one write(2): whole or not at all

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


@dataclass
class LedgerFile:
    records: list[dict[str, Any]] = field(default_factory=list)
    cut_lines: int = 0  # lines that did not parse (a record cut by a kill, or damage)


def _open_for_append(path: Path) -> int:
    """The ledger opened for appending, never blocking: what holds its name and is not a regular file (a FIFO would
    block the role at its start, a directory fail it at every start) was not written by a process of the run, so it
    is kept aside by the damaged-file rule and a new file begun."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK
    for _ in range(2):
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as e:
            if e.errno not in (errno.EISDIR, errno.ENXIO, errno.ELOOP):
                raise
        else:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                return fd
            os.close(fd)
        keep_aside(path, "a ledger's name is taken by something not a regular file")
    raise LedgerFileError(f"ledger {path} could not be opened as a regular file: remove what holds its name")


def read_ledger(path: Path) -> LedgerFile:
    """Every record of a ledger file; a line that does not parse (a record cut by a kill, damage, a line past
    MAX_LINE_BYTES) is counted, not kept. The file must be a regular file (LedgerFileError naming it)."""
    out = LedgerFile()
    with open(open_regular(path, LedgerFileError, "ledger"), "rb") as f:
        for raw in _lines(f):
            if raw is None or (rec := parse(raw)) is None:
                out.cut_lines += 1
            else:
                out.records.append(rec)
    return out


def _lines(f: BinaryIO) -> Iterator[bytes | None]:
    """The file's lines, each at most MAX_LINE_BYTES; None for a longer one (read past, never held whole)."""
    while raw := f.readline(MAX_LINE_BYTES + 1):
        if len(raw) <= MAX_LINE_BYTES or raw.endswith(b"\n"):
            yield raw
            continue
        while (more := f.readline(MAX_LINE_BYTES)) and not more.endswith(b"\n"):
            pass
        yield None
