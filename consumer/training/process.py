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
Trainer, the ring) is built first; then it takes its index's seat (common/lifecycle/seat.py),
and only then does it become drafter K: metrics port, checkpoint, tracker series,
row and journal. A warm standby (`--standby`) builds and attaches the same way,
precompiles its first step, and waits there for a drafter to die, so a takeover costs
the checkpoint load and a step, not the imports, the build and the compile. A drafter
started for its index precompiles while its checkpoint loads (`Resumed.load`).

This file keeps the assembly and the loop (`DrafterLoop`); the loop's parts are components of their own: the ring's
items onto the device (`Prefetcher`, consumer/training/ring_input.py), each item settled in the one order exactly once
rests on (`ItemAccount`, consumer/training/accounting.py), what a step reports (`StepReport`,
consumer/reporting/step_report.py), replica averaging (`Averaging`, consumer/training/replicas.py), the checkpoint
policy (`Checkpoints`, consumer/training/checkpoint_policy.py) and the LR schedule's length (`StepSchedule`,
consumer/training/trainer.py).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from dflash_ring.common.compile_cache import use_compile_cache
from dflash_ring.common.config.dump import dump_toml
from dflash_ring.common.config.schema import Config, drafter_target_settings
from dflash_ring.common.device import checked_device
from dflash_ring.common.config.data import DataConfig
from dflash_ring.common.config.drafter import DrafterConfig
from dflash_ring.common.gpu_metrics import device_uuid
from dflash_ring.common.layout import Role
from dflash_ring.common.lifecycle.ledger_events import DrafterStart, Evaluated, Exited, Trained
from dflash_ring.common.lifecycle.liveness import is_alive, lock_path
from dflash_ring.common.metrics import DRAFTER, DrafterMetrics, check_port_free
from dflash_ring.common.ring import ConsumerPort, SlotReader, fingerprint_digest
from dflash_ring.common.ring_spec import run_fingerprint_fields
from dflash_ring.common.lifecycle.role_process import RoleProcess, role_process
from dflash_ring.common.lifecycle.seat import Seat, take_seat
from dflash_ring.common.lifecycle.startup import Startup
from dflash_ring.common.config.target import TargetConfig
from dflash_ring.common.target_geometry import target_geometry
from dflash_ring.common.config.train import TrainConfig
from dflash_ring.common.lifecycle.trained_journal import Journal, drop_covered, journal_dir, seal
from dflash_ring.consumer.training.accounting import Consumed, ItemAccount
from dflash_ring.consumer.training.checkpoint import CheckpointStore, check_same_shape
from dflash_ring.consumer.training.checkpoint_policy import Checkpoints
from dflash_ring.consumer.modeling.fp8 import check_precision
from dflash_ring.consumer.modeling.head_cache import CACHE_NAME as HEAD_CACHE_NAME
from dflash_ring.consumer.modeling.head_loader import load_target_head
from dflash_ring.consumer.training.nonfinite import NonFiniteSteps
from dflash_ring.consumer.families.build import build_drafter
from dflash_ring.consumer.families import family
from dflash_ring.consumer.training.replica_group import fingerprint_fields
from dflash_ring.consumer.training.replicas import Averaging
from dflash_ring.consumer.training.ring_input import Prefetcher, ring_reading
from dflash_ring.consumer.reporting.source_metrics import SourceLabels
from dflash_ring.consumer.reporting.step_report import StepReport
from dflash_ring.consumer.modeling.target_head import FrozenTargetHead
from dflash_ring.consumer.reporting.tracking import RunRecord, Tracking, check_tracking_dir
from dflash_ring.consumer.training.trainer import DeviceBatch, StepSchedule, Trainer
from dflash_ring.consumer.training.warm_start import warm_start

log = logging.getLogger(__name__)


