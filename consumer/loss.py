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

The teacher's logits depend on the sequence position alone, and overlapping blocks read the same
positions (ddtree: ~8 blocks per position), so they are computed once per distinct position the step
reads (TeacherLogits), kept for the step and gathered per row inside the fused chunk function: the
same values as one product per row, at an eighth of the teacher's head FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash_ring.common.drafter_config import DrafterConfig
from .model import Anchors, FrozenTargetHead
from .fp8_head import E5M2, Fp8Head, quantize_rows
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


@dataclass(frozen=True)
class TeacherLogits:
    """The target's logits once per distinct sequence position a step reads, and which one each row reads.

    logits is None when only the target's argmax is needed (label = "target_argmax" without KL)."""

    logits: torch.Tensor | None  # [U, V] in the head's dtype, as head_logits gives them
    lse: torch.Tensor  # [U] fp32 log-normalisers
    argmax: torch.Tensor  # [U] the target's greedy token
    row: torch.Tensor  # [R] int64: supervised row r reads position row[r]


def teacher_logits(target_hidden: torch.Tensor, positions: torch.Tensor, weight: torch.Tensor,
                   multiplier: float | None, cap: float | None, chunk_rows: int, keep_logits: bool) -> TeacherLogits:
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


@dataclass(frozen=True)
class _Transform:
    """The target's logit transform (head_logits) and the gradient's format: constants of the compiled chunk."""

    multiplier: float | None  # the target's logit multiplier (Granite, Cohere, Falcon-H1), then
    cap: float | None  # its logit softcap (Gemma): applied to draft and teacher alike
    fp8: bool  # the gradient leaves the chunk quantized per row for the FP8 head product (fp8_head.py)


def _logit_grad(logits: torch.Tensor, log_q: torch.Tensor, label: torch.Tensor, p: torch.Tensor | None,
                a: torch.Tensor, k: torch.Tensor | None, transform: _Transform):
    """a (q - onehot) + k (q - p) = d(a CE + k KL)/d(logits) per row, through the logit transform to the plain
    head product: (d in the logits' dtype, None), or (d in E5M2, its row scales) for the FP8 head."""
    q = log_q.exp()
    onehot = torch.arange(log_q.shape[-1], device=log_q.device)[None, :] == label[:, None]
    d = (q - onehot.float()) * a[:, None]
    if p is not None:
        d = d + (q - p) * k[:, None]
    if transform.cap is not None:  # d(cap * tanh(z / cap))/dz = 1 - tanh^2, with tanh = capped / cap
        d = d * (1 - (logits.float() / transform.cap) ** 2)
    if transform.multiplier is not None:  # d(m z)/dz = m
        d = d * transform.multiplier
    return quantize_rows(d, E5M2) if transform.fp8 else (d.to(logits.dtype), None)


