"""What the supervisor undoes and reads back: a dead row's slots, state words the protocol cannot produce, the
items a removed ring still held, and the ring's status. iceoryx2's stale_resource_cleanup.rs is the model: every
repair is a compare-and-swap from the word it judged, so a process that moved the word meanwhile wins."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from dflash_ring.common.layout import NO_OWNER, Counter, Role, RowStatus, SlotState, pack_state
from dflash_ring.common.ring.segment import Segment
from dflash_ring.common.ring.slots import Slots
from dflash_ring.common.ring.table import ProcessTable
from dflash_ring.common.slot_format import SlotFormatError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CorruptSlot:
    """A slot whose state word the protocol cannot produce, and what was done about it."""

    slot: int
    item: int
    word: int
    why: str  # what is impossible about the word
    outcome: str  # where its item went


@dataclass
class RingStatus:
    run: str
    created_ns: int
    n_slots: int
    slot_bytes: int
    slots_by_state: dict[str, int]
    counters: dict[str, int]
    rows: list[dict[str, Any]]

    @property
    def depth(self) -> int:
        return self.slots_by_state["ready"]


_STATES = frozenset(int(s) for s in SlotState)
_HOLDER = {SlotState.WRITING: Role.PRODUCER, SlotState.READY: Role.PRODUCER, SlotState.READING: Role.CONSUMER}


def impossible_word(word: int, roles: np.ndarray) -> str | None:
    """Why the protocol cannot have produced this state word, given the process table's roles; None if it can.

    Reachable words: FREE owned by nobody (or the all-zero word of a new ring), WRITING by a producer row,
    READY by the producer row that published it or by nobody (requeued or redelivered), READING by a
    consumer row. A row's role is set before its first claim and never cleared, so roles read after the
    word judge it soundly."""
    state, owner = word & 0xFF, (word >> 8) & 0xFFFF
    if state not in _STATES:
        return f"has state {state}, which is no slot state"
    state = SlotState(state)
    if state == SlotState.FREE:
        return None if owner == NO_OWNER or word == 0 else f"is FREE with owner row {owner}, which frees nothing"
    if state == SlotState.READY and owner == NO_OWNER:
        return None
    if owner >= len(roles):
        return f"is {state.name} by row {owner}, outside the {len(roles)}-row process table"
    want, role = _HOLDER[state], int(roles[owner])
    if role == want:
        return None
    what = (
        "a row no process has taken"
        if role == Role.NONE
        else (f"the {Role(role).name.lower()} row" if role in Role._value2member_map_ else f"a row of role {role}")
    )
    return f"is {state.name} by row {owner}, {what}: only a {want.name.lower()} row holds a slot {state.name}"


def _suspects(words: np.ndarray, roles: np.ndarray) -> np.ndarray:
    """The slots whose words impossible_word may object to, in one vectorized look (every supervisor pass
    reads every word; a Python call per word would cost milliseconds on a ring of thousands of slots)."""
    state, owner = words & 0xFF, (words >> 8) & 0xFFFF
    role = roles[np.minimum(owner, len(roles) - 1)].astype(np.int64)
    held = owner < len(roles)
    fine = (
        (state == SlotState.FREE) & ((owner == NO_OWNER) | (words == 0))
        | (state == SlotState.READY) & ((owner == NO_OWNER) | held & (role == Role.PRODUCER))
        | (state == SlotState.WRITING) & held & (role == Role.PRODUCER)
        | (state == SlotState.READING) & held & (role == Role.CONSUMER)
    )
    return np.flatnonzero(~fine)


class Repair:
    def __init__(self, segment: Segment, table: ProcessTable, slots: Slots):
        self._seg, self._table, self._slots = segment, table, slots

    # ---- a dead row ---------------------------------------------------------------------------

    def reclaim_slots_of(self, row: int) -> tuple[int, int]:
        """Undo what a dead row held: WRITING -> FREE, READING -> READY. Returns (freed, redelivered).

        The caller must hold the dead row's lock, so no successor runs meanwhile.
        """
        seg = self._seg
        freed = redelivered = 0
        self._slots.settle(row)  # first: whether its last CAS happened is read from the slot words as they are
        for slot, word in enumerate(seg.desc["state"].copy()):
            word = int(word)
            if (word >> 8) & 0xFFFF != row:
                continue
            state = word & 0xFF
            if state == SlotState.WRITING:
                new, c = pack_state((word >> 24) + 1, NO_OWNER, SlotState.FREE), Counter.RECLAIMED
                seg.clear_header(slot)  # written but never published: no item (see Slots.unconsumed)
            elif state == SlotState.READING:
                new, c = pack_state((word >> 24) + 1, NO_OWNER, SlotState.READY), Counter.REDELIVERED
            else:
                continue
            if seg.states[slot].cmpxchg_strong(expected=word, desired=new):
                seg.counters[c].fetch_add(1)
                if c == Counter.RECLAIMED:
                    self._table.roll_back_cursor(row, word)  # the claim that committed it was never published
                    freed += 1
                else:
                    redelivered += 1
        if freed:
            seg.hint(seg.sem_free)
        if redelivered:
            seg.hint(seg.sem_ready)
        return freed, redelivered

    def owned_slots(self) -> set[int]:
        """Rows that hold a WRITING or READING slot right now."""
        states = self._seg.desc["state"].copy()
        held = np.isin(states & 0xFF, (SlotState.WRITING, SlotState.READING))
        return {int(w >> 8) & 0xFFFF for w in states[held]}

    # ---- words the protocol cannot produce ----------------------------------------------------

    def repair_impossible_words(self) -> list[CorruptSlot]:
        """Put every slot whose state word the protocol cannot produce back where the protocol goes on.

        Such a word (a state byte that is no state, an owner row outside the process table or of a role
        that never holds that state) is nobody's to undo: the reaper would wait forever for an owner that
        does not exist, and a state nobody counts lets the run end without the item. So the slot is
        counted corrupt and its item made READY again if its header reads (a claim clears the header, so
        a readable one is this item's, published), else FREE. Each change is a CAS from the impossible
        word, so a process that moved the word meanwhile wins. The supervisor calls this every pass.
        """
        seg = self._seg
        words = seg.desc["state"].copy()  # before the roles: a row's role, once set, never goes back
        roles = seg.rows["role"].copy()
        found = []
        for slot in _suspects(words, roles).tolist():
            word = int(words[slot])
            if (why := impossible_word(word, roles)) is not None and (c := self._repair(slot, word, why)):
                found.append(c)
        # A READY word rewritten to a FREE one the protocol can reach: only the slot's contents tell (unconsumed).
        maybe = ((words & 0xFF) == SlotState.FREE) & (words != 0) & (seg.desc["deliveries"] == 0)
        for slot in np.flatnonzero(maybe).tolist():
            word = int(words[slot])
            if impossible_word(word, roles) is None and self._slots.unconsumed(slot):
                if self._slots.restore_unconsumed(slot, word):
                    found.append(
                        CorruptSlot(
                            slot,
                            int(seg.desc[slot]["item"]),
                            word,
                            "says FREE over a published item no drafter claimed",
                            "made READY again: redelivered",
                        )
                    )
        return found

    # ---- holding words no claim stated ---------------------------------------------------------

    def repair_unstated_words(self) -> list[CorruptSlot]:
        """Put back every WRITING or READING word that no claim of its row stated (Slots._claim): a same-user process
        wrote it into the segment, with a plausible owner (even the live process's own row), and the protocol would
        wait for that row to publish or release a slot it never took (a READY item set READING is never trained,
        the run never ends; set WRITING, `stop --now` would drop it as an unpublished write). The slot is counted
        corrupt and goes back to where its item is: READY if it holds a published item nobody consumed, else FREE.
        Each change is a CAS from the judged word. The supervisor calls this every pass, after
        repair_impossible_words; what that repaired is no longer looked at here."""
        seg = self._seg
        words = seg.desc["state"].copy()
        holding = np.isin(words & 0xFF, (SlotState.WRITING, SlotState.READING))
        found = []
        for slot in np.flatnonzero(holding & (seg.desc["holder"] != words)).tolist():
            word = int(words[slot])
            if self._stated(slot, word) or impossible_word(word, seg.rows["role"]) is not None:
                continue
            owner = (word >> 8) & 0xFFFF
            r = seg.rows[owner]
            who = f"{Role(int(r['role'])).name.lower()} {int(r['index'])} (row {owner}, pid {int(r['pid'])})"
            state = SlotState(word & 0xFF).name
            if self._owed(slot):
                new, outcome = pack_state((word >> 24) + 1, NO_OWNER, SlotState.READY), "made READY again: redelivered"
            else:
                new, outcome = pack_state((word >> 24) + 1, NO_OWNER, SlotState.FREE), "freed (it held no item owed)"
            if not seg.states[slot].cmpxchg_strong(expected=word, desired=new):
                continue  # moved meanwhile: looked at again on the next pass
            seg.counters[Counter.CORRUPT].fetch_add(1)
            seg.hint(seg.sem_ready if new & 0xFF == SlotState.READY else seg.sem_free)
            why = f"says {state} by {who}, which never claimed it"
            found.append(CorruptSlot(slot, int(seg.desc[slot]["item"]), word, why, outcome))
        return found

    def _stated(self, slot: int, word: int) -> bool:
        """Whether a claim stated `word` for `slot`, or the slot has moved off it. The holder is read again after the
        row's claim: a claim withdrawn between the two looks had named its holder first (Slots._claim). A word that
        stays put through all three looks, with neither saying it, was never claimed."""
        seg = self._seg
        if int(seg.desc[slot]["holder"]) == word:
            return True
        r = seg.rows[(word >> 8) & 0xFFFF]
        if int(r["claim_slot"]) == slot + 1 and int(r["claim_word"]) == word:
            return True
        return int(seg.desc[slot]["holder"]) == word or int(seg.desc[slot]["state"]) != word

    def _owed(self, slot: int) -> bool:
        """Whether the slot holds a published item that no consumer has finished: its header reads (Slots.header_reads)
        and its last holder was not a consumer that released it."""
        d = self._seg.desc[slot]
        holder = int(d["holder"])
        released = holder & 0xFF == SlotState.READING and int(d["released"]) == holder
        return not released and self._slots.header_reads(slot)

    def _repair(self, slot: int, word: int, why: str) -> CorruptSlot | None:
        seg = self._seg
        item = int(seg.desc[slot]["item"])
        gen = word >> 24
        if word & 0xFF == SlotState.FREE and self._slots.unconsumed(slot):
            new, outcome = (
                pack_state(gen + 1, NO_OWNER, SlotState.READY),
                ("made READY again: a published item nobody consumed, redelivered"),
            )
        elif word & 0xFF == SlotState.FREE:
            new, outcome = pack_state(gen + 1, NO_OWNER, SlotState.FREE), "owner cleared (a free slot holds no item)"
        else:
            try:
                seg.header(slot)
                new, outcome = pack_state(gen + 1, NO_OWNER, SlotState.READY), "made READY again: redelivered"
            except SlotFormatError as e:
                new, outcome = pack_state(gen + 1, NO_OWNER, SlotState.FREE), f"freed, its item dropped: {e}"
        if not seg.states[slot].cmpxchg_strong(expected=word, desired=new):
            return None  # moved meanwhile: looked at again on the next pass
        seg.counters[Counter.CORRUPT].fetch_add(1)
        seg.hint(seg.sem_ready if new & 0xFF == SlotState.READY else seg.sem_free)
        return CorruptSlot(slot, item, word, why, outcome)

    # ---- what a removed ring still held -------------------------------------------------------

    def unfinished_items(self) -> tuple[list[dict[str, Any]], list[str]]:
        """The metadata of every item published and not yet trained (READY, or READING by a holder that may
        die, or under a state word the protocol cannot produce or no claim stated: see repair_impossible_words and
        repair_unstated_words); and a line for each
        such slot whose header cannot be read. Used by whoever removes the ring, so that what it held is
        produced again (supervisor/unfinished.py)."""
        seg = self._seg
        metas, damaged = [], []
        desc = seg.desc.copy()
        roles = seg.rows["role"].copy()
        for slot, word in enumerate(desc["state"].tolist()):
            why = impossible_word(word, roles)
            published = word & 0xFF in (SlotState.READY, SlotState.READING)
            if word & 0xFF == SlotState.FREE and self._slots.unconsumed(slot):
                published, why = True, "says FREE over a published item no drafter claimed"
            elif word & 0xFF in (SlotState.WRITING, SlotState.READING) and why is None and not self._stated(slot, word):
                if not self._owed(slot):
                    continue  # a holding word nobody claimed, over a consumed item or none: nothing is owed
                state, owner = SlotState(word & 0xFF).name, (word >> 8) & 0xFFFF
                published, why = True, f"says {state} by row {owner}, which never claimed it, over a published item"
            if not published and (why is None or word & 0xFF == SlotState.FREE):
                continue  # free, or being written by a producer: nothing published to keep
            name = f"slot {slot} (item {int(desc['item'][slot])})"
            try:
                metas.append(dict(seg.header(slot).meta))
            except SlotFormatError as e:
                damaged.append(f"{name}: {e}" + (f" (its state word {why})" if why else ""))
                continue
            if why is not None:  # a word nobody could have written: the item is still owed, so it is kept
                log.error("%s is corrupt: its state word %#x %s; its item is kept for the replay list", name, word, why)
        return metas, damaged

    def unfinished_item_numbers(self) -> set[int]:
        """The item numbers of every slot READY or READING: what the ring itself still delivers or replays (a dead
        drafter's journal leaves them out, common/lifecycle/trained_journal.py)."""
        desc = self._seg.desc.copy()
        held = np.isin(desc["state"] & 0xFF, (SlotState.READY, SlotState.READING))
        return {int(i) for i in desc["item"][held]}

    # ---- observation --------------------------------------------------------------------------

    def slot_counts(self) -> dict[str, int]:
        states = self._seg.desc["state"] & 0xFF
        return {s.name.lower(): int(np.count_nonzero(states == s)) for s in SlotState}

    def status(self) -> RingStatus:
        seg = self._seg
        now = time.time_ns()
        rows = []
        for i, r in enumerate(seg.rows.copy()):
            if r["role"] == Role.NONE:
                continue
            rows.append(
                {
                    "row": i,
                    "role": Role(int(r["role"])).name.lower(),
                    "index": int(r["index"]),
                    "pid": int(r["pid"]),
                    "status": RowStatus(int(r["status"])).name.lower(),
                    "heartbeat_age_s": round((now - int(r["heartbeat_ns"])) / 1e9, 3),
                    "items": int(r["items"]),
                    "restarts": int(r["restarts"]),
                }
            )
        return RingStatus(
            run=seg.identity.run_name,
            created_ns=seg.identity.created_ns,
            n_slots=seg.geometry.n_slots,
            slot_bytes=seg.geometry.slot_bytes,
            slots_by_state=self.slot_counts(),
            counters={c.name.lower(): self._table.counter(c) for c in Counter},
            rows=rows,
        )