def target_config_dict(target_path: str) -> dict[str, Any]:
    path = Path(target_path) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"target.path {target_path!r} has no config.json: point it at a local HF model directory"
        )
    from dflash_ring.common.bounded_read import CONFIG_BYTES, read_text
    from dflash_ring.common.config.target import TargetConfigError

    return json.loads(read_text(path, CONFIG_BYTES, TargetConfigError, "target config"))


def resolve_drafter_config(drafter: DrafterConfig, target: TargetConfig) -> DrafterConfig:
    """The drafter's settings with the target's choices filled in (mask token, captured layers)."""
    geometry = target_geometry(target)  # a target it cannot read: its own TargetConfigError
    mask, layer_ids = drafter_target_settings(drafter, geometry)  # refusals are ConfigErrors: one line at the boundary
    return replace(drafter, mask_token_id=mask, target_layer_ids=layer_ids)


def pick_device(requested: str, index: int) -> torch.device:
    if requested != "auto":
        return checked_device(requested)
    if torch.cuda.is_available():
        return torch.device("cuda", index % torch.cuda.device_count())
    return torch.device("cpu")


class DrafterLoop:
    """Each batch from the ring: step, settle, report; then averaging and the checkpoint policy.

    The step is `Trainer.train_step`, or for a held-out item `Trainer.evaluate` (no gradient, no step). Settling
    (`ItemAccount.settle`) records the item and releases its slot, in the one order exactly once rests on; the report
    (`StepReport`) is what the metrics, the log and the trackers show of it. A held-out item's sums are kept in the
    record file before it is settled, so a drafter killed before the release leaves it READING and it is evaluated
    once, by whoever gets it redelivered.
    """

    def __init__(
        self,
        trainer: Trainer,
        account: ItemAccount,
        report: StepReport,
        averaging: Averaging,
        checkpoints: Checkpoints,
        schedule: StepSchedule,
    ):
        self.trainer, self.account, self.report = trainer, account, report
        self.averaging, self.checkpoints, self.schedule = averaging, checkpoints, schedule
        self.nonfinite = NonFiniteSteps(trainer.cfg)  # train.max_nonfinite_steps in a row: Diverged

    def take(self, taken: tuple[DeviceBatch, SlotReader]) -> None:
        """One item from the ring: evaluated if held out, else trained."""
        if taken[0].is_eval:
            self.evaluate(taken)
        else:
            self.train(taken)

    def evaluate(self, taken: tuple[DeviceBatch, SlotReader]) -> None:
        batch, slot = taken
        stats = self.trainer.evaluate(batch)
        self.report.held_out(batch, stats)
        self.account.settle(Evaluated, batch, slot, self.trainer.step)
        self.report.evaluated(stats)

    def train(self, taken: tuple[DeviceBatch, SlotReader]) -> None:
        batch, slot = taken
        total = self.schedule.total()
        before = self.trainer.micro_batches
        m = self.trainer.train_step(batch, total)
        # A micro-batch still accumulating goes into the next optimizer step: its journal line says so.
        held_by = self.trainer.step + (1 if self.trainer.accumulated else 0)
        self.account.settle(
            Trained, batch, slot, self.trainer.step, empty=self.trainer.micro_batches == before, held_by=held_by
        )
        self.report.trained(batch, m, total)
        if m is not None:  # an optimizer step (not a micro-batch of one still accumulating)
            self.nonfinite.watch(m.step, m.loss, m.grad_norm)  # reported first: the last bad step is in the curves
            self.averaging.after_step(m.step)
            self.checkpoints.after_step(m.step)


@dataclass
class Built:
    """What a drafter builds before it knows which replica it is: a warm standby builds it once and waits."""

    drafter_cfg: DrafterConfig
    target_config: dict[str, Any]
    head: FrozenTargetHead
    trainer: Trainer


