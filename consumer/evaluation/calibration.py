"""How well a DSpark drafter's confidence predicts acceptance, measured on verification rounds (the offline eval).

The confidence head's c_k estimates P(slot k accepted | every earlier slot accepted), so the product
prod_{j<=k} sigmoid(c_j) predicts that the first k drafts of a round are all accepted; serving engines schedule
verification by it (reference dspark-dflash2.md, 1.2). Per position k = 1..B, over every round, that product is
scored against the round's outcome (accepted >= k), as DeepSpec's confidence-head eval does
(deepspec/eval/dspark/confidence_head.py): ECE over equal-width bins, AUROC (rank-based, ties at average rank),
Brier score, and the bins themselves for a reliability diagram (`dflash-ring report EVAL.json`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

BINS = 10


@dataclass(frozen=True)
class ReliabilityBin:
    lo: float  # predictions in [lo, hi); the last bin also holds 1.0
    hi: float
    count: int
    mean_predicted: float | None  # None for an empty bin
    observed: float | None  # the fraction of its rounds whose first k drafts were all accepted


@dataclass(frozen=True)
class PositionCalibration:
    position: int  # k: the first k drafts of a round; 0 for all positions pooled
    count: int  # rounds scored (pooled: rounds x positions)
    observed: float  # fraction with the first k drafts all accepted
    mean_predicted: float  # mean of prod_{j<=k} sigmoid(c_j)
    ece: float
    auroc: float | None  # None where every round had the same outcome
    brier: float
    bins: list[ReliabilityBin]


@dataclass(frozen=True)
class ConfidenceCalibration:
    bins: int
    positions: list[PositionCalibration]  # k = 1..B
    pooled: PositionCalibration


def _check(predicted: Sequence[float], outcomes: Sequence[bool]) -> None:
    if len(predicted) != len(outcomes):
        raise ValueError(f"{len(predicted)} predictions but {len(outcomes)} outcomes")
    if not predicted:
        raise ValueError("no predictions to score")
    if bad := [p for p in predicted if not 0.0 <= p <= 1.0]:
        raise ValueError(f"predictions must be probabilities in [0, 1], got {bad[:3]}")


def _bin_of(p: float, bins: int) -> int:
    return min(int(p * bins), bins - 1)


def reliability_bins(predicted: Sequence[float], outcomes: Sequence[bool], bins: int = BINS) -> list[ReliabilityBin]:
    """Equal-width bins of [0, 1]: per bin, how many predictions fell in it, their mean, and the observed rate."""
    _check(predicted, outcomes)
    sums, hits, counts = [0.0] * bins, [0] * bins, [0] * bins
    for p, y in zip(predicted, outcomes):
        b = _bin_of(p, bins)
        sums[b] += p
        hits[b] += bool(y)
        counts[b] += 1
    return [
        ReliabilityBin(
            lo=b / bins,
            hi=(b + 1) / bins,
            count=counts[b],
            mean_predicted=sums[b] / counts[b] if counts[b] else None,
            observed=hits[b] / counts[b] if counts[b] else None,
        )
        for b in range(bins)
    ]


def expected_calibration_error(predicted: Sequence[float], outcomes: Sequence[bool], bins: int = BINS) -> float:
    """sum over equal-width bins of (bin count / N) * |mean prediction - observed rate|."""
    n = len(predicted)
    return sum(
        b.count / n * abs(b.mean_predicted - b.observed) for b in reliability_bins(predicted, outcomes, bins) if b.count
    )


def auroc(predicted: Sequence[float], outcomes: Sequence[bool]) -> float | None:
    """P(a random positive scores above a random negative), ties counting one half: the Mann-Whitney U statistic
    from average ranks. None when the outcomes are all one class (no pair to rank)."""
    _check(predicted, outcomes)
    positives = sum(bool(y) for y in outcomes)
    negatives = len(outcomes) - positives
    if not positives or not negatives:
        return None
    order = sorted(range(len(predicted)), key=lambda i: predicted[i])
    rank_sum, i = 0.0, 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and predicted[order[j + 1]] == predicted[order[i]]:
            j += 1
        average_rank = (i + j) / 2 + 1  # ranks i+1..j+1 shared by the tied group
        rank_sum += average_rank * sum(bool(outcomes[order[m]]) for m in range(i, j + 1))
        i = j + 1
    return (rank_sum - positives * (positives + 1) / 2) / (positives * negatives)


def brier_score(predicted: Sequence[float], outcomes: Sequence[bool]) -> float:
    _check(predicted, outcomes)
    return sum((p - float(bool(y))) ** 2 for p, y in zip(predicted, outcomes)) / len(predicted)


def _score(position: int, predicted: Sequence[float], outcomes: Sequence[bool], bins: int) -> PositionCalibration:
    return PositionCalibration(
        position=position,
        count=len(predicted),
        observed=sum(map(bool, outcomes)) / len(outcomes),
        mean_predicted=sum(predicted) / len(predicted),
        ece=expected_calibration_error(predicted, outcomes, bins),
        auroc=auroc(predicted, outcomes),
        brier=brier_score(predicted, outcomes),
        bins=reliability_bins(predicted, outcomes, bins),
    )


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x)) if x >= 0 else math.exp(x) / (1 + math.exp(x))


def prefix_predictions(rounds: Sequence[tuple[Sequence[float], int]]) -> list[tuple[list[float], list[bool]]]:
    """Per position k = 1..B (B: the drafts per round), over every round (its confidence logits c_1..c_B and how
    many drafts it accepted): (prod_{j<=k} sigmoid(c_j) per round, accepted >= k per round)."""
    width = {len(logits) for logits, _ in rounds}
    if len(width) != 1:
        raise ValueError(f"rounds carry different numbers of confidences: {sorted(width)}")
    (drafts,) = width
    per_position: list[tuple[list[float], list[bool]]] = [([], []) for _ in range(drafts)]
    for logits, accepted in rounds:
        if not 0 <= accepted <= drafts:
            raise ValueError(f"a round accepted {accepted} of {drafts} drafts")
        product = 1.0
        for k, c in enumerate(logits):
            product *= sigmoid(c)
            per_position[k][0].append(product)
            per_position[k][1].append(accepted >= k + 1)
    return per_position


def confidence_calibration(
    rounds: Sequence[tuple[Sequence[float], int]], bins: int = BINS
) -> ConfidenceCalibration | None:
    """The figures per position and pooled over positions; None without rounds."""
    if not rounds:
        return None
    per_position = prefix_predictions(rounds)
    pooled_p = [p for predicted, _ in per_position for p in predicted]
    pooled_y = [y for _, outcomes in per_position for y in outcomes]
    return ConfidenceCalibration(
        bins=bins,
        positions=[_score(k + 1, predicted, outcomes, bins) for k, (predicted, outcomes) in enumerate(per_position)],
        pooled=_score(0, pooled_p, pooled_y, bins),
    )
