"""A step's numbers as one flat record: the one path from a training step to the log line, the Prometheus
gauges, the trackers and the run's record file.

Keys are "/"-separated names (`loss`, `accuracy/pos_3`, `ring/depth`; per data source `source/<name>/loss`;
evaluation records `eval/...`), and no key is also the start of another (`accuracy` beside `accuracy/pos_1`):
MLflow's file store keeps each key as a path, so one would have to be a file and a directory at once. The log line,
`DrafterMetrics.publish` and the trackers all read this dict and nothing else, so a number added here reaches every
one of them (trackers log whatever keys it has).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from dflash_ring.consumer.reporting.source_metrics import SourceStats, add_sources, overall
from dflash_ring.consumer.training.trainer import StepMetrics


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
    by_source: dict[str, SourceStats]  # the window's steps per data source (sums: exact over any window)


class Window:
    """Rolling numbers since the last logged step; `stats` reads them, `restart` begins the next window."""

    def __init__(self, read_ring: Callable[[], RingReading]):
        self.read_ring = read_ring
        self.restart()

    def restart(self) -> None:
        self.t0, self.tokens, self.first = time.perf_counter(), 0, self.read_ring()
        self.by_source: dict[str, SourceStats] = {}

    def add(self, tokens: int) -> None:
        self.tokens += tokens

    def add_sources(self, by_source: dict[str, SourceStats]) -> None:
        add_sources(self.by_source, by_source)

    def stats(self) -> WindowStats:
        now = self.read_ring()
        return WindowStats(
            seconds=max(time.perf_counter() - self.t0, 1e-9),
            tokens=self.tokens,
            wait_s=now.wait_s - self.first.wait_s,
            produced=now.produced - self.first.produced,
            produced_tokens=now.produced_tokens - self.first.produced_tokens,
            depth=now.depth,
            by_source=self.by_source,
        )


def step_scalars(m: StepMetrics, w: WindowStats) -> dict[str, float]:
    """One optimizer step (and the window up to it) as the flat record every sink reads."""
    acc = m.accuracy_per_position
    return {
        "loss": m.loss,
        "ce": m.ce,
        "kl": m.kl,
        "cap": m.cap,
        "accuracy/mean": sum(acc) / len(acc) if acc else 0.0,
        **{f"accuracy/pos_{k}": a for k, a in enumerate(acc, 1)},  # pos_1: the first token after the anchor
        "accept_len": m.accept_len,
        "accept_len_prob": m.accept_len_prob,
        "lr": m.lr,
        "grad_norm": m.grad_norm,
        "step_s": m.step_s,
        "tokens_per_s": w.tokens / w.seconds,
        "ring/depth": float(w.depth),
        "ring/wait_s": w.wait_s,
        "producers/items_per_s": w.produced / w.seconds,
        "producers/tokens_per_s": w.produced_tokens / w.seconds,
        **m.figures,  # the family's own (DrafterFamily.figures)
        **source_scalars(w.by_source),  # over the window: a source missing from one batch still has a figure
        **window_scalars(w.by_source),
    }


def window_scalars(by_source: dict[str, SourceStats]) -> dict[str, float]:
    """`window/{loss,accuracy,accept_len,accept_len_prob,blocks}`: every source's blocks of the window together,
    by the very sums `source/<name>/...` are ratios of. `loss` and `accept_len` above are the logged step's own;
    these are the window's, so `dflash-ring report` draws one definition of a window's value in its per-drafter
    and per-source panels (a window of one source gives that source's figures). Nothing without a block."""
    total = overall(by_source)
    if not total.blocks:
        return {}
    return {
        "window/loss": total.loss,
        "window/accuracy": total.accuracy,
        "window/accept_len": total.accept_len,
        "window/accept_len_prob": total.accept_len_prob,
        "window/blocks": float(total.blocks),
    }


def source_scalars(by_source: dict[str, SourceStats], prefix: str = "") -> dict[str, float]:
    """`<prefix>source/<name>/{loss,accuracy,accept_len,accept_len_prob,blocks,tokens}`: the ratios only where
    the source had blocks (a source without a block has no figure, not a zero); DSpark's `tau_probabilistic` and
    `confidence_{abs_error,bias,cumprod_bias}` where it had them. Names are [A-Za-z0-9_.-] (config/data.py), so
    every key is valid in every tracker."""
    out: dict[str, float] = {}
    for name, s in sorted(by_source.items()):
        key = f"{prefix}source/{name}/"
        out[key + "tokens"] = float(s.tokens)
        out[key + "blocks"] = float(s.blocks)
        if s.blocks:
            out |= {
                key + "loss": s.loss,
                key + "accuracy": s.accuracy,
                key + "accept_len": s.accept_len,
                key + "accept_len_prob": s.accept_len_prob,
            }
        if s.analytic_blocks:
            out[key + "tau_probabilistic"] = s.tau_probabilistic
        if s.confidence_drafts:
            out |= {
                key + "confidence_abs_error": s.confidence_sums[0] / s.confidence_drafts,
                key + "confidence_bias": s.confidence_sums[1] / s.confidence_drafts,
                key + "confidence_cumprod_bias": s.confidence_sums[2] / s.confidence_drafts,
            }
    return out


def eval_scalars(by_source: dict[str, SourceStats], items: int) -> dict[str, float]:
    """The held-out items evaluated since the last evaluation record: `eval/{loss,accuracy,accept_len,
    accept_len_prob,items,blocks,tokens}` over all of them (sums added, not a mean of the sources' ratios),
    and `eval/source/<name>/...` per source. Every key starts with `eval/`: the trackers' evaluation series."""
    total = overall(by_source)
    out = {"eval/items": float(items), "eval/blocks": float(total.blocks), "eval/tokens": float(total.tokens)}
    if total.blocks:
        out |= {
            "eval/loss": total.loss,
            "eval/accuracy": total.accuracy,
            "eval/accept_len": total.accept_len,
            "eval/accept_len_prob": total.accept_len_prob,
        }
    return out | source_scalars(by_source, "eval/")


def source_line(record: dict[str, float], prefix: str = "") -> str:
    """The per-source figures of a record (`source_scalars`' keys under `prefix`), for a log line."""
    names = sorted({k[len(prefix) + 7 :].rsplit("/", 1)[0] for k in record if k.startswith(prefix + "source/")})
    parts = []
    for name in names:
        key = f"{prefix}source/{name}/"
        blocks, tokens = int(record[key + "blocks"]), int(record[key + "tokens"])
        parts.append(
            f"{name}: loss {record[key + 'loss']:.4f} acc {record[key + 'accuracy']:.3f} accept_len "
            f"{record[key + 'accept_len']:.2f} ({blocks} blocks, {tokens} tokens)"
            if blocks
            else f"{name}: no block ({tokens} tokens)"
        )
    return "; ".join(parts)


def log_line(step: int, total: int, r: dict[str, float]) -> str:
    """The record as the drafter's log line (for people; programs read the record file or /metrics)."""
    last = max((k for k in r if k.startswith("accuracy/pos_")), key=lambda k: int(k.rsplit("_", 1)[1]), default=None)
    acc1, acc_last = r.get("accuracy/pos_1", 0.0), r[last] if last else 0.0
    return (
        f"step {step}/{total} loss {r['loss']:.4f} acc@1 {acc1:.3f} acc@last {acc_last:.3f} "
        f"accept_len {r['accept_len']:.2f} accept_len_prob {r['accept_len_prob']:.2f} lr {r['lr']:.2e} "
        f"grad_norm {r['grad_norm']:.3g} tok/s {r['tokens_per_s']:.0f} ring_wait {r['ring/wait_s']:.1f}s "
        f"depth {r['ring/depth']:.0f} producers {r['producers/items_per_s']:.2f} items/s "
        f"{r['producers/tokens_per_s']:.0f} tok/s"
        + (f" tau_prob {r['tau_probabilistic']:.2f}" if "tau_probabilistic" in r else "")
        + (f" conf_err {r['confidence/abs_error']:.3f}" if "confidence/abs_error" in r else "")
        + (
            f" sel_accept_len {r['selector/accept_len']:.2f} top_k_recall {r['selector/top_k_recall']:.3f}"
            if "selector/accept_len" in r
            else ""
        )
    )
