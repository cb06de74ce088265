"""DFlash objectives through the frozen lm_head: position-weighted CE (paper or D-PACE), soft KL, CAP.

Block position k predicts token anchor+k (k >= 1; the anchor itself is not a target). Every term is a
function of two per-position quantities, the CE of the label under the drafter, CE_k, and (with a
teacher) the KL from the target's distribution, KL_k:

    loss = sum_k w_k (CE_k + kl_weight * KL_k) / S  -  cap_weight * mean_blocks(A / (B - 1))

- "ce" (the paper): w_k = exp(-(k-1)/gamma), S = sum of w over supervised positions.
- "dpace" (D-PACE, arXiv 2605.18810): q_k = exp(-CE_k) and q~_k = (1 - alpha) q_k + alpha, detached;
  C_k = prod_{j<=k} q~_j (an unsupervised position counts as 1); w_k = sum_{m>=k} C_m mask_m; S = the number
  of supervised positions (speculators' normalisation: docs/recipes.md says why).
- CAP: A = sum_{k>=1} prod_{j<=k} q_j(y_j), the expected accepted length under the drafter's own
  distribution (an unsupervised position ends the product); gradients flow through the products.
  1 + A is also reported as the probabilistic accept length.

Every per-position coefficient depends only on its own block, so the vocabulary projection runs in
chunks of whole blocks inside one autograd node: a [rows, vocab] logits tensor exists for one chunk at
a time in the forward and is never kept for the backward; the gradient w.r.t. the draft hidden is
formed chunk by chunk (the head is frozen, so that is the only gradient).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash_ring.common.drafter_config import DrafterConfig
from .model import Anchors, FrozenTargetHead
from .target_head import head_logits


def position_weights(block_size: int, gamma: float, device: torch.device | None = None) -> torch.Tensor:
    """[B] weights; position 0 (the given anchor token) gets 0."""
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    return torch.where(k >= 1, torch.exp(-(k - 1) / gamma), torch.zeros_like(k))


def dpace_weights(ce: torch.Tensor, valid: torch.Tensor, alpha: float) -> torch.Tensor:
    """[N, K] D-PACE weights of block positions 1..K from their CE [N, K] (detached; 0 where not valid)."""
    q = torch.exp(-ce.detach().float())
    smoothed = torch.where(valid, (1 - alpha) * q + alpha, torch.ones_like(q))
    reach = torch.cumprod(smoothed, dim=1) * valid
    return torch.where(valid, reach.flip(1).cumsum(1).flip(1), torch.zeros_like(q))


def accept_products(ce: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[N, K] prod_{j<=k} q_j(y_j) with q = exp(-CE): the chance the first k drafts are all accepted when
    sampled from the drafter; an unsupervised position ends the product (differentiable in ce)."""
    alive = torch.cumprod(valid.to(ce.dtype), dim=1)
    return torch.exp(-torch.cumsum(torch.where(valid, ce, torch.zeros_like(ce)), dim=1)) * alive


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


def _logit_grad(log_q: torch.Tensor, label: torch.Tensor, p: torch.Tensor | None, a: torch.Tensor,
                k: torch.Tensor | None) -> torch.Tensor:
    """a (q - onehot) + k (q - p): d(a CE + k KL)/d(logits) per row, fp32."""
    q = log_q.exp()
    onehot = torch.arange(log_q.shape[-1], device=log_q.device)[None, :] == label[:, None]
    d = (q - onehot.float()) * a[:, None]
    if p is not None:
        d = d + (q - p) * k[:, None]
    return d


def _chunk_terms(logits: torch.Tensor, label: torch.Tensor, teacher_logits: torch.Tensor | None,
                 label_from_teacher: bool, a: torch.Tensor | None, k: torch.Tensor | None):
    """Per-row CE and KL, the draft's top-1, the label used, the rows' log-normalisers and, when the
    coefficients a, k are known already, d(loss)/d(logits) of one row chunk (fp32 inside).

    One function so that on a GPU torch.compile fuses the softmax, gather, argmax and gradient into a
    pass or two over the [rows, vocab] chunk instead of one per op.
    """
    lse_q = torch.logsumexp(logits.float(), dim=-1)
    log_q = logits.float() - lse_q[:, None]
    predictions = logits.argmax(dim=-1)
    p, lse_p = None, torch.zeros_like(lse_q)
    kl = torch.zeros_like(lse_q)
    if teacher_logits is not None:
        lse_p = torch.logsumexp(teacher_logits.float(), dim=-1)
        log_p = teacher_logits.float() - lse_p[:, None]
        if label_from_teacher:
            label = teacher_logits.argmax(dim=-1)
        p = log_p.exp()
        kl = (p * (log_p - log_q)).sum(dim=-1)
    ce = -log_q.gather(1, label[:, None]).squeeze(1)
    d_logits = None if a is None else _logit_grad(log_q, label, p, a, k).to(logits.dtype)
    return ce, kl, predictions, label, lse_q, lse_p, d_logits


