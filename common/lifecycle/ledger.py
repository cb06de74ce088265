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

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_ring.common.layout import OPERATOR_NAME, Role
from dflash_ring.common.lifecycle.ledger_events import LedgerEvent, encode, parse


class Ledger:
    def __init__(self, path: Path):
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
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


def read_ledger(path: Path) -> LedgerFile:
    out = LedgerFile()
    with open(path, "rb") as f:
        for raw in f:
            if (rec := parse(raw)) is None:
                out.cut_lines += 1
            else:
                out.records.append(rec)
    return out