def build(
    drafter: DrafterConfig,
    target: TargetConfig,
    train: TrainConfig,
    source_names: tuple[str, ...],
    compile_cache_dir: str,
    device: torch.device,
    head_cache: Path,
) -> Built:
    """The drafter's parts (`source_names`: data.source_names(), the labels of the per-source figures;
    `compile_cache_dir`: run.compile_cache_dir). The target's frozen head (2.5 GB at 8B width: reading it and
    copying it to the GPU release the GIL) is read on a thread while this one imports the compiler the trainer needs
    (~3-4 s on an H200 host): on a restart the two no longer add up."""
    t0 = time.perf_counter()
    drafter_cfg = resolve_drafter_config(drafter, target)
    target_config = target_config_dict(target.path)
    compiles = train.compile and device.type == "cuda"
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="head") as pool:
        # The head probe runs once per target; a restart reads its result (no modeling code imported).
        reading = pool.submit(
            load_target_head,
            target.path,
            dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
            device=device,
            cache=head_cache,
        )
        if compiles:
            use_compile_cache(
                compile_cache_dir,
                "drafter",
                {"drafter": asdict(drafter_cfg), "target": target_config, "attention": train.attention_for("cuda")},
            )
            import_compiler()
        t_imports = time.perf_counter()
        head = reading.result()
    log.debug(
        "target head read in %.2fs%s",
        time.perf_counter() - t0,
        f" (beside it, the compiler imported in {t_imports - t0:.2f}s)" if compiles else "",
    )
    torch.manual_seed(train.seed)  # the initial weights: reproducible, and equal across replicas
    with torch.device(device):  # initialised where it trains: an 8B-wide drafter takes ~10 s on a CPU
        model = build_drafter(drafter_cfg, target_config)
        family(drafter_cfg.arch).initialise(model, drafter_cfg)  # a resume, a warm start then load over it
    trainer = Trainer(model, head, drafter_cfg, train, device, SourceLabels(source_names))
    return Built(drafter_cfg, target_config, head, trainer)


class Resumed:
    """The checkpoint a drafter resumes from, loaded before its seat is its own and loaded again if that changed.

    A drafter started for its index loads its checkpoint before it attaches (a wrong one fails at once, not once a
    ring appears); a standby knows its index only when it takes one over. Whoever held the seat until then may
    have written newer checkpoints (a standby that had taken this index over): the resume is from the latest
    after the seat is taken, or the journal would not cover what lies between.
    """

    def __init__(self, checkpoint_dir: str, index: int, built: Built):
        """`checkpoint_dir`: train.checkpoint_dir, which holds drafter-<index>/."""
        self.store = CheckpointStore(Path(checkpoint_dir) / f"drafter-{index}")
        self.trainer, self.drafter_cfg, self.target_config = built.trainer, built.drafter_cfg, built.target_config
        # Where the first weights came from (drafter.init_from, consumer/training/warm_start.py): saved with every
        # checkpoint.
        self.warm_start: dict[str, str] | None = None
        self.consumed = Consumed()
        self.loaded: tuple[str, tuple[str, ...]] | None = None  # the store's contents when last loaded
        # When the state resumed from was taken (0.0: none, from the start; None: a checkpoint of a version that did
        # not save it): the ledger's `start` record carries it, what `reconcile` knows survived a killed predecessor.
        self.snapshot_t: float | None = 0.0

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
            self.snapshot_t = ckpt.info.get("snapshot_t")
            self.warm_start = ckpt.info.get("warm_start")
            log.info("resumed from %s (step %d)", ckpt.path, ckpt.step)
        elif self.drafter_cfg.init_from is not None and self.warm_start is None:  # the first start: once
            started = warm_start(self.trainer.model, self.drafter_cfg, self.target_config, self.drafter_cfg.init_from)
            self.warm_start = started.record()
            log.info("warm start from %s (%s, weights sha256 %s)", started.path, started.arch, started.weights_sha256)


