"""The drafter's checkpoint policy (`Checkpoints`): when a checkpoint is taken, and what follows once it is durable.

The state is written by consumer/training/checkpoint.py, in the background by async_checkpoint.py beside this.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflash_ring.common.lifecycle.ledger import Ledger
from dflash_ring.common.lifecycle.ledger_events import CheckpointDurable
from dflash_ring.common.lifecycle.trained_journal import Journal
from dflash_ring.consumer.training.async_checkpoint import BackgroundWriter, HostSnapshot
from dflash_ring.consumer.training.checkpoint import CheckpointStore
from dflash_ring.consumer.training.trainer import Trainer

log = logging.getLogger(__name__)


class Checkpoints:
    """The checkpoint policy: every train.checkpoint_every_steps, and once more at the end.

    With train.async_checkpoints (the default) a checkpoint costs the step only a copy of the state into host
    memory (`HostSnapshot`); a thread writes it while training goes on (`BackgroundWriter`), and its `ckpt`
    ledger record and log line come once it is durable. The consumed items and high-water marks are taken
    in the same call as the weights, so a resumed drafter's state is one moment's.

    Each checkpoint's state starts a new journal segment (common/lifecycle/trained_journal.py), and once it is durable
    the segments every kept checkpoint covers go: what the journal holds is exactly what a crash would lose.

    A checkpoint that comes due while the previous one is still being written waits for it rather than
    being skipped: a SIGKILL then loses at most two intervals of updates (since the last durable snapshot,
    plus the one being written: the bound `reconcile` checks), where skipping would stretch that without
    limit on a disk slower than the interval. The wait is logged: checkpoint_every_steps is shorter than a
    write takes. The final checkpoint, and any write in flight, are durable before `final` returns.
    """

    def __init__(
        self,
        store: CheckpointStore,
        every: int,
        keep: int,
        state: Callable[[], dict[str, Any]],
        trainer: Trainer,
        journal: Journal,
        ledger: Ledger | None,
        background: bool = True,
    ):
        self.store, self.every, self.keep, self.state, self.trainer = store, every, keep, state, trainer
        self.journal, self.ledger = journal, ledger
        self.saved_at = trainer.step  # the step of the newest checkpoint taken (durable once `wait` returns)
        self.snapshot = HostSnapshot() if background else None
        self.writer = BackgroundWriter(store, keep) if background else None

    def save(self) -> None:
        info = self.state()
        taken_t = round(time.time(), 4)  # the ledger's precision: `snapshot_t` in its records
        # Saved with it: a successor's `start` record names the state it resumed from (the ledger's `ckpt` record
        # of the checkpoint may never be written: a kill once `latest` moved and before the record).
        ckpt = self.trainer.state(dict(info, snapshot_t=taken_t))
        step, items = ckpt.step, info["items"]
        self.journal.rotate(step)  # what trains from here on is not in this state
        if self.writer is None:
            self.store.save(ckpt, keep=self.keep, on_latest=lambda path: self._durable(path, step, items, taken_t))
        else:
            busy, t0 = self.writer.busy, time.perf_counter()
            self.writer.wait()  # the buffer is free only once the previous write is done (raises if it failed)
            if busy:
                log.warning(
                    "checkpoint at step %d waited %.1f s for the write of step %d: a write takes longer than "
                    "train.checkpoint_every_steps = %d steps",
                    step,
                    time.perf_counter() - t0,
                    self.saved_at,
                    self.every,
                )
            host = self.snapshot.take(ckpt)
            self.trainer.hold_updates(self.snapshot.copied)
            self.writer.start(host, self.snapshot.copied, lambda path: self._durable(path, step, items, taken_t))
        self.saved_at = step

    def _durable(self, path: Path, step: int, items: int, taken_t: float) -> None:
        self.journal.covered(self.store.oldest_step(keep=self.keep))
        if self.ledger is not None:
            self.ledger.write(CheckpointDurable(step, items, taken_t))
        log.info("checkpoint %s", path)

    def after_step(self, step: int) -> None:
        if self.writer is not None:
            self.writer.check()  # a failed background write stops the drafter now, as a failed save in the step did
        if step - self.saved_at >= self.every:
            self.save()

    def wait(self) -> None:
        """Until the checkpoint being written is durable (raises if its write failed)."""
        if self.writer is not None:
            self.writer.wait()

    def final(self) -> None:
        self.wait()
        if self.trainer.step != self.saved_at or not self.store.contents()[1]:  # a step unsaved, or none at all
            self.save()
            self.wait()
