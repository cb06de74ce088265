"""The ledger's records: one typed event per kind, the one writer of a line and the one parser of it.

Every process that keeps a ledger (`run.ledger_dir`, common/lifecycle/ledger.py) writes these, and `tools/reconcile.py`
and `tools/chaos.py` read them back: the exactly-once evidence. A line is one JSON object, its keys in this order: `ev`
(the kind), `pid`, `t` (wall-clock seconds), then the event's fields in the order its class declares them. An optional
field (a default of None or False) is left out of the line when it has that default, as the roles always wrote them; so
a line is byte for byte what it was when each writer spelled its own (tests/test_ledger_events.py).

    supervisor  start {ring_created_ns, adoptions}    after it created or adopted the ring
    producer    start {plan: [batches per epoch], resume: [epoch, position], replay: [[epoch, position]...]
                       [, eval: [[positions of held-out batches] per epoch]]}
                pub   {item, epoch, pos[, replay][, eval]}
                                                      after `publish` committed the batch and its cursor;
                                                      replay: a batch a removed ring held, produced again;
                                                      eval: a held-out batch (data.eval_fraction)
                intake {segments, replay: [[epoch, position]...]}
                                                      dead drafters' sealed journals taken into its replay
                                                      list: those batches are produced again from here on
                done  {}                              shard finished
    drafter     start {step[, took_over][, snapshot_t]}
                                                      after joining (step: the checkpoint resumed from);
                                                      took_over: the pid its row named, when this process took
                                                      the index over (a standby, or after waiting on a live holder);
                                                      snapshot_t: when the state resumed from was taken (0: none,
                                                      from the start; absent: a checkpoint that did not save it)
                got   {item, deliveries, producer, epoch, pos}
                                                      the batch is copied out of its slot (still claimed)
                train {step, item, deliveries, producer, epoch, pos[, empty]}
                                                      `train_step` returned on that batch; written just
                                                      before its slot is released; empty: it had nothing
                                                      to supervise (no update, not journaled)
                eval  {step, item, deliveries, producer, epoch, pos}
                                                      a held-out batch evaluated (never trained); written
                                                      just before its slot is released
                ckpt  {step, items, snapshot_t}       a checkpoint is durable; snapshot_t: when its state was
                                                      taken (written in the background, it lands later)
                exit  {step}                          clean exit
    every role  startup {phases: {name: seconds}, total}
                                                      its first useful work is done (common/lifecycle/startup.py)

A batch's identity is (producer, epoch, pos): pos is its index in that producer's list for the epoch, the same
coordinates as its resume cursor. Three roles write `start`; which one a record is follows from its file's name
(`<role>-<index>.jsonl`). Parsing is tolerant: a line cut by a kill is counted, not fatal; a record is handed back as
the dict it was written as (reconcile quotes records in its findings), and its kind read with `kind`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, ClassVar

_KIND, _PID, _TIME = "ev", "pid", "t"  # the envelope's keys: first in every line


@dataclass(frozen=True)
class LedgerEvent:
    KIND: ClassVar[str]

    def line_fields(self) -> dict[str, Any]:
        """The line's fields after the envelope, in declaration order; an optional one (default None or False) only
        when it is set (a flag then as `true`)."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.default is False:
                if not value:
                    continue
                value = True
            elif f.default is None and value is None:
                continue
            out[f.name] = value
        return out


@dataclass(frozen=True)
class BatchIdentity:
    """A batch's identity from its slot metadata (written by the producer's SlotFiller)."""

    producer: Any
    epoch: Any
    pos: Any

    @classmethod
    def of(cls, meta: dict[str, Any]) -> BatchIdentity:
        return cls(meta.get("producer"), meta.get("epoch"), meta.get("position"))

    def as_dict(self) -> dict[str, Any]:
        return {"producer": self.producer, "epoch": self.epoch, "pos": self.pos}


# ---- the supervisor -----------------------------------------------------------------------------


@dataclass(frozen=True)
class SupervisorStart(LedgerEvent):
    KIND: ClassVar[str] = "start"
    ring_created_ns: int
    adoptions: int


# ---- a producer ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProducerStart(LedgerEvent):
    KIND: ClassVar[str] = "start"
    plan: list[int]
    resume: list[int]
    replay: list[list[int]]
    eval: list[list[int]] | None = None


@dataclass(frozen=True)
class Published(LedgerEvent):
    KIND: ClassVar[str] = "pub"
    item: int
    epoch: int
    pos: int
    replay: bool = False
    eval: bool = False


@dataclass(frozen=True)
class Intake(LedgerEvent):
    KIND: ClassVar[str] = "intake"
    segments: list[str]
    replay: list[list[int]]


@dataclass(frozen=True)
class ShardDone(LedgerEvent):
    KIND: ClassVar[str] = "done"


# ---- a drafter ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class DrafterStart(LedgerEvent):
    KIND: ClassVar[str] = "start"
    step: int
    took_over: int | None = None
    snapshot_t: float | None = None


@dataclass(frozen=True)
class Got(LedgerEvent):
    KIND: ClassVar[str] = "got"
    item: int
    deliveries: int
    batch: BatchIdentity

    def line_fields(self) -> dict[str, Any]:
        return {"item": self.item, "deliveries": self.deliveries, **self.batch.as_dict()}


@dataclass(frozen=True)
class Settled(LedgerEvent):
    """A batch done with, just before its slot is released: trained, or evaluated if held out."""

    step: int
    item: int
    deliveries: int
    batch: BatchIdentity

    def line_fields(self) -> dict[str, Any]:
        return {"step": self.step, "item": self.item, "deliveries": self.deliveries, **self.batch.as_dict()}


@dataclass(frozen=True)
class Trained(Settled):
    KIND: ClassVar[str] = "train"
    empty: bool = False  # nothing to supervise: no update to lose

    def line_fields(self) -> dict[str, Any]:
        return {**super().line_fields(), **({"empty": True} if self.empty else {})}


@dataclass(frozen=True)
class Evaluated(Settled):
    KIND: ClassVar[str] = "eval"


@dataclass(frozen=True)
class CheckpointDurable(LedgerEvent):
    KIND: ClassVar[str] = "ckpt"
    step: int
    items: int
    snapshot_t: float


@dataclass(frozen=True)
class Exited(LedgerEvent):
    KIND: ClassVar[str] = "exit"
    step: int


# ---- every role ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class StartupDone(LedgerEvent):
    KIND: ClassVar[str] = "startup"
    phases: dict[str, float]
    total: float


# ---- the writer and the parser --------------------------------------------------------------------


def encode(event: LedgerEvent, pid: int, t: float) -> bytes:
    """The one writer of a ledger line."""
    return (
        json.dumps({_KIND: event.KIND, _PID: pid, _TIME: t, **event.line_fields()}, separators=(",", ":")) + "\n"
    ).encode()


def parse(raw: bytes) -> dict[str, Any] | None:
    """The one parser of a ledger line: the record, or None for a line that is none (cut by a kill, or damage)."""
    try:
        rec = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(rec, dict) or _KIND not in rec or _PID not in rec:
        return None
    return rec


def kind(record: dict[str, Any]) -> str:
    """A parsed record's kind: compare it with an event's KIND."""
    return record[_KIND]


def is_one_of(record: dict[str, Any], *events: type[LedgerEvent]) -> bool:
    return record[_KIND] in {e.KIND for e in events}
