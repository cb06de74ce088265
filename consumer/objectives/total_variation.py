"""DSpark's distribution term: L1 = ||q - p||_1 (= 2 TV) between draft and target, and the analytic acceptance.

Under lossless rejection sampling a draft sampled from q is accepted with probability sum_v min(q_v, p_v) =
1 - TV = 1 - L1 / 2 (alpha*, DeepSpec's loss.py; clamped to [0, 1] against rounding): DSpark's confidence head
learns it, and its cumulative product along the block is the expected accepted length (tau_probabilistic).

d L1 / d z_j = q_j (s_j - sum_v q_v s_v) with s = sign(q - p): the softmax's Jacobian applied to the sign.
"""

from __future__ import annotations

import torch


def l1_of(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """[rows] sum_v |q_v - p_v| (fp32)."""
    return (q - p).abs().sum(dim=-1)


def l1_grad(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    sign = torch.sign(q - p)
    return q * (sign - (q * sign).sum(dim=-1, keepdim=True))


def analytic_acceptance(l1: torch.Tensor) -> torch.Tensor:
    """alpha* = clamp(1 - L1 / 2, 0, 1), detached: what the confidence head is trained to predict."""
    return (1 - l1.detach() / 2).clamp(0, 1)
