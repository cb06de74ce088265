"""The drafter's loss and metrics for a packed batch: labels, teacher, the objective's components, the figures.

DFlash's block position k drafts token anchor + k (k >= 1; the anchor itself is not a target); DSpark's slot k drafts
anchor + k + 1 (every slot drafts). Either way a block's drafts j = 1..K are the tokens j after the anchor, and the loss
is a function of per-draft quantities (consumer/objectives/: CE, KL and DSpark's L1 per row, their position weighting,
CAP, DSpark's confidence):

    loss = sum_j w_j (ce_weight CE_j + kl_weight KL_j + tv_weight L1_j) / S  -  CAP  +  confidence_weight BCE

- "ce" (the paper): w_j = exp(-(j-1)/gamma), S = sum of w over supervised drafts (DSpark the same, gamma 4).
- "dpace" (D-PACE, arXiv 2605.18810): w from the drafter's own detached acceptance, S = the supervised drafts.
- CAP: A = sum_{k>=1} prod_{j<=k} q_j(y_j), the expected accepted length under the drafter's own distribution;
  1 + A is also reported as the probabilistic accept length.
- DSpark (arXiv 2607.05147): the logits carry the Markov head's bias; L1 = ||q - p||_1 to the target's distribution;
  the confidence head's BCE against alpha* = 1 - L1 / 2; a draft after an unsupervised one is not supervised
  (DeepSpec's cumulative eval mask). Its figures: accept_rate@k (mean alpha*), tau_probabilistic = 1 + sum_k
  prod_{j<=k} alpha*_j, and the confidence's absolute error, bias and cumulative-product bias.
- DFlash2: + selector_weight x the candidate selector's K-way CE over the unary top-K, scored with the true
  predecessor (objectives/selector.py: rows whose gold is outside the top-K are left out, and counted in the recall).

The vocabulary projection runs in chunks of whole blocks inside one autograd node (objectives/head_loss.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash_ring.common.config.drafter import DrafterConfig
from dflash_ring.consumer.modeling.model import Anchors, DFlashDraftModel, FrozenTargetHead
from dflash_ring.consumer.objectives.cap import Cap, accept_products
from dflash_ring.consumer.objectives.confidence import Calibration, calibration, confidence_loss
from dflash_ring.consumer.objectives.dpace import DPace
from dflash_ring.consumer.objectives.fused import ChunkSpec
from dflash_ring.consumer.objectives.head_loss import ChunkedHeadLoss, TermWeights, chunk_plan
from dflash_ring.consumer.objectives.position_decay import PositionDecay
from dflash_ring.consumer.objectives.selector import selector_terms
from dflash_ring.consumer.objectives.teacher import teacher_logits
from dflash_ring.consumer.objectives.total_variation import analytic_acceptance


@dataclass(frozen=True)
class BlockLabels:
    tokens: torch.Tensor  # [N, B] int64: the token slot k drafts (0 where that is outside the sequence)
    valid: torch.Tensor  # [N, B] bool: slot k drafts, its token is inside the anchor's sequence, loss_mask set


def block_labels(
    anchors: Anchors,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    block_size: int,
    sample_from_anchor: bool = False,
) -> BlockLabels:
    """DFlash: slot k is labelled with token anchor + k, slot 0 never. sample_from_anchor (DSpark): slot k with
    anchor + k + 1, and a slot after an unsupervised one is not supervised either (DeepSpec's eval mask)."""
    shift = 1 if sample_from_anchor else 0
    offsets = torch.arange(block_size, device=input_ids.device)
    positions = anchors.positions[:, None] + offsets + shift
    inside = positions < anchors.seq_bounds()[1][:, None]
    safe = torch.where(inside, positions, 0)
    valid = inside & (offsets + shift >= 1) & loss_mask.bool()[safe]
    if sample_from_anchor:
        valid = valid.long().cumprod(dim=1).bool()
    return BlockLabels(tokens=torch.where(valid, input_ids[safe], 0), valid=valid)


@dataclass(frozen=True)
class DSparkHeads:
    """The DSpark heads' outputs on a step's blocks (DSparkDraftModel.heads), and the Markov head's projection."""

    markov: torch.Tensor  # [N, B, r] Markov features: slot k's logit bias is markov_w2 @ markov[:, k]
    markov_w2: torch.Tensor  # [V, r]
    confidence: torch.Tensor  # [N, B] fp32 confidence logits


@dataclass(frozen=True)
class SelectorInputs:
    """What DFlash2's selector objective needs of the model on a step's blocks (DFlash2DraftModel)."""

    context: torch.Tensor  # [N, B, r] predecessor_codebook[true prev] * hidden_projection(h), per slot
    successor_codebook: torch.Tensor  # [V, r]
    top_k: int


@dataclass(frozen=True)
class SelectorStats:
    """DFlash2's selector on a step (objectives/selector.py): sums over supervised rows, and per block [N]."""

    loss: torch.Tensor  # detached: the selector's term (before selector_weight)
    rows: torch.Tensor  # supervised rows
    in_top_k: torch.Tensor  # rows whose gold is among the unary top-K (recall = in_top_k / rows)
    correct: torch.Tensor  # rows the selector, teacher-forced, gets right (a gold outside the top-K is a miss)
    top_k_mass: torch.Tensor  # sum over rows of the draft's probability mass on its top-K
    block_accept: torch.Tensor  # [N] 1 + prefix of selector hits: the greedy serving walk's accepted length
    block_oracle: torch.Tensor  # [N] 1 + prefix of rows with the gold in the top-K: the top-K oracle's


@dataclass(frozen=True)
class DFlashLoss:
    loss: torch.Tensor  # scalar to backward
    ce: torch.Tensor  # detached: the weighted CE term, sum w CE / S
    kl: torch.Tensor  # detached: the weighted KL term, sum w KL / S (0 without a teacher)
    cap: torch.Tensor  # detached: mean over blocks of A / K (what cap_weight scales)
    tv: torch.Tensor  # detached: the weighted L1 term, sum w L1 / S (0 unless the objective has it)
    confidence: torch.Tensor  # detached: the confidence's weighted BCE (0 without a confidence head)
    correct_per_position: torch.Tensor  # [K] top-1 hits of drafts 1..K
    valid_per_position: torch.Tensor  # [K] supervised labels of drafts 1..K
    accept_len: torch.Tensor  # mean over blocks of (teacher-forced accepted prefix + 1)
    accept_len_prob: torch.Tensor  # mean over blocks of 1 + A (CAP's: from the label's probabilities)
    num_blocks: int
    teacher_positions: int  # distinct positions whose teacher logits the step computed (0 without a teacher)
    # With L1 to the target (DSpark): the analytic acceptance alpha* summed per draft position [K] (accept_rate@k is
    # alpha_per_position / valid_per_position), and tau_probabilistic, the mean over blocks of 1 + sum prod alpha*.
    alpha_per_position: torch.Tensor | None
    tau_probabilistic: torch.Tensor | None
    # Per block [N], detached, for figures over any grouping of blocks (e.g. per data source): a group's loss
    # is sum(block_loss_sum) / sum(block_weight_sum).
    block_loss_sum: torch.Tensor  # sum_k w_k (ce_weight CE_k + kl_weight KL_k + tv_weight L1_k [+ conf BCE_k])
    block_weight_sum: torch.Tensor  # the block's share of S
    block_correct: torch.Tensor
    block_valid: torch.Tensor
    block_accept: torch.Tensor
    block_accept_prob: torch.Tensor
    block_tau_probabilistic: torch.Tensor | None  # with alpha*
    calibration: Calibration | None  # with a confidence head: per block sums over its supervised drafts
    selector: SelectorStats | None = None  # with DFlash2's candidate selector

    @property
    def accuracy_per_position(self) -> torch.Tensor:
        return self.correct_per_position / self.valid_per_position.clamp_min(1)

    @property
    def num_valid_tokens(self) -> torch.Tensor:
        return self.valid_per_position.sum()


def drafter_loss(
    model: DFlashDraftModel,
    hidden: torch.Tensor,
    anchors: Anchors,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    head: FrozenTargetHead,
    cfg: DrafterConfig,
    target_hidden: torch.Tensor | None = None,
    heads: bool = True,
) -> DFlashLoss:
    """dflash_loss of a drafter's output, with what its family's own modules give the objective
    (`objective_inputs`: DSpark's heads, DFlash2's selector; heads=False leaves them out: the backbone alone, for
    timing): the one call the trainer and the benches make."""
    extra = model.objective_inputs(hidden, input_ids, anchors) if heads else {}
    return dflash_loss(hidden, anchors, input_ids, loss_mask, head, cfg, target_hidden, **extra)


def _weighting(cfg: DrafterConfig, valid: torch.Tensor) -> PositionDecay | DPace:
    if cfg.loss == "dpace":
        return DPace(cfg.dpace_alpha, int(valid.sum()))
    return PositionDecay.of(valid, cfg.loss_gamma)


def dflash_loss(
    hidden: torch.Tensor,
    anchors: Anchors,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    head: FrozenTargetHead,
    cfg: DrafterConfig,
    target_hidden: torch.Tensor | None = None,
    dspark: DSparkHeads | None = None,
    selector: SelectorInputs | None = None,
) -> DFlashLoss:
    """Loss and metrics for drafter output hidden [N, B, H] (DFlashDraftModel.forward).

    target_hidden: optional [T, H] final-normed target hidden states, needed iff the objective reads the
    target (cfg.needs_target_logits: KL, L1, the confidence, or target-argmax labels); head.logits(target_hidden[p])
    is the target's distribution for token p+1, so the teacher for the draft of token p sits at p-1.
    dspark: the DSpark heads' outputs (DSpark only; None there: the backbone's logits alone, which only a
    config without the confidence term may ask for, as bench drafter does to time the heads).
    selector: DFlash2's selector inputs (DFlash2 only, and there whenever selector_weight > 0).
    """
    if cfg.needs_target_logits != (target_hidden is not None):
        raise ValueError(
            "target_hidden must be given exactly when kl_weight, tv_weight or confidence_weight > 0 "
            "or label = 'target_argmax'"
        )
    if dspark is not None and not cfg.markov_rank or dspark is None and cfg.confidence_weight > 0:
        raise ValueError(
            "the DSpark heads' outputs are given with a Markov head (markov_rank >= 1: DSpark) only, and there "
            "whenever confidence_weight > 0"
        )
    if selector is not None and not cfg.selector_rank or selector is None and cfg.selector_weight > 0:
        raise ValueError(
            "the selector's inputs are given with a candidate selector (selector_rank >= 1: DFlash2) only, and there "
            "whenever selector_weight > 0"
        )
    block_size = hidden.shape[1]
    if block_size != cfg.block_size:
        raise ValueError(f"hidden has blocks of {block_size}, config says {cfg.block_size}")
    labels = block_labels(anchors, input_ids, loss_mask, block_size, cfg.sample_from_anchor)
    first = 0 if cfg.sample_from_anchor else 1  # the first slot that drafts
    valid = labels.valid[:, first:]
    drafts = valid.shape[1]
    weighting = _weighting(cfg, valid)
    spec = ChunkSpec(
        kl=cfg.kl_weight > 0,
        tv=cfg.tv_weight > 0 or cfg.confidence_weight > 0,
        multiplier=head.logit_multiplier,
        cap=head.logit_softcap,
        fp8=head.fp8 is not None and dspark is None,
    )
    teacher, used = None, labels.tokens[:, first:][valid]
    if target_hidden is not None:  # the draft of token anchor + j reads the target at anchor + j - 1
        teacher_positions = anchors.positions[:, None] + torch.arange(drafts, device=hidden.device)
        teacher = teacher_logits(
            target_hidden,
            teacher_positions[valid],
            head.lm_head_weight,
            head.logit_multiplier,
            head.logit_softcap,
            cfg.loss_chunk_tokens,
            keep_logits=spec.taught,
        )
        if cfg.label == "target_argmax":
            used = teacher.argmax[teacher.row]
    plan = chunk_plan(
        valid,
        cfg.loss_chunk_tokens,
        weighting=weighting,
        terms=TermWeights(cfg.ce_weight, cfg.kl_weight, cfg.tv_weight),
        cap=Cap(cfg.cap_weight, valid.shape[0], drafts) if cfg.cap_weight > 0 else None,
        spec=spec,
        fp8=head.fp8,
        teacher=teacher if spec.taught else None,
        top_k=0 if selector is None else selector.top_k,
    )
    markov, w2 = (None, None) if dspark is None else (dspark.markov[valid], dspark.markov_w2)
    rows = hidden[:, first:][valid]
    loss, ce, kl, l1, w, predictions, top_values, top_ids, row_lse = ChunkedHeadLoss.apply(
        rows, markov, w2, head.lm_head_weight, used, valid, plan
    )
    normaliser = plan.normaliser

    def grid(rows: torch.Tensor) -> torch.Tensor:
        return torch.zeros(valid.shape, dtype=rows.dtype, device=rows.device).masked_scatter(valid, rows)

    alpha = analytic_acceptance(l1) if spec.tv else None
    conf_term, calib = torch.zeros((), device=hidden.device), None
    if dspark is not None:
        conf_term = confidence_loss(dspark.confidence[valid], alpha, w, normaliser)
        loss = loss + cfg.confidence_weight * conf_term
        calib = calibration(torch.sigmoid(dspark.confidence.detach()), grid(alpha), valid)
    block_terms = cfg.ce_weight * ce + cfg.kl_weight * kl + cfg.tv_weight * l1
    stats = None
    if selector is not None:
        terms = selector_terms(
            rows,
            selector.context[:, first:][valid],
            selector.successor_codebook,
            top_values,
            top_ids,
            row_lse,
            used,
            w,
            head.lm_head_weight,
            head.logit_multiplier,
            head.logit_softcap,
        )
        loss = loss + cfg.selector_weight * terms.loss
        # the block's share of the selector term, in units of the head loss's normaliser: sum over blocks / S = term
        scale = cfg.selector_weight * normaliser / terms.normaliser.clamp_min(torch.finfo(torch.float32).tiny)
        block_terms = block_terms + scale * terms.ce
        stats = SelectorStats(
            loss=terms.loss.detach(),
            rows=valid.sum(),
            in_top_k=terms.in_top_k.sum(),
            correct=terms.correct.sum(),
            top_k_mass=terms.top_k_mass.sum(),
            block_accept=(grid(terms.correct).long().cumprod(dim=1).sum(dim=1) + 1).float(),
            block_oracle=(grid(terms.in_top_k).long().cumprod(dim=1).sum(dim=1) + 1).float(),
        )
    if dspark is not None:
        block_terms = block_terms + cfg.confidence_weight * F.binary_cross_entropy_with_logits(
            dspark.confidence.detach()[valid], alpha, reduction="none"
        )
    correct = grid(predictions == used)
    # A miss or an unsupervised position ends the accepted prefix, as the verifier would.
    block_accept = (correct.long().cumprod(dim=1).sum(dim=1) + 1).float()
    block_accept_prob = 1 + accept_products(grid(ce), valid).sum(dim=1)
    block_tau = None if alpha is None else 1 + (grid(alpha) + ~valid).cumprod(dim=1).mul(valid).sum(dim=1)
    n = max(anchors.num_blocks, 1)
    return DFlashLoss(
        loss=loss,
        ce=(w * ce).sum() / normaliser,
        kl=(w * kl).sum() / normaliser,
        cap=(block_accept_prob - 1).sum() / (n * drafts),
        tv=(w * l1).sum() / normaliser,
        confidence=conf_term.detach(),
        correct_per_position=correct.sum(dim=0),
        valid_per_position=valid.sum(dim=0),
        accept_len=block_accept.sum() / n,
        accept_len_prob=block_accept_prob.sum() / n,
        num_blocks=anchors.num_blocks,
        teacher_positions=0 if teacher is None else teacher.lse.numel(),
        alpha_per_position=None if alpha is None else grid(alpha).sum(dim=0),
        tau_probabilistic=None if block_tau is None else block_tau.sum() / n,
        block_loss_sum=grid(w * block_terms).sum(dim=1),
        block_weight_sum=weighting.share(grid(w), valid),
        block_correct=correct.sum(dim=1),
        block_valid=valid.sum(dim=1),
        block_accept=block_accept,
        block_accept_prob=block_accept_prob,
        block_tau_probabilistic=block_tau,
        calibration=calib,
        selector=stats,
    )
