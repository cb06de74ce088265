"""Soft KL from the target's distribution p to the draft's q, KL(p || q), and its gradient w.r.t. the logits, q - p.

p is the target's softmax through its own (frozen) head on the shipped final hidden state: the distribution the
target would sample the label from (recipes.md: the ddtree recipe's `kl15`)."""

from __future__ import annotations

import torch


def kl_of(p: torch.Tensor, log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """[rows] sum_v p (log p - log q)."""
    return (p * (log_p - log_q)).sum(dim=-1)


def kl_grad(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return q - p
