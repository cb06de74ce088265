"""Prometheus metrics: every process of a run serves /metrics, and every name is defined here.

The names are a contract with deploy/ (alert rules, dashboard), so they live in one module:
prefix dflash_ring_, base units (seconds, bytes), counters end in _total, ratios are 0-1.

Ports (MetricsConfig): supervisor port_base, target i port_base + 1 + i, drafter j port_base + 100 + j,
`dflash-ring regenerate` port_base + 200.
Hot paths count per item or per optimizer step, never per token.

The supervisor's ring numbers are read from the ring at scrape time (RingCollector), so a scrape
shows exactly what `dflash-ring status` would show at that moment.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from dflash_ring.common.config.schema import MetricsConfig, TopologyConfig
from dflash_ring.common.layout import OPERATOR_NAME, ROLE_NAME, Role

if TYPE_CHECKING:  # the supervisor serves metrics without torch (a second of its start-up on a small box)
    import torch

log = logging.getLogger(__name__)

SUPERVISOR, TARGET, DRAFTER = (OPERATOR_NAME[r] for r in (Role.SUPERVISOR, Role.PRODUCER, Role.CONSUMER))
REGENERATE = "regenerate"  # not a ring role: the offline job that writes the target's replies
PORT_OFFSET = {SUPERVISOR: 0, TARGET: 1, DRAFTER: 100, REGENERATE: 200}

# Copies move 1 MiB to ~1.3 GiB (tens of microseconds to ~100 ms); steps take ~10 ms to seconds.
COPY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

disable_created_metrics()  # *_created series only double the scrape; Prometheus does not need them


class MetricsPortError(RuntimeError):
    """The metrics port of this process cannot be bound; the message names the port and the setting."""


def port_of(m: MetricsConfig, role: str, index: int = 0) -> int:
    return m.port_base + PORT_OFFSET[role] + (0 if role in (SUPERVISOR, REGENERATE) else index)


def run_ports(m: MetricsConfig, t: TopologyConfig) -> dict[str, int]:
    """Every process's port, e.g. {"supervisor": 9460, "target-0": 9461, "drafter-0": 9560}."""
    ports = {SUPERVISOR: port_of(m, SUPERVISOR)}
    ports |= {f"{TARGET}-{i}": port_of(m, TARGET, i) for i in range(t.producers)}
    ports |= {f"{DRAFTER}-{j}": port_of(m, DRAFTER, j) for j in range(t.consumers)}
    return ports


def _port_error(m: MetricsConfig, who: str, port: int, e: OSError) -> MetricsPortError:
    if e.errno == errno.EADDRINUSE:
        return MetricsPortError(
            f"metrics port {port} on {m.bind} (for {who}) is already in use, by another run or program. "
            f"Ports are metrics.port_base ({m.port_base}) + 0 supervisor, + 1 + i target i, + 100 + j drafter j, "
            f"+ 200 regenerate: choose a free base with `--set metrics.port_base=N` (or port_base in [metrics]), "
            f"or turn metrics off with `--set metrics.enabled=false`"
        )
    return MetricsPortError(
        f"cannot serve metrics for {who} on {m.bind}:{port} ({e}): check metrics.bind "
        f"and metrics.port_base, or set metrics.enabled = false"
    )


def check_ports_free(m: MetricsConfig, t: TopologyConfig) -> None:
    """Refuse to start a one-host run whose metrics ports are taken, before any process starts."""
    for who, port in run_ports(m, t).items():
        _check_free(m, who, port)


def check_port_free(m: MetricsConfig, role: str, index: int) -> None:
    """Refuse to start a process whose port is taken, before minutes of loading (for one that serves it later)."""
    _check_free(m, f"{role} {index}", port_of(m, role, index))


def _check_free(m: MetricsConfig, who: str, port: int) -> None:
    if not m.enabled:
        return
    try:
        with socket.create_server((m.bind, port)):
            pass
    except OSError as e:
        raise _port_error(m, who, port, e) from None


