"""Where a drafter's steps and held-out items are reported: Prometheus, the log line, the record file and trackers.

One sink for what follows a settled item (torchtitan's `MetricsProcessor` is the model): its counters at once; a
step's record (consumer/reporting/step_record.py) to the metrics at once and to the log, the record file and the
trackers every train.log_every_steps (and the last one at the end); the rolling window those rates are over. A held-out
item's
per-source sums wait for the next multiple of train.eval_every_steps (and the end), where they become one evaluation
record (`eval_scalars`), emitted like a step's.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import asdict

from dflash_ring.common.lifecycle.ledger_events import BatchIdentity
from dflash_ring.common.metrics import DrafterMetrics
from dflash_ring.consumer.reporting.source_metrics import SourceStats, add_sources, held_out_sources
from dflash_ring.consumer.reporting.step_record import (
    RingReading,
    Window,
    eval_scalars,
    log_line,
    source_line,
    step_scalars,
)
from dflash_ring.consumer.reporting.tracking import Tracking
from dflash_ring.consumer.training.trainer import DeviceBatch, StepMetrics

log = logging.getLogger(__name__)


class StepReport:
    def __init__(
        self,
        metrics: DrafterMetrics,
        tracking: Tracking,
        read_ring: Callable[[], RingReading],
        log_every: int,
        eval_every: int = 100,
    ):
        self.metrics, self.tracking, self.log_every, self.eval_every = metrics, tracking, log_every, eval_every
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
                log.warning(
                    "tracking: a held-out line of %s is malformed (%s): left out of the next evaluation record",
                    tracking.record.f.name,
                    " ".join(str(e).split()) or type(e).__name__,
                )

    @property
    def eval_items(self) -> int:
        return len(self.eval_seen)

    def _count_held_out(self, item: str, stats: dict[str, SourceStats]) -> bool:
        if item in self.eval_seen:
            return False
        self.eval_seen.add(item)
        add_sources(self.eval_sources, stats)
        return True

    def held_out(self, batch: DeviceBatch, stats: dict[str, SourceStats]) -> None:
        """A held-out batch's sums, kept in the record file before its release: a kill cannot lose them."""
        item = json.dumps(BatchIdentity.of(batch.meta).as_dict(), sort_keys=True)
        if self._count_held_out(item, stats):
            self.tracking.record.hold_out({"item": item, "sources": {n: asdict(s) for n, s in stats.items()}})

    def evaluated(self, stats: dict[str, SourceStats]) -> None:
        """A held-out batch settled."""
        self.metrics.items.inc()
        self.metrics.eval_items.inc()
        self.metrics.count_source_tokens({name: s.tokens for name, s in stats.items()}, "eval")

    def trained(self, batch: DeviceBatch, m: StepMetrics | None, total: int) -> None:
        """A trained batch settled; `m`, the optimizer step it completed (None while gradients accumulate) of
        `total` estimated."""
        self.metrics.items.inc()
        self.metrics.tokens.inc(batch.num_tokens)
        self.window.add(batch.num_tokens)
        if m is None:
            return
        self.window.add_sources(m.by_source)
        self.metrics.count_source_tokens({name: s.tokens for name, s in m.by_source.items()}, "train")
        record = step_scalars(m, self.window.stats())
        self.metrics.publish(m.step, m.step_s, record)
        self.unlogged = (m.step, total, record)
        if m.step % self.log_every == 0:
            self.log_step()
        if m.step % self.eval_every == 0:
            self.report_eval(m.step)

    def report_eval(self, step: int) -> None:
        """The held-out items evaluated since the last report, as one record at `step` (nothing if there were
        none)."""
        if not self.eval_items:
            return
        record = eval_scalars(self.eval_sources, self.eval_items)
        # A restarted drafter's step at or below its series' last evaluation record has one already: these items
        # wait for the next step past it instead of being dropped with the record.
        if not self.tracking.emit(step, record):  # the record file and the trackers: the eval series
            return
        self.eval_sources, self.eval_seen = {}, set()
        self.metrics.publish_sources(record)
        text = (
            f"eval at step {step}: {int(record['eval/items'])} held-out items, loss "
            f"{record.get('eval/loss', float('nan')):.4f} acc {record.get('eval/accuracy', float('nan')):.3f} "
            f"accept_len {record.get('eval/accept_len', float('nan')):.2f}"
        )
        log.info("%s; by source: %s", text, source_line(record, "eval/"))

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

    def end(self, step: int) -> None:
        """At the drafter's end: the last step, and the held-out items since the last evaluation record."""
        self.log_step()
        self.report_eval(step)
