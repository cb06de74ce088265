"""`dflash-ring target`: one producer process, running the frozen target on its shard into the ring.

    loader thread:  batch n+1 -> host tensors (pinned on a GPU host)
    main thread:    launch the forward of batch n   (asynchronous on a GPU)
                    publish batch n-1 once its copy has landed   (the copy overlapped forward n)
                    claim a slot (waits while the ring is full; never drops)
                    queue batch n's D2H copy on a side stream straight into the slot

The slot is registered with CUDA (Ring.attach(pin=True)), so the copy is one DMA at PCIe speed
with no pageable staging buffer, and the compute stream never waits for it. On the CPU every step
is synchronous and a batch is published as soon as it is written.

Resume. `publish` commits the batch's cursor in the ring's process table, so a restarted producer
continues after its last published batch (a batch whose slot was reclaimed unpublished is redone).
The same cursor goes to a file in target.state_dir after each publish, for when the ring itself
is gone; the ring's record wins. Whoever removes a ring first writes the items still in it into
that file's replay list (common/lifecycle/resume_state.py), and a producer publishes those first: a run
stopped at any moment loses nothing. At the end of the shard the file holds the end (a drained run
started again must not redo a finished shard); the supervisor removes it once the run is complete.

The process, after it attaches, as the drafter's is (consumer/training/process.py): `build` (the data, the target in its
batch layout, the shard's batcher: interruptible, before the row is taken), `resume` (the plan in the row, the
resume point, the replay list) and `publish_shard` (the publish loop, which checks the stop flag itself).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from pathlib import Path
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial

import numpy as np
import posix_ipc
import torch
from transformers import PreTrainedTokenizerBase

from dflash_ring.common.lifecycle import sd_notify
from dflash_ring.common.compile_cache import use_compile_cache
from dflash_ring.common.host_bounds import check_num_proc
from dflash_ring.common.config.schema import Config, RingConfig
from dflash_ring.common.chat_encoding import mask_token_refusal
from dflash_ring.common.config.target import TargetConfig, TargetConfigError
from dflash_ring.common.target_geometry import target_geometry
from dflash_ring.common.tokenizer_loading import check_token_ids
from dflash_ring.common.gpu_metrics import device_uuid
from dflash_ring.common.layout import Role
from dflash_ring.common.lifecycle.ledger_events import ProducerStart, ShardDone
from dflash_ring.common.lifecycle.ledger import Ledger
from dflash_ring.common.lifecycle.resume_state import CursorFile, ResumeState, cursor_path
from dflash_ring.common.metrics import DeviceSpan, ProducerMetrics
from dflash_ring.common.ring import ProducerPort, SlotWriter
from dflash_ring.common.lifecycle.role_process import RoleProcess, StopSignal, role_process
from dflash_ring.common.slot_contract import FEATURES, FINAL_HIDDEN, HOST_TENSORS, META_KEYS, check_fits, item_tensors
from dflash_ring.common.lifecycle.startup import Startup

from .accounting import PublishAccount
from .batching import Batch, ShardBatcher
from .live_replay import LiveReplay
from .conformance import choose_packing
from .probe_cache import cached_probe
from .data_stats import DataStats, data_stats, log_lines
from .pretokenized import SourceData, load_sources, target_tokenizer
from .resume import check_resume_point, replays_after_the_end, resume_point, resumed_batches
from .target import TargetModel, TargetOutput, resolve_device, resolve_dtype
from .tensor_group import TensorGroup, check_group

log = logging.getLogger(__name__)

LOG_EVERY_S = 30.0


# ---- slot format --------------------------------------------------------------------------------


def check_slot_fits(
    ring: RingConfig, max_tokens_per_batch: int, feature_width: int, final_hidden: int | None, dtype: torch.dtype
) -> None:
    """The largest batch (data.max_tokens_per_batch) of a target's features (`final_hidden`: the width of the final
    hidden state when shipped) fits a slot of `ring`. Numbers, not the loaded model, so that check-config runs this
    very check from the target's config.json before a run."""
    check_fits(ring.slot_bytes, ring.slot_header_bytes, max_tokens_per_batch, feature_width, final_hidden, dtype)


