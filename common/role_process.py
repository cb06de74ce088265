"""One lifecycle for every target and drafter process, in the order that keeps failures cheap and stops clean.

1. Metrics: a taken port fails here, before minutes of loading.
2. `attach`: the ring (a mismatched config fails there). Only then do SIGTERM and SIGINT set `stop`:
   while it waits for the ring a process holds nothing, and the default handlers end it at once (a
   handler set earlier left it deaf to `systemctl stop` for all of run.attach_timeout_s). A target
   attaches before loading its model (a wrong config costs no load); a drafter after (a wrong model
   fails at once, without waiting for a ring). Phases after `attach` that never look at `stop`
   (tokenizing the data, loading the model, building the plan: minutes) run inside `interruptible()`,
   where the signal also raises `StopSignal`, so the process unwinds and exits within a bound.
3. `join`: the process-table row (a dead predecessor's slots undone first), the ledger, READY to systemd.
4. On the way out, whatever happened: STOPPING to systemd, the row given up (a finished producer
   keeps DONE), the lock released, the ring closed.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import CollectorRegistry

from dflash_ring.common import sd_notify
from dflash_ring.common.config import Config
from dflash_ring.common.gpu_metrics import GpuCollector
from dflash_ring.common.layout import OPERATOR_NAME, Role
from dflash_ring.common.ledger import Ledger
from dflash_ring.common.membership import Membership
from dflash_ring.common.metrics import serve
from dflash_ring.common.ring import Ring
from dflash_ring.common.startup import Startup


class StopSignal(BaseException):
    """SIGTERM or SIGINT during an `interruptible()` phase: not an Exception, so no `except Exception` in the
    loading code swallows it."""


class RoleProcess:
    """What a target or drafter process holds for its lifetime; made by `role_process`."""

    def __init__(self, cfg: Config, role: Role, index: int, registry: CollectorRegistry,
                 stack: contextlib.ExitStack):
        self.cfg, self.role, self.index, self.registry = cfg, role, index, registry
        self.stop = threading.Event()
        self.ring: Ring | None = None
        self.member: Membership | None = None
        self.ledger: Ledger | None = None
        self._stack = stack
        self._interruptible = 0

    @property
    def name(self) -> str:
        return f"{OPERATOR_NAME[self.role]} {self.index}"

    def attach(self, *, pin: bool) -> Ring:
        """Wait for the supervisor's ring (run.attach_timeout_s), then let SIGTERM/SIGINT set `stop`."""
        self.ring = self._stack.enter_context(Ring.attach(self.cfg, pin=pin))
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

    def _on_signal(self, signum: int, frame: object) -> None:
        self.stop.set()
        if self._interruptible:
            raise StopSignal(signal.Signals(signum).name)

    def join(self, ready: str) -> Membership:
        """Take this process's row and ledger and tell systemd it is ready (`ready` says what it loaded)."""
        self.member = Membership.join(self.ring, self.cfg, self.role, self.index)
        self._stack.callback(self._leave)
        self.ledger = Ledger.open(self.cfg, self.role, self.index)
        sd_notify.ready(f"{self.name}: {ready}")
        return self.member

    def _leave(self) -> None:
        sd_notify.stopping()
        self.member.leave()


@contextmanager
def role_process(cfg: Config, role: Role, index: int, gpu_uuid: str, startup: Startup) -> Iterator[RoleProcess]:
    registry = serve(cfg, OPERATOR_NAME[role], index, gpu_uuid)
    if cfg.metrics.enabled:
        registry.register(GpuCollector([gpu_uuid]))
    startup.export(registry)
    with contextlib.ExitStack() as stack:
        yield RoleProcess(cfg, role, index, registry, stack)
