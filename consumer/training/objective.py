"""A family's training objective on one packed batch: the inputs it reads, what it returns, and the block families'
objective (DFlash, DSpark, DFlash2: the block forward at sampled anchors, then consumer/training/loss.py).

The trainer, the held-out evaluation and the benches call `family(arch).objective` and nothing else, so a family
whose training is not a block forward (EAGLE-3's unrolled steps over every position) brings its own, returning the
same DFlashLoss: the loss, the shared figures (per draft position, per block for the per-source sums) and its
family's own optional parts, which its `figures` names for the record (consumer/families/family.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dflash_ring.consumer.training.loss import DFlashLoss, drafter_loss
from dflash_ring.consumer.modeling.model import Anchors

if TYPE_CHECKING:
    from torch import nn

    from dflash_ring.common.config.drafter import DrafterConfig
    from dflash_ring.consumer.modeling.target_head import FrozenTargetHead


@dataclass(frozen=True)
class ObjectiveInputs:
    """One packed batch on the training device, with the anchors sampled for it."""

    features: torch.Tensor  # [T, n*H] the target's layers the drafter reads
    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] bool
    cu_seqlens: torch.Tensor  # [S+1] int64
    final_hidden: torch.Tensor | None  # [T, H] final-normed, where the objective reads the target (needs_target_logits)
    anchors: Anchors  # sampled by the caller (its own generator: training's, or an item-seeded one for held-out rows)
    attention: str = "sdpa"  # "flex" or "sdpa" (train.attention_for the device)
    anchors_per_group: int = 64


@dataclass(frozen=True)
class StepObjective:
    out: DFlashLoss
    # The blocks out's per-block tensors describe, each owned by one sequence (source_metrics.by_source reads it):
    # the sampled anchors for a block family; a family that supervises other rows returns those.
    blocks: Anchors


def block_objective(
    model: nn.Module, inputs: ObjectiveInputs, head: FrozenTargetHead, cfg: DrafterConfig, heads: bool = True
) -> StepObjective:
    """The block families' objective: the drafter's blocks at the anchors, then dflash_loss with its family's own
    inputs (heads=False: the backbone alone, as bench drafter times it)."""
    hidden = model(
        inputs.features,
        inputs.input_ids,
        inputs.anchors,
        head,
        attention=inputs.attention,
        anchors_per_group=inputs.anchors_per_group,
    )
    out = drafter_loss(
        model, hidden, inputs.anchors, inputs.input_ids, inputs.loss_mask, head, cfg, inputs.final_hidden, heads
    )
    return StepObjective(out, inputs.anchors)