def check_mask_token(cfg: Config, tokenizer: PreTrainedTokenizerBase) -> None:
    """The mask token (drafter.mask_token_id, else target.mask_token_id) against the target's tokenizer: a token the
    data or the chat template uses is refused in one line. A function of its own so that check-config runs it too."""
    mask = cfg.drafter.mask_token_id if cfg.drafter.mask_token_id is not None else cfg.target.mask_token_id
    if mask is not None and (why := mask_token_refusal(tokenizer, mask, target_geometry(cfg.target).vocab_size)):
        raise TargetConfigError(why)


# ---- loader -----------------------------------------------------------------------------------


@dataclass
class Prepared:
    """A batch with its model inputs as host tensors, ready for a non-blocking H2D copy."""

    batch: Batch
    inputs: dict[str, torch.Tensor]
    cu_seqlens: list[int]


def prepare(batch: Batch, *, packed: bool, pad_id: int, pin: bool) -> Prepared:
    if packed:
        starts = np.repeat(batch.cu_seqlens[:-1], batch.lengths)
        arrays = {
            "input_ids": batch.input_ids.astype(np.int64),
            "position_ids": np.arange(batch.num_tokens, dtype=np.int64) - starts,
            "cu_seqlens": batch.cu_seqlens,
        }
    else:
        ids, mask, _ = batch.padded(pad_id)
        arrays = {
            "input_ids": ids.astype(np.int64),
            "attention_mask": mask.astype(np.int64),
            "token_index": np.flatnonzero(mask),
        }
    inputs = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in arrays.items()}
    if pin:
        inputs = {k: v.pin_memory() for k, v in inputs.items()}
    return Prepared(batch, inputs, batch.cu_seqlens.tolist())


class Loader:
    """Prepares the next batches on a thread, so the GPU never waits on numpy gathers."""

    def __init__(self, batches: Iterator[Batch], prepare_fn: Callable[[Batch], Prepared], depth: int = 2):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._fill, args=(batches, prepare_fn), name="loader", daemon=True)
        self._thread.start()

    def _fill(self, batches: Iterator[Batch], prepare_fn: Callable[[Batch], Prepared]) -> None:
        try:
            for batch in batches:
                if not self._put(prepare_fn(batch)):
                    return
            self._put(None)
        except BaseException as e:  # handed to the main thread, which raises it
            self._put(e)

    def _put(self, item: object) -> bool:
        while not self._closed.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def __iter__(self) -> Iterator[Prepared]:
        while (item := self._queue.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=10)


# ---- forward and writer -------------------------------------------------------------------------


def run_target(target: TargetModel, prep: Prepared) -> TargetOutput:
    """Launch the forward; on a GPU this returns as soon as the kernels are queued."""
    inputs = {k: v.to(target.device, non_blocking=True) for k, v in prep.inputs.items()}
    if target.packed:
        return target.forward_packed(inputs["input_ids"], inputs["position_ids"], inputs["cu_seqlens"], prep.cu_seqlens)
    return target.forward_padded(inputs["input_ids"], inputs["attention_mask"], inputs["token_index"])


@dataclass
class InFlight:
    """A claimed slot whose feature copy may still be running; `output` stays alive until it lands."""

    writer: SlotWriter
    batch: Batch
    output: TargetOutput
    copied: torch.cuda.Event | None
    copy_span: DeviceSpan | None = None
    target_span: DeviceSpan | None = None  # the forward that made `output`, read once the copy landed


