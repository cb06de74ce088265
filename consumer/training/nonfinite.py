"""Training that has gone bad: an update whose gradient is not finite is skipped, and a streak of them ends the drafter.

A loss that turned NaN (train.lr = 1e30, weight_decay = 1e30, a target whose features are NaN) trained on to the
run's end: NaN curves, NaN checkpoints, exit 0. Now:

- An optimizer step whose gradient is not finite is not taken (Trainer._update, consumer/training/trainer.py). AdamW
would
  write the NaN into both moments (and every later step through them) and into every weight; its gradients are
  dropped instead, so the step updates nothing, not even weight decay, and the state stays the last finite one (one
  bad batch costs that batch, not the run).
- `NonFiniteSteps`: train.max_nonfinite_steps optimizer steps in a row whose loss or gradient norm is not finite end
  the drafter with `Diverged` (common/lifecycle/diverged.py: one line, EXIT_DIVERGED, not restarted). A finite step
  starts the count again.
- `first_non_finite`: which of some tensors holds NaN or inf, for the checkpoint and the export, which refuse them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

import torch

from dflash_ring.common.config.train import TrainConfig
from dflash_ring.common.lifecycle.diverged import Diverged

log = logging.getLogger(__name__)


def first_non_finite(tensors: Mapping[str, torch.Tensor]) -> tuple[str, str] | None:
    """(name, "NaN" or "inf") of the first floating-point tensor holding NaN or inf, or None: max |x| of each (NaN
    where any element is, inf where one is; no copy of the tensor), and one host sync per device."""
    floats = [(k, v.detach()) for k, v in tensors.items() if v.is_floating_point() and v.numel()]
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for _, v in floats:
        by_device.setdefault(v.device, []).append(v if v.element_size() >= 2 else v.float())  # float8: widened
    on_host = {device: torch.stack([p.float() for p in _peaks(vs)]).cpu().tolist() for device, vs in by_device.items()}
    seen = dict.fromkeys(on_host, 0)
    for name, v in floats:
        peak = on_host[v.device][seen[v.device]]
        seen[v.device] += 1
        if not math.isfinite(peak):
            return name, "NaN" if math.isnan(peak) else "inf"
    return None


def _peaks(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """max |x| of each tensor, NaN where it holds one: on a GPU fused over all of them (as clip_grad_norm_'s norms,
    one launch, not one per tensor); on the CPU from aminmax, which reads ~5x faster there than a norm does."""
    if tensors[0].device.type != "cpu":
        return list(torch._foreach_norm(tensors, math.inf))
    return [torch.maximum(low.abs(), high.abs()) for low, high in map(torch.aminmax, tensors)]


class NonFiniteSteps:
    """The count of optimizer steps in a row whose loss or gradient norm is not finite; at train.max_nonfinite_steps
    the drafter ends (`Diverged`), naming the steps, the figures and what to change."""

    def __init__(self, train: TrainConfig, index: int | None = None):
        self.train, self.index = train, index
        self.first: int | None = None  # the first step of the streak
        self.count = 0

    def watch(self, step: int, loss: float, grad_norm: float) -> None:
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.first, self.count = None, 0
            return
        if self.first is None:
            self.first = step
        self.count += 1
        limit = self.train.max_nonfinite_steps
        if self.count < limit:
            log.warning(
                "step %d: loss %s, grad_norm %s: not finite, its update skipped (%d of train.max_nonfinite_steps = %d "
                "in a row end the drafter)",
                step,
                loss,
                grad_norm,
                self.count,
                limit,
            )
            return
        who = "" if self.index is None else f"drafter {self.index}: "
        raise Diverged(
            f"{who}training has diverged: the loss or gradient norm was not finite for "
            f"train.max_nonfinite_steps = {limit} optimizer steps in a row (steps {self.first} to {step}; the last: "
            f"loss {loss}, grad_norm {grad_norm}); their updates were skipped, so the weights and checkpoints are "
            f"those of before. Lower train.lr (now {self.train.lr:g}) or train.weight_decay (now "
            f"{self.train.weight_decay:g}), or check the data and the target (features that are not finite), then "
            "restart the drafter: it resumes from its last checkpoint"
        )
