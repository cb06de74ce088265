"""The shared-memory slot ring: the one channel between target producers and drafter trainers.

Slot life cycle, each arrow one compare-and-swap on the slot's state word:

    FREE --producer claims--> WRITING --publish--> READY --consumer claims--> READING --release--> FREE
               (abort / producer died: back to FREE)      (consumer died: back to READY, redelivered)

Ownership lives only in the state words; the two POSIX semaphores are wake-up
hints with timeouts, so a process dying anywhere leaves nothing held that a
compare-and-swap by the reaper cannot undo. Producers number items with one
fetch-add on the header's sequence index; consumers take the READY slot with
the lowest item number, so the ring is FIFO and any number of producers feeds
any number of consumers through the same pool of slots.

The package: `segment.py` (the names, the mapping, its creation and removal, from a `RingSpec`: no Config
below here), `table.py` (the process table), `slots.py` (the state machine), `repair.py` (what the supervisor
undoes and reads back), `ports.py` (a role's side, bound to its row). `Ring` puts them together.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from dflash_ring.common.layout import Counter, Identity, Role, RowStatus
from dflash_ring.common.ring import segment
from dflash_ring.common.ring.ports import ConsumerPort, ProducerPort
from dflash_ring.common.ring.repair import CorruptSlot, Repair, RingStatus, impossible_word
from dflash_ring.common.ring.segment import (
    ConfigMismatchError,
    HalfCreatedRingError,
    RingNotFound,
    RingSpec,
    Segment,
    fingerprint_digest,
    replica_segment_name,
    segment_name,
)
from dflash_ring.common.ring.slots import SlotLostError, SlotReader, Slots, SlotWriter
from dflash_ring.common.ring.table import ProcessTable

__all__ = [
    "ConfigMismatchError",
    "ConsumerPort",
    "CorruptSlot",
    "HalfCreatedRingError",
    "ProducerPort",
    "Ring",
    "RingNotFound",
    "RingSpec",
    "RingStatus",
    "SlotLostError",
    "SlotReader",
    "SlotWriter",
    "fingerprint_digest",
    "impossible_word",
    "replica_segment_name",
    "segment_name",
]


class Ring:
    """One process's mapping of the ring. Create it (supervisor) or attach to it; close it when done.

    Roles work through their ports (`producer(row)`, `consumer(row)`); the rest is the supervisor's and the
    operator commands' view of every row."""

    def __init__(self, seg: Segment):
        self.segment = seg
        self.table = ProcessTable(seg)
        self.slots = Slots(seg, self.table)
        self.repair = Repair(seg, self.table, self.slots)

    # ---- life cycle ---------------------------------------------------------------------------

    @classmethod
    def create(cls, spec: RingSpec) -> Ring:
        """Create the run's segment and semaphores exclusively (mode 0600). Supervisor only."""
        ring = cls(segment.create(spec))
        ring.slots.wait_s = spec.wait_s
        return ring

    @classmethod
    def attach(cls, spec: RingSpec, timeout_s: float | None = None, pin: bool = False) -> Ring:
        """Attach to the live ring of spec's run, waiting for the supervisor to create it."""
        ring = cls.open(spec.run, spec.attach_timeout_s if timeout_s is None else timeout_s)
        try:
            ring.segment.check(spec)
            ring.slots.wait_s = spec.wait_s
            if pin and spec.pin:
                from dflash_ring.common.pinning import HostRegistration

                ring.segment.pin = HostRegistration(ring.segment.tensor())
        except BaseException:
            ring.close()
            raise
        return ring

    @classmethod
    def open(cls, run: str, timeout_s: float = 0.0) -> Ring:
        """Map an existing ring without a spec (status, stop, clean)."""
        return cls(segment.open_segment(run, timeout_s))

    unlink = staticmethod(segment.unlink)
    exists = staticmethod(segment.exists)

    def check(self, spec: RingSpec) -> None:
        """Refuse (ConfigMismatchError) a spec other than the one the ring was created from, naming each field."""
        self.segment.check(spec)

    def close(self) -> None:
        """Drop this process's mapping. Tensor views handed out must be gone first."""
        self.segment.close()

    def __enter__(self) -> Ring:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- what it is ---------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.segment.name

    @property
    def identity(self) -> Identity:
        return self.segment.identity

    @property
    def fingerprint_fields(self) -> dict[str, Any]:
        return self.segment.fields

    @property
    def lock_dir(self) -> Path | None:
        """The lock directory of the run's processes, as its creator recorded it (None: an older header)."""
        d = self.segment.fields.get("run.lock_dir")
        return Path(d) if isinstance(d, str) and d.startswith("/") else None

    # ---- the roles' ports ---------------------------------------------------------------------

    def producer(self, row: int) -> ProducerPort:
        return ProducerPort(self.segment, self.table, self.slots, row)

    def consumer(self, row: int) -> ConsumerPort:
        return ConsumerPort(self.segment, self.table, self.slots, self.repair, row)

    # ---- every row: the supervisor, membership, operator commands -----------------------------

    def row_of(self, role: Role, index: int) -> int:
        return self.table.row_of(role, index)

    def take_row(self, row: int, role: Role, index: int) -> None:
        self.table.take_row(row, role, index)

    def row_status(self, row: int) -> RowStatus:
        return self.table.row_status(row)

    def set_row_status(self, row: int, status: RowStatus) -> None:
        self.table.set_row_status(row, status)

    def heartbeat(self, row: int) -> None:
        self.table.heartbeat(row)

    def rows(self) -> np.ndarray:
        return self.table.rows()

    def committed_cursor(self, row: int) -> tuple[int, int] | None:
        return self.table.committed_cursor(row)

    def committed_replayed(self, row: int) -> int:
        return self.table.committed_replayed(row)

    def settled_resume(self, row: int) -> tuple[tuple[int, int], int] | None:
        return self.table.settled_resume(row)

    def cursor_plan(self, row: int) -> str:
        return self.table.cursor_plan(row)

    def planned_items(self) -> int:
        return self.table.planned_items()

    def counter(self, c: Counter) -> int:
        return self.table.counter(c)

    def increment(self, c: Counter) -> int:
        return self.segment.counters[c].fetch_add(1)

    def set_flag(self, c: Counter, value: int = 1) -> None:
        self.segment.counters[c].store(value)

    @property
    def draining(self) -> bool:
        return self.segment.draining

    @property
    def shutting_down(self) -> bool:
        return self.segment.shutting_down

    def broadcast(self) -> None:
        self.segment.broadcast()

    def reclaim_slots_of(self, row: int) -> tuple[int, int]:
        return self.repair.reclaim_slots_of(row)

    def owned_slots(self) -> set[int]:
        return self.repair.owned_slots()

    def repair_impossible_words(self) -> list[CorruptSlot]:
        return self.repair.repair_impossible_words()

    def repair_unstated_words(self) -> list[CorruptSlot]:
        return self.repair.repair_unstated_words()

    def unfinished_items(self) -> tuple[list[dict[str, Any]], list[str]]:
        return self.repair.unfinished_items()

    def unfinished_item_numbers(self) -> set[int]:
        return self.repair.unfinished_item_numbers()

    def slot_counts(self) -> dict[str, int]:
        return self.repair.slot_counts()

    def status(self) -> RingStatus:
        return self.repair.status()
