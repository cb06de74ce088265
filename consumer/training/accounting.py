"""A drafter's account of each ring item it is done with: what it consumed, its journal, its ledger, the release.

Exactly once rests on one order, kept here and nowhere else: an item is settled only once the step (or the
evaluation) that used it has returned, and it is recorded before its slot goes back to the producers. Until the
release the slot stays READING, so what a drafter killed before it held is redelivered (and reconcile undoes its
`train` record by the later delivery); from the release on, only the journal's line brings the batch back if the
update dies with the drafter before a checkpoint holds it (common/lifecycle/trained_journal.py).

    consumed    the item and its producer's newest (epoch, position), saved with every checkpoint
    journal     a trained batch that made an update (not an empty one, not a held-out one)
    ledger      its `train` or `eval` record (common/lifecycle/ledger_events.py), when run.ledger_dir is set
    crash point `trained` or `evaluated` (common/crash_points.py): the kill the chaos tests aim between the two
    release     the slot back to the producers
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dflash_ring.common.crash_points import crash_point
from dflash_ring.common.lifecycle.ledger import Ledger
from dflash_ring.common.lifecycle.ledger_events import BatchIdentity, Evaluated, Settled, Trained
from dflash_ring.common.ring import SlotReader
from dflash_ring.common.lifecycle.trained_journal import Journal
from dflash_ring.consumer.training.trainer import DeviceBatch


@dataclass
class Consumed:
    """What this drafter has taken, saved with every checkpoint: items, and per producer the newest
    (epoch, position) trained."""

    by_producer: dict[str, list[int]] = field(default_factory=dict)
    items: int = 0

    def add(self, meta: dict[str, Any]) -> None:
        self.items += 1
        producer = str(meta.get("producer", "?"))
        mark = [int(meta.get("epoch", 0)), int(meta.get("position", 0))]
        self.by_producer[producer] = max(self.by_producer.get(producer, mark), mark)

    def saved_with(self, info: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint's info: these counts now, then `info` (what does not change while the drafter runs)."""
        return {"consumed": self.by_producer, "items": self.items, **info}


_CRASH_POINT = {Trained: "trained", Evaluated: "evaluated"}


class ItemAccount:
    def __init__(
        self, consumed: Consumed, journal: Journal, ledger: Ledger | None, release: Callable[[SlotReader], None]
    ):
        self.consumed, self.journal, self.ledger, self.release = consumed, journal, ledger, release

    def settle(
        self,
        kind: type[Settled],
        batch: DeviceBatch,
        slot: SlotReader,
        step: int,
        empty: bool = False,
        held_by: int | None = None,
    ) -> None:
        """Batch `batch` from `slot`, trained (`Trained`; `empty`: it had nothing to supervise, so no update to lose)
        or evaluated (`Evaluated`) at optimizer step `step`: accounted for, then released. `held_by`: the optimizer
        step whose update holds a trained batch (`step` + 1 while its micro-batch still accumulates; None: `step`),
        written in its journal line: a line whose step a checkpoint covers names a batch that checkpoint holds."""
        self.consumed.add(batch.meta)
        if kind is Trained and not empty:  # from the release on, only this line brings it back
            self.journal.append(batch.meta, slot.item, step if held_by is None else held_by)
        if self.ledger is not None:  # before the release: a kill in between redelivers it (reconcile knows)
            identity = BatchIdentity.of(batch.meta)
            self.ledger.write(
                Trained(step, slot.item, slot.deliveries, identity, empty=empty)
                if kind is Trained
                else Evaluated(step, slot.item, slot.deliveries, identity)
            )
        crash_point(_CRASH_POINT[kind])
        self.release(slot)  # only now may the producers refill the slot
