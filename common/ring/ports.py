"""A role's side of the ring, bound to its row: what a producer or a drafter calls, and nothing else.

The ports hold no state of their own: `ring.producer(row)` and `ring.consumer(row)` may be called again for the
same row. A producer's publish commits its resume point with the slot word (Slots.publish), so its port holds
both the slots and the table.
"""

from __future__ import annotations

from dflash_ring.common.layout import RowStatus
from dflash_ring.common.ring.segment import Segment
from dflash_ring.common.ring.slots import SlotReader, Slots, SlotWriter
from dflash_ring.common.ring.table import ProcessTable


class ProducerPort:
    def __init__(self, segment: Segment, table: ProcessTable, slots: Slots, row: int):
        self._seg, self._table, self._slots, self.row = segment, table, slots, row

    @property
    def run(self) -> str:
        return self._seg.run

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

    def done(self) -> None:
        """The shard is published: the supervisor counts this row finished (RowStatus.DONE)."""
        self._table.set_row_status(self.row, RowStatus.DONE)


class ConsumerPort:
    def __init__(self, table: ProcessTable, slots: Slots, row: int):
        self._table, self._slots, self.row = table, slots, row

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
