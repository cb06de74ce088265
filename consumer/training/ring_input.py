"""The drafter's data loader: ring items onto the training device, one ahead of the step.

The mirror of the producer's `Loader` and `SlotFiller` (producer/process.py). A prefetch thread claims the next item
and copies it to the device while the current step runs; the slot stays claimed until the step that used it has
returned and the item is settled (consumer/training/accounting.py), so a drafter killed at any moment leaves what it
held READING, for the reaper to hand to another drafter.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import torch

from dflash_ring.common.lifecycle import sd_notify
from dflash_ring.common.layout import Counter
from dflash_ring.common.lifecycle.ledger import Ledger
from dflash_ring.common.lifecycle.ledger_events import BatchIdentity, Got
from dflash_ring.common.lifecycle.membership import Membership
from dflash_ring.common.metrics import DrafterMetrics
from dflash_ring.common.ring import ConsumerPort, SlotReader
from dflash_ring.common.slot_contract import read_item
from dflash_ring.common.slot_format import SlotFormatError
from dflash_ring.consumer.reporting.step_record import RingReading
from dflash_ring.consumer.training.trainer import DeviceBatch

log = logging.getLogger(__name__)


def to_device(r: SlotReader, device: torch.device, stream: torch.cuda.Stream | None) -> DeviceBatch:
    """Copy one slot's tensors to the device; returns once the copy has landed (the slot may then go)."""
    t = read_item(r.tensors, r.meta)
    with torch.cuda.stream(stream) if stream is not None else _null():
        batch = DeviceBatch(
            features=t.features.to(device, non_blocking=True),
            input_ids=t.input_ids.to(device, dtype=torch.long, non_blocking=True),
            loss_mask=t.loss_mask.to(device, dtype=torch.bool, non_blocking=True),
            cu_seqlens=t.cu_seqlens.to(device, dtype=torch.long, non_blocking=True),
            final_hidden=None if t.final_hidden is None else t.final_hidden.to(device, non_blocking=True),
            meta=t.meta,
            source_ids=t.source_ids.to(device, dtype=torch.long, non_blocking=True),
        )
    if stream is not None:
        stream.synchronize()
        # Allocated on the side stream, used on the default one: keep the allocator from reusing them early.
        for x in (
            batch.features,
            batch.input_ids,
            batch.loss_mask,
            batch.cu_seqlens,
            batch.final_hidden,
            batch.source_ids,
        ):
            if x is not None:
                x.record_stream(torch.cuda.default_stream(device))
    elif device.type == "cpu":  # .to(cpu) aliases the slot: take a private copy
        batch.features, batch.input_ids = batch.features.clone(), batch.input_ids.clone()
        if batch.final_hidden is not None:
            batch.final_hidden = batch.final_hidden.clone()
    return batch


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class Prefetcher(threading.Thread):
    """Claims the next item and copies it to the device while the current step computes.

    At most one item is prefetched ahead (`room`). Its slot stays claimed until it is trained (`take`
    hands out the reader with the batch, and the training loop releases it).
    """

    def __init__(
        self,
        port: ConsumerPort,
        device: torch.device,
        metrics: DrafterMetrics | None = None,
        ledger: Ledger | None = None,
    ):
        super().__init__(name="prefetch", daemon=True)
        self.port, self.device = port, device
        self.metrics = metrics or DrafterMetrics()
        self.ledger = ledger  # run.ledger_dir: one record per batch taken from the ring
        self.items: queue.Queue[tuple[DeviceBatch, SlotReader] | None] = queue.Queue()
        self.room = threading.Semaphore(1)
        self.stopping = threading.Event()
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def run(self) -> None:
        while not self.stopping.is_set():
            if not self.room.acquire(timeout=0.5):
                continue
            waited = self.port.wait_seconds
            try:
                r = self.port.claim(timeout_s=0.5)
            except SlotFormatError as e:
                log.error("%s", e)
                r = None
            self.metrics.wait.inc(self.port.wait_seconds - waited)
            if r is None:
                self.room.release()
                if self.port.shutting_down:
                    break
                continue
            t0 = time.perf_counter()
            batch = to_device(r, self.device, self.stream)
            self.metrics.h2d.observe(time.perf_counter() - t0)  # to_device returns once the copy landed
            if self.ledger is not None:
                self.ledger.write(Got(r.item, r.deliveries, BatchIdentity.of(r.meta)))
            self.items.put((batch, r))
        self.items.put(None)

    def take(self, timeout_s: float) -> tuple[DeviceBatch, SlotReader] | None:
        """The next batch and the slot it came from (None at the end); raises queue.Empty on timeout."""
        taken = self.items.get(timeout=timeout_s)
        self.room.release()
        return taken

    def next(self, stop: threading.Event, me: Membership) -> tuple[DeviceBatch, SlotReader] | None:
        """The next batch, beating the row's heartbeat and systemd's watchdog while it waits; None on stop or at the
        end."""
        while not stop.is_set():
            me.heartbeat()
            sd_notify.watchdog()
            try:
                return self.take(0.5)
            except queue.Empty:
                continue
        return None

    def leftovers(self) -> list[tuple[DeviceBatch, SlotReader]]:
        """Batches taken when a stop came (at most one), once the thread has ended (`stopping` set first)."""
        self.join()
        out = []
        while True:
            try:
                batch = self.items.get_nowait()
            except queue.Empty:
                return out
            if batch is not None:
                out.append(batch)

    def pending(self) -> int:
        """Batches taken from the ring and waiting to train (not held-out ones, nor the end-of-run None)."""
        return sum(b is not None and not b[0].is_eval for b in list(self.items.queue))


def ring_reading(port: ConsumerPort) -> RingReading:
    """What the step's record shows of the ring (consumer/reporting/step_record.py: Window)."""
    return RingReading(
        port.wait_seconds, port.counter(Counter.PRODUCED), port.produced_tokens(), port.slot_counts()["ready"]
    )
