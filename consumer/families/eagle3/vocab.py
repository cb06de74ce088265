"""The reduced draft vocabulary of an EAGLE-3 drafter from the training data's token counts, as speculators builds it
(train/vocab_mapping.py; shared/reference/eagle3.md 1.3): the draft_vocab_size tokens seen most often under the loss
mask, ties to the lower id (deterministic, where EAGLE and SpecForge keep Counter's insertion order), padded with the
lowest unseen ids when the data names fewer, ascending. d2t holds offsets (target id = i + d2t[i]) and t2d marks the
selected target ids: the maps vLLM, SGLang and speculators read."""

from __future__ import annotations

import torch


def token_counts(input_ids: torch.Tensor, loss_mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[vocab_size] int64: how often each token occurs where loss_mask is set (the tokens the drafter drafts)."""
    return torch.bincount(input_ids[loss_mask.bool()].long(), minlength=vocab_size)


def vocab_mapping(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t [draft_vocab_size] int64, t2d [V] bool) of token counts [V]."""
    vocab = counts.numel()
    if not 0 < draft_vocab_size <= vocab:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} must lie in 1..{vocab} (the target's vocabulary)")
    order = torch.sort(-counts, stable=True).indices  # most frequent first, ties to the lower id
    seen = order[: min(draft_vocab_size, int((counts > 0).sum()))]
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[seen] = True
    t2d[(~t2d).nonzero().squeeze(1)[: draft_vocab_size - seen.numel()]] = True  # the lowest unseen ids
    selected = t2d.nonzero().squeeze(1)
    return selected - torch.arange(draft_vocab_size), t2d
