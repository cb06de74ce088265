"""Loss, accuracy and accept length per data source: sums over the blocks of each source's sequences.

Built from DFlashLoss's per-block tensors: block i belongs to sequence
repeat_interleave(arange(S), cu_anchors.diff())[i], and that sequence to the item's source_ids entry.
Everything is kept as sums (the blocks' weighted loss and weights, hits and supervised positions, accept
lengths and blocks), so micro-batches, steps and windows add up exactly and a figure is one ratio at the
end: a source's loss over a window is sum(block_loss_sum) / sum(block_weight_sum) over its blocks in that
window, exactly what the objective (its CE and KL terms; CAP is a whole-batch term) gives on those blocks
alone.

Labels are the configured source names (data.source_names(), at most data.MAX_SOURCES): an item that
names another source (a producer of another configuration) is counted under OTHER, said once per name,
so the `source` label of the Prometheus series stays bounded whatever the ring carries.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields

import torch

from dflash_ring.consumer.training.loss import DFlashLoss
from dflash_ring.consumer.modeling.model import Anchors

log = logging.getLogger(__name__)

OTHER = "other"  # the label of sources this drafter was not configured with


@dataclass
class SourceStats:
    """One source's sums over some blocks."""

    blocks: int = 0
    tokens: int = 0  # supervised (loss-mask) tokens of the source's sequences, anchored or not
    loss_sum: float = 0.0  # DFlashLoss.block_loss_sum summed: w_k * (CE_k + kl_weight * KL_k), raw weights
    weight_sum: float = 0.0
    correct: int = 0
    valid: int = 0
    accept_sum: float = 0.0  # teacher-forced accepted prefix + 1, summed over blocks
    accept_prob_sum: float = 0.0  # probabilistic accept length, summed over blocks
    # With L1 to the target (DSpark): tau_probabilistic summed over the blocks that have it; with a confidence
    # head, |c - alpha*|, c - alpha* and the cumulative products' difference summed over supervised drafts.
    analytic_blocks: int = 0
    tau_prob_sum: float = 0.0
    confidence_drafts: int = 0
    confidence_sums: tuple[float, float, float] = (0.0, 0.0, 0.0)

    def add(self, other: SourceStats) -> None:
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            setattr(
                self, f.name, tuple(a + b for a, b in zip(mine, theirs)) if isinstance(mine, tuple) else mine + theirs
            )

    @property
    def tau_probabilistic(self) -> float:
        return self.tau_prob_sum / self.analytic_blocks if self.analytic_blocks else 0.0

    @property
    def loss(self) -> float:
        return self.loss_sum / self.weight_sum if self.weight_sum else 0.0

    @property
    def accuracy(self) -> float:
        return self.correct / self.valid if self.valid else 0.0

    @property
    def accept_len(self) -> float:
        return self.accept_sum / self.blocks if self.blocks else 0.0

    @property
    def accept_len_prob(self) -> float:
        return self.accept_prob_sum / self.blocks if self.blocks else 0.0


def held_out_sources(saved: dict[str, dict[str, float]]) -> dict[str, SourceStats]:
    """Per-source sums as a record file keeps them (`asdict` of each SourceStats), read back: ValueError or
    TypeError for a value that is not one of the numbers written there."""
    out = {}
    for name, d in saved.items():
        if set(d) != {f.name for f in fields(SourceStats)}:
            raise ValueError(f"source {name!r}: keys {sorted(d)}")
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
        for k, v in values.items():
            for x in v if isinstance(v, tuple) else (v,):
                if isinstance(x, bool) or not isinstance(x, (int, float)) or x != x or abs(x) == float("inf"):
                    raise ValueError(f"source {name!r}: {k} = {v!r}")
        out[str(name)] = SourceStats(**values)
    return out


def add_sources(total: dict[str, SourceStats], part: dict[str, SourceStats]) -> None:
    for name, stats in part.items():
        total.setdefault(name, SourceStats()).add(stats)


def overall(by_source: dict[str, SourceStats]) -> SourceStats:
    """All sources together: the sums added (a ratio of the totals, not a mean of the sources' ratios)."""
    total = SourceStats()
    for s in by_source.values():
        total.add(s)
    return total


class SourceLabels:
    """Maps an item's source names onto this drafter's configured ones (OTHER for the rest)."""

    def __init__(self, configured: Iterable[str]):
        self.configured = tuple(configured)
        self._known = set(self.configured)
        self._warned: set[str] = set()

    def of(self, names: Sequence[str]) -> list[str]:
        out = []
        for name in names:
            if name in self._known:
                out.append(name)
                continue
            if name not in self._warned:
                self._warned.add(name)
                log.warning(
                    "ring items name data source %r, which this drafter's config does not list (%s): "
                    "counted as %r in the per-source figures",
                    name,
                    ", ".join(self.configured),
                    OTHER,
                )
            out.append(OTHER)
        return out


def by_source(
    out: DFlashLoss, anchors: Anchors, source_ids: torch.Tensor, loss_mask: torch.Tensor, labels: Sequence[str]
) -> dict[str, SourceStats]:
    """Each source's sums over the blocks of `out` (one item); `labels[k]` names source index k.

    One host transfer for all of it: the sums are gathered into one [8, K] tensor on the device.
    """
    k, device = len(labels), out.block_loss_sum.device
    seqs = torch.arange(anchors.cu_anchors.numel() - 1, device=device)
    block_source = source_ids.to(device, torch.long)[seqs.repeat_interleave(anchors.cu_anchors.diff())]
    token_source = source_ids.to(device, torch.long).repeat_interleave(anchors.cu_seqlens.diff())

    def per_source(index: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return torch.zeros(k, dtype=torch.float64, device=device).index_add_(0, index, values.double())

    ones = torch.ones_like(out.block_loss_sum)
    calib = out.calibration
    sums = torch.stack(
        [
            per_source(block_source, ones),
            per_source(token_source, loss_mask.to(device)),
            per_source(block_source, out.block_loss_sum),
            per_source(block_source, out.block_weight_sum),
            per_source(block_source, out.block_correct),
            per_source(block_source, out.block_valid),
            per_source(block_source, out.block_accept),
            per_source(block_source, out.block_accept_prob),
            *(
                (per_source(block_source, ones), per_source(block_source, out.block_tau_probabilistic))
                if out.block_tau_probabilistic is not None
                else ()
            ),
            *(
                (
                    per_source(block_source, calib.abs_error),
                    per_source(block_source, calib.bias),
                    per_source(block_source, calib.cumprod_bias),
                )
                if calib is not None
                else ()
            ),
        ]
    ).tolist()
    result: dict[str, SourceStats] = {}
    for j, label in enumerate(labels):
        b, t, ls, ws, c, v, a, ap, *dspark = (row[j] for row in sums)
        if not (b or t):
            continue
        extra = {}
        if out.block_tau_probabilistic is not None:
            extra |= {"analytic_blocks": int(dspark[0]), "tau_prob_sum": dspark[1]}
        if calib is not None:
            extra |= {"confidence_drafts": int(v), "confidence_sums": tuple(dspark[2:5])}
        result.setdefault(label, SourceStats()).add(SourceStats(int(b), int(t), ls, ws, int(c), int(v), a, ap, **extra))
    return result