def _teacher_log_p(teacher: torch.Tensor, teacher_lse: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """log p of the rows [rows, V] from the per-position teacher logits: a gather the compiled chunk fuses."""
    return teacher[row].float() - teacher_lse[row][:, None]


def _chunk_terms(logits: torch.Tensor, label: torch.Tensor, teacher: torch.Tensor | None,
                 teacher_lse: torch.Tensor | None, row: torch.Tensor | None, a: torch.Tensor | None,
                 k: torch.Tensor | None, transform: _Transform):
    """Per-row CE and KL, the draft's top-1, the rows' log-normaliser and, when the coefficients a, k are
    known already, d(loss)/d(head product) of one row chunk (fp32 inside; _logit_grad).

    One function so that on a GPU torch.compile fuses the softmax, the teacher's gather, the argmax and the
    gradient into a pass or two over the [rows, vocab] chunk instead of one per op.
    """
    lse_q = torch.logsumexp(logits.float(), dim=-1)
    log_q = logits.float() - lse_q[:, None]
    predictions = logits.argmax(dim=-1)
    p = None
    kl = torch.zeros_like(lse_q)
    if teacher is not None:
        log_p = _teacher_log_p(teacher, teacher_lse, row)
        p = log_p.exp()
        kl = (p * (log_p - log_q)).sum(dim=-1)
    ce = -log_q.gather(1, label[:, None]).squeeze(1)
    d_logits = (None, None) if a is None else _logit_grad(logits, log_q, label, p, a, k, transform)
    return ce, kl, predictions, lse_q, d_logits


def _chunk_grad(logits: torch.Tensor, label: torch.Tensor, teacher: torch.Tensor | None,
                teacher_lse: torch.Tensor | None, row: torch.Tensor | None, lse_q: torch.Tensor, a: torch.Tensor,
                k: torch.Tensor | None, transform: _Transform):
    """d(loss)/d(head product) of one chunk once its coefficients are known (they depend on its CE: D-PACE,
    CAP): one elementwise pass, the softmax normalisers coming from the first."""
    p = None if teacher is None else _teacher_log_p(teacher, teacher_lse, row).exp()
    return _logit_grad(logits, logits.float() - lse_q[:, None], label, p, a, k, transform)


_compiled: dict[str, object] = {}


def _on(device: torch.device, fn):
    """fn compiled on CUDA. Sizes become symbolic only once they change between calls (the rows of a chunk,
    the step's teacher positions), so the vocabulary stays a constant and each element's row is not an
    integer division by a runtime value in the fused passes over [rows, vocab]."""
    if device.type != "cuda":
        return fn
    if fn.__name__ not in _compiled:
        _compiled[fn.__name__] = torch.compile(fn, dynamic=None)
    return _compiled[fn.__name__]


@dataclass(frozen=True)
class _Plan:
    """What the chunk loop needs besides tensors: the objective and where each chunk of whole blocks starts."""

    cfg: DrafterConfig
    row_bounds: list[int]  # chunk c owns rows [row_bounds[c], row_bounds[c + 1])
    block_bounds: list[int]  # and blocks [block_bounds[c], block_bounds[c + 1])
    normaliser: float  # S
    num_blocks: int
    transform: _Transform
    fp8: Fp8Head | None  # the FP8 copies of the head, when the draft's products run in FP8
    teacher: TeacherLogits | None  # the KL's teacher, per distinct position (None without KL)


class _ChunkedHeadLoss(torch.autograd.Function):
    """The loss above, chunked over whole blocks; see the module docstring."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, decay, valid, plan: _Plan):
        cfg, teacher = plan.cfg, plan.teacher
        needs_grad = ctx.needs_input_grad[0]
        grad = torch.empty_like(hidden) if needs_grad else None
        rows_out = [torch.empty(hidden.shape[0], device=hidden.device) for _ in range(3)]  # ce, kl, raw weight
        predictions = torch.empty_like(labels)
        loss = hidden.new_zeros((), dtype=torch.float32)
        # Coefficients known before the CE (the paper's fixed weights, no CAP): one fused pass per chunk.
        fixed = cfg.loss == "ce" and cfg.cap_weight == 0
        cap_scale = cfg.cap_weight / (max(plan.num_blocks, 1) * (valid.shape[1]))
        terms, second = _on(hidden.device, _chunk_terms), _on(hidden.device, _chunk_grad)
        for c in range(len(plan.row_bounds) - 1):
            rows = slice(plan.row_bounds[c], plan.row_bounds[c + 1])
            grid = valid[plan.block_bounds[c]:plan.block_bounds[c + 1]]
            draft = hidden[rows]
            plain = F.linear(draft.to(weight.dtype), weight) if plan.fp8 is None else plan.fp8.logits(draft)
            logits = head_logits(plain, plan.transform.multiplier, plan.transform.cap)
            taught = (None, None, None) if teacher is None else (teacher.logits, teacher.lse, teacher.row[rows])
            w = decay[rows] if cfg.loss == "ce" else None
            a = w / plan.normaliser if fixed and needs_grad else None
            ce, kl, predictions[rows], lse_q, d_logits = terms(
                logits, labels[rows], *taught, a, None if a is None else a * cfg.kl_weight, plan.transform)
            ce_grid = torch.zeros(grid.shape, device=ce.device).masked_scatter(grid, ce.detach())
            if w is None:
                w = dpace_weights(ce_grid, grid, cfg.dpace_alpha)[grid]
            products = accept_products(ce_grid, grid)
            loss += (w * (ce + cfg.kl_weight * kl)).sum() / plan.normaliser - cap_scale * products.sum()
            rows_out[0][rows], rows_out[1][rows], rows_out[2][rows] = ce, kl, w
            if not needs_grad:
                continue
            if d_logits[0] is None:
                # d(-cap_scale * sum A)/d(CE_j) = cap_scale * sum_{k>=j} P_k: the positions j gates.
                gated = products.flip(1).cumsum(1).flip(1)[grid]
                a = w / plan.normaliser + cap_scale * gated
                d_logits = second(logits, labels[rows], *taught, lse_q, a, w / plan.normaliser * cfg.kl_weight,
                                  plan.transform)
            d, d_scale = d_logits
            grad[rows] = (d @ weight if plan.fp8 is None else plan.fp8.grad_hidden(d, d_scale)).to(hidden.dtype)
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(*rows_out, predictions)
        return loss, *rows_out, predictions

    @staticmethod
    def backward(ctx, d_loss, *_):
        (grad,) = ctx.saved_tensors
        return grad * d_loss.to(grad.dtype), None, None, None, None, None


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
    teacher_positions: int  # distinct positions whose teacher logits the step computed (0 without a teacher)
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


def _plan(valid: torch.Tensor, cfg: DrafterConfig, normaliser: float, head: FrozenTargetHead,
          teacher: TeacherLogits | None) -> _Plan:
    per_chunk = max(1, cfg.loss_chunk_tokens // valid.shape[1])
    row_ends = F.pad(valid.sum(dim=1).cumsum(0), (1, 0))
    blocks = list(range(0, valid.shape[0], per_chunk)) + [valid.shape[0]]
    transform = _Transform(head.logit_multiplier, head.logit_softcap, fp8=head.fp8 is not None)
    return _Plan(cfg, row_ends[blocks].tolist(), blocks, normaliser, valid.shape[0], transform, head.fp8,
                 teacher if cfg.kl_weight > 0 else None)


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
    teacher, used = None, labels.tokens[:, 1:][valid]
    if target_hidden is not None:
        teacher_positions = anchors.positions[:, None] + torch.arange(block_size - 1, device=hidden.device)
        teacher = teacher_logits(target_hidden, teacher_positions[valid], head.lm_head_weight, head.logit_multiplier,
                                 head.logit_softcap, cfg.loss_chunk_tokens, keep_logits=cfg.kl_weight > 0)
        if cfg.label == "target_argmax":
            used = teacher.argmax[teacher.row]
    loss, ce, kl, w, predictions = _ChunkedHeadLoss.apply(
        hidden[:, 1:][valid], head.lm_head_weight, used, decay, valid, _plan(valid, cfg, normaliser, head, teacher))

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
        teacher_positions=0 if teacher is None else teacher.lse.numel(),
        block_loss_sum=grid(w * (ce + cfg.kl_weight * kl)).sum(dim=1),
        block_weight_sum=grid(w).sum(dim=1) if cfg.loss == "ce" else valid.sum(dim=1).float(),
        block_correct=correct.sum(dim=1),
        block_valid=valid.sum(dim=1),
        block_accept=block_accept,
        block_accept_prob=block_accept_prob,
    )
