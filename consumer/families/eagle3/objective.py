"""EAGLE-3's training objective: training-time test over every packed position, the forward KL to the target's
distribution over the draft vocabulary, decayed per step (shared/reference/eagle3.md 2).

Row t, step k drafts token t + 2 + k; its label is the target's distribution p_{t+1+k} = softmax of the frozen head on
the final hidden state at t + 1 + k, restricted to the draft vocabulary (renormalised), and it is supervised when
t + 1 + k lies inside t's document and loss_mask[t + 1 + k] is set (speculators' mask index). Each document's steps
stay inside it (NeMo Automodel's doc_remaining), where speculators 0.9.0 reads the next document's labels for k >= 1
(tests/test_eagle3.py pins both). The loss is speculators':

    loss = kl_weight * sum_k decay^k * sum_t m_{t,k} KL(p~_{t+1+k} || q_t^(k)) / max(sum_t m_{t,k}, 1)

The vocabulary products run in chunks of loss_chunk_tokens rows, each recomputed in the backward pass
(activation checkpointing), so no [T, V] logits outlive their chunk.

For the shared figures each row with a supervised step is a "block" and step k its draft position k + 1: hits are
the draft's argmax against the target's (both in the draft vocabulary), the accepted length is the teacher-forced
prefix of hits + 1, the probabilistic one 1 + sum_k prod_{j<=k} q_j(y_j) with y the target's argmax.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

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


def _chunk_terms(
    norm: nn.Module,
    hidden: torch.Tensor,
    teacher: torch.Tensor,
    lm_head: torch.Tensor,
    target_rows: torch.Tensor,
    multiplier: float | None,
    cap: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(KL [n], draft argmax [n], target argmax [n], log q at the target's argmax [n]) of n rows: the draft's logits
    lm_head(norm(hidden)), the target's head_logits(target_rows . teacher), both over the draft vocabulary."""
    log_q = F.log_softmax(F.linear(norm(hidden), lm_head).float(), dim=-1)
    with torch.no_grad():
        target = head_logits(F.linear(teacher.to(target_rows.dtype), target_rows), multiplier, cap).float()
        log_p = F.log_softmax(target, dim=-1)
        best = log_p.argmax(dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(dim=-1)
    return kl, log_q.argmax(dim=-1), best, log_q.gather(1, best[:, None]).squeeze(1).detach()


def eagle3_objective(
    model: Eagle3DraftModel, inputs: ObjectiveInputs, head: FrozenTargetHead, cfg: DrafterConfig
) -> StepObjective:
    """The unrolled steps, then the KL per supervised (row, step); the sampled anchors are not used (every row
    drafts)."""
    if inputs.final_hidden is None:
        raise ValueError("EAGLE-3's objective reads the target's distribution: the batch needs its final hidden state")
    steps, length = cfg.ttt_steps, inputs.input_ids.shape[0]
    hiddens = model(inputs.features, inputs.input_ids, inputs.cu_seqlens, head, steps, attention=inputs.attention)
    valid = step_labels(inputs.input_ids, inputs.loss_mask, inputs.cu_seqlens, steps)
    ids = model.draft_ids
    target_rows = head.lm_head_weight if ids is None else head.lm_head_weight[ids]
    device = inputs.features.device
    kl_grid = torch.zeros(length, steps, device=device)
    correct = torch.zeros(length, steps, dtype=torch.bool, device=device)
    log_q_best = torch.zeros(length, steps, device=device)
    loss = torch.zeros((), device=device)
    for k, hidden in enumerate(hiddens):
        rows = valid[:, k].nonzero().squeeze(1)
        if not rows.numel():
            continue
        kls = []
        for chunk in rows.split(cfg.loss_chunk_tokens):
            kl, pred, best, lq = checkpoint(
                _chunk_terms,
                model.norm,
                hidden[chunk],
                inputs.final_hidden[chunk + 1 + k],
                model.lm_head.weight,
                target_rows,
                head.logit_multiplier,
                head.logit_softcap,
                use_reentrant=False,
            )
            kls.append(kl)
            correct[chunk, k] = pred == best
            log_q_best[chunk, k] = lq
        kl = torch.cat(kls)
        kl_grid[rows, k] = kl.detach()
        loss = loss + cfg.ttt_step_loss_decay**k * kl.sum() / rows.numel()
    loss = cfg.kl_weight * loss
    return StepObjective(_figures(loss, kl_grid, correct, log_q_best, valid, cfg), _rows(valid, inputs.cu_seqlens))


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
        teacher_positions=int(valid.sum()),  # one teacher product per supervised (row, step): each step has its own
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