def serve(m: MetricsConfig, run_name: str, role: str, index: int = 0, uuid: str = "") -> CollectorRegistry:
    """This process's registry, served on its port when metrics are enabled (a private one otherwise).

    Carries dflash_ring_process_info{role,index,run,UUID} = 1 and the standard process_* metrics.
    A port past 65535 (port_base too high for this role's offset) is refused by name.
    """
    registry = CollectorRegistry()
    if not m.enabled:
        return registry
    for c in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        registry.register(c)
    Gauge(
        "dflash_ring_process_info",
        "This process: role (supervisor|target|drafter|regenerate), index, run "
        "and GPU UUID (empty on the CPU); always 1",
        ["role", "index", "run", "UUID"],
        registry=registry,
    ).labels(role, str(index), run_name, uuid).set(1)
    port = port_of(m, role, index)
    who = role if role in (SUPERVISOR, REGENERATE) else f"{role} {index}"
    if port > 65535:
        raise MetricsPortError(
            f"metrics port of {who} would be {port} (metrics.port_base {m.port_base} + "
            f"{PORT_OFFSET[role]}), past 65535: lower metrics.port_base or set "
            "metrics.enabled = false"
        )
    try:
        start_http_server(port, addr=m.bind, registry=registry)
    except OSError as e:
        raise _port_error(m, who, port, e) from None
    log.info("metrics on http://%s:%d/metrics", m.bind, port)
    return registry


def startup_gauge(registry: CollectorRegistry) -> Gauge:
    """Start-up phases of this process (common/lifecycle/startup.py names them per role)."""
    return Gauge(
        "dflash_ring_startup_seconds",
        "Seconds each start-up phase of this process took, from its exec "
        "to its first useful work (supervisor: ring created or adopted; target: first publish; drafter: "
        "first step); the phases sum to the whole start-up",
        ["phase"],
        registry=registry,
    )


class DeviceSpan:
    """Times device work without a sync: CUDA events on a GPU (read once the work is known done), else the clock."""

    def __init__(self, device: torch.device, stream: torch.cuda.Stream | None = None):
        import torch

        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        if device.type == "cuda":
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record(stream)
        self._t0, self._t1 = time.perf_counter(), 0.0

    def end(self, stream: torch.cuda.Stream | None = None) -> DeviceSpan:
        if self._events is not None:
            self._events[1].record(stream)
        self._t1 = time.perf_counter()
        return self

    def seconds(self) -> float:
        if self._events is None:
            return self._t1 - self._t0
        self._events[1].synchronize()  # already done where callers read it: after the copy landed
        return self._events[0].elapsed_time(self._events[1]) / 1000.0


class ProducerMetrics:
    """A target's numbers, updated once per published item."""

    def __init__(self, registry: CollectorRegistry | None = None):
        r = registry if registry is not None else CollectorRegistry()
        self.blocked = Counter(
            "dflash_ring_producer_blocked_seconds_total",
            "Seconds this target waited for a free slot (ring full)",
            registry=r,
        )
        self.d2h = Histogram(
            "dflash_ring_d2h_copy_seconds",
            "Device-to-host copy of one item into its slot",
            buckets=COPY_BUCKETS,
            registry=r,
        )
        self.step = Histogram(
            "dflash_ring_target_step_seconds", "Target forward time of one batch", buckets=STEP_BUCKETS, registry=r
        )
        self.tokens = Counter("dflash_ring_target_tokens_total", "Tokens this target published", registry=r)
        self.items = Counter("dflash_ring_target_items_total", "Items (batches) this target published", registry=r)
        self.source_trained = Counter(
            "dflash_ring_target_trained_tokens_total",
            "Trained (loss-mask) tokens this target published, by data source: the mix the drafters actually see",
            ["source"],
            registry=r,
        )
        self.bad_rows = Counter(
            "dflash_ring_bad_rows_skipped_total",
            "Data set rows skipped as unusable at load (the whole set: each target "
            "reports the same rows; use max, not sum)",
            registry=r,
        )
        self.packing = Gauge(
            "dflash_ring_target_packing_info",
            "1 for the batch layout this target runs (packed: the conformance probe passed; "
            "padded: target.packing = padded, or auto after a failed probe)",
            ["mode", "model_type"],
            registry=r,
        )
        self.conformance_error = Gauge(
            "dflash_ring_target_conformance_error",
            "Largest per-token relative error of packed against per-sequence features "
            "in the start-up conformance probe (NaN: not probed)",
            registry=r,
        )


