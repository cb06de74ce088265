"""The frozen lm_head's two products of the draft in FP8 (drafter.precision = "fp8"), with rowwise scales.

The draft's logits (hidden [M, H] x W^T) and their gradient to the hidden states (d_logits [M, V] x W) are a
third of a wide drafter's step (27B width: 2 x 80 of ~600 TFLOP); the H200 runs them ~1.7x faster in FP8
(shared/reference/h200-limits.md). The head is frozen, so its two FP8 copies are made once, each scaled
along the axis the product keeps: per vocabulary row for the logits, per hidden column for the gradient.
The activations are scaled per row: the hidden states here (a cheap pass over H), the logits' gradient
inside the loss's compiled chunk function (consumer/training/loss.py), where the cast fuses into the pass that
forms it. The gradient is cast to e5m2: its entries span q ~ 1/V up to ~1 in a row, wider than e4m3's range.

The teacher's logits stay in the head's own dtype: they are computed once per position (cheap) and define
the distribution the drafter learns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_ring.consumer.modeling.fp8 import Fp8Unavailable

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2


def quantize_rows(x: torch.Tensor, dtype: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x / s in dtype, s [M, 1] fp32) with each row's amax mapped to dtype's largest value."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    scale = torch.where(amax > 0, amax, torch.ones_like(amax)) / torch.finfo(dtype).max
    return (x.float() / scale).to(dtype), scale


@dataclass(frozen=True)
class Fp8Head:
    """Two e4m3 copies of a frozen [V, H] lm_head weight, laid out as torch._scaled_mm reads its second operand."""

    by_vocab: torch.Tensor  # [V, H] e4m3, row v scaled by vocab_scale[0, v]
    vocab_scale: torch.Tensor  # [1, V] fp32
    by_hidden: torch.Tensor  # [H, V] e4m3 (W^T, contiguous), row h scaled by hidden_scale[0, h]
    hidden_scale: torch.Tensor  # [1, H] fp32

    @classmethod
    def of(cls, weight: torch.Tensor) -> Fp8Head:
        if weight.shape[0] % 16 or weight.shape[1] % 16:
            raise Fp8Unavailable(
                f"the FP8 head needs a vocabulary and width divisible by 16 (torch._scaled_mm), got "
                f'{tuple(weight.shape)}; train this target with drafter.precision = "bf16"'
            )
        by_vocab, vocab_scale = quantize_rows(weight)
        by_hidden, hidden_scale = quantize_rows(weight.t())
        return cls(by_vocab, vocab_scale.t().contiguous(), by_hidden.contiguous(), hidden_scale.t().contiguous())

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The plain product hidden [M, H] x W^T as bf16 [M, V]."""
        rows, scale = quantize_rows(hidden)
        return torch._scaled_mm(
            rows, self.by_vocab.t(), scale_a=scale, scale_b=self.vocab_scale, out_dtype=torch.bfloat16
        )

    def grad_hidden(self, d_logits: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """(d_logits * scale) [M, V] x W as bf16 [M, H]; d_logits comes quantized per row (quantize_rows, E5M2)."""
        return torch._scaled_mm(
            d_logits, self.by_hidden.t(), scale_a=scale, scale_b=self.hidden_scale, out_dtype=torch.bfloat16
        )