class SlotFiller:
    """Writes one batch into a claimed slot: ids from host memory, features by DMA on a side stream."""

    def __init__(self, index: int, device: torch.device, source_names: tuple[str, ...]):
        self.index, self.source_names = index, list(source_names)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def fill(self, w: SlotWriter, batch: Batch, out: TargetOutput) -> InFlight:
        f = out.features
        hidden = out.final_hidden.shape[1] if out.final_hidden is not None else None
        views = {
            name: w.tensor(name, dtype, shape)
            for name, dtype, shape in item_tensors(batch.num_tokens, len(batch.lengths), f.shape[1], hidden, f.dtype)
        }
        for name in HOST_TENSORS:
            views[name].copy_(torch.from_numpy(getattr(batch, name)))
        w.meta = dict(
            zip(
                META_KEYS,
                (
                    self.index,
                    batch.epoch,
                    batch.position,
                    batch.num_tokens,
                    len(batch.lengths),
                    self.source_names,
                    batch.eval,
                ),
                strict=True,
            )
        )
        device_out = [(FEATURES, f)] + ([(FINAL_HIDDEN, out.final_hidden)] if hidden is not None else [])
        if self.stream is None:
            span = DeviceSpan(f.device)
            for name, t in device_out:
                views[name].copy_(t)
            return InFlight(w, batch, out, None, span.end())
        self.stream.wait_stream(torch.cuda.current_stream(f.device))
        with torch.cuda.stream(self.stream):
            span = DeviceSpan(f.device, self.stream)
            for name, t in device_out:
                views[name].copy_(t, non_blocking=True)
            span.end(self.stream)
            copied = torch.cuda.Event()
            copied.record(self.stream)
        return InFlight(w, batch, out, copied, span)


@dataclass
class Stats:
    batches: int = 0
    tokens: int = 0
    padded_tokens: int = 0  # rows x width of padded batches; equals tokens when packed
    started: float = 0.0

    def add(self, batch: Batch) -> None:
        self.batches += 1
        self.tokens += batch.num_tokens
        self.padded_tokens += round(batch.num_tokens / (1.0 - batch.padding_fraction))

    @property
    def padding_fraction(self) -> float:
        return 1.0 - self.tokens / self.padded_tokens if self.padded_tokens else 0.0


class Producer:
    """The main loop: one batch in the forward, the previous one's copy landing, at most one slot held."""

    def __init__(
        self,
        port: ProducerPort,
        index: int,
        target: TargetModel,
        *,
        stop: threading.Event,
        account: PublishAccount | None = None,
        metrics: ProducerMetrics | None = None,
        source_names: tuple[str, ...] = ("data",),
        startup: Startup | None = None,
    ):
        self.port, self.target = port, target
        self.source_names = source_names  # Batch.source_ids index these
        self.stop = stop
        self.account = account or PublishAccount(self.port)
        self.startup = startup  # finished by the first publish
        self.metrics = metrics or ProducerMetrics()
        self.filler = SlotFiller(index, target.device, source_names)
        self.stats = Stats()
        self._logged = 0.0

    def run(self, prepared: Iterable[Prepared]) -> bool:
        """Publish every batch; True when all were published, False on stop, drain or shutdown."""
        self.stats.started = self._logged = time.monotonic()
        in_flight: InFlight | None = None
        try:
            for prep in prepared:
                if self.stop.is_set():
                    return False
                forward = DeviceSpan(self.target.device)
                out = run_target(self.target, prep)
                forward.end()
                if in_flight is not None:
                    self._publish(in_flight)
                    in_flight = None
                w = self._acquire()
                if w is None:
                    return False
                in_flight = self.filler.fill(w, prep.batch, out)
                in_flight.target_span = forward
                if in_flight.copied is None:
                    self._publish(in_flight)
                    in_flight = None
            return True
        except BaseException:
            if in_flight is not None:
                self._abort(in_flight)
                in_flight = None
            raise
        finally:
            if in_flight is not None:
                self._publish(in_flight)  # a finished forward on stop: keep it
            self._log()

    def _acquire(self) -> SlotWriter | None:
        """A slot, waiting while the ring is full; None on drain, shutdown or our own stop signal."""
        while not self.stop.is_set():
            sd_notify.watchdog()
            waited = self.port.wait_seconds
            try:
                w = self.port.acquire(timeout_s=1.0)
            except posix_ipc.SignalError:  # our SIGTERM handler ran inside the semaphore wait
                continue
            finally:
                self.metrics.blocked.inc(self.port.wait_seconds - waited)
            if w is not None or self.port.draining or self.port.shutting_down:
                return w
        return None

    def _publish(self, f: InFlight) -> None:
        if f.copied is not None:
            f.copied.synchronize()
        b = f.batch
        self.account.publish(f.writer, b)
        self.port.heartbeat()
        self.stats.add(f.batch)
        m = self.metrics
        m.tokens.inc(f.batch.num_tokens)
        if not b.eval:  # held-out rows are evaluated, never trained
            for name, trained in zip(self.source_names, b.trained_by_source(len(self.source_names)).tolist()):
                m.source_trained.labels(name).inc(trained)
        if f.copy_span is not None:
            m.d2h.observe(f.copy_span.seconds())
        if f.target_span is not None:
            m.step.observe(f.target_span.seconds())
        m.items.inc()  # once it matches the ring's count, the item's other numbers are in
        if self.startup is not None:  # last: a scrape that shows it shows this item's numbers too
            self.startup.finish("first_publish", self.account.ledger)  # resume point, loader, first forward and copy
        if time.monotonic() - self._logged > LOG_EVERY_S:
            self._log()

    def _abort(self, f: InFlight) -> None:
        if f.copied is not None:
            f.copied.synchronize()  # no DMA may still write into a slot handed back
        self.port.abort(f.writer)

    def _log(self) -> None:
        self._logged = time.monotonic()
        s, elapsed = self.stats, max(self._logged - self.stats.started, 1e-9)
        log.info(
            "published %d batches, %d tokens (%.0f tokens/s), %.1fs waiting on a full ring, padding %.1f%%",
            s.batches,
            s.tokens,
            s.tokens / elapsed,
            self.port.wait_seconds,
            100 * s.padding_fraction,
        )


