"""D-PACE position weights (arXiv 2605.18810): each draft weighted by how likely the drafter is to reach it.

q_k = exp(-CE_k) and q~_k = (1 - alpha) q_k + alpha, detached; C_k = prod_{j<=k} q~_j (an unsupervised position counts
as 1); w_k = sum_{m>=k} C_m mask_m; the loss is normalised by the number of supervised positions (speculators'
normalisation: docs/recipes.md says why). The weights need the chunk's CE first: a second pass forms the gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def dpace_weights(ce: torch.Tensor, valid: torch.Tensor, alpha: float) -> torch.Tensor:
    """[N, K] D-PACE weights of block positions 1..K from their CE [N, K] (detached; 0 where not valid)."""
    q = torch.exp(-ce.detach().float())
    smoothed = torch.where(valid, (1 - alpha) * q + alpha, torch.ones_like(q))
    reach = torch.cumprod(smoothed, dim=1) * valid
    return torch.where(valid, reach.flip(1).cumsum(1).flip(1), torch.zeros_like(q))


@dataclass(frozen=True)
class DPace:
    alpha: float
    supervised: int  # S: the step's supervised drafts
    before_ce = False

    @property
    def normaliser(self) -> float:
        return float(self.supervised)

    def fixed(self, rows: slice) -> None:
        return None

    def weights(self, rows: slice, ce_grid: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        return dpace_weights(ce_grid, grid, self.alpha)[grid]

    def share(self, weight_grid: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """[N] each block's part of the normaliser S: its supervised drafts."""
        return valid.sum(dim=1).float()