class DrafterMetrics:
    """A drafter's numbers: per item in the prefetcher, per optimizer step in the main loop."""

    def __init__(self, registry: CollectorRegistry | None = None):
        r = registry if registry is not None else CollectorRegistry()
        self.wait = Counter(
            "dflash_ring_consumer_wait_seconds_total",
            "Seconds this drafter waited for a ready slot (ring empty)",
            registry=r,
        )
        self.h2d = Histogram(
            "dflash_ring_h2d_copy_seconds",
            "Host-to-device copy of one item out of its slot",
            buckets=COPY_BUCKETS,
            registry=r,
        )
        self.items = Counter("dflash_ring_drafter_items_total", "Items this drafter took from the ring", registry=r)
        self.tokens = Counter("dflash_ring_drafter_tokens_total", "Tokens this drafter trained on", registry=r)
        self.steps = Counter(
            "dflash_ring_drafter_steps_total", "Optimizer steps of this drafter (this start)", registry=r
        )
        self.step = Histogram(
            "dflash_ring_drafter_step_seconds", "Time of one training step", buckets=STEP_BUCKETS, registry=r
        )
        self.loss = Gauge("dflash_ring_drafter_loss", "Training loss of the last step", registry=r)
        self.accuracy = Gauge(
            "dflash_ring_drafter_accuracy",
            "Top-1 accuracy of the last step, mean over block positions (0-1)",
            registry=r,
        )
        self.acceptance = Gauge(
            "dflash_ring_drafter_acceptance_length",
            "Teacher-forced acceptance length of the last step's blocks (accepted prefix + 1)",
            registry=r,
        )
        self.acceptance_prob = Gauge(
            "dflash_ring_drafter_probabilistic_acceptance_length",
            "Probabilistic acceptance length of the last step's blocks: 1 + expected "
            "accepted drafts under the drafter's own distribution (what CAP optimises)",
            registry=r,
        )
        self.position_accuracy = Gauge(
            "dflash_ring_drafter_position_accuracy",
            "Top-1 accuracy of the last step at each block position (1..B-1)",
            ["position"],
            registry=r,
        )
        self.accept_rate = Gauge(
            "dflash_ring_drafter_position_accept_rate",
            "DSpark: mean analytic acceptance 1 - TV of the last step at each draft position (1 = the first draft)",
            ["position"],
            registry=r,
        )
        self.tau_probabilistic = Gauge(
            "dflash_ring_drafter_tau_probabilistic",
            "DSpark: 1 + sum over the block of the cumulative product of the analytic "
            "acceptance, mean over the last step's blocks",
            registry=r,
        )
        self.confidence_error = Gauge(
            "dflash_ring_drafter_confidence_abs_error",
            "DSpark: mean |confidence - analytic acceptance| over the last step's drafts",
            registry=r,
        )
        self.selector_accept_len = Gauge(
            "dflash_ring_drafter_selector_accept_len",
            "DFlash2: mean accepted length over the last step's blocks of the greedy "
            "walk through the candidate selector (teacher-forced, exact while it is "
            "right)",
            registry=r,
        )
        self.selector_recall = Gauge(
            "dflash_ring_drafter_selector_top_k_recall",
            "DFlash2: share of the last step's drafts whose label is in the unary top-K",
            registry=r,
        )
        self.lr = Gauge("dflash_ring_drafter_learning_rate", "Learning rate of the last step", registry=r)
        self.step_number = Gauge("dflash_ring_drafter_step", "Optimizer step reached (survives restarts)", registry=r)
        self.grad_norm = Gauge(
            "dflash_ring_drafter_grad_norm", "Gradient norm of the last step, before clipping", registry=r
        )
        # The step record's keys (consumer/reporting/step_record.py) each gauge shows.
        self.gauges = {
            "loss": self.loss,
            "accuracy/mean": self.accuracy,
            "accept_len": self.acceptance,
            "accept_len_prob": self.acceptance_prob,
            "lr": self.lr,
            "grad_norm": self.grad_norm,
        }
        # Per data source (the configured names, at most data.MAX_SOURCES, and "other"), split "train" (the
        # steps since the last logged one) or "eval" (the held-out items of the last evaluation report).
        by_source = ["source", "split"]
        self.source_loss = Gauge(
            "dflash_ring_drafter_source_loss",
            "Loss over the blocks of one data source's "
            "sequences (train: the steps since the last logged one; eval: the last evaluation report)",
            by_source,
            registry=r,
        )
        self.source_accuracy = Gauge(
            "dflash_ring_drafter_source_accuracy",
            "Top-1 accuracy over one data source's blocks (0-1)",
            by_source,
            registry=r,
        )
        self.source_acceptance = Gauge(
            "dflash_ring_drafter_source_acceptance_length",
            "Teacher-forced acceptance length of one data source's blocks",
            by_source,
            registry=r,
        )
        self.source_tokens = Counter(
            "dflash_ring_drafter_source_tokens_total",
            "Supervised (loss-mask) tokens this drafter trained (train) or evaluated (eval), by data source",
            by_source,
            registry=r,
        )
        self.eval_items = Counter(
            "dflash_ring_drafter_eval_items_total", "Held-out items this drafter evaluated (never trained)", registry=r
        )

    def publish(self, step: int, step_s: float, record: dict[str, float]) -> None:
        """One optimizer step: its record (consumer/reporting/step_record.py) into the gauges, its time and number."""
        self.steps.inc()
        self.step.observe(step_s)
        self.step_number.set(step)
        for key, gauge in self.gauges.items():
            gauge.set(record[key])
        for key, gauge in {
            "tau_probabilistic": self.tau_probabilistic,
            "confidence/abs_error": self.confidence_error,
            "selector/accept_len": self.selector_accept_len,
            "selector/top_k_recall": self.selector_recall,
        }.items():
            if key in record:  # DSpark's, DFlash2's
                gauge.set(record[key])
        for key, value in record.items():
            if key.startswith("accuracy/pos_"):
                self.position_accuracy.labels(key.removeprefix("accuracy/pos_")).set(value)
            elif key.startswith("accept_rate/pos_"):
                self.accept_rate.labels(key.removeprefix("accept_rate/pos_")).set(value)
        self.publish_sources(record)

    def publish_sources(self, record: dict[str, float]) -> None:
        """A record's per-source keys (`source/<name>/<what>`, `eval/source/<name>/<what>`) into the labelled
        gauges: the same numbers the log line and the trackers get."""
        gauges = {"loss": self.source_loss, "accuracy": self.source_accuracy, "accept_len": self.source_acceptance}
        for key, value in record.items():
            if key.startswith("source/"):
                split, rest = "train", key.removeprefix("source/")
            elif key.startswith("eval/source/"):
                split, rest = "eval", key.removeprefix("eval/source/")
            else:
                continue
            name, _, what = rest.rpartition("/")
            if what in gauges:
                gauges[what].labels(name, split).set(value)

    def count_source_tokens(self, tokens: dict[str, int], split: str) -> None:
        """Per item or optimizer step, as the other token counters: supervised tokens by source."""
        for name, n in tokens.items():
            self.source_tokens.labels(name, split).inc(n)


