"""The target's logits once per distinct sequence position a step reads, and which one each row reads.

The teacher's logits depend on the sequence position alone, and overlapping blocks read the same positions (ddtree:
~8 blocks per position), so they are computed once per distinct position (TeacherLogits), kept for the step and
gathered per row inside the fused chunk passes: the same values as one product per row, at an eighth of the
teacher's head FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash_ring.consumer.modeling.target_head import head_logits


@dataclass(frozen=True)
class TeacherLogits:
    """logits is None when only the target's argmax is needed (label = "target_argmax" without KL or L1)."""

    logits: torch.Tensor | None  # [U, V] in the head's dtype, as head_logits gives them
    lse: torch.Tensor  # [U] fp32 log-normalisers
    argmax: torch.Tensor  # [U] the target's greedy token
    row: torch.Tensor  # [R] int64: supervised row r reads position row[r]


def teacher_logits(
    target_hidden: torch.Tensor,
    positions: torch.Tensor,
    weight: torch.Tensor,
    multiplier: float | None,
    cap: float | None,
    chunk_rows: int,
    keep_logits: bool,
) -> TeacherLogits:
    """Teacher logits of target_hidden[positions] [R, H], each distinct position's product computed once
    (in chunks of chunk_rows, so the softmax temporaries stay one chunk wide)."""
    distinct, row = torch.unique(positions, return_inverse=True)
    n = distinct.numel()
    logits = torch.empty(n, weight.shape[0], dtype=weight.dtype, device=weight.device) if keep_logits else None
    lse = torch.empty(n, device=weight.device)
    argmax = torch.empty(n, dtype=torch.long, device=weight.device)
    with torch.no_grad():
        for lo in range(0, n, max(chunk_rows, 1)):
            part = slice(lo, min(lo + chunk_rows, n))
            chunk = head_logits(F.linear(target_hidden[distinct[part]].to(weight.dtype), weight), multiplier, cap)
            lse[part], argmax[part] = torch.logsumexp(chunk.float(), dim=-1), chunk.argmax(dim=-1)
            if logits is not None:
                logits[part] = chunk
    return TeacherLogits(logits, lse, argmax, row)
