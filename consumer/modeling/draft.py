"""One drafting round as the verifier takes it (`Draft`), and how a drafted position's token is picked
(`sample_tokens`): shared by offline evaluation (evaluate.py) and each family's draft function
(families/<name>/__init__.py), so a family drafts without importing the evaluation that calls it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Draft:
    """One round's drafts, in block order."""

    tokens: torch.Tensor  # [n] ids: n = B - 1 for a DFlash block, B for a DSpark block
    # [n, V] q_k: the distribution tokens[k] was sampled from, given the drafts before it; what sampled
    # verification (temperature > 0) needs. None for greedy drafts.
    probs: torch.Tensor | None = None
    # [n] confidence logits c_k (DSpark): sigmoid(c_k) estimates P(draft k accepted | every earlier one accepted)
    confidence: torch.Tensor | None = None


DraftFn = Callable[[torch.Tensor, torch.Tensor], "Draft | torch.Tensor"]
"""(committed ids [S + 1] ending with the anchor, target features [S, n*H]) -> the round's Draft, or just its
token ids [n] (greedy)."""


def sample_tokens(
    logits: torch.Tensor, temperature: float, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Ids [...] from logits [..., V]: the argmax at temperature 0 (distribution None), else a sample of
    softmax(logits / temperature) (fp32), returned with it."""
    if temperature == 0:
        return logits.argmax(dim=-1), None
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    flat = torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=generator)
    return flat.reshape(probs.shape[:-1]), probs