class RegenerateMetrics:
    """`dflash-ring regenerate`'s numbers, updated per reply (this start only; the job's totals are in its records)."""

    OUTCOMES = ("complete", "truncated_kept", "truncated_dropped", "unusable", "error", "bad_row", "too_long")

    def __init__(self, registry: CollectorRegistry | None = None):
        r = registry if registry is not None else CollectorRegistry()
        self.prompts = Counter(
            "dflash_ring_regenerate_prompts_total",
            "Source rows by outcome: complete and truncated_kept replies are written; "
            "truncated_dropped (hit max_new_tokens, keep_truncated off), unusable (a reply the data "
            "loader would refuse), error (the engine failed the prompt), bad_row and too_long (over "
            "regenerate.max_prompt_tokens) are skipped",
            ["outcome"],
            registry=r,
        )
        self.generated_tokens = Counter(
            "dflash_ring_regenerate_generated_tokens_total", "Tokens the engine generated (kept or not)", registry=r
        )
        self.prompt_tokens = Counter(
            "dflash_ring_regenerate_prompt_tokens_total", "Prompt tokens the engine read", registry=r
        )
        self.errors = Counter(
            "dflash_ring_regenerate_errors_total",
            "Engine failures: reply (one prompt failed, skipped) or abort (the job stopped)",
            ["kind"],
            registry=r,
        )
        self.rows_done = Gauge(
            "dflash_ring_regenerate_rows_done", "Source rows in finished shards, earlier starts included", registry=r
        )
        self.rows_total = Gauge("dflash_ring_regenerate_rows", "Source rows of the job", registry=r)
        for outcome in self.OUTCOMES:
            self.prompts.labels(outcome)
        for kind in ("reply", "abort"):
            self.errors.labels(kind)


