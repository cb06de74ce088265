"""The loss through the frozen lm_head, chunked over whole blocks inside one autograd node.

Every per-row coefficient depends only on its own block, so the vocabulary projection runs in chunks of whole blocks:
a [rows, vocab] logits tensor exists for one chunk at a time in the forward and is never kept for the backward; the
gradients are formed chunk by chunk (the head is frozen: the draft's hidden states, and with DSpark's Markov head its
features and markov_w2, are all that get one).

Per chunk: the fused pass (fused.py) gives each row's CE, KL and L1; the weighting (position_decay.py, dpace.py) gives
each row's weight w, before the CE when it can (then the gradient comes out of the same pass) or from the chunk's CE
grid; CAP (cap.py) adds its coefficients from the CE's products. With plan.top_k (DFlash2), each chunk's top-K logits
and ids are kept for the selector's objective (selector.py), which runs after the loop on [rows, K] only. The loop knows
terms and coefficients, not recipes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash_ring.consumer.modeling.fp8_head import E5M2, Fp8Head, quantize_rows
from dflash_ring.consumer.modeling.target_head import head_logits
from .cap import Cap, accept_products
from .dpace import DPace
from .fused import ChunkSpec, Coefficients, chunk_grad, chunk_terms, on
from .position_decay import PositionDecay
from .teacher import TeacherLogits


@dataclass(frozen=True)
class TermWeights:
    ce: float
    kl: float
    tv: float


@dataclass(frozen=True)
class HeadLossPlan:
    """What the chunk loop needs besides tensors: where each chunk of whole blocks starts, and the objective's parts."""

    row_bounds: list[int]  # chunk c owns rows [row_bounds[c], row_bounds[c + 1])
    block_bounds: list[int]  # and blocks [block_bounds[c], block_bounds[c + 1])
    weighting: PositionDecay | DPace
    terms: TermWeights
    cap: Cap | None
    spec: ChunkSpec
    fp8: Fp8Head | None  # the FP8 copies of the head, when the draft's products run in FP8
    teacher: TeacherLogits | None  # the teacher, per distinct position (None without KL or L1)
    top_k: int = 0  # DFlash2's selector: keep each row's top-K logits and ids, and its log-normaliser (selector.py)

    @property
    def normaliser(self) -> float:
        return max(self.weighting.normaliser, torch.finfo(torch.float32).tiny)


