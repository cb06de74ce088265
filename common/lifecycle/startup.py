"""A role process's start-up, phase by phase: from its exec to its first useful work.

Recovery after a kill is the restart delay plus this, so it is measured where it happens and shown
three ways: one log line, the gauge dflash_ring_startup_seconds{phase} (common/metrics.py), and a
`startup` ledger record that `dflash-ring chaos` aggregates per role. The clock starts at the
process's start time in /proc/self/stat, not at the first line of Python: the interpreter and the
imports are usually the largest part. Phases are durations, in the order they ran; first useful
work is the supervisor's ring created or adopted, a target's first publish, a drafter's first step.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

from dflash_ring.common.lifecycle.ledger_events import StartupDone

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry, Gauge

    from dflash_ring.common.lifecycle.ledger import Ledger

log = logging.getLogger(__name__)

# The phases of each role, in order (what each covers is in the role's code, next to its mark).
SUPERVISOR_PHASES = ("imports", "config", "ring")
TARGET_PHASES = ("imports", "config", "attach", "data", "model", "probe", "join", "first_publish")
# A drafter's "standby" is its wait for its seat (none when the seat is free; a warm standby's whole wait) and
# "takeover" its checkpoint loaded once the seat is its own (a standby's, or one newer than it loaded at "checkpoint"):
# a takeover's kill to first step is the phases after "standby".
# "checkpoint" overlaps the first step's precompile (consumer/training/process.py); a standby precompiles at
# "precompile", once attached, before it waits.
DRAFTER_PHASES = (
    "imports",
    "config",
    "model",
    "checkpoint",
    "attach",
    "precompile",
    "standby",
    "takeover",
    "join",
    "first_item",
    "first_step",
)


def process_age_s() -> float:
    """Seconds since this process started (its start time in /proc, on the boot clock; 10 ms ticks)."""
    with open("/proc/self/stat", "rb") as f:
        stat = f.read()
    start_ticks = int(stat[stat.rindex(b")") + 2 :].split()[19])  # field 22, counted after "pid (comm)"
    return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")


class Startup:
    """Marks the end of each phase; `finish` marks the last one, logs the line and writes the ledger record once."""

    def __init__(self, what: str):
        self.what = what  # e.g. "target 0", for the log line
        self._last = time.monotonic()
        self.exec_age_s = process_age_s()  # at _last
        self.phases: dict[str, float] = {}
        self.done = False
        self._gauge: Gauge | None = None

    def mark(self, phase: str) -> None:
        """The phase `phase` ends now (a phase already marked, or any mark after `finish`, is ignored)."""
        if self.done or phase in self.phases:
            return
        now = time.monotonic()
        # The first phase runs from exec: the time before this object existed belongs to it.
        self.phases[phase] = round(now - self._last + (self.exec_age_s if not self.phases else 0.0), 4)
        self._last = now
        if self._gauge is not None:
            self._gauge.labels(phase).set(self.phases[phase])

    def export(self, registry: CollectorRegistry) -> None:
        """Serve the phases on this process's registry from now on (those marked so far included)."""
        from dflash_ring.common.metrics import startup_gauge

        self._gauge = startup_gauge(registry)
        for phase, s in self.phases.items():
            self._gauge.labels(phase).set(s)

    @property
    def total_s(self) -> float:
        return round(sum(self.phases.values()), 3)

    def finish(self, phase: str, ledger: Ledger | None = None) -> None:
        """First useful work done: mark `phase`, log one line, write the `startup` ledger record. Once."""
        if self.done:
            return
        self.mark(phase)
        self.done = True
        log.info(
            "%s started in %.2fs: %s",
            self.what,
            self.total_s,
            ", ".join(f"{p} {s:.2f}s" for p, s in self.phases.items()),
        )
        if ledger is not None:
            ledger.write(StartupDone(self.phases, self.total_s))
