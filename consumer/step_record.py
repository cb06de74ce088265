"""A step's numbers as one flat record: the one path from a training step to the log line, the Prometheus
gauges, the trackers and the run's record file.

Keys are "/"-separated names (`loss`, `accuracy/pos_3`, `ring/depth`; per data source `source/<name>/loss`;
evaluation records `eval/...`), and no key is also the start of another (`accuracy` beside `accuracy/pos_1`):
MLflow's file store keeps each key as a path, so one would have to be a file and a directory at once. The log line, `DrafterMetrics.publish` and the trackers all read this dict
and nothing else, so a number added here reaches every one of them (trackers log whatever keys it has).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from dflash_ring.consumer.trainer import StepMetrics


@dataclass(frozen=True)
class RingReading:
    """The ring as this drafter sees it at one moment."""

    wait_s: float  # seconds this drafter has waited on an empty ring since it started
    produced: int  # items every producer has published (the ring's counter, the producers' rows summed)
    produced_tokens: int  # their tokens
    depth: int  # ready items no drafter has claimed yet


@dataclass(frozen=True)
class WindowStats:
    """What happened between the last logged step and now: rates need a window, a step's own numbers do not."""

    seconds: float
    tokens: int  # tokens this drafter trained on
    wait_s: float  # of those seconds, waiting on an empty ring
    produced: int  # items the producers published
    produced_tokens: int  # their tokens
    depth: int  # the ring now


class Window:
    """Rolling numbers since the last logged step; `stats` reads them, `restart` begins the next window."""

    def __init__(self, read_ring: Callable[[], RingReading]):
        self.read_ring = read_ring
        self.restart()

    def restart(self) -> None:
        self.t0, self.tokens, self.first = time.perf_counter(), 0, self.read_ring()

    def add(self, tokens: int) -> None:
        self.tokens += tokens

    def stats(self) -> WindowStats:
        now = self.read_ring()
        return WindowStats(seconds=max(time.perf_counter() - self.t0, 1e-9), tokens=self.tokens,
                           wait_s=now.wait_s - self.first.wait_s, produced=now.produced - self.first.produced,
                           produced_tokens=now.produced_tokens - self.first.produced_tokens, depth=now.depth)


def step_scalars(m: StepMetrics, w: WindowStats) -> dict[str, float]:
    """One optimizer step (and the window up to it) as the flat record every sink reads."""
    acc = m.accuracy_per_position
    return {
        "loss": m.loss, "ce": m.ce, "kl": m.kl, "cap": m.cap,
        "accuracy/mean": sum(acc) / len(acc) if acc else 0.0,
        **{f"accuracy/pos_{k}": a for k, a in enumerate(acc, 1)},  # pos_1: the first token after the anchor
        "accept_len": m.accept_len, "accept_len_prob": m.accept_len_prob,
        "lr": m.lr, "grad_norm": m.grad_norm, "step_s": m.step_s,
        "tokens_per_s": w.tokens / w.seconds,
        "ring/depth": float(w.depth), "ring/wait_s": w.wait_s,
        "producers/items_per_s": w.produced / w.seconds, "producers/tokens_per_s": w.produced_tokens / w.seconds,
    }


def log_line(step: int, total: int, r: dict[str, float]) -> str:
    """The record as the drafter's log line (for people; programs read the record file or /metrics)."""
    last = max((k for k in r if k.startswith("accuracy/pos_")), key=lambda k: int(k.rsplit("_", 1)[1]), default=None)
    acc1, acc_last = r.get("accuracy/pos_1", 0.0), r[last] if last else 0.0
    return (f"step {step}/{total} loss {r['loss']:.4f} acc@1 {acc1:.3f} acc@last {acc_last:.3f} "
            f"accept_len {r['accept_len']:.2f} accept_len_prob {r['accept_len_prob']:.2f} lr {r['lr']:.2e} "
            f"grad_norm {r['grad_norm']:.3g} tok/s {r['tokens_per_s']:.0f} ring_wait {r['ring/wait_s']:.1f}s "
            f"depth {r['ring/depth']:.0f} producers {r['producers/items_per_s']:.2f} items/s "
            f"{r['producers/tokens_per_s']:.0f} tok/s")