# ---- the process ------------------------------------------------------------------------------


def serve_replays(
    producer: Producer,
    replay: LiveReplay,
    batcher: ShardBatcher,
    epochs: int,
    load: Callable[[Iterator[Batch]], Loader],
    stop: threading.Event,
) -> Loader | None:
    """After the shard: publish each replay that joins the list, until shutdown, drain or a stop signal. The
    supervisor ends the run only once nothing is owed (supervisor/owed.py), so a drafter that dies near the end
    still has its lost batches produced again. Returns the last loader (for the caller to close)."""
    port, loader = producer.port, None
    while not (stop.is_set() or port.shutting_down or port.draining):
        port.heartbeat()
        sd_notify.watchdog()
        replay.poll()
        done = port.committed_replayed()
        if replay.pending:
            loader = load(replays_after_the_end(batcher, replay, done, epochs))
            producer.run(loader)
            loader.close()
            replay.finish(epochs)
        else:
            time.sleep(0.2)
    return loader


def run_producer(cfg: Config, index: int, device_name: str | None, startup: Startup) -> int:
    """Produce shard `index` of topology.producers; 0 when finished or stopped cleanly."""
    device = resolve_device(device_name or cfg.target.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    check_group(cfg.target, device)  # target.tensor_parallel against the target and this host, before any wait
    check_num_proc(cfg.data.num_proc)  # data.num_proc against this host's cores, before any wait
    with role_process(cfg, Role.PRODUCER, index, device_uuid(device), startup) as proc:
        metrics = ProducerMetrics(proc.registry)
        proc.attach(pin=device.type == "cuda")  # a mismatched config fails before any loading
        startup.mark("attach")  # metrics port, and the wait for the supervisor's ring
        try:
            with TensorGroup.held(cfg.target, device, proc.interruptible) as group:
                return _produce(cfg, index, device, group, proc, metrics, startup)
        except StopSignal as e:  # in a phase that never looks at the stop flag: it unwound instead
            log.info("stopped by %s while starting (before the first publish)", e)
            return 0


def _produce(
    cfg: Config,
    index: int,
    device: torch.device,
    group: TensorGroup | None,
    proc: RoleProcess,
    metrics: ProducerMetrics,
    startup: Startup,
) -> int:
    """The producer after `attach`: loading and planning are interruptible (`RoleProcess.interruptible`); the
    publish loop checks the stop flag itself. With a tensor-parallel group, this process is its leader: the only
    rank that touches the ring."""
    with proc.interruptible():
        built = build(cfg, index, device, group, metrics, startup)
    me = proc.join("model loaded, ring attached")
    startup.mark("join")  # the batch plan, and the row (waits for a dead predecessor's lock)
    with proc.interruptible():
        plan = ShardPlan.of(built.batcher, cfg.data.epochs)
    resumed = resume(cfg, index, device, proc.ring.producer(me.row), built, plan, proc.ledger)
    publish_shard(cfg.data.epochs, index, proc, built, resumed, metrics, startup)
    return 0


@dataclass
class Built:
    """What a producer loads before it takes its row (an interruptible phase: nothing here writes the ring)."""

    target: TargetModel
    source_names: tuple[str, ...]  # Batch.source_ids index these
    composition: DataStats
    batcher: ShardBatcher
    cursor_file: CursorFile
    prepare_batch: Callable[[Batch], Prepared]  # what the loader thread runs on each batch


def build(
    cfg: Config,
    index: int,
    device: torch.device,
    group: TensorGroup | None,
    metrics: ProducerMetrics,
    startup: Startup,
) -> Built:
    """The data, the target (with a tensor-parallel group, sharded over its ranks) in its batch layout, and this
    shard's batcher and cursor file."""
    tokenizer, sources, composition = load_data(cfg, metrics)
    startup.mark("data")  # tokenizer, tokenized data (cached after the first start), its statistics
    target = TargetModel.load(cfg.target, device, packed=False, group=group)
    if len(tokenizer) > target.config.vocab_size:  # else every id the tokenizer gives has its embedding row
        check_data_token_ids(cfg.target, target.config.vocab_size, sources)
    startup.mark("model")
    choose_layout(cfg, device, target, metrics, startup)
    batcher = ShardBatcher.from_config(
        sources, cfg.data, rank=index, world_size=cfg.topology.producers, packing=target.packed
    )
    path = cursor_path(cfg.target.state_dir, cfg.run.name, index)
    path.parent.mkdir(parents=True, exist_ok=True)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return Built(
        target,
        tuple(s.name for s in sources),
        composition,
        batcher,
        CursorFile(path, batcher.plan_key(), batcher.plan_description()),
        partial(prepare, packed=target.packed, pad_id=pad_id, pin=device.type == "cuda"),
    )


def load_data(cfg: Config, metrics: ProducerMetrics) -> tuple[PreTrainedTokenizerBase, list[SourceData], DataStats]:
    """The target's tokenizer, the data tokenized with it, and the data's statistics."""
    tokenizer = target_tokenizer(cfg.target)
    check_mask_token(cfg, tokenizer)
    mask = cfg.drafter.mask_token_id if cfg.drafter.mask_token_id is not None else cfg.target.mask_token_id
    sources = load_sources(cfg.data, tokenizer, reserved_token=mask)
    metrics.bad_rows.inc(sum(len(s.data.bad_rows) for s in sources))
    # Before anything is published: what this run trains on.
    composition = data_stats(sources, cfg.data.eval_fraction, cfg.data.seed)
    for line in log_lines(composition):
        log.info("%s", line)
    return tokenizer, sources, composition


def check_data_token_ids(target: TargetConfig, vocab_size: int, sources: list[SourceData]) -> None:
    """Every source's token ids against the target's embedding rows (a tokenizer larger than its vocabulary)."""
    for s in sources:
        if len(s.data.tokens):
            check_token_ids(
                int(s.data.tokens.max()),
                vocab_size,
                target.tokenizer or target.path,
                target.path,
                f"data source {s.name} ({s.path}), tokenized,",
            )


def choose_layout(
    cfg: Config, device: torch.device, target: TargetModel, metrics: ProducerMetrics, startup: Startup
) -> None:
    """Packed or padded batches (target.packing, the conformance probe deciding), and what the layout decides: the
    slot must hold the largest batch, and a packed target on a GPU compiles its decoder layers."""
    # Before anything is published; a restart on the same model, code and device reads the saved result.
    probe = choose_packing(
        target, cfg.target.packing, cached_probe(Path(cfg.target.state_dir).expanduser() / "probe", cfg.target.path)
    )
    startup.mark("probe")
    metrics.packing.labels("packed" if target.packed else "padded", target.config.model_type).set(1)
    metrics.conformance_error.set(float("nan") if probe is None or probe.max_error is None else probe.max_error)
    hidden = target.hidden_size if target.final_hidden else None
    check_slot_fits(cfg.ring, cfg.data.max_tokens_per_batch, target.feature_width, hidden, target.dtype)
    if cfg.target.compile and device.type == "cuda" and target.packed:
        use_compile_cache(
            cfg.run.compile_cache_dir,
            "target",
            {
                "model": target.config.to_dict(),
                "layers": target.layer_ids,
                "dtype": str(target.dtype),
                "final_hidden": target.final_hidden,
            },
        )
        log.info("compiled decoder layers %s (first batches compile)", target.compile_layers())


@dataclass(frozen=True)
class ShardPlan:
    """This shard's batches in each epoch, and the held-out positions among them."""

    batches: list[int]
    eval_positions: list[list[int]]

    @classmethod
    def of(cls, batcher: ShardBatcher, epochs: int) -> ShardPlan:
        plan = cls([], [])
        for e in range(epochs):  # one pass: eval_positions(e) reads the plan epoch_plan(e) just made
            plan.batches.append(len(batcher.epoch_plan(e)))
            plan.eval_positions.append(batcher.eval_positions(e))
        return plan

    def has(self, epoch: int, position: int) -> bool:
        return 0 <= epoch < len(self.batches) and 0 <= position < self.batches[epoch]


@dataclass
class Resumed:
    """Where this producer's shard starts again, the replay list it publishes first, and its row's port."""

    port: ProducerPort
    start: ResumeState
    replay: LiveReplay


def resume(
    cfg: Config,
    index: int,
    device: torch.device,
    port: ProducerPort,
    built: Built,
    plan: ShardPlan,
    ledger: Ledger | None,
) -> Resumed:
    """The plan into the row (the drafters' LR schedules count it), the resume point (producer/resume.py), the live
    replay list, and the ledger's start record."""
    port.set_planned_items(sum(plan.batches), sum(map(len, plan.eval_positions)))
    start, source = resume_point(port, built.cursor_file)
    check_resume_point(start, plan.batches, source)  # before anything is published from it
    log.info(
        "producer %d of %d: %d samples an epoch, %d epochs, %s features; resuming at epoch %d "
        "position %d (from the %s)%s",
        index,
        cfg.topology.producers,
        built.composition.total.epoch_rows,
        cfg.data.epochs,
        resolve_dtype(cfg.target.dtype, device),
        start.epoch,
        start.position,
        source,
        f", after {len(start.pending_replay)} batch(es) a stopped run left untrained" if start.pending_replay else "",
    )
    replay = LiveReplay(index, start, built.cursor_file, cfg.train.checkpoint_dir, plan.has, ledger)
    if ledger is not None:
        ledger.write(
            ProducerStart(
                plan.batches,
                [start.epoch, start.position],
                [list(x) for x in start.pending_replay],
                plan.eval_positions if any(plan.eval_positions) else None,
            )
        )
    return Resumed(port, start, replay)


def publish_shard(
    epochs: int,
    index: int,
    proc: RoleProcess,
    built: Built,
    resumed: Resumed,
    metrics: ProducerMetrics,
    startup: Startup,
) -> None:
    """The publish loop: the shard from its resume point, then what dead drafters lose, until the run ends."""
    load = partial(Loader, prepare_fn=built.prepare_batch)
    port, replay, loader = resumed.port, resumed.replay, None
    try:
        loader = load(resumed_batches(built.batcher, resumed.start, replay))
        producer = Producer(
            port,
            index,
            built.target,
            stop=proc.stop,
            account=PublishAccount(port, proc.ledger, replay),
            metrics=metrics,
            source_names=built.source_names,
            startup=startup,
        )
        if producer.run(loader):
            port.done((epochs, 0))
            if proc.ledger is not None:
                proc.ledger.write(ShardDone())
            # Keep the end, not nothing: a run drained now and started again must not redo this shard.
            # The supervisor removes the file once every shard is done (the run is complete).
            replay.finish(epochs)
            log.info("shard done; producing again what dead drafters lose, until the run ends")
            loader.close()
            loader = serve_replays(producer, replay, built.batcher, epochs, load, proc.stop)
        else:
            log.info("stopped before the end of the shard (signal, drain or shutdown)")
    finally:
        if loader is not None:
            loader.close()
