"""The drafter-trainer process: claim ring items, train on them, checkpoint, exit on shutdown.

A prefetch thread claims the next item and copies it to the training device
while the current step runs. A slot goes back to the producers only once the
step that used it has returned: a drafter killed at any moment leaves what it
held READING, and the reaper hands it to another drafter (nothing in flight is
lost; a drafter holds at most two slots, the one training and the one
prefetched). Only the supervisor's shutdown ends the loop, never an empty ring.
SIGTERM finishes the current step, trains the one item already prefetched,
checkpoints, and exits 0.

What does not depend on which replica it is (the frozen head, the drafter, the
Trainer, the ring) is built first; then it takes its index's seat (common/seat.py),
and only then does it become drafter K: metrics port, checkpoint, tracker series,
row and journal. A warm standby (`--standby`) builds and attaches the same way,
precompiles its first step, and waits there for a drafter to die, so a takeover costs
the checkpoint load and a step, not the imports, the build and the compile. A drafter
started for its index precompiles while its checkpoint loads (`Resumed.load`).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from dflash_ring.common import sd_notify
from dflash_ring.common.compile_cache import use_compile_cache
from dflash_ring.common.config import (Config, GroupConfig, TopologyConfig, drafter_target_settings, dump_toml,
                                       fingerprint_digest)
from dflash_ring.common.device import checked_device
from dflash_ring.common.crash_points import crash_point
from dflash_ring.common.data_config import DataConfig
from dflash_ring.common.drafter_config import DrafterConfig
from dflash_ring.common.gpu_metrics import device_uuid
from dflash_ring.common.layout import Counter, Role
from dflash_ring.common.ledger import Ledger, identity
from dflash_ring.common.membership import Membership
from dflash_ring.common.liveness import is_alive, lock_path
from dflash_ring.common.metrics import DRAFTER, DrafterMetrics, check_port_free
from dflash_ring.common.ring import Ring, SlotReader
from dflash_ring.common.role_process import RoleProcess, role_process
from dflash_ring.common.seat import Seat, take_seat
from dflash_ring.common.slot_contract import read_item
from dflash_ring.common.slot_format import SlotFormatError
from dflash_ring.common.startup import Startup
from dflash_ring.common.target_config import TargetConfig
from dflash_ring.common.train_config import TrainConfig
from dflash_ring.common.trained_journal import Journal, drop_covered, journal_dir, seal
from dflash_ring.consumer.async_checkpoint import BackgroundWriter, HostSnapshot
from dflash_ring.consumer.checkpoint import CheckpointStore, check_same_shape
from dflash_ring.consumer.fp8 import check_precision
from dflash_ring.consumer.head_cache import CACHE_NAME as HEAD_CACHE_NAME
from dflash_ring.consumer.head_loader import load_target_head
from dflash_ring.consumer.model import build_drafter
from dflash_ring.consumer.replica_group import ReplicaGroup, fingerprint_fields
from dflash_ring.consumer.replicas import ReplicaAverager
from dflash_ring.consumer.source_metrics import SourceLabels, SourceStats, add_sources, held_out_sources
from dflash_ring.consumer.step_record import (RingReading, Window, eval_scalars, log_line, source_line,
                                              step_scalars)
from dflash_ring.consumer.target_head import FrozenTargetHead
from dflash_ring.consumer.tracking import RunRecord, Tracking, check_tracking_dir
from dflash_ring.consumer.trainer import DeviceBatch, Trainer

log = logging.getLogger(__name__)


def target_config_dict(target_path: str) -> dict[str, Any]:
    path = Path(target_path) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"target.path {target_path!r} has no config.json: point it at a local HF model directory")
    return json.loads(path.read_text())


def resolve_drafter_config(drafter: DrafterConfig, target: TargetConfig) -> DrafterConfig:
    """The drafter's settings with the target's choices filled in (mask token, captured layers)."""
    mask, layer_ids = drafter_target_settings(drafter, target)  # refusals are ConfigErrors: one line at the boundary
    return replace(drafter, mask_token_id=mask, target_layer_ids=layer_ids)


def pick_device(requested: str, index: int) -> torch.device:
    if requested != "auto":
        return checked_device(requested)
    if torch.cuda.is_available():
        return torch.device("cuda", index % torch.cuda.device_count())
    return torch.device("cpu")


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
        for x in (batch.features, batch.input_ids, batch.loss_mask, batch.cu_seqlens, batch.final_hidden,
                  batch.source_ids):
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

    def __init__(self, ring: Ring, row: int, device: torch.device, metrics: DrafterMetrics | None = None):
        super().__init__(name="prefetch", daemon=True)
        self.ring, self.row, self.device = ring, row, device
        self.metrics = metrics or DrafterMetrics()
        self.ledger: Ledger | None = None  # run.ledger_dir: one record per batch taken from the ring
        self.items: queue.Queue[tuple[DeviceBatch, SlotReader] | None] = queue.Queue()
        self.room = threading.Semaphore(1)
        self.stopping = threading.Event()
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def run(self) -> None:
        while not self.stopping.is_set():
            if not self.room.acquire(timeout=0.5):
                continue
            waited = self.ring.wait_seconds
            try:
                r = self.ring.claim(self.row, timeout_s=0.5)
            except SlotFormatError as e:
                log.error("%s", e)
                r = None
            self.metrics.wait.inc(self.ring.wait_seconds - waited)
            if r is None:
                self.room.release()
                if self.ring.shutting_down:
                    break
                continue
            t0 = time.perf_counter()
            batch = to_device(r, self.device, self.stream)
            self.metrics.h2d.observe(time.perf_counter() - t0)  # to_device returns once the copy landed
            if self.ledger is not None:
                self.ledger.write("got", item=r.item, deliveries=r.deliveries, **identity(r.meta))
            self.items.put((batch, r))
        self.items.put(None)

    def take(self, timeout_s: float) -> tuple[DeviceBatch, SlotReader] | None:
        """The next batch and the slot it came from (None at the end); raises queue.Empty on timeout."""
        taken = self.items.get(timeout=timeout_s)
        self.room.release()
        return taken


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


class Averaging:
    """Replica averaging every train.average_every_steps: with this host's replicas through shared memory,
    then (this host's leader) with the other hosts' leaders through the group."""

    def __init__(self, every: int, consumers: int, index: int, model: torch.nn.Module, lock_dir: Path,
                 run_name: str, group: GroupConfig, group_fields: dict[str, Any]):
        """`every`: train.average_every_steps; `consumers`: topology.consumers (this host's replicas); `group` and
        `group_fields` (replica_group.fingerprint_fields): the hosts' group, when it has a rendezvous."""
        self.every = every
        self.replicas, self.group = None, None
        caught = 0
        if consumers > 1 and self.every:
            self.replicas = ReplicaAverager(run_name, index, consumers, model, lock_dir)
            caught = self.replicas.catch_up()
        if group.rendezvous and self.every:  # other hosts: this host's leader meets them
            self.group = ReplicaGroup.named(group, run_name, index, model, lock_dir, group_fields,
                                            fresh=caught == 0)
            self.group.start()  # a restarted host takes the live hosts' weights before its first step

    def after_step(self, step: int) -> None:
        if not self.every or step % self.every:
            return
        if self.replicas is not None:
            self.replicas.publish(step)
            self.replicas.average()
        if self.group is not None and self.group.sync(step) and self.replicas is not None:
            self.replicas.publish(step)  # this host's other replicas take the group mean from here

    def leave_group(self) -> None:
        """At once on stop: a peer waiting on this host in a collective re-forms without it."""
        if self.group is not None:
            self.group.close()
            self.group = None

    def close(self, step: int) -> None:
        self.leave_group()
        if self.replicas is not None:
            self.replicas.publish(step)  # a restarted or late peer catches up from here
            self.replicas.close()


class Checkpoints:
    """The checkpoint policy: every train.checkpoint_every_steps, and once more at the end.

    With train.async_checkpoints (the default) a checkpoint costs the step only a copy of the state into host
    memory (`HostSnapshot`); a thread writes it while training goes on (`BackgroundWriter`), and its `ckpt`
    ledger record and log line come once it is durable. The consumed items and high-water marks are taken
    in the same call as the weights, so a resumed drafter's state is one moment's.

    Each checkpoint's state starts a new journal segment (common/trained_journal.py), and once it is durable the
    segments every kept checkpoint covers go: what the journal holds is exactly what a crash would lose.

    A checkpoint that comes due while the previous one is still being written waits for it rather than
    being skipped: a SIGKILL then loses at most two intervals of updates (since the last durable snapshot,
    plus the one being written: the bound `reconcile` checks), where skipping would stretch that without
    limit on a disk slower than the interval. The wait is logged: checkpoint_every_steps is shorter than a
    write takes. The final checkpoint, and any write in flight, are durable before `final` returns.
    """

    def __init__(self, store: CheckpointStore, every: int, keep: int, state: Callable[[], dict[str, Any]],
                 trainer: Trainer, journal: Journal, ledger: Ledger | None, background: bool = True):
        self.store, self.every, self.keep, self.state, self.trainer = store, every, keep, state, trainer
        self.journal, self.ledger = journal, ledger
        self.saved_at = trainer.step  # the step of the newest checkpoint taken (durable once `wait` returns)
        self.snapshot = HostSnapshot() if background else None
        self.writer = BackgroundWriter(store, keep) if background else None

    def save(self) -> None:
        info = self.state()
        taken_t = time.time()
        ckpt = self.trainer.state(info)
        step, items = ckpt.step, info["items"]
        self.journal.rotate(step)  # what trains from here on is not in this state
        if self.writer is None:
            self.store.save(ckpt, keep=self.keep, on_latest=lambda path: self._durable(path, step, items, taken_t))
        else:
            busy, t0 = self.writer.busy, time.perf_counter()
            self.writer.wait()  # the buffer is free only once the previous write is done (raises if it failed)
            if busy:
                log.warning("checkpoint at step %d waited %.1f s for the write of step %d: a write takes longer than "
                            "train.checkpoint_every_steps = %d steps", step, time.perf_counter() - t0,
                            self.saved_at, self.every)
            host = self.snapshot.take(ckpt)
            self.trainer.hold_updates(self.snapshot.copied)
            self.writer.start(host, self.snapshot.copied, lambda path: self._durable(path, step, items, taken_t))
        self.saved_at = step

    def _durable(self, path: Path, step: int, items: int, taken_t: float) -> None:
        self.journal.covered(self.store.oldest_step(keep=self.keep))
        if self.ledger is not None:
            self.ledger.write("ckpt", step=step, items=items, snapshot_t=round(taken_t, 4))
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
        if self.trainer.step != self.saved_at or self.store.load_latest() is None:
            self.save()
            self.wait()


class DrafterLoop:
    """Each batch from the ring: train, then what follows a step (its record to the metrics, the log and the
    trackers; averaging; checkpoint).

    A held-out item is evaluated instead (`Trainer.evaluate`: no gradient, no step), then released, so a
    drafter killed before that leaves it READING and it is evaluated once, by whoever gets it redelivered.
    Its per-source sums wait in `eval_sources` for the next multiple of train.eval_every_steps (and the
    end), where they become one evaluation record (`eval_scalars`), emitted like a step's.
    """

    def __init__(self, trainer: Trainer, consumed: Consumed, averaging: Averaging, checkpoints: Checkpoints,
                 metrics: DrafterMetrics, tracking: Tracking, total_steps: Callable[[], int],
                 read_ring: Callable[[], RingReading], log_every: int, ledger: Ledger | None,
                 release: Callable[[SlotReader], None], journal: Journal, eval_every: int = 100):
        self.trainer, self.consumed, self.averaging, self.checkpoints = trainer, consumed, averaging, checkpoints
        self.journal = journal
        self.metrics, self.tracking, self.total_steps = metrics, tracking, total_steps
        self.log_every, self.ledger, self.release, self.eval_every = log_every, ledger, release, eval_every
        self.window = Window(read_ring)
        self.unlogged: tuple[int, int, dict[str, float]] | None = None  # the newest step, when not logged
        # The held-out items since the last evaluation record, by batch identity: those a killed predecessor
        # evaluated (their sums in the record file, tracking.HELD_OUT) first, so a kill between two evaluation
        # records loses none of them, and one evaluated again (redelivered before its release) counts once.
        self.eval_sources: dict[str, SourceStats] = {}
        self.eval_seen: set[str] = set()
        for line in tracking.record.held_out:
            try:
                self._count_held_out(str(line["item"]), held_out_sources(line["sources"]))
            except (KeyError, TypeError, ValueError) as e:
                log.warning("tracking: a held-out line of %s is malformed (%s): left out of the next evaluation "
                            "record", tracking.record.f.name, " ".join(str(e).split()) or type(e).__name__)

    def take(self, taken: tuple[DeviceBatch, SlotReader]) -> None:
        """One item from the ring: evaluated if held out, else trained."""
        if taken[0].is_eval:
            self.evaluate(taken)
        else:
            self.train(taken)

    @property
    def eval_items(self) -> int:
        return len(self.eval_seen)

    def _count_held_out(self, item: str, stats: dict[str, SourceStats]) -> bool:
        if item in self.eval_seen:
            return False
        self.eval_seen.add(item)
        add_sources(self.eval_sources, stats)
        return True

    def evaluate(self, taken: tuple[DeviceBatch, SlotReader]) -> None:
        batch, slot = taken
        self.consumed.add(batch.meta)
        stats = self.trainer.evaluate(batch)
        item = json.dumps(identity(batch.meta), sort_keys=True)
        if self._count_held_out(item, stats):  # its sums kept before the release: a kill cannot lose them
            self.tracking.record.hold_out({"item": item, "sources": {n: asdict(s) for n, s in stats.items()}})
        if self.ledger is not None:  # before the release: a kill in between redelivers it (reconcile knows)
            self.ledger.write("eval", step=self.trainer.step, item=slot.item, deliveries=slot.deliveries,
                              **identity(batch.meta))
        crash_point("evaluated")
        self.release(slot)
        self.metrics.items.inc()
        self.metrics.eval_items.inc()
        self.metrics.count_source_tokens({name: s.tokens for name, s in stats.items()}, "eval")

    def report_eval(self) -> None:
        """The held-out items evaluated since the last report, as one record (nothing if there were none)."""
        if not self.eval_items:
            return
        record = eval_scalars(self.eval_sources, self.eval_items)
        # A restarted drafter's step at or below its series' last evaluation record has one already: these items
        # wait for the next step past it instead of being dropped with the record.
        if not self.tracking.emit(self.trainer.step, record):  # the record file and the trackers: the eval series
            return
        self.eval_sources, self.eval_seen = {}, set()
        self.metrics.publish_sources(record)
        text = (f"eval at step {self.trainer.step}: {int(record['eval/items'])} held-out items, loss "
                f"{record.get('eval/loss', float('nan')):.4f} acc {record.get('eval/accuracy', float('nan')):.3f} "
                f"accept_len {record.get('eval/accept_len', float('nan')):.2f}")
        log.info("%s; by source: %s", text, source_line(record, "eval/"))

    def train(self, taken: tuple[DeviceBatch, SlotReader]) -> None:
        batch, slot = taken
        self.consumed.add(batch.meta)
        total = self.total_steps()
        before = self.trainer.micro_batches
        m = self.trainer.train_step(batch, total)
        empty = self.trainer.micro_batches == before  # nothing to supervise: no update to lose
        if not empty:  # before the release: from then on only this line brings it back
            self.journal.append(batch.meta, slot.item)
        if self.ledger is not None:  # before the release: a kill in between redelivers it (reconcile knows)
            self.ledger.write("train", step=self.trainer.step, item=slot.item, deliveries=slot.deliveries,
                              **identity(batch.meta), **({"empty": True} if empty else {}))
        crash_point("trained")
        self.release(slot)  # trained: only now may the producers refill the slot
        self.metrics.items.inc()
        self.metrics.tokens.inc(batch.num_tokens)
        self.window.add(batch.num_tokens)
        if m is None:  # accumulating gradients
            return
        self.window.add_sources(m.by_source)
        self.metrics.count_source_tokens({name: s.tokens for name, s in m.by_source.items()}, "train")
        record = step_scalars(m, self.window.stats())
        self.metrics.publish(m.step, m.step_s, record)
        self.averaging.after_step(m.step)
        self.unlogged = (m.step, total, record)
        if m.step % self.log_every == 0:
            self.log_step()
        if m.step % self.eval_every == 0:
            self.report_eval()
        self.checkpoints.after_step(m.step)

    def log_step(self) -> None:
        """The newest step to the log, the record file and the trackers: every log_every_steps, and the last one
        at the end (a series ends where the drafter did)."""
        if self.unlogged is not None:
            step, total, record = self.unlogged
            log.info("%s", log_line(step, total, record))
            if any(k.startswith("source/") for k in record):
                log.info("step %d by source: %s", step, source_line(record))
            self.tracking.emit(step, record)  # the record file, then the trackers
            self.window.restart()
            self.unlogged = None


@dataclass
class Built:
    """What a drafter builds before it knows which replica it is: a warm standby builds it once and waits."""

    drafter_cfg: DrafterConfig
    target_config: dict[str, Any]
    head: FrozenTargetHead
    trainer: Trainer


def build(drafter: DrafterConfig, target: TargetConfig, train: TrainConfig, source_names: tuple[str, ...],
          compile_cache_dir: str, device: torch.device, head_cache: Path) -> Built:
    """`source_names`: data.source_names(), the labels of the per-source figures; `compile_cache_dir`:
    run.compile_cache_dir."""
    drafter_cfg = resolve_drafter_config(drafter, target)
    target_config = target_config_dict(target.path)
    # The head probe runs once per target; a restart reads its result (no modeling code imported).
    head = load_target_head(target.path, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                            device=device, cache=head_cache)
    if train.compile and device.type == "cuda":
        use_compile_cache(compile_cache_dir, "drafter",
                          {"drafter": asdict(drafter_cfg), "target": target_config,
                           "attention": train.attention_for("cuda")})
    torch.manual_seed(train.seed)  # the initial weights: reproducible, and equal across replicas
    with torch.device(device):  # initialised where it trains: an 8B-wide drafter takes ~10 s on a CPU
        model = build_drafter(drafter_cfg, target_config)
    trainer = Trainer(model, head, drafter_cfg, train, device, SourceLabels(source_names))
    return Built(drafter_cfg, target_config, head, trainer)


class Resumed:
    """The checkpoint a drafter resumes from, loaded before its seat is its own and loaded again if that changed.

    A drafter started for its index loads its checkpoint before it attaches (a wrong one fails at once, not once a
    ring appears); a standby knows its index only when it takes one over. Whoever held the seat until then may
    have written newer checkpoints (a standby that had taken this index over): the resume is from the latest
    after the seat is taken, or the journal would not cover what lies between.
    """

    def __init__(self, checkpoint_dir: str, index: int, trainer: Trainer, drafter_cfg: DrafterConfig):
        """`checkpoint_dir`: train.checkpoint_dir, which holds drafter-<index>/."""
        self.store = CheckpointStore(Path(checkpoint_dir) / f"drafter-{index}")
        self.trainer, self.drafter_cfg = trainer, drafter_cfg
        self.consumed = Consumed()
        self.loaded: tuple[str, tuple[str, ...]] | None = None  # the store's contents when last loaded

    def load(self, beside: Callable[[], None] | None = None) -> None:
        """The latest checkpoint into the trainer, unless the store is as it was at the last load. `beside` runs while
        the checkpoint is read, verified and copied to the device on another thread (page cache, hashing and copies
        release the GIL): a restarted drafter precompiles its first step there. The trainer takes the checkpoint only
        once `beside` has returned, so nothing it runs sees the weights change under it."""
        contents = self.store.contents()
        if contents == self.loaded:
            if beside is not None:
                beside()
            return
        self.loaded = contents
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint") as pool:
            reading = pool.submit(self.store.load_latest, device=self.trainer.device)
            if beside is not None:
                beside()
            ckpt = reading.result()
        if ckpt is not None:
            check_same_shape(ckpt, self.trainer.model, self.drafter_cfg.model_fields())  # either precision
            self.trainer.restore(ckpt)
            self.consumed = Consumed(ckpt.info.get("consumed", {}), int(ckpt.info.get("items", 0)))
            log.info("resumed from %s (step %d)", ckpt.path, ckpt.step)


def run_drafter(cfg: Config, indices: list[int], device_name: str | None, startup: Startup,
                standby: bool = False) -> int:
    """Drafter `indices[0]`; with `standby`, a warm standby for every drafter of `indices`: built and attached, it
    takes over the first whose holder dies (common/seat.py), and exits 0 at the run's end if none does."""
    device = pick_device(device_name or cfg.train.device, indices[0])
    check_precision(cfg.drafter.precision, device)  # one line, before anything is built or joined
    check_tracking_dir(cfg.tracking_dir())  # fails here, before the model is built
    if not standby and not is_alive(lock_path(cfg.lock_dir(), Role.CONSUMER, indices[0])):
        # Nobody holds this drafter's seat, so nobody should hold its port: a taken one fails now, not after the
        # load. (When a live process holds the seat, it serves the port, and this one will wait as its standby.)
        check_port_free(cfg.metrics, DRAFTER, indices[0])
    with role_process(cfg, Role.CONSUMER, None, device_uuid(device), startup) as proc:
        # The head cache is per drafter directory; a standby reads (or writes) its first index's.
        built = build(cfg.drafter, cfg.target, cfg.train, cfg.data.source_names(), cfg.run.compile_cache_dir, device,
                      Path(cfg.train.checkpoint_dir) / f"drafter-{indices[0]}" / HEAD_CACHE_NAME)
        startup.mark("model")  # the target's frozen head, the drafter built on its device
        resumed = None
        if not standby:
            resumed = Resumed(cfg.train.checkpoint_dir, indices[0], built.trainer, built.drafter_cfg)
            resumed.load(beside=lambda: _precompile(cfg.data, built.trainer))
        startup.mark("checkpoint")  # read and verified; beside it, the first step precompiled
        ring = proc.attach(pin=True)  # after loading: a wrong model fails at once, not after a ring appears
        startup.mark("attach")
        if standby:  # compiled while nothing waits on it, so a takeover's first step is a step, not a compile
            _precompile(cfg.data, built.trainer)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # its activations' memory back to the drafters sharing the GPU
        startup.mark("precompile")
        seat = take_seat(ring, cfg.lock_dir(), Role.CONSUMER, indices, proc.stop, standby)
        if seat is None:
            log.info("drafter %s: the run %s before %s", "standby" if standby else indices[0],
                     "was stopped" if proc.stop.is_set() else "ended", "anything died" if standby else "its seat freed")
            return 0
        startup.mark("standby")  # waiting for the seat (a drafter whose seat is free: no time)
        if standby:
            startup.what = f"drafter {seat.index}"
            log.warning("standby (pid %d) takes over drafter %d, whose holder (pid %d) died", os.getpid(), seat.index,
                        seat.predecessor_pid)
            resumed = Resumed(cfg.train.checkpoint_dir, seat.index, built.trainer, built.drafter_cfg)
        proc.serve(seat.index)  # the index's port: free now that its seat is ours
        resumed.load()  # the latest the seat's last holder made durable (nothing new: nothing loaded again)
        startup.mark("takeover")
        run = RunRecord(cfg.run.name, dump_toml(cfg, full=True), fingerprint_digest(cfg.fingerprint_fields()).hex())
        with Tracking(cfg.tracking, cfg.tracking_dir(), seat.index, run) as tracking:
            train(cfg, seat, proc, built, resumed, tracking, startup)
    return 0


def _precompile(data: DataConfig, trainer: Trainer) -> None:
    """The first step's compile ahead of the first item (Trainer.precompile), at the widths the producers batch to."""
    if seconds := trainer.precompile(data.max_tokens_per_batch, data.max_length):
        log.info("first step precompiled in %.2fs", seconds)


def train(cfg: Config, seat: Seat, proc: RoleProcess, built: Built, resumed: Resumed, tracking: Tracking,
          startup: Startup) -> None:
    """Drafter `seat.index` from joining to its exit: the row, the journal, the loop, the final checkpoint."""
    index, trainer, ring = seat.index, built.trainer, proc.ring
    metrics = DrafterMetrics(proc.registry)
    drafter_cfg, consumed = built.drafter_cfg, resumed.consumed
    me = proc.join("model loaded, ring attached", seat.lock)  # seals a dead predecessor's journal first
    journal = resume_journal(cfg.train.checkpoint_dir, index, ring, trainer.step)
    checkpoints = Checkpoints(resumed.store, cfg.train.checkpoint_every_steps, cfg.train.keep_checkpoints,
                              lambda: {"consumed": consumed.by_producer, "items": consumed.items,
                                       "drafter": asdict(drafter_cfg), "target_config": built.target_config,
                                       "target_head": built.head.spec.to_json(),
                                       # where a DSpark export reads the target's embed_tokens/lm_head from
                                       "target_path": str(Path(cfg.target.path).expanduser().resolve())},
                              trainer, journal, proc.ledger, background=cfg.train.async_checkpoints)
    if proc.ledger is not None:
        proc.ledger.write("start", step=trainer.step, **({"took_over": seat.predecessor_pid} if seat.takeover else {}))
    averaging = Averaging(cfg.train.average_every_steps, cfg.topology.consumers, index, trainer.model, cfg.lock_dir(),
                          cfg.run.name, cfg.group,
                          fingerprint_fields(drafter_cfg, cfg.target, cfg.train, cfg.group, trainer.model))
    startup.mark("join")  # the row (a dead predecessor's slots undone), the replicas' weights caught up
    log.info("drafter %d on %s: %d parameters, ring %s", index, trainer.device,
             sum(p.numel() for p in trainer.model.parameters()), ring.name)
    prefetch = Prefetcher(ring, me.row, trainer.device, metrics)
    prefetch.ledger = proc.ledger
    loop = DrafterLoop(trainer, consumed, averaging, checkpoints, metrics, tracking,
                       lambda: cfg.train.total_steps or _estimated_steps(ring, cfg.topology, cfg.train.grad_accum,
                                                                         trainer, _prefetched(prefetch)),
                       lambda: RingReading(ring.wait_seconds, ring.counter(Counter.PRODUCED),
                                           ring.produced_tokens(), ring.slot_counts()["ready"]),
                       cfg.train.log_every_steps, proc.ledger, ring.release, journal, cfg.train.eval_every_steps)
    prefetch.start()
    while (taken := _next(prefetch, proc.stop, me)) is not None:
        startup.mark("first_item")  # waited for and copied out of the ring
        loop.take(taken)
        if not taken[0].is_eval:  # a held-out item first is not the first step
            startup.finish("first_step", proc.ledger)  # the first training step (compiles, when it does)
    prefetch.stopping.set()
    averaging.leave_group()
    for taken in _leftovers(prefetch):  # claimed already: train it, as the stop promises
        loop.take(taken)
    loop.log_step()
    loop.report_eval()
    if flushed := trainer.flush(loop.total_steps()):
        log.info("the last %d micro-batch(es) of an unfinished accumulation applied as step %d", flushed,
                 trainer.step)
    averaging.close(trainer.step)
    checkpoints.final()
    journal.close()
    log.info("drafter %d done: %d steps, %d items; %s", index, trainer.step, consumed.items,
             "stopped by signal" if proc.stop.is_set() else "run finished")
    if proc.ledger is not None:
        proc.ledger.write("exit", step=trainer.step)


def resume_journal(checkpoint_dir: str, index: int, ring: Ring, step: int) -> Journal:
    """This process's journal, resuming from checkpoint `step`. Joining sealed what a dead predecessor trained after
    the `latest` checkpoint; a resume that fell back to an older checkpoint (a damaged `latest`) seals what it
    trained after this one as well. Older segments are covered by the state resumed from."""
    directory = journal_dir(checkpoint_dir, index)
    seal(directory, step, ring.identity.created_ns, ring.unfinished_item_numbers(), mine=os.getpid())
    drop_covered(directory, step, os.getpid())
    return Journal(directory, ring.identity.created_ns, step)


def _next(prefetch: Prefetcher, stop: threading.Event, me: Membership) -> tuple[DeviceBatch, SlotReader] | None:
    while not stop.is_set():
        me.heartbeat()
        sd_notify.watchdog()
        try:
            return prefetch.take(0.5)
        except queue.Empty:
            continue
    return None


def _leftovers(prefetch: Prefetcher) -> list[tuple[DeviceBatch, SlotReader]]:
    """Batches the prefetcher had taken when a stop came (at most one)."""
    prefetch.join()
    out = []
    while True:
        try:
            batch = prefetch.items.get_nowait()
        except queue.Empty:
            return out
        if batch is not None:
            out.append(batch)


def _prefetched(prefetch: Prefetcher) -> int:
    """Batches taken from the ring and waiting to train (not held-out ones, nor the end-of-run None)."""
    return sum(b is not None and not b[0].is_eval for b in list(prefetch.items.queue))


def _estimated_steps(ring: Ring, topology: TopologyConfig, grad_accum: int, trainer: Trainer, pending: int) -> int:
    """Optimizer steps this drafter will have taken at the run's end, counting the batch about to train.

    Drafters take items as they come, so an even split of the plan (planned // consumers) was off by
    however unevenly they got them: `step 170/167`, and an LR schedule that ended early. Instead: steps so
    far, plus this batch, the one prefetched (`pending`) and an even share of the items no drafter has
    taken yet. Re-estimated every step, it reaches the exact final step as the ring runs dry (who takes the
    last few items is a race, so per drafter it cannot be known earlier). A producer that has not announced
    its plan yet counts as planning what the others do.

    Held-out items take no step: the items left are counted at the plans' share of training items (held-out
    batches are spread evenly through every epoch, so what is left holds about that share too, and the
    estimate is still exact as the ring runs dry); a prefetched held-out item is not counted in `pending`.
    """
    rows = ring.rows()
    producers = rows["role"] == Role.PRODUCER
    plans = rows["planned_items"][producers]
    announced = int((plans > 0).sum())
    if announced == 0:
        return max(1, trainer.step + 1)
    planned = int(plans.sum()) * topology.producers // announced
    training_share = 1.0 - int(rows["planned_eval_items"][producers].sum()) / int(plans.sum())
    # Released (trained) items are counted; claimed ones (READING: this batch, the prefetched ones, and what other
    # drafters are training) will be trained by their holders, so they are not shared out again.
    left = max(0, planned - ring.counter(Counter.CONSUMED) - ring.slot_counts()["reading"])
    # Rounded down: the last few items race, the other drafters take them.
    share = int(left * training_share) // topology.consumers
    micro = trainer.accumulated + 1 + pending + share  # micro-batches still to train
    return max(trainer.step + 1, trainer.step + micro // grad_accum)
