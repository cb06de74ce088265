"""DSpark's named figures of a step (its objective's L1 to the target and confidence head, consumer/training/loss.py),
as the step record's keys: `tv`, `tau_probabilistic`, `accept_rate/pos_<k>` (k = 1: the first draft), and with the
confidence
head `confidence_loss` and `confidence/{abs_error,bias,cumprod_bias}` over the step's supervised drafts."""

from __future__ import annotations

from dflash_ring.consumer.training.loss import DFlashLoss


def dspark_figures(out: DFlashLoss) -> dict[str, float]:
    if out.alpha_per_position is None:  # a config without the L1 term (bench drafter's backbone-only steps)
        return {}
    rate = (out.alpha_per_position / out.valid_per_position.clamp_min(1)).tolist()
    figures = {
        "tv": float(out.tv),
        "tau_probabilistic": float(out.tau_probabilistic),
        **{f"accept_rate/pos_{k}": round(r, 4) for k, r in enumerate(rate, 1)},
    }
    if out.calibration is not None:
        drafts = max(int(out.num_valid_tokens), 1)
        c = out.calibration
        figures |= {
            "confidence_loss": float(out.confidence),
            "confidence/abs_error": float(c.abs_error.sum()) / drafts,
            "confidence/bias": float(c.bias.sum()) / drafts,
            "confidence/cumprod_bias": float(c.cumprod_bias.sum()) / drafts,
        }
    return figures
