"""CAP: -cap_weight * mean over blocks of A / K, A = sum_{k>=1} prod_{j<=k} q_j(y_j) the expected accepted length
under the drafter's own distribution (an unsupervised position ends the product); gradients flow through the
products, so each CE's coefficient is cap_scale * sum_{k>=j} P_k (the positions draft j gates). 1 + A is also reported
as the probabilistic accept length."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def accept_products(ce: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[N, K] prod_{j<=k} q_j(y_j) with q = exp(-CE): the chance the first k drafts are all accepted when
    sampled from the drafter; an unsupervised position ends the product (differentiable in ce)."""
    alive = torch.cumprod(valid.to(ce.dtype), dim=1)
    return torch.exp(-torch.cumsum(torch.where(valid, ce, torch.zeros_like(ce)), dim=1)) * alive


@dataclass(frozen=True)
class Cap:
    weight: float
    num_blocks: int
    drafts: int  # K: drafts per block

    @property
    def scale(self) -> float:
        return self.weight / (max(self.num_blocks, 1) * self.drafts)

    def loss(self, products: torch.Tensor) -> torch.Tensor:
        return -self.scale * products.sum()

    def ce_coefficients(self, products: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        """[rows] d(CAP)/d(CE_j) = scale * sum_{k>=j} P_k."""
        return self.scale * products.flip(1).cumsum(1).flip(1)[grid]
