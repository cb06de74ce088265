"""One lifecycle for every target and drafter process, in the order that keeps failures cheap and stops clean.

1. Metrics: a taken port fails here, before minutes of loading. Except a drafter's: its port is its index's, and
   its index's seat may be held by a live process (its standby, common/lifecycle/seat.py) serving that port, so a
   drafter serves once its seat is taken (`serve`).
2. `attach`: the ring (a mismatched config fails there). Only then do SIGTERM and SIGINT set `stop`:
   while it waits for the ring a process holds nothing, and the default handlers end it at once (a
   handler set earlier left it deaf to `systemctl stop` for all of run.attach_timeout_s). A target
   attaches before loading its model (a wrong config costs no load); a drafter after (a wrong model
   fails at once, without waiting for a ring). Phases after `attach` that never look at `stop`
   (tokenizing the data, loading the model, building the plan: minutes) run inside `interruptible()`,
   where the signal also raises `StopSignal`, so the process unwinds and exits within a bound.
3. `join`: the process-table row (its lock taken there, or already taken; a dead predecessor's slots undone first),
   the ledger, READY to systemd.
4. On the way out, whatever happened: STOPPING to systemd, the row given up (a finished producer
   keeps DONE), the lock released, the ring closed.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import CollectorRegistry

from dflash_ring.common.lifecycle import sd_notify
from dflash_ring.common.config.schema import Config, MetricsConfig, RunConfig
from dflash_ring.common.gpu_metrics import GpuCollector
from dflash_ring.common.layout import OPERATOR_NAME, Role
from dflash_ring.common.lifecycle.ledger import Ledger
from dflash_ring.common.lifecycle.liveness import LockFile
from dflash_ring.common.lifecycle.membership import Membership
from dflash_ring.common.metrics import serve
from dflash_ring.common.ring import Ring, RingSpec
from dflash_ring.common.ring_spec import ring_spec
from dflash_ring.common.lifecycle.startup import Startup


REPEAT_S = 0.5  # how often a stop in an interruptible phase is raised again until the phase has ended


def _disarm() -> None:
    signal.setitimer(signal.ITIMER_REAL, 0)


class StopSignal(BaseException):
    """SIGTERM or SIGINT during an `interruptible()` phase: not an Exception, so no `except Exception` in the
    loading code swallows it."""


class RoleProcess:
    """What a target or drafter process holds for its lifetime; made by `role_process` from the config's sections
    it reads: the ring's spec, metrics, run (name, locks, ledger), and train.checkpoint_dir (a drafter's journal)."""

    def __init__(
        self,
        role: Role,
        gpu_uuid: str,
        startup: Startup,
        stack: contextlib.ExitStack,
        *,
        spec: RingSpec,
        metrics: MetricsConfig,
        run: RunConfig,
        journal_dir: str,
    ):
        self.role, self.gpu_uuid, self.startup = role, gpu_uuid, startup
        self.spec, self.metrics, self.run, self.journal_dir = spec, metrics, run, journal_dir
        self.index: int | None = None  # known once it serves (a standby learns it when it takes a seat over)
        self.registry: CollectorRegistry | None = None
        self.stop = threading.Event()
        self.ring: Ring | None = None
        self.member: Membership | None = None
        self.ledger: Ledger | None = None
        self._stack = stack
        self._interruptible = 0
        self._stopped_by = ""  # the signal that set `stop` during an interruptible phase

    @property
    def name(self) -> str:
        return f"{OPERATOR_NAME[self.role]} {self.index}"

    def serve(self, index: int) -> CollectorRegistry:
        """Become role `index` on /metrics: its port, its process info, the start-up phases so far and from now on."""
        self.index = index
        self.registry = serve(self.metrics, self.run.name, OPERATOR_NAME[self.role], index, self.gpu_uuid)
        if self.metrics.enabled:
            self.registry.register(GpuCollector([self.gpu_uuid]))
        self.startup.export(self.registry)
        return self.registry

    def attach(self, *, pin: bool) -> Ring:
        """Wait for the supervisor's ring (run.attach_timeout_s), then let SIGTERM/SIGINT set `stop`."""
        self.ring = self._stack.enter_context(Ring.attach(self.spec, pin=pin))
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        return self.ring

    @contextmanager
    def interruptible(self) -> Iterator[None]:
        """A phase that never checks `stop` (loading, tokenizing, planning): a signal in it raises StopSignal.
        Only for code that may be abandoned at any point (no ring or process-table write in it)."""
        if self.stop.is_set():
            raise StopSignal
        self._interruptible += 1
        try:
            yield
        finally:
            self._interruptible -= 1
            if not self._interruptible:
                _disarm()  # here, not only in the alarm's handler: by the next alarm Python may be finalizing, and
                # SIGALRM's default action (exit -14) would replace the exit code of a clean stop

    def _on_signal(self, signum: int, frame: object) -> None:
        self.stop.set()
        if self._interruptible:
            # Raised wherever the main thread is. Where that is a weakref callback or a __del__, Python prints
            # "Exception ignored" and goes on: so SIGALRM raises it again every REPEAT_S until the phase has ended,
            # and the swallowed one is no traceback on stderr (_quiet_stop).
            sys.unraisablehook = _quiet_stop
            self._stopped_by = signal.Signals(signum).name
            signal.signal(signal.SIGALRM, self._on_alarm)
            signal.setitimer(signal.ITIMER_REAL, REPEAT_S, REPEAT_S)
            raise StopSignal(self._stopped_by)

    def _on_alarm(self, signum: int, frame: object) -> None:
        if self._interruptible:
            raise StopSignal(self._stopped_by)
        _disarm()  # the phase ended: it unwound, and nothing more is raised

    def join(self, ready: str, lock: LockFile | None = None) -> Membership:
        """Take this process's row and ledger and tell systemd it is ready (`ready` says what it loaded); `lock`:
        its index's lock when it has taken it already."""
        self.member = Membership.join(
            self.ring, self.run, self.role, self.index, journal_dir=self.journal_dir, lock=lock
        )
        self._stack.callback(self._leave)
        self.ledger = Ledger.open(self.run.ledger_dir, self.role, self.index)
        sd_notify.ready(f"{self.name}: {ready}")
        return self.member

    def _leave(self) -> None:
        sd_notify.stopping()
        self.member.leave()


@contextmanager
def role_process(cfg: Config, role: Role, index: int | None, gpu_uuid: str, startup: Startup) -> Iterator[RoleProcess]:
    """index None: serve later (`RoleProcess.serve`), once the index is this process's (a drafter)."""
    with contextlib.ExitStack() as stack:
        stack.callback(_disarm)  # whatever the way out: no stop's alarm outlives the process's lifecycle
        proc = RoleProcess(
            role,
            gpu_uuid,
            startup,
            stack,
            spec=ring_spec(cfg),
            metrics=cfg.metrics,
            run=cfg.run,
            journal_dir=cfg.train.checkpoint_dir,
        )
        if index is not None:
            proc.serve(index)
        yield proc


def _quiet_stop(unraisable: sys.UnraisableHookArgs) -> None:
    """A StopSignal that Python swallowed (raised inside a weakref callback or a __del__) is raised again by the
    alarm: it is not an error, and its "Exception ignored ... Traceback" lines on stderr would read as one. Anything
    else unraisable is reported as Python reports it."""
    if isinstance(unraisable.exc_value, StopSignal):
        return
    sys.__unraisablehook__(unraisable)
