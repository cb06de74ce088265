"""DSpark's confidence objective and the figures that say how well the confidence is calibrated.

The head's logit c_k is trained with BCE against the detached analytic acceptance alpha*_k (total_variation.py),
position-weighted like CE and normalised by the weights' sum (DeepSpec's loss.py; the gradient reaches the backbone
and markov_w1, as there: speculators tried detaching it and reverted). The serving engines schedule verification by
the cumulative product of sigmoid(c) along the block, so its bias against the product of alpha* is reported too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def confidence_loss(
    logits: torch.Tensor, alpha: torch.Tensor, weights: torch.Tensor, normaliser: float
) -> torch.Tensor:
    """sum w BCE(sigmoid(logits), alpha) / S over supervised rows (all [R], fp32)."""
    bce = F.binary_cross_entropy_with_logits(logits.float(), alpha.float(), reduction="none")
    return (weights * bce).sum() / normaliser


@dataclass(frozen=True)
class Calibration:
    """Per block [N], sums over its supervised drafts: for figures over any grouping of blocks (per data source)."""

    abs_error: torch.Tensor  # sum |sigmoid(c) - alpha*|
    bias: torch.Tensor  # sum sigmoid(c) - alpha*
    cumprod_bias: torch.Tensor  # sum prod_{j<=k} sigmoid(c_j) - prod_{j<=k} alpha*_j


def calibration(confidence: torch.Tensor, alpha: torch.Tensor, valid: torch.Tensor) -> Calibration:
    """confidence (probabilities) and alpha* on the [N, K] grid, valid where supervised (a prefix of each block)."""
    live = valid.float()
    c, a = confidence.detach().float() * live, alpha.float() * live
    prefix_c, prefix_a = (c + (1 - live)).cumprod(1) * live, (a + (1 - live)).cumprod(1) * live
    return Calibration(((c - a).abs() * live).sum(1), ((c - a) * live).sum(1), (prefix_c - prefix_a).sum(1))