def _chunk_grad(logits: torch.Tensor, label: torch.Tensor, teacher_logits: torch.Tensor | None, lse_q: torch.Tensor,
                lse_p: torch.Tensor, a: torch.Tensor, k: torch.Tensor | None) -> torch.Tensor:
    """d(loss)/d(logits) of one chunk once its coefficients are known (they depend on its CE: D-PACE, CAP):
    one elementwise pass, the softmax normalisers coming from the first."""
    p = None if teacher_logits is None else torch.exp(teacher_logits.float() - lse_p[:, None])
    return _logit_grad(logits.float() - lse_q[:, None], label, p, a, k).to(logits.dtype)


_compiled: dict[str, object] = {}


def _on(device: torch.device, fn):
    if device.type != "cuda":
        return fn
    if fn.__name__ not in _compiled:
        _compiled[fn.__name__] = torch.compile(fn, dynamic=True)
    return _compiled[fn.__name__]


@dataclass(frozen=True)
class _Plan:
    """What the chunk loop needs besides tensors: the objective and where each chunk of whole blocks starts."""

    cfg: DrafterConfig
    row_bounds: list[int]  # chunk c owns rows [row_bounds[c], row_bounds[c + 1])
    block_bounds: list[int]  # and blocks [block_bounds[c], block_bounds[c + 1])
    normaliser: float  # S
    num_blocks: int
    multiplier: float | None  # the target's logit multiplier (Granite, Cohere, Falcon-H1), then
    cap: float | None  # its logit softcap (Gemma): applied to draft and teacher alike (head_logits)


