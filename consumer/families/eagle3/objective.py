"""EAGLE-3's training objective: training-time test over every packed position, the forward KL to the target's
distribution over the draft vocabulary, decayed per step (shared/reference/eagle3.md 2).

Row t, step k drafts token t + 2 + k; its label is the target's distribution p_{t+1+k} = softmax of the frozen head on
the final hidden state at t + 1 + k, restricted to the draft vocabulary (renormalised), and it is supervised when
t + 1 + k lies inside t's document and loss_mask[t + 1 + k] is set (speculators' mask index). Each document's steps
stay inside it (NeMo Automodel's doc_remaining), where speculators 0.9.0 reads the next document's labels for k >= 1
(tests/test_eagle3.py pins both). The loss is speculators':

    loss = kl_weight * sum_k decay^k * sum_t m_{t,k} KL(p~_{t+1+k} || q_t^(k)) / max(sum_t m_{t,k}, 1)

The vocabulary products run in chunks of loss_chunk_tokens label positions, with their gradients made in the forward
pass (_StepsKL), so no [T, V] logits outlive their chunk and the target's distribution is computed once per position.

For the shared figures each row with a supervised step is a "block" and step k its draft position k + 1: hits are
the draft's argmax against the target's (both in the draft vocabulary), the accepted length is the teacher-forced
prefix of hits + 1, the probabilistic one 1 + sum_k prod_{j<=k} q_j(y_j) with y the target's argmax.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from dflash_ring.consumer.training.loss import DFlashLoss
from dflash_ring.consumer.modeling.model import Anchors
from dflash_ring.consumer.training.objective import ObjectiveInputs, StepObjective
from dflash_ring.consumer.modeling.target_head import head_logits

if TYPE_CHECKING:
    from dflash_ring.common.config.drafter import DrafterConfig
    from dflash_ring.consumer.families.eagle3.model import Eagle3DraftModel
    from dflash_ring.consumer.modeling.target_head import FrozenTargetHead


def step_labels(input_ids: torch.Tensor, loss_mask: torch.Tensor, cu_seqlens: torch.Tensor, steps: int) -> torch.Tensor:
    """[T, steps] bool: row t's step k is supervised (its label position t + 1 + k inside t's document, masked in)."""
    length = input_ids.shape[0]
    ends = cu_seqlens[1:].repeat_interleave(cu_seqlens.diff())
    label = torch.arange(length, device=input_ids.device)[:, None] + 1 + torch.arange(steps, device=input_ids.device)
    inside = label < ends[:, None]
    return inside & loss_mask.bool()[label.clamp(max=length - 1)]


# Rows of the head's gradient updated by one product: a [V, H] temporary per chunk would cost V x H x 2 bytes (2.5 GB
# at the Qwen3.6-27B width) at the step's peak; a slice of 32k rows, 1/8 of it.
VOCAB_SLICE = 32768


class _StepsKL(torch.autograd.Function):
    """The loss over every step's supervised rows with its gradients made in the forward pass (as Liger's fused
    linear losses do): no [rows, V] tensor is kept for the backward, none is recomputed, and the target's
    distribution is computed once per label position, for all the steps that read it (step k's row t reads position
    t + 1 + k: one position serves up to ttt_steps (row, step) pairs).

    The KL's gradient to the draft's logits is q - p (p sums to 1), scaled by the step's weight; the head's and the
    normed hidden states' gradients follow by two products per chunk. Inputs: the lm_head weight, the teacher rows
    over the draft vocabulary, the final hidden states, valid [T, K], the label positions (ascending), each step's
    weight [K], the chunk, the target head's logit multiplier and softcap, then each step's normed hidden state.
    Outputs: the loss, and (not differentiable) the KL [T, K], the draft's argmax hits against the target's and log q
    at the target's argmax.

    Memory: the head's gradient (fp32, as its .grad will be) and the hidden states' (in the products' dtype: bf16
    under autocast) live from the forward to the backward; the chunk's [rows, V] tensors are reused in place."""

    @staticmethod
    def forward(
        ctx, weight, target_rows, final_hidden, valid, label_positions, weights, chunk, multiplier, cap, *normed
    ):
        length, steps = valid.shape
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        device = weight.device.type
        product = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else normed[0].dtype
        grad_normed = [torch.zeros(x.shape, dtype=product, device=x.device) for x in normed]
        kl_grid = torch.zeros(length, steps, device=weight.device)
        correct = torch.zeros(length, steps, dtype=torch.bool, device=weight.device)
        log_q_best = torch.zeros(length, steps, device=weight.device)
        loss = torch.zeros((), dtype=torch.float64, device=weight.device)
        for positions in label_positions.split(chunk):
            target = head_logits(F.linear(final_hidden[positions].to(target_rows.dtype), target_rows), multiplier, cap)
            log_p = F.log_softmax(target.float(), dim=-1)
            best = log_p.argmax(dim=-1)
            for k in range(steps):
                rows = positions - 1 - k
                use = (rows >= 0) & valid[rows.clamp(min=0), k]
                if not use.any():
                    continue
                rows, lp = rows[use], log_p[use]
                x = normed[k][rows]
                log_q = F.log_softmax(F.linear(x, weight).float(), dim=-1)
                p = lp.exp()
                kl = lp.sub(log_q).mul_(p).sum(dim=-1)
                loss += weights[k].double() * kl.double().sum()
                kl_grid[rows, k] = kl
                correct[rows, k] = log_q.argmax(dim=-1) == best[use]
                log_q_best[rows, k] = log_q.gather(1, best[use][:, None]).squeeze(1)
                grad_logits = log_q.exp_().sub_(p).mul_(weights[k])  # q - p, weighted, in log_q's memory
                del p
                grad_normed[k][rows] = (grad_logits.to(weight.dtype) @ weight).to(product)
                x = x.to(product)
                for part in range(0, grad_logits.shape[1], VOCAB_SLICE):  # no [V, H] temporary per chunk
                    grad_weight[part : part + VOCAB_SLICE] += (
                        grad_logits[:, part : part + VOCAB_SLICE].T.to(product) @ x
                    )
        # Held on ctx, not saved: the backward hands grad_weight on as the only reference, so autograd makes it the
        # head's .grad without a copy (a saved tensor's second reference would cost a [V, H] fp32 copy at the peak).
        ctx.grads = [grad_weight, *grad_normed]
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(kl_grid, correct, log_q_best)
        return loss.float(), kl_grid, correct, log_q_best

    @staticmethod
    def backward(ctx, grad_loss, *_):
        grad_weight, *grad_normed = ctx.grads  # used once (no retain_graph): scaled in place
        del ctx.grads
        return (
            grad_weight.mul_(grad_loss).to(ctx.weight_dtype),
            *(None,) * 8,
            *(g.mul_(grad_loss.to(g.dtype)) for g in grad_normed),  # autograd casts each to its input's dtype
        )


