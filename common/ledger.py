"""An optional per-process ledger of what was committed, consumed and trained (`run.ledger_dir`).

Off by default. When `run.ledger_dir` is set, every process appends JSON lines to
`<ledger_dir>/<role>-<index>.jsonl` (mode 0600), one `write(2)` per record on an O_APPEND
descriptor: no Python buffering, so a record is in the page cache the moment the call returns
and a SIGKILL loses at most the record being written (a power loss can lose more: there is no
fsync). Incarnations of one role append to the same file; every record carries its pid.
Cost: one small write per item or checkpoint, never per token.

Records (`ev`, plus `pid` and `t`, wall-clock seconds):

    supervisor  start {adopted}                       after it created or adopted the ring
    producer    start {plan: [batches per epoch], resume: [epoch, position], replay: [[epoch, position]...]
                       [, eval: [[positions of held-out batches] per epoch]]}
                pub   {item, epoch, pos[, replay][, eval]}
                                                      after `publish` committed the batch and its cursor;
                                                      replay: a batch a removed ring held, produced again;
                                                      eval: a held-out batch (data.eval_fraction)
                intake {segments, replay: [[epoch, position]...]}
                                                      dead drafters' sealed journals taken into its replay
                                                      list: those batches are produced again from here on
                done  {}                              shard finished
    drafter     start {step[, took_over]}             after joining (step: the checkpoint resumed from);
                                                      took_over: the pid its row named, when this process took
                                                      the index over (a standby, or after waiting on a live holder)
                got   {item, producer, epoch, pos, deliveries}
                                                      the batch is copied out of its slot (still claimed)
                train {item, deliveries, producer, epoch, pos, step[, empty]}
                                                      `train_step` returned on that batch; written just
                                                      before its slot is released; empty: it had nothing
                                                      to supervise (no update, not journaled)
                eval  {item, deliveries, producer, epoch, pos, step}
                                                      a held-out batch evaluated (never trained); written
                                                      just before its slot is released
                ckpt  {step, items, snapshot_t}       a checkpoint is durable; snapshot_t: when its state was
                                                      taken (written in the background, it lands later)
                exit  {step}                          clean exit
    every role  startup {phases: {name: seconds}, total}
                                                      its first useful work is done (common/startup.py)

A batch's identity is (producer, epoch, pos): pos is its index in that producer's list for the
epoch, the same coordinates as its resume cursor. `read_ledger` parses tolerantly: a line cut by
a kill is counted, not fatal.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_ring.common.layout import OPERATOR_NAME, Role


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

    def write(self, ev: str, **fields: Any) -> None:
        line = json.dumps({"ev": ev, "pid": self._pid, "t": round(time.time(), 4), **fields},
                          separators=(",", ":")) + "\n"
        os.write(self._fd, line.encode())  # one write(2): whole in the page cache or not at all

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
            try:
                rec = json.loads(raw)
                if not isinstance(rec, dict) or "ev" not in rec or "pid" not in rec:
                    raise ValueError("not a ledger record")
            except ValueError:
                out.cut_lines += 1
                continue
            out.records.append(rec)
    return out


def identity(meta: dict[str, Any]) -> dict[str, Any]:
    """A batch's identity from its slot metadata (written by the producer's SlotFiller)."""
    return {"producer": meta.get("producer"), "epoch": meta.get("epoch"), "pos": meta.get("position")}