class _ChunkedHeadLoss(torch.autograd.Function):
    """The loss above, chunked over whole blocks; see the module docstring."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, decay, valid, target_hidden, plan: _Plan):
        cfg = plan.cfg
        needs_grad = ctx.needs_input_grad[0]
        grad = torch.empty_like(hidden) if needs_grad else None
        rows_out = [torch.empty(hidden.shape[0], device=hidden.device) for _ in range(3)]  # ce, kl, raw weight
        predictions, used = torch.empty_like(labels), torch.empty_like(labels)
        loss = hidden.new_zeros((), dtype=torch.float32)
        # Coefficients known before the CE (the paper's fixed weights, no CAP): one fused pass per chunk.
        fixed = cfg.loss == "ce" and cfg.cap_weight == 0
        cap_scale = cfg.cap_weight / (max(plan.num_blocks, 1) * (valid.shape[1]))
        terms, second = _on(hidden.device, _chunk_terms), _on(hidden.device, _chunk_grad)
        for c in range(len(plan.row_bounds) - 1):
            rows = slice(plan.row_bounds[c], plan.row_bounds[c + 1])
            grid = valid[plan.block_bounds[c]:plan.block_bounds[c + 1]]
            logits = head_logits(F.linear(hidden[rows].to(weight.dtype), weight), plan.multiplier, plan.cap)
            teacher = None if target_hidden is None else head_logits(
                F.linear(target_hidden[rows].to(weight.dtype), weight), plan.multiplier, plan.cap)
            w = decay[rows] if cfg.loss == "ce" else None
            a = w / plan.normaliser if fixed and needs_grad else None
            ce, kl, predictions[rows], used[rows], lse_q, lse_p, d_logits = terms(
                logits, labels[rows], teacher, cfg.label == "target_argmax", a,
                None if a is None else a * cfg.kl_weight)
            ce_grid = torch.zeros(grid.shape, device=ce.device).masked_scatter(grid, ce.detach())
            if w is None:
                w = dpace_weights(ce_grid, grid, cfg.dpace_alpha)[grid]
            products = accept_products(ce_grid, grid)
            loss += (w * (ce + cfg.kl_weight * kl)).sum() / plan.normaliser - cap_scale * products.sum()
            rows_out[0][rows], rows_out[1][rows], rows_out[2][rows] = ce, kl, w
            if not needs_grad:
                continue
            if d_logits is None:
                # d(-cap_scale * sum A)/d(CE_j) = cap_scale * sum_{k>=j} P_k: the positions j gates.
                gated = products.flip(1).cumsum(1).flip(1)[grid]
                a = w / plan.normaliser + cap_scale * gated
                d_logits = second(logits, used[rows], teacher, lse_q, lse_p, a, w / plan.normaliser * cfg.kl_weight)
            if plan.cap is not None:  # d(cap * tanh(z / cap))/dz = 1 - tanh^2, with tanh = capped / cap
                d_logits = d_logits * (1 - (logits.float() / plan.cap) ** 2).to(d_logits.dtype)
            if plan.multiplier is not None:  # d(m z)/dz = m
                d_logits = d_logits * plan.multiplier
            grad[rows] = (d_logits @ weight).to(hidden.dtype)
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(*rows_out, predictions, used)
        return loss, *rows_out, predictions, used

    @staticmethod
    def backward(ctx, d_loss, *_):
        (grad,) = ctx.saved_tensors
        return grad * d_loss.to(grad.dtype), None, None, None, None, None, None


@dataclass(frozen=True)
class DFlashLoss:
    loss: torch.Tensor  # scalar to backward
    ce: torch.Tensor  # detached: the weighted CE term, sum w CE / S
    kl: torch.Tensor  # detached: the weighted KL term, sum w KL / S (0 without a teacher)
    cap: torch.Tensor  # detached: mean over blocks of A / (B - 1) (what cap_weight scales)
    correct_per_position: torch.Tensor  # [B-1] top-1 hits at block positions 1..B-1
    valid_per_position: torch.Tensor  # [B-1] supervised labels at block positions 1..B-1
    accept_len: torch.Tensor  # mean over blocks of (teacher-forced accepted prefix + 1)
    accept_len_prob: torch.Tensor  # mean over blocks of 1 + A (tau_probabilistic)
    num_blocks: int
    # Per block [N], detached, for figures over any grouping of blocks (e.g. per data source): a group's loss
    # is sum(block_loss_sum) / sum(block_weight_sum).
    block_loss_sum: torch.Tensor  # sum_k w_k (CE_k + kl_weight KL_k), raw weights
    block_weight_sum: torch.Tensor  # the block's share of S
    block_correct: torch.Tensor
    block_valid: torch.Tensor
    block_accept: torch.Tensor
    block_accept_prob: torch.Tensor

    @property
    def accuracy_per_position(self) -> torch.Tensor:
        return self.correct_per_position / self.valid_per_position.clamp_min(1)

    @property
    def num_valid_tokens(self) -> torch.Tensor:
        return self.valid_per_position.sum()


def _plan(valid: torch.Tensor, cfg: DrafterConfig, normaliser: float, head: FrozenTargetHead) -> _Plan:
    per_chunk = max(1, cfg.loss_chunk_tokens // valid.shape[1])
    row_ends = F.pad(valid.sum(dim=1).cumsum(0), (1, 0))
    blocks = list(range(0, valid.shape[0], per_chunk)) + [valid.shape[0]]
    return _Plan(cfg, row_ends[blocks].tolist(), blocks, normaliser, valid.shape[0], head.logit_multiplier,
                 head.logit_softcap)


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

    target_hidden: optional [T, H] final-normed target hidden states, needed iff the objective reads the
    target (cfg.needs_target_logits: KL, or target-argmax labels); head.logits(target_hidden[p]) is the
    target's distribution for token p+1, so the teacher for label anchor+k sits at anchor+k-1.
    """
    if cfg.needs_target_logits != (target_hidden is not None):
        raise ValueError("target_hidden must be given exactly when kl_weight > 0 or label = 'target_argmax'")
    block_size = hidden.shape[1]
    if block_size != cfg.block_size:
        raise ValueError(f"hidden has blocks of {block_size}, config says {cfg.block_size}")
    labels = block_labels(anchors, input_ids, loss_mask, block_size)
    valid = labels.valid[:, 1:]
    if cfg.loss == "ce":
        decay = position_weights(block_size, cfg.loss_gamma, hidden.device)[1:].expand_as(valid)[valid]
        normaliser = float(decay.sum())
    else:  # D-PACE: the weights come from the CE, chunk by chunk
        decay, normaliser = None, float(valid.sum())
    normaliser = max(normaliser, torch.finfo(torch.float32).tiny)
    teacher = None
    if target_hidden is not None:
        teacher_positions = anchors.positions[:, None] + torch.arange(block_size - 1, device=hidden.device)
        teacher = target_hidden[teacher_positions[valid]]
    loss, ce, kl, w, predictions, used = _ChunkedHeadLoss.apply(
        hidden[:, 1:][valid], head.lm_head_weight, labels.tokens[:, 1:][valid], decay, valid, teacher,
        _plan(valid, cfg, normaliser, head))

    def grid(rows: torch.Tensor) -> torch.Tensor:
        return torch.zeros(valid.shape, dtype=rows.dtype, device=rows.device).masked_scatter(valid, rows)

    correct = grid(predictions == used)
    # A miss or an unsupervised position ends the accepted prefix, as the verifier would.
    block_accept = (correct.long().cumprod(dim=1).sum(dim=1) + 1).float()
    block_accept_prob = 1 + accept_products(grid(ce), valid).sum(dim=1)
    n = max(anchors.num_blocks, 1)
    return DFlashLoss(
        loss=loss,
        ce=(w * ce).sum() / normaliser,
        kl=(w * kl).sum() / normaliser,
        cap=(block_accept_prob - 1).sum() / (n * (block_size - 1)),
        correct_per_position=correct.sum(dim=0),
        valid_per_position=valid.sum(dim=0),
        accept_len=block_accept.sum() / n,
        accept_len_prob=block_accept_prob.sum() / n,
        num_blocks=anchors.num_blocks,
        block_loss_sum=grid(w * (ce + cfg.kl_weight * kl)).sum(dim=1),
        block_weight_sum=grid(w).sum(dim=1) if cfg.loss == "ce" else valid.sum(dim=1).float(),
        block_correct=correct.sum(dim=1),
        block_valid=valid.sum(dim=1),
        block_accept=block_accept,
        block_accept_prob=block_accept_prob,
    )
