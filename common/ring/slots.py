"""The slot state machine: every transition one compare-and-swap on the slot's state word.

    FREE --try_acquire--> WRITING --publish--> READY (gen+1) --try_claim--> READING --release--> FREE (gen+1)
                (abort: FREE, gen+1)                              (requeue: READY, gen+1)

A word packs `generation | owner row | state`; the generation fences a stale owner's late transition, and since only a
claim keeps it, a WRITING or READING word names one claim. Each claim is stated (`_claim`): the row names it before
its CAS, the slot's descriptor names its holder after, so a holding word nobody took this way (a same-user process
wrote the segment) is told from one the protocol made (common/ring/repair.py, repair_unstated_words). A row's
`items` is the one count of what it published (producer) or released (consumer); each count moves with its CAS
in three steps (`_commit`: arm, CAS, count), so a death between the CAS and the count is repaired by whoever
reclaims the row (`settle`). Waiting (`acquire`, `claim`) sleeps on a semaphore that is only a hint.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import posix_ipc

from dflash_ring.common.crash_points import crash_point
from dflash_ring.common.layout import NO_OWNER, Counter, SlotState, pack_state
from dflash_ring.common.ring.segment import Segment
from dflash_ring.common.ring.table import ProcessTable
from dflash_ring.common.slot_format import SlotFormatError, SlotHeader, SlotLayout, encode_header, view

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
_READY = int(SlotState.READY)  # numpy compares a plain int ~2 µs faster than an IntEnum member
T = TypeVar("T")


class SlotLostError(RuntimeError):
    """A slot this process held was taken back (it was presumed dead): its work is void."""


@dataclass
class SlotWriter:
    """A slot claimed by a producer: fill the tensors it hands out, then publish."""

    slot: int
    item: int
    word: int
    layout: SlotLayout
    area: torch.Tensor
    meta: dict[str, Any] = field(default_factory=dict)

    def tensor(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A zero-copy view into the slot, to be filled in place (e.g. by a D2H copy)."""
        return view(self.area, self.layout.add(name, dtype, shape))


@dataclass
class SlotReader:
    """A slot claimed by a consumer. Its tensors are views into shared memory:
    copy what you need before `release`, after which a producer may overwrite them."""

    slot: int
    item: int
    word: int
    deliveries: int
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]