class RingCollector(Collector):
    """The supervisor's view of the ring, read at scrape time from the same source as `dflash-ring status`."""

    def __init__(self, lock_dir: Path):
        self._lock_dir = lock_dir
        self._ring = None
        self._mutex = threading.Lock()

    def attach(self, ring) -> None:
        with self._mutex:
            self._ring = ring

    def detach(self) -> None:
        """Before the ring is closed: a scrape never reads an unmapped segment."""
        with self._mutex:
            self._ring = None

    def collect(self):
        from dflash_ring.common.lifecycle.liveness import live_lock_files

        with self._mutex:
            if self._ring is None:
                return
            st = self._ring.status()
            expected = int(self._ring.fingerprint_fields["topology.producers"])
        live = [p.stem for p in live_lock_files(self._lock_dir)]
        c = st.counters
        yield GaugeMetricFamily("dflash_ring_capacity_slots", "Slots in the ring", value=st.n_slots)
        slots = GaugeMetricFamily("dflash_ring_slots", "Slots by state", labels=["state"])
        for state, n in st.slots_by_state.items():
            slots.add_metric([state], n)
        yield slots
        yield GaugeMetricFamily("dflash_ring_depth_items", "Items ready and not yet claimed", value=st.depth)
        for key, text in (
            ("produced", "Items published by all targets"),
            ("consumed", "Items released by all drafters"),
            ("redelivered", "Items of dead drafters handed to another"),
            ("reclaimed", "Half-written slots of dead targets returned to free"),
            (
                "corrupt",
                "Slots found corrupt: a header that failed validation (item dropped), or a state word "
                "the ring protocol cannot produce (item redelivered when its header reads)",
            ),
        ):
            yield CounterMetricFamily(f"dflash_ring_items_{key}", text, value=c[key])
        yield GaugeMetricFamily(
            "dflash_ring_producers_done", "Targets that finished their shard", value=c["producers_done"]
        )
        yield GaugeMetricFamily(
            "dflash_ring_producers_expected", "Targets of the run (topology.producers)", value=expected
        )
        yield GaugeMetricFamily("dflash_ring_draining", "1 while the run drains", value=int(c["drain"] != 0))
        yield GaugeMetricFamily(
            "dflash_ring_shutting_down", "1 once shutdown is broadcast", value=int(c["shutdown"] != 0)
        )
        yield CounterMetricFamily(
            "dflash_ring_supervisor_adoptions",
            "Times a restarted supervisor adopted the ring",
            value=c["supervisor_adoptions"],
        )
        starts = CounterMetricFamily(
            "dflash_ring_process_starts",
            "Times a process took its row (restarts = starts - 1)",
            labels=["role", "index"],
        )
        beat = GaugeMetricFamily(
            "dflash_ring_heartbeat_age_seconds", "Seconds since a process's last heartbeat", labels=["role", "index"]
        )
        for row in st.rows:
            labels = [OPERATOR_NAME[Role[row["role"].upper()]], str(row["index"])]
            starts.add_metric(labels, row["restarts"] + 1)
            beat.add_metric(labels, row["heartbeat_age_s"])
        yield starts
        yield beat
        yield GaugeMetricFamily(
            "dflash_ring_consumers_live",
            "Drafters holding their lock now",
            value=sum(s.startswith("consumer-") for s in live),
        )
        yield GaugeMetricFamily(
            "dflash_ring_producers_live",
            "Targets holding their lock now",
            value=sum(s.startswith(f"{ROLE_NAME[Role.PRODUCER]}-") for s in live),
        )