def chunk_plan(valid: torch.Tensor, chunk_tokens: int, **parts) -> HeadLossPlan:
    """Chunks of whole blocks, about chunk_tokens rows each; valid [N, K]: the supervised drafts of each block."""
    per_chunk = max(1, chunk_tokens // valid.shape[1])
    row_ends = F.pad(valid.sum(dim=1).cumsum(0), (1, 0))
    blocks = list(range(0, valid.shape[0], per_chunk)) + [valid.shape[0]]
    return HeadLossPlan(row_ends[blocks].tolist(), blocks, **parts)


class ChunkedHeadLoss(torch.autograd.Function):
    """See the module docstring. Inputs: the supervised rows' hidden [R, H], their Markov features [R, r] and
    markov_w2 [V, r] (or None, None), the head weight [V, H], the labels [R], valid [N, K], the plan. Outputs: the
    loss and, per row, CE, KL, L1 and the weight w (detached), the draft's top-1, and (plan.top_k = K; else K = 0)
    its top-K logits [R, K] fp32, their ids [R, K] and the log-normaliser [R]."""

    @staticmethod
    def forward(ctx, hidden, markov, markov_w2, weight, labels, valid, plan: HeadLossPlan):
        teacher, spec, terms, cap = plan.teacher, plan.spec, plan.terms, plan.cap
        wants = ctx.needs_input_grad
        grad = torch.empty_like(hidden) if wants[0] else None
        grad_markov = torch.empty_like(markov) if markov is not None and wants[1] else None
        grad_w2 = torch.zeros(markov_w2.shape, device=hidden.device) if markov_w2 is not None and wants[2] else None
        needs_grad = any(g is not None for g in (grad, grad_markov, grad_w2))
        rows_out = [torch.empty(hidden.shape[0], device=hidden.device) for _ in range(4)]  # ce, kl, l1, weight
        predictions = torch.empty_like(labels)
        top_values = torch.empty(hidden.shape[0], plan.top_k, device=hidden.device)
        top_ids = torch.empty(hidden.shape[0], plan.top_k, dtype=torch.long, device=hidden.device)
        row_lse = torch.empty(hidden.shape[0], device=hidden.device)
        loss = hidden.new_zeros((), dtype=torch.float32)
        # Coefficients known before the CE (fixed weights, no CAP): one fused pass per chunk.
        one_pass = plan.weighting.before_ce and cap is None
        s = plan.normaliser
        first, second = on(hidden.device, chunk_terms), on(hidden.device, chunk_grad)
        for c in range(len(plan.row_bounds) - 1):
            rows = slice(plan.row_bounds[c], plan.row_bounds[c + 1])
            grid = valid[plan.block_bounds[c] : plan.block_bounds[c + 1]]
            draft = hidden[rows]
            plain = F.linear(draft.to(weight.dtype), weight) if plan.fp8 is None else plan.fp8.logits(draft)
            if markov is not None:  # DSpark: the Markov head's bias, formed per chunk like the head product
                plain = plain + F.linear(markov[rows].to(markov_w2.dtype), markov_w2).to(plain.dtype)
            logits = head_logits(plain, spec.multiplier, spec.cap)
            taught = (teacher.logits, teacher.lse, teacher.row[rows]) if spec.taught else (None, None, None)
            coefficients = None
            if one_pass and needs_grad:
                w = plan.weighting.fixed(rows) / s
                coefficients = Coefficients(
                    terms.ce * w, terms.kl * w if spec.kl else None, terms.tv * w if spec.tv else None
                )
            ce, kl, l1, predictions[rows], lse_q, d_logits = first(logits, labels[rows], *taught, coefficients, spec)
            if plan.top_k:
                values, ids = torch.topk(logits, plan.top_k, dim=-1)
                top_values[rows], top_ids[rows], row_lse[rows] = values.float(), ids, lse_q
            ce_grid = torch.zeros(grid.shape, device=ce.device).masked_scatter(grid, ce.detach())
            w = plan.weighting.weights(rows, ce_grid, grid)
            loss += (w * (terms.ce * ce + terms.kl * kl + terms.tv * l1)).sum() / s
            products = accept_products(ce_grid, grid) if cap is not None else None
            if cap is not None:
                loss += cap.loss(products)
            rows_out[0][rows], rows_out[1][rows], rows_out[2][rows], rows_out[3][rows] = ce, kl, l1, w
            if not needs_grad:
                continue
            if d_logits[0] is None:
                a = terms.ce * w / s + (cap.ce_coefficients(products, grid) if cap is not None else 0)
                d_logits = second(
                    logits,
                    labels[rows],
                    *taught,
                    lse_q,
                    Coefficients(a, terms.kl * w / s if spec.kl else None, terms.tv * w / s if spec.tv else None),
                    spec,
                )
            d, d_scale = d_logits
            if markov is not None:  # the bias's gradient needs d itself, also when the head's product runs in FP8
                if grad_markov is not None:
                    grad_markov[rows] = (d @ markov_w2.to(d.dtype)).to(markov.dtype)
                if grad_w2 is not None:
                    grad_w2 += (d.t() @ markov[rows].to(d.dtype)).float()
                if plan.fp8 is not None:
                    d, d_scale = quantize_rows(d, E5M2)
            if grad is not None:
                grad[rows] = (d @ weight if plan.fp8 is None else plan.fp8.grad_hidden(d, d_scale)).to(hidden.dtype)
        ctx.present = tuple(g is not None for g in (grad, grad_markov, grad_w2))
        ctx.w2_dtype = None if markov_w2 is None else markov_w2.dtype
        ctx.save_for_backward(*(g for g in (grad, grad_markov, grad_w2) if g is not None))
        ctx.mark_non_differentiable(*rows_out, predictions, top_values, top_ids, row_lse)
        return loss, *rows_out, predictions, top_values, top_ids, row_lse

    @staticmethod
    def backward(ctx, d_loss, *_):
        saved = iter(ctx.saved_tensors)
        grad, grad_markov, grad_w2 = (next(saved) * d_loss if present else None for present in ctx.present)
        grad = None if grad is None else grad.to(ctx.saved_tensors[0].dtype)
        grad_w2 = None if grad_w2 is None else grad_w2.to(ctx.w2_dtype)
        return grad, grad_markov, grad_w2, None, None, None, None
