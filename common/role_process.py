"""One lifecycle for every target and drafter process, in the order that keeps failures cheap and stops clean.

1. Metrics: a taken port fails here, before minutes of loading.
2. The ring: a mismatched config fails before any loading. Only then do SIGTERM and SIGINT set
   `stop`: while it waits for the ring a process holds nothing, and the default handlers end it at
   once (a handler set earlier left it deaf to `systemctl stop` for all of run.attach_timeout_s).
3. The caller loads what it needs, then `join`s: its process-table row (a dead predecessor's slots
   undone first), its ledger, READY to systemd.
4. On the way out, whatever happened: STOPPING to systemd, the row given up (a finished producer
   keeps DONE), the lock released.
"""

from __future__ import annotations

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


class RoleProcess:
    """What a target or drafter process holds for its lifetime; made by `role_process`."""

    def __init__(self, cfg: Config, role: Role, index: int, registry: CollectorRegistry, ring: Ring,
                 stop: threading.Event):
        self.cfg, self.role, self.index = cfg, role, index
        self.registry, self.ring, self.stop = registry, ring, stop
        self.member: Membership | None = None
        self.ledger: Ledger | None = None

    @property
    def name(self) -> str:
        return f"{OPERATOR_NAME[self.role]} {self.index}"

    def join(self, ready: str) -> Membership:
        """Take this process's row and ledger and tell systemd it is ready (`ready` says what it loaded)."""
        self.member = Membership.join(self.ring, self.cfg, self.role, self.index)
        self.ledger = Ledger.open(self.cfg, self.role, self.index)
        sd_notify.ready(f"{self.name}: {ready}")
        return self.member

    def _close(self) -> None:
        if self.member is not None:
            sd_notify.stopping()
            self.member.leave()


@contextmanager
def role_process(cfg: Config, role: Role, index: int, gpu_uuid: str, *, pin: bool) -> Iterator[RoleProcess]:
    registry = serve(cfg, OPERATOR_NAME[role], index, gpu_uuid)
    if cfg.metrics.enabled:
        registry.register(GpuCollector([gpu_uuid]))
    stop = threading.Event()
    with Ring.attach(cfg, pin=pin) as ring:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        process = RoleProcess(cfg, role, index, registry, ring, stop)
        try:
            yield process
        finally:
            process._close()