def run_drafter(
    cfg: Config, indices: list[int], device_name: str | None, startup: Startup, standby: bool = False
) -> int:
    """Drafter `indices[0]`; with `standby`, a warm standby for every drafter of `indices`: built and attached, it
    takes over the first whose holder dies (common/lifecycle/seat.py), and exits 0 at the run's end if none does."""
    device = pick_device(device_name or cfg.train.device, indices[0])
    check_precision(cfg.drafter.precision, device)  # one line, before anything is built or joined
    check_tracking_dir(cfg.tracking_dir())  # fails here, before the model is built
    if not standby and not is_alive(lock_path(cfg.run.lock_dir(), Role.CONSUMER, indices[0])):
        # Nobody holds this drafter's seat, so nobody should hold its port: a taken one fails now, not after the
        # load. (When a live process holds the seat, it serves the port, and this one will wait as its standby.)
        check_port_free(cfg.metrics, DRAFTER, indices[0])
    with role_process(cfg, Role.CONSUMER, None, device_uuid(device), startup) as proc:
        # The head cache is per drafter directory; a standby reads (or writes) its first index's.
        built = build(
            cfg.drafter,
            cfg.target,
            cfg.train,
            cfg.data.source_names(),
            cfg.run.compile_cache_dir,
            device,
            Path(cfg.train.checkpoint_dir) / f"drafter-{indices[0]}" / HEAD_CACHE_NAME,
        )
        startup.mark("model")  # the target's frozen head, the drafter built on its device
        resumed = None
        if not standby:
            resumed = Resumed(cfg.train.checkpoint_dir, indices[0], built)
            resumed.load(beside=lambda: _precompile(cfg.data, built.trainer))
        startup.mark("checkpoint")  # read and verified; beside it, the first step precompiled
        ring = proc.attach(pin=True)  # after loading: a wrong model fails at once, not after a ring appears
        startup.mark("attach")
        if standby:  # compiled while nothing waits on it, so a takeover's first step is a step, not a compile
            _precompile(cfg.data, built.trainer)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # its activations' memory back to the drafters sharing the GPU
        startup.mark("precompile")
        seat = take_seat(ring, cfg.run.lock_dir(), Role.CONSUMER, indices, proc.stop, standby)
        if seat is None:
            log.info(
                "drafter %s: the run %s before %s",
                "standby" if standby else indices[0],
                "was stopped" if proc.stop.is_set() else "ended",
                "anything died" if standby else "its seat freed",
            )
            return 0
        startup.mark("standby")  # waiting for the seat (a drafter whose seat is free: no time)
        if standby:
            startup.what = f"drafter {seat.index}"
            log.warning(
                "standby (pid %d) takes over drafter %d, whose holder (pid %d) died",
                os.getpid(),
                seat.index,
                seat.predecessor_pid,
            )
            resumed = Resumed(cfg.train.checkpoint_dir, seat.index, built)
        proc.serve(seat.index)  # the index's port: free now that its seat is ours
        resumed.load()  # the latest the seat's last holder made durable (nothing new: nothing loaded again)
        startup.mark("takeover")
        run = RunRecord(cfg.run.name, dump_toml(cfg, full=True), fingerprint_digest(run_fingerprint_fields(cfg)).hex())
        with Tracking(cfg.tracking, cfg.tracking_dir(), seat.index, run) as tracking:
            train(cfg, seat, proc, built, resumed, tracking, startup)
    return 0


def import_compiler() -> None:
    """What torch.compile loads at the first compiled call (Dynamo, Inductor and their sympy), imported now."""
    import torch._dynamo  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401


def _precompile(data: DataConfig, trainer: Trainer) -> None:
    """The first step's compile ahead of the first item (Trainer.precompile), at the widths the producers batch to."""
    if seconds := trainer.precompile(data.max_tokens_per_batch, data.max_length):
        log.info("first step precompiled in %.2fs", seconds)