def eagle3_objective(
    model: Eagle3DraftModel, inputs: ObjectiveInputs, head: FrozenTargetHead, cfg: DrafterConfig
) -> StepObjective:
    """The unrolled steps, then the KL per supervised (row, step); the sampled anchors are not used (every row
    drafts)."""
    if inputs.final_hidden is None:
        raise ValueError("EAGLE-3's objective reads the target's distribution: the batch needs its final hidden state")
    steps = cfg.ttt_steps
    hiddens = model(inputs.features, inputs.input_ids, inputs.cu_seqlens, head, steps, attention=inputs.attention)
    valid = step_labels(inputs.input_ids, inputs.loss_mask, inputs.cu_seqlens, steps)
    ids = model.draft_ids
    target_rows = head.lm_head_weight if ids is None else head.lm_head_weight[ids]
    counts = valid.sum(dim=0)
    # the label positions some step reads: t + 1 + k for every supervised (t, k), each once
    offsets = 1 + torch.arange(steps, device=valid.device)
    label_positions = torch.unique((torch.arange(valid.shape[0], device=valid.device)[:, None] + offsets)[valid])
    decay = cfg.ttt_step_loss_decay ** torch.arange(steps, device=valid.device, dtype=torch.float32)
    weights = torch.where(counts > 0, cfg.kl_weight * decay / counts.clamp(min=1), 0.0)
    loss, kl_grid, correct, log_q_best = _StepsKL.apply(
        model.lm_head.weight,
        target_rows,
        inputs.final_hidden,
        valid,
        label_positions,
        weights,
        cfg.loss_chunk_tokens,
        head.logit_multiplier,
        head.logit_softcap,
        *(model.norm(hidden) for hidden in hiddens),
    )
    figures = _figures(loss, kl_grid, correct, log_q_best, valid, label_positions.numel(), cfg)
    return StepObjective(figures, _rows(valid, inputs.cu_seqlens))


def _rows(valid: torch.Tensor, cu_seqlens: torch.Tensor) -> Anchors:
    """The rows with a supervised step, grouped by sequence: the objective's "blocks"."""
    positions = valid.any(dim=1).nonzero().squeeze(1)
    per_sequence = torch.searchsorted(positions, cu_seqlens)
    return Anchors(positions=positions, cu_anchors=per_sequence, cu_seqlens=cu_seqlens)


def _figures(
    loss: torch.Tensor,
    kl_grid: torch.Tensor,
    correct: torch.Tensor,
    log_q_best: torch.Tensor,
    valid: torch.Tensor,
    teacher_positions: int,
    cfg: DrafterConfig,
) -> DFlashLoss:
    supervised = valid.any(dim=1)
    valid, kl_grid = valid[supervised], kl_grid[supervised]
    hits = correct[supervised] & valid
    q_best = torch.where(valid, log_q_best[supervised], float("-inf")).exp()
    decay = cfg.ttt_step_loss_decay ** torch.arange(valid.shape[1], device=valid.device, dtype=kl_grid.dtype)
    block_accept = (hits.long().cumprod(dim=1).sum(dim=1) + 1).float()
    block_accept_prob = 1 + q_best.cumprod(dim=1).sum(dim=1)
    n, zero = max(int(supervised.sum()), 1), torch.zeros((), device=valid.device)
    return DFlashLoss(
        loss=loss,
        ce=zero,
        kl=loss.detach(),
        cap=(block_accept_prob - 1).sum() / (n * valid.shape[1]),
        tv=zero,
        confidence=zero,
        correct_per_position=hits.sum(dim=0),
        valid_per_position=valid.sum(dim=0),
        accept_len=block_accept.sum() / n,
        accept_len_prob=block_accept_prob.sum() / n,
        num_blocks=int(supervised.sum()),
        teacher_positions=teacher_positions,  # one teacher product per label position, for every step reading it
        alpha_per_position=None,
        tau_probabilistic=None,
        # A source's loss is its rows' decay-weighted mean KL per supervised step (the batch's loss normalises
        # each step by its own count instead, as speculators does).
        block_loss_sum=cfg.kl_weight * (decay * kl_grid * valid).sum(dim=1),
        block_weight_sum=(decay * valid).sum(dim=1),
        block_correct=hits.sum(dim=1),
        block_valid=valid.sum(dim=1),
        block_accept=block_accept,
        block_accept_prob=block_accept_prob,
        block_tau_probabilistic=None,
        calibration=None,
    )
