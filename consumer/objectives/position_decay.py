"""The paper's position weighting: draft j (the token j after the anchor) gets w_j = exp(-(j - 1) / gamma), and the
loss is normalised by the weights' sum over supervised drafts. DSpark weights its slots the same way: its slot
k drafts j = k + 1, and DeepSpec's w_k = exp(-k / gamma)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def position_weights(block_size: int, gamma: float, device: torch.device | None = None) -> torch.Tensor:
    """[B] weights of block positions 0..B-1 where position k drafts token anchor + k; position 0 (the given
    anchor token) gets 0."""
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    return torch.where(k >= 1, torch.exp(-(k - 1) / gamma), torch.zeros_like(k))


def draft_weights(drafts: int, gamma: float, device: torch.device | None = None) -> torch.Tensor:
    """[drafts] w_j of drafts j = 1..drafts."""
    return position_weights(drafts + 1, gamma, device)[1:]


@dataclass(frozen=True)
class PositionDecay:
    """Fixed weights, known before the CE: the chunk's gradient can be formed in the same pass as its terms."""

    rows: torch.Tensor  # [R] the weight of every supervised row, in row order
    before_ce = True

    @classmethod
    def of(cls, valid: torch.Tensor, gamma: float) -> PositionDecay:
        """valid [N, K]: which drafts of each block are supervised."""
        return cls(draft_weights(valid.shape[1], gamma, valid.device).expand_as(valid)[valid])

    @property
    def normaliser(self) -> float:
        return float(self.rows.sum())

    def fixed(self, rows: slice) -> torch.Tensor:
        return self.rows[rows]

    def weights(self, rows: slice, ce_grid: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        return self.rows[rows]

    def share(self, weight_grid: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """[N] each block's part of the normaliser S: its drafts' weights."""
        return weight_grid.sum(dim=1)