class Slots:
    def __init__(self, segment: Segment, table: ProcessTable):
        self._seg, self._table = segment, table
        self.wait_s = 0.2
        self.wait_seconds = 0.0  # time this process spent blocked on an empty or full ring

    # ---- producer side ------------------------------------------------------------------------

    def try_acquire(self, row: int) -> SlotWriter | None:
        """Claim a FREE slot for writing and take the next item number; None if the ring is full."""
        seg = self._seg
        states = seg.desc["state"].copy()
        n = len(states)
        start = random.randrange(n)
        for k in range(n):
            slot = (start + k) % n
            word = int(states[slot])
            if word & 0xFF != SlotState.FREE:
                continue
            if self.unconsumed(slot):  # a READY word rewritten to FREE: its item is not this producer's to drop
                if self.restore_unconsumed(slot, word):
                    log.error(
                        "slot %d (item %d) is corrupt: its state word %#x says FREE over a published item no "
                        "drafter claimed (the protocol cannot produce that: another process wrote the "
                        "segment); made READY again, redelivered, counted corrupt",
                        slot,
                        int(seg.desc[slot]["item"]),
                        word,
                    )
                continue
            mine = pack_state(word >> 24, row, SlotState.WRITING)
            if self._claim(row, slot, word, mine):
                crash_point("claimed")  # the descriptor still shows the slot's previous item here
                seg.clear_header(slot)
                item = seg.counters[Counter.NEXT_ITEM].fetch_add(1)
                d = seg.desc[slot]
                d["item"], d["claimed_ns"], d["deliveries"] = item, time.time_ns(), 0
                geo = seg.geometry
                return SlotWriter(
                    slot, item, mine, SlotLayout(geo.slot_bytes, geo.slot_header_bytes), seg.slot_area(slot)
                )
        return None

    def acquire(self, row: int, timeout_s: float | None = None) -> SlotWriter | None:
        """Claim a slot, waiting while the ring is full. None on drain, shutdown or timeout."""
        return self._wait(
            lambda: None if self._seg.draining else self.try_acquire(row), self._seg.sem_free, row, timeout_s
        )

    def publish(
        self, w: SlotWriter, row: int, cursor: tuple[int, int] | None = None, replayed: int = 0, tokens: int = 0
    ) -> None:
        """Make the slot READY. With a cursor, the producer's resume point moves to it in the same step.

        The resume point is (cursor, replayed): the next batch of the plan, and how many entries of the
        producer's replay list are published. It is recorded before the compare-and-swap, with the claim
        (state word, generation included) that commits it; if the producer dies before the CAS, the
        reaper rolls it back with the slot, and only for that very claim: never for a later claim of
        the same slot.
        """
        seg = self._seg
        header = encode_header(SlotHeader(w.layout.specs, w.meta), seg.geometry.slot_header_bytes)
        off = seg.geometry.slot_offset(w.slot)
        seg.mv[off : off + len(header)] = header
        if cursor is not None:
            self._table.stage_cursor(row, w.word, cursor, replayed)
        if not self._commit(row, w.slot, w.word, pack_state((w.word >> 24) + 1, row, SlotState.READY), "published"):
            raise SlotLostError(f"slot {w.slot} (item {w.item}) was reclaimed while this process wrote it")
        seg.rows[row]["tokens"] += tokens  # only this producer writes its row
        seg.hint(seg.sem_ready)

    def abort(self, w: SlotWriter) -> None:
        """Give a claimed slot back unpublished (e.g. on shutdown)."""
        seg = self._seg
        seg.clear_header(w.slot)  # a FREE slot with a header and no delivery is an unconsumed item (`unconsumed`)
        if seg.states[w.slot].cmpxchg_strong(
            expected=w.word, desired=pack_state((w.word >> 24) + 1, NO_OWNER, SlotState.FREE)
        ):
            seg.hint(seg.sem_free)

    # ---- consumer side ------------------------------------------------------------------------

    def try_claim(self, row: int) -> SlotReader | None:
        """Claim the READY slot with the lowest item number; None if none is READY.

        A slot whose header fails validation is dropped (back to FREE, counted)
        and SlotFormatError is raised, so the caller can log it and go on.
        """
        seg = self._seg
        states = seg.desc["state"].copy()
        ready = np.flatnonzero((states & 0xFF) == _READY)
        if len(ready) > 1:
            ready = ready[np.argsort(seg.desc["item"][ready], kind="stable")]
        for slot in ready.tolist():
            word = int(states[slot])
            mine = pack_state(word >> 24, row, SlotState.READING)
            if not self._claim(row, slot, word, mine):
                continue
            d = seg.desc[slot]
            d["claimed_ns"] = time.time_ns()
            d["deliveries"] += 1
            item, deliveries = int(d["item"]), int(d["deliveries"])
            area = seg.slot_area(slot)
            try:
                header = seg.header(slot)
            except SlotFormatError as e:
                seg.states[slot].cmpxchg_strong(
                    expected=mine, desired=pack_state((word >> 24) + 1, NO_OWNER, SlotState.FREE)
                )
                seg.counters[Counter.CORRUPT].fetch_add(1)
                seg.hint(seg.sem_free)
                raise SlotFormatError(f"slot {slot} (item {item}) dropped: {e}") from None
            tensors = {s.name: view(area, s) for s in header.tensors}
            return SlotReader(slot, item, mine, deliveries, tensors, header.meta)
        return None

    def claim(self, row: int, timeout_s: float | None = None) -> SlotReader | None:
        """Claim the oldest READY item, waiting while the ring is empty. None on shutdown or timeout.

        An empty ring is never a reason to stop: only the supervisor's shutdown is. Once shutdown
        is set nothing more is claimed (a normal end has an empty ring; `stop --now` means stop),
        so what is READY then is exactly what goes untrained.
        """
        return self._wait(
            lambda: None if self._seg.shutting_down else self.try_claim(row), self._seg.sem_ready, row, timeout_s
        )

    def release(self, r: SlotReader) -> None:
        """Hand a consumed slot back to the producers."""
        seg = self._seg
        row = (r.word >> 8) & 0xFFFF
        seg.released[r.slot] = r.word  # before the CAS: a FREE slot whose holder was released holds no item
        if not self._commit(row, r.slot, r.word, pack_state((r.word >> 24) + 1, NO_OWNER, SlotState.FREE), "released"):
            raise SlotLostError(f"slot {r.slot} (item {r.item}) was reclaimed while this process read it")
        seg.hint(seg.sem_free)

    def requeue(self, r: SlotReader) -> None:
        """Give a claimed item back unconsumed, for another consumer to take."""
        seg = self._seg
        if seg.states[r.slot].cmpxchg_strong(
            expected=r.word, desired=pack_state((r.word >> 24) + 1, NO_OWNER, SlotState.READY)
        ):
            seg.hint(seg.sem_ready)

    # ---- stated claims and counted transitions ------------------------------------------------

    def _claim(self, row: int, slot: int, expected: int, mine: int) -> bool:
        """The CAS that takes a slot (WRITING or READING), stated: the row names the claim (its word, then its slot)
        before the CAS, the descriptor names the holder after it, and only then is the row's statement withdrawn. So
        whenever a slot's word is `mine`, the descriptor's holder or this row's claim says so; words never repeat, so
        no earlier or later claim can say it for this one. One thread of a process claims (the producer's loop, the
        drafter's loader): the row's one claim field is never shared."""
        seg = self._seg
        seg.claim_word[row] = mine
        seg.claim_slot[row] = slot + 1  # last: armed once the word is in place
        if not seg.states[slot].cmpxchg_strong(expected=expected, desired=mine):
            seg.claim_slot[row] = 0
            return False
        crash_point("stated")  # the slot is this row's, said by its claim alone: a death here is the reaper's
        seg.holder[slot] = mine
        seg.claim_slot[row] = 0
        return True

    def _commit(self, row: int, slot: int, expected: int, desired: int, point: str) -> bool:
        """The CAS of a publish or a release, with the row's count: arm (slot, the word the CAS expects,
        items + 1), the CAS, count (items = that). False, and nothing counted, if the word had moved."""
        r = self._seg.rows[row]
        r["intent_word"] = expected
        r["intent_items"] = r["items"] + 1
        r["intent_slot"] = slot + 1  # last: armed only once the rest is in place
        if not self._seg.states[slot].cmpxchg_strong(expected=expected, desired=desired):
            r["intent_slot"] = 0
            return False
        crash_point(point)
        r["items"] = r["intent_items"]  # an assignment, so completing it twice counts once
        r["intent_slot"] = 0
        return True

    def settle(self, row: int) -> None:
        """For a dead row (its lock held): complete its count if its CAS happened, else drop it.

        The CAS happened iff the slot's word moved off the expected one: a WRITING or READING word
        owned by the dead row changes only by its own CAS or by this reclaim, which comes after.
        """
        r = self._seg.rows[row]
        slot = int(r["intent_slot"]) - 1
        if slot < 0:
            return
        if 0 <= slot < self._seg.geometry.n_slots and int(self._seg.desc[slot]["state"]) != int(r["intent_word"]):
            r["items"] = r["intent_items"]
        r["intent_slot"] = 0

    # ---- a FREE word over an item nobody consumed -----------------------------------------------

    def unconsumed(self, slot: int) -> bool:
        """Whether the slot, whatever its word says, holds a published item that no consumer ever claimed.

        Every item that reaches FREE by the protocol either was never published (its claim cleared the
        header, and an abort or a reclaim of a dead writer clears what a publish may have written) or was
        claimed by a consumer first (its claim counts a delivery before any release). So a readable header
        with no delivery is a published item whose READY word was rewritten by someone outside the protocol
        (a same-user process can write the segment): the item is still owed."""
        return int(self._seg.desc[slot]["deliveries"]) == 0 and self.header_reads(slot)

    def header_reads(self, slot: int) -> bool:
        """Whether the slot's header is one a publish wrote (a claim for writing clears it, and so do an abort and a
        dead writer's reclaim, whatever a publish may have written)."""
        seg = self._seg
        off = seg.geometry.slot_offset(slot)
        if seg.mv[off : off + 4] == b"\0\0\0\0":  # cleared by a claim (or a new ring): the common case, cheap
            return False
        try:
            seg.header(slot)
        except SlotFormatError:
            return False
        return True

    def restore_unconsumed(self, slot: int, word: int) -> bool:
        """CAS a FREE word over an unconsumed item back to READY, counted corrupt (a process that moved it
        meanwhile wins); the caller names it."""
        seg = self._seg
        if not seg.states[slot].cmpxchg_strong(
            expected=word, desired=pack_state((word >> 24) + 1, NO_OWNER, SlotState.READY)
        ):
            return False
        seg.counters[Counter.CORRUPT].fetch_add(1)
        seg.hint(seg.sem_ready)
        return True

    # ---- waiting ------------------------------------------------------------------------------

    def _wait(
        self, attempt: Callable[[], T | None], sem: posix_ipc.Semaphore, row: int, timeout_s: float | None
    ) -> T | None:
        seg = self._seg
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        waited_from = None
        try:
            while True:
                got = attempt()
                if got is not None or seg.shutting_down:
                    return got
                if seg.draining and sem is seg.sem_free:
                    return None
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    return None
                waited_from = waited_from or now
                self._table.heartbeat(row)
                wait = self.wait_s if deadline is None else min(self.wait_s, deadline - now)
                with contextlib.suppress(posix_ipc.BusyError):
                    sem.acquire(wait)
        finally:
            if waited_from is not None:
                self.wait_seconds += time.monotonic() - waited_from