def train(
    cfg: Config, seat: Seat, proc: RoleProcess, built: Built, resumed: Resumed, tracking: Tracking, startup: Startup
) -> None:
    """Drafter `seat.index` from joining to its exit: the row, the journal, the loop, the final checkpoint."""
    index, trainer = seat.index, built.trainer
    metrics = DrafterMetrics(proc.registry)
    drafter_cfg, consumed = built.drafter_cfg, resumed.consumed
    me = proc.join("model loaded, ring attached", seat.lock)  # seals a dead predecessor's journal first
    port = proc.ring.consumer(me.row)
    journal = resume_journal(cfg.train.checkpoint_dir, index, port, trainer.step)
    checkpoints = Checkpoints(
        resumed.store,
        cfg.train.checkpoint_every_steps,
        cfg.train.keep_checkpoints,
        partial(
            consumed.saved_with,
            {
                "drafter": asdict(drafter_cfg),
                "target_config": built.target_config,
                "target_head": built.head.spec.to_json(),
                # where a DSpark export reads the target's embed_tokens/lm_head from
                "target_path": str(Path(cfg.target.path).expanduser().resolve()),
                "warm_start": resumed.warm_start,  # None: a fresh initialisation
            },
        ),
        trainer,
        journal,
        proc.ledger,
        background=cfg.train.async_checkpoints,
    )
    if proc.ledger is not None:
        proc.ledger.write(
            DrafterStart(trainer.step, seat.predecessor_pid if seat.takeover else None, resumed.snapshot_t)
        )
    averaging = Averaging.join(
        cfg.train.average_every_steps,
        cfg.topology.consumers,
        cfg.group,
        cfg.run.name,
        cfg.run.lock_dir(),
        index,
        trainer.model,
        partial(fingerprint_fields, drafter_cfg, cfg.target, cfg.train, cfg.group, trainer.model),
    )
    startup.mark("join")  # the row (a dead predecessor's slots undone), the replicas' weights caught up
    log.info(
        "drafter %d on %s: %d parameters, ring %s",
        index,
        trainer.device,
        sum(p.numel() for p in trainer.model.parameters()),
        proc.ring.name,
    )
    prefetch = Prefetcher(port, trainer.device, metrics, proc.ledger)
    report = StepReport(
        metrics, tracking, partial(ring_reading, port), cfg.train.log_every_steps, cfg.train.eval_every_steps
    )
    schedule = StepSchedule(
        trainer, cfg.train.total_steps, port, cfg.topology.producers, cfg.topology.consumers, prefetch.pending
    )
    loop = DrafterLoop(
        trainer,
        ItemAccount(consumed, journal, proc.ledger, port.release),
        report,
        averaging,
        checkpoints,
        schedule,
    )
    prefetch.start()
    while (taken := prefetch.next(proc.stop, me)) is not None:
        startup.mark("first_item")  # waited for and copied out of the ring
        loop.take(taken)
        if not taken[0].is_eval:  # a held-out item first is not the first step
            startup.finish("first_step", proc.ledger)  # the first training step (compiles, when it does)
    prefetch.stopping.set()
    averaging.leave_group()
    for taken in prefetch.leftovers():  # claimed already: train it, as the stop promises
        loop.take(taken)
    report.end(trainer.step)
    if flushed := trainer.flush(schedule.total()):
        log.info("the last %d micro-batch(es) of an unfinished accumulation applied as step %d", flushed, trainer.step)
    averaging.close(trainer.step)
    checkpoints.final()
    journal.close()
    log.info(
        "drafter %d done: %d steps, %d items; %s",
        index,
        trainer.step,
        consumed.items,
        "stopped by signal" if proc.stop.is_set() else "run finished",
    )
    if proc.ledger is not None:
        proc.ledger.write(Exited(trainer.step))


def resume_journal(checkpoint_dir: str, index: int, port: ConsumerPort, step: int) -> Journal:
    """This process's journal, resuming from checkpoint `step`. Joining sealed what a dead predecessor trained after
    the `latest` checkpoint; a resume that fell back to an older checkpoint (a damaged `latest`) seals what it
    trained after this one as well. Older segments are covered by the state resumed from."""
    directory = journal_dir(checkpoint_dir, index)
    seal(directory, step, port.identity.created_ns, port.unfinished_item_numbers(), mine=os.getpid())
    drop_covered(directory, step, os.getpid())
    return Journal(directory, port.identity.created_ns, step)
