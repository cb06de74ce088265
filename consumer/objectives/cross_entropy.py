"""CE of the label under the draft, -log q(y), and its gradient w.r.t. the logits, q - onehot(y)."""

from __future__ import annotations

import torch


def ce_of(log_q: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """[rows] -log q(label) from log_q [rows, V] (fp32)."""
    return -log_q.gather(1, label[:, None]).squeeze(1)


def ce_grad(q: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """d CE / d logits [rows, V]."""
    onehot = torch.arange(q.shape[-1], device=q.device)[None, :] == label[:, None]
    return q - onehot.float()
