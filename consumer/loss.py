"""DFlash objective: position-decayed CE (optionally + KL to the target) through the frozen lm_head.

Block position k predicts token anchor+k (k >= 1; the anchor itself is not a
target) with weight exp(-(k-1)/gamma): early positions gate acceptance of all
later ones. The vocabulary projection runs in row chunks inside one autograd
node, so a [rows, vocab] logits tensor exists for one chunk at a time in the
forward and is never kept for the backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash_ring.common.drafter_config import DrafterConfig
from .model import Anchors, FrozenTargetHead
from .target_head import softcap


def position_weights(block_size: int, gamma: float, device: torch.device | None = None) -> torch.Tensor:
    """[B] weights; position 0 (the given anchor token) gets 0."""
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    return torch.where(k >= 1, torch.exp(-(k - 1) / gamma), torch.zeros_like(k))


@dataclass(frozen=True)
class BlockLabels:
    tokens: torch.Tensor  # [N, B] int64: input_ids[anchor + k] (0 where that is outside the sequence)
    valid: torch.Tensor  # [N, B] bool: k >= 1, anchor + k inside the anchor's sequence, loss_mask set


def block_labels(
    anchors: Anchors, input_ids: torch.Tensor, loss_mask: torch.Tensor, block_size: int
) -> BlockLabels:
    offsets = torch.arange(block_size, device=input_ids.device)
    positions = anchors.positions[:, None] + offsets
    inside = positions < anchors.seq_bounds()[1][:, None]
    safe = torch.where(inside, positions, 0)
    valid = inside & (offsets >= 1) & loss_mask.bool()[safe]
    return BlockLabels(tokens=torch.where(valid, input_ids[safe], 0), valid=valid)


def _chunk_terms(logits: torch.Tensor, label: torch.Tensor, w: torch.Tensor, target_logits: torch.Tensor | None,
                 kl_weight: float, need_grad: bool):
    """Weighted CE and KL sums, top-1 and d(loss)/d(logits) of one row chunk, in fp32.

    One function so that on a GPU torch.compile fuses the softmax, gather, argmax and
    gradient into a pass or two over the [rows, vocab] chunk instead of one per op.
    """
    log_q = F.log_softmax(logits.float(), dim=-1)
    predictions = log_q.argmax(dim=-1)
    ce = (w * -log_q.gather(1, label[:, None]).squeeze(1)).sum()
    kl = ce.new_zeros(())
    p = None
    if target_logits is not None:
        log_p = F.log_softmax(target_logits.float(), dim=-1)
        p = log_p.exp()
        kl = (w * (p * (log_p - log_q)).sum(dim=-1)).sum()
    if not need_grad:
        return ce, kl, predictions, None
    # d(CE)/d(logits) = q - onehot;  d(KL)/d(logits) = q - p.
    d_logits = log_q.exp()
    if p is not None:
        d_logits = d_logits * (1.0 + kl_weight) - kl_weight * p
    onehot = torch.arange(logits.shape[-1], device=logits.device)[None, :] == label[:, None]
    d_logits = (d_logits - onehot.float()) * w[:, None]
    return ce, kl, predictions, d_logits.to(logits.dtype)


_compiled_chunk_terms = None


def _terms_fn(device: torch.device):
    global _compiled_chunk_terms
    if device.type != "cuda":
        return _chunk_terms
    if _compiled_chunk_terms is None:
        _compiled_chunk_terms = torch.compile(_chunk_terms, dynamic=True)
    return _compiled_chunk_terms


class _ChunkedHeadLoss(torch.autograd.Function):
    """sum_r w_r * (CE_r + kl_weight * KL(target_r || draft_r)) over rows, chunked over rows.

    The gradient w.r.t. the draft hidden is formed chunk by chunk in the forward
    (the head is frozen, so that is the only gradient), which is why no logits
    survive to the backward.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, row_weights, target_hidden, kl_weight, chunk, cap):
        needs_grad = ctx.needs_input_grad[0]
        grad = torch.empty_like(hidden) if needs_grad else None
        ce_sum = hidden.new_zeros((), dtype=torch.float32)
        kl_sum = torch.zeros_like(ce_sum)
        predictions = torch.empty_like(labels)
        terms = _terms_fn(hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            logits = softcap(F.linear(hidden[rows].to(weight.dtype), weight), cap)
            teacher = None if target_hidden is None else softcap(
                F.linear(target_hidden[rows].to(weight.dtype), weight), cap)
            ce, kl, predictions[rows], d_logits = terms(logits, labels[rows], row_weights[rows], teacher,
                                                        kl_weight, needs_grad)
            ce_sum += ce
            kl_sum += kl
            if needs_grad:
                if cap is not None:  # d(cap * tanh(z / cap))/dz = 1 - tanh^2, with tanh = capped / cap
                    d_logits = d_logits * (1 - (logits.float() / cap) ** 2).to(d_logits.dtype)
                grad[rows] = (d_logits @ weight).to(hidden.dtype)
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(ce_sum, kl_sum, predictions)
        return ce_sum + kl_weight * kl_sum, ce_sum, kl_sum, predictions

    @staticmethod
    def backward(ctx, d_loss, _d_ce, _d_kl, _d_predictions):
        (grad,) = ctx.saved_tensors
        return grad * d_loss.to(grad.dtype), None, None, None, None, None, None, None


@dataclass(frozen=True)
class DFlashLoss:
    loss: torch.Tensor  # scalar to backward: weighted CE + kl_weight * weighted KL
    ce: torch.Tensor  # detached weighted CE
    kl: torch.Tensor  # detached weighted KL (0 without target_hidden)
    correct_per_position: torch.Tensor  # [B-1] top-1 hits at block positions 1..B-1
    valid_per_position: torch.Tensor  # [B-1] supervised labels at block positions 1..B-1
    accept_len: torch.Tensor  # mean over blocks of (teacher-forced accepted prefix + 1)
    num_blocks: int

    @property
    def accuracy_per_position(self) -> torch.Tensor:
        return self.correct_per_position / self.valid_per_position.clamp_min(1)

    @property
    def num_valid_tokens(self) -> torch.Tensor:
        return self.valid_per_position.sum()


def dflash_loss(
    hidden: torch.Tensor,
    anchors: Anchors,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    head: FrozenTargetHead,
    cfg: DrafterConfig,
    target_hidden: torch.Tensor | None = None,
) -> DFlashLoss:
    """Loss and metrics for drafter output hidden [N, B, H] (DFlashDraftModel.forward).

    target_hidden: optional [T, H] final-normed target hidden states, needed iff
    cfg.kl_weight > 0; head.logits(target_hidden[p]) is the target's distribution
    for token p+1, so the teacher for label anchor+k sits at anchor+k-1.
    """
    if (cfg.kl_weight > 0) != (target_hidden is not None):
        raise ValueError("target_hidden must be given exactly when kl_weight > 0")
    block_size = hidden.shape[1]
    if block_size != cfg.block_size:
        raise ValueError(f"hidden has blocks of {block_size}, config says {cfg.block_size}")
    labels = block_labels(anchors, input_ids, loss_mask, block_size)
    valid = labels.valid[:, 1:]
    targets = labels.tokens[:, 1:][valid]
    weights = position_weights(block_size, cfg.loss_gamma, hidden.device)[1:].expand_as(valid)[valid]
    row_weights = weights / weights.sum().clamp_min(torch.finfo(torch.float32).tiny)
    teacher = None
    if target_hidden is not None:
        teacher_positions = anchors.positions[:, None] + torch.arange(block_size - 1, device=hidden.device)
        teacher = target_hidden[teacher_positions[valid]]
    loss, ce, kl, predictions = _ChunkedHeadLoss.apply(
        hidden[:, 1:][valid],
        head.lm_head_weight,
        targets,
        row_weights,
        teacher,
        cfg.kl_weight,
        cfg.loss_chunk_tokens,
        head.logit_softcap,  # the target's final_logit_softcapping (Gemma), applied to draft and teacher alike
    )
    correct = torch.zeros_like(valid)
    correct[valid] = predictions == targets
    # A miss or an unsupervised position ends the accepted prefix, as the verifier would.
    accepted = correct.long().cumprod(dim=1).sum(dim=1) + 1
    return DFlashLoss(
        loss=loss,
        ce=ce,
        kl=kl,
        correct_per_position=correct.sum(dim=0),
        valid_per_position=valid.sum(dim=0),
        accept_len=accepted.float().sum() / max(anchors.num_blocks, 1),
        num_blocks=anchors.num_blocks,
    )
