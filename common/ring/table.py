"""The process table: one row per process of the run (its role, pid, heartbeat, status, counts) and a producer's
resume point (cursor, replay progress, data plan) committed with its publishes (common/ring/slots.py)."""

from __future__ import annotations

import os
import time

import numpy as np

from dflash_ring.common.layout import NO_OWNER, Counter, Role, RowStatus, SlotState, pack_state
from dflash_ring.common.ring.segment import Segment


class ProcessTable:
    def __init__(self, segment: Segment):
        self._seg = segment

    @property
    def producers(self) -> int:
        return int(self._seg.fields["topology.producers"])  # read when asked: `clean` opens a damaged header too

    @property
    def consumers(self) -> int:
        return int(self._seg.fields["topology.consumers"])

    def row_of(self, role: Role, index: int) -> int:
        if role == Role.SUPERVISOR:
            return 0
        producers = self.producers
        limit = producers if role == Role.PRODUCER else self.consumers
        if not 0 <= index < limit:
            raise ValueError(
                f"{role.name.lower()} index {index} is out of range: the run has "
                f"topology.{role.name.lower()}s = {limit}"
            )
        return 1 + index if role == Role.PRODUCER else 1 + producers + index

    def take_row(self, row: int, role: Role, index: int) -> None:
        r = self._seg.rows[row]
        if r["pid"] != 0:
            r["restarts"] += 1
        r["role"], r["index"], r["pid"] = int(role), index, os.getpid()
        r["started_ns"] = r["heartbeat_ns"] = time.time_ns()
        r["status"] = RowStatus.RUNNING

    def set_row_status(self, row: int, status: RowStatus) -> None:
        self._seg.rows[row]["status"] = status

    def mark_done(self, row: int, end: tuple[int, int]) -> None:
        """A producer's shard is published: DONE, with its row's cursor at `end`, the end of its plan (where every
        publish of its last batch and of later replays leaves it already; a producer that published nothing in this
        ring, having resumed at the end from its cursor file, records it here). So every DONE row states its end, and
        the supervisor counts only those: a DONE written into a row whose cursor is short of the end is no finished
        shard. Staged with a word no slot holds (WRITING by no owner): never rolled back."""
        r = self._seg.rows[row]
        r["prev_cursor"] = r["cursor"] if r["has_cursor"] else (-1, -1)
        r["prev_replayed"] = r["replayed"]
        r["pending_word"] = pack_state(0, NO_OWNER, SlotState.WRITING)
        r["cursor"] = end
        r["has_cursor"] = 1
        r["status"] = RowStatus.DONE

    def row_status(self, row: int) -> RowStatus:
        return RowStatus(int(self._seg.rows[row]["status"]))

    def heartbeat(self, row: int) -> None:
        self._seg.rows[row]["heartbeat_ns"] = time.time_ns()

    def rows(self) -> np.ndarray:
        return self._seg.rows.copy()

    # ---- a producer's resume point ------------------------------------------------------------

    def committed_cursor(self, row: int) -> tuple[int, int] | None:
        """The (epoch, position) after the producer's last published batch, if it has one."""
        r = self._seg.rows[row]
        if not r["has_cursor"] or r["cursor"][0] < 0:
            return None
        return int(r["cursor"][0]), int(r["cursor"][1])

    def committed_replayed(self, row: int) -> int:
        """How many entries of the producer's replay list its published batches have covered."""
        return int(self._seg.rows[row]["replayed"])

    def stage_cursor(self, row: int, word: int, cursor: tuple[int, int], replayed: int) -> None:
        """Record the resume point a publish commits, before its compare-and-swap, with the claim (state word,
        generation included) that commits it: `roll_back_cursor` undoes it for that very claim only."""
        r = self._seg.rows[row]
        r["prev_cursor"] = r["cursor"] if r["has_cursor"] else (-1, -1)
        r["prev_replayed"] = r["replayed"]
        r["pending_word"] = word
        r["cursor"] = cursor
        r["replayed"] = replayed
        r["has_cursor"] = 1

    def roll_back_cursor(self, row: int, word: int) -> None:
        """The claim `word` was never published (its writer died): its staged resume point goes with it."""
        r = self._seg.rows[row]
        if r["has_cursor"] and r["pending_word"] == word:
            r["cursor"] = r["prev_cursor"]
            r["replayed"] = r["prev_replayed"]

    def settled_resume(self, row: int) -> tuple[tuple[int, int], int] | None:
        """A dead producer's resume point ((epoch, position), replayed), its unpublished claim undone: what the
        reaper would leave, without needing the row's lock file (whoever removes a dead ring calls this)."""
        r = self._seg.rows[row].copy()
        if not r["has_cursor"]:
            return None
        cursor, replayed = r["cursor"], r["replayed"]
        if int(r["pending_word"]) in {int(w) for w in self._seg.desc["state"]}:  # its publish CAS never happened
            cursor, replayed = r["prev_cursor"], r["prev_replayed"]
        if cursor[0] < 0:
            return None
        return (int(cursor[0]), int(cursor[1])), int(replayed)

    def cursor_plan(self, row: int) -> str:
        """The data plan the row's committed cursor belongs to ('' if none was recorded)."""
        return bytes(self._seg.rows[row]["cursor_plan"]).decode("ascii", "replace")

    def set_cursor_plan(self, row: int, plan: str) -> None:
        """Only while the row has no committed cursor: the cursors it publishes from now on are of `plan`."""
        self._seg.rows[row]["cursor_plan"] = plan.encode("ascii")[:24]

    def set_planned_items(self, row: int, n: int, evals: int = 0) -> None:
        """A producer's plan: `n` items over the run, `evals` of them evaluation items."""
        self._seg.rows[row]["planned_eval_items"] = evals
        self._seg.rows[row]["planned_items"] = n

    def planned_items(self) -> int:
        """Batches all producers that have started plan to publish over the run."""
        rows = self._seg.rows
        return int(rows["planned_items"][rows["role"] == Role.PRODUCER].sum())

    # ---- counts -------------------------------------------------------------------------------

    def produced_tokens(self) -> int:
        """Tokens every producer has published (their rows' `tokens`; see layout.ROW_DTYPE for how exact)."""
        return int(self._seg.rows["tokens"][1 : 1 + self.producers].sum())

    def counter(self, c: Counter) -> int:
        """A header counter; PRODUCED and CONSUMED are the sums of the producer and consumer rows' items."""
        if c == Counter.PRODUCED:
            return self._items_of_rows(1, self.producers)
        if c == Counter.CONSUMED:
            producers = self.producers
            return self._items_of_rows(1 + producers, self._seg.geometry.n_rows - 1 - producers)
        return self._seg.counters[c].load()

    def _items_of_rows(self, first: int, count: int) -> int:
        return int(self._seg.rows["items"][first : first + count].sum())
