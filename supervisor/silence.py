"""Name a role that stops answering.

A producer or drafter beats its row from its main loop (each publish, each wait for a slot or an item, each
training step). A row that still says RUNNING but whose beat has not moved for supervisor.silent_after_s belongs to
a process that is stopped (SIGSTOP, a debugger), hung (a collective, a deadlock, a blocked read) or in one very long
step: the run goes on around it, but whatever it holds waits. The reaper acts only on the dead (their lock is free);
this only names the silent, in one log line each (role, index, pid, how long), again every REPEAT_S while it stays
silent, and once when it answers again, so an operator reading the journal finds the stall within seconds of the
threshold instead of at exit_timeout_s. What a tensor-parallel leader names for its ranks (producer/tensor_group.py),
the supervisor names for every row."""

from __future__ import annotations

import logging
import time

import numpy as np

from dflash_ring.common.layout import OPERATOR_NAME, Role, RowStatus

log = logging.getLogger(__name__)

REPEAT_S = 60.0  # while a row stays silent, named again this often


class SilenceWatch:
    """The rows named silent so far (row -> when last named, and the beat it was silent since)."""

    def __init__(self, after_s: float) -> None:
        self.after_s = after_s
        self._named: dict[int, tuple[float, int]] = {}

    def observe(self, rows: np.ndarray, now_ns: int | None = None) -> list[str]:
        """Log (and return) the lines this look at the process table gives: a row silent past the threshold, named
        again every REPEAT_S; a named row that beats again or left."""
        now_ns = time.time_ns() if now_ns is None else now_ns
        lines: list[str] = []
        for row in range(1, len(rows)):  # row 0 is the supervisor's own
            r = rows[row]
            beat = int(r["heartbeat_ns"])
            silent_s = (now_ns - beat) / 1e9
            running = int(r["status"]) == RowStatus.RUNNING and beat > 0
            named = self._named.get(row)
            name = _name(r)
            if named is not None and (not running or beat != named[1]):
                del self._named[row]
                lines.append(f"{name} answers again" if running else f"{name} left its row")
                log.warning(lines[-1])
                continue
            if not running or silent_s < self.after_s:
                continue
            if named is None or now_ns / 1e9 - named[0] >= REPEAT_S:
                self._named[row] = (now_ns / 1e9, beat)
                lines.append(
                    f"{name} has not answered for {silent_s:.0f}s (no heartbeat; still RUNNING and alive): stopped, "
                    "hung or in a very long step; what it holds waits"
                )
                log.warning(lines[-1])
        return lines


def _name(r: np.void) -> str:
    """ "drafter 0 (pid 123)"; a row whose role field names no role (damaged) is named by its number alone."""
    try:
        role = OPERATOR_NAME[Role(int(r["role"]))]
    except (KeyError, ValueError):
        role = "role"
    return f"{role} {int(r['index'])} (pid {int(r['pid'])})"
