"""A role's side of the ring, bound to its row: everything a producer or a drafter asks of it, and nothing else.

The ports hold no state of their own: `ring.producer(row)` and `ring.consumer(row)` may be called again for the
same row. A producer's publish commits its resume point with the slot word (Slots.publish), so its port holds
both the slots and the table. A drafter also reads the whole ring: its step record shows the producers' progress
and the ring's depth, its LR schedule's length counts the producers' plans against what is trained or claimed, and
its trained journal is sealed against the items the ring still holds.
"""

from __future__ import annotations

import numpy as np

from dflash_ring.common.layout import Counter, Identity, RowStatus
from dflash_ring.common.ring.repair import Repair
from dflash_ring.common.ring.segment import Segment
from dflash_ring.common.ring.slots import SlotReader, Slots, SlotWriter
from dflash_ring.common.ring.table import ProcessTable


class ProducerPort:
    def __init__(self, segment: Segment, table: ProcessTable, slots: Slots, row: int):
        self._seg, self._table, self._slots, self.row = segment, table, slots, row

    @property
    def run(self) -> str:
        return self._seg.run

    @property
    def wait_seconds(self) -> float:
        """Time this process spent blocked on an empty or full ring."""
        return self._slots.wait_seconds

    @property
    def draining(self) -> bool:
        """The run drains (SIGTERM to the supervisor, or `dflash-ring stop`): producers take no new work."""
        return self._seg.draining

    @property
    def shutting_down(self) -> bool:
        return self._seg.shutting_down

    def try_acquire(self) -> SlotWriter | None:
        return self._slots.try_acquire(self.row)

    def acquire(self, timeout_s: float | None = None) -> SlotWriter | None:
        return self._slots.acquire(self.row, timeout_s)

    def publish(self, w: SlotWriter, cursor: tuple[int, int] | None = None, replayed: int = 0, tokens: int = 0) -> None:
        self._slots.publish(w, self.row, cursor, replayed, tokens)

    def abort(self, w: SlotWriter) -> None:
        self._slots.abort(w)

    def heartbeat(self) -> None:
        self._table.heartbeat(self.row)

    def committed_cursor(self) -> tuple[int, int] | None:
        return self._table.committed_cursor(self.row)

    def committed_replayed(self) -> int:
        return self._table.committed_replayed(self.row)

    def cursor_plan(self) -> str:
        return self._table.cursor_plan(self.row)

    def set_cursor_plan(self, plan: str) -> None:
        self._table.set_cursor_plan(self.row, plan)

    def set_planned_items(self, n: int, evals: int = 0) -> None:
        self._table.set_planned_items(self.row, n, evals)

    def done(self, end: tuple[int, int]) -> None:
        """The shard is published up to `end` (the plan's (epochs, 0)): the supervisor counts this row finished
        (RowStatus.DONE) once its cursor says so (ProcessTable.mark_done)."""
        self._table.mark_done(self.row, end)


class ConsumerPort:
    def __init__(self, segment: Segment, table: ProcessTable, slots: Slots, repair: Repair, row: int):
        self._seg, self._table, self._slots, self._repair, self.row = segment, table, slots, repair, row

    @property
    def wait_seconds(self) -> float:
        """Time this process spent blocked on an empty or full ring."""
        return self._slots.wait_seconds

    @property
    def shutting_down(self) -> bool:
        """The supervisor's shutdown: the only thing that ends a drafter's claiming (an empty ring never does)."""
        return self._seg.shutting_down

    @property
    def identity(self) -> Identity:
        return self._seg.identity

    def try_claim(self) -> SlotReader | None:
        return self._slots.try_claim(self.row)

    def claim(self, timeout_s: float | None = None) -> SlotReader | None:
        return self._slots.claim(self.row, timeout_s)

    def release(self, r: SlotReader) -> None:
        self._slots.release(r)

    def requeue(self, r: SlotReader) -> None:
        self._slots.requeue(r)

    def heartbeat(self) -> None:
        self._table.heartbeat(self.row)

    # ---- the whole ring, read ----------------------------------------------------------------

    def rows(self) -> np.ndarray:
        return self._table.rows()

    def counter(self, c: Counter) -> int:
        return self._table.counter(c)

    def produced_tokens(self) -> int:
        return self._table.produced_tokens()

    def slot_counts(self) -> dict[str, int]:
        return self._repair.slot_counts()

    def unfinished_item_numbers(self) -> set[int]:
        return self._repair.unfinished_item_numbers()
