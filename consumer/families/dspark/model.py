"""DSpark's training model: the DFlash backbone with every slot drafting and the Markov and confidence heads
(dspark_heads.py). Parameter names are DeepSeek's flat Qwen3DSparkModel names."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dflash_ring.consumer.families.dspark.dspark_heads import ConfidenceHead, MarkovHead
from dflash_ring.consumer.training.loss import DSparkHeads
from dflash_ring.consumer.modeling.model import Anchors, DFlashDraftModel

if TYPE_CHECKING:
    from transformers import Qwen3Config


class DSparkDraftModel(DFlashDraftModel):
    """DSpark (consumer/dspark_heads.py): the DFlash backbone, every slot drafting (slot k predicts anchor + k + 1),
    plus the Markov and confidence heads. Parameter names are DeepSeek's flat Qwen3DSparkModel names."""

    sample_from_anchor = True

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        rank, hidden = int(config.markov_rank), config.hidden_size
        self.markov_head = MarkovHead(config.vocab_size, rank, hidden, config.markov_head_type)
        self.confidence_head = ConfidenceHead(hidden, rank)
        for module in (self.markov_head, self.confidence_head):
            for sub in module.modules():
                if isinstance(sub, nn.Linear):
                    nn.init.normal_(sub.weight, std=config.initializer_range)
                    if sub.bias is not None:
                        nn.init.zeros_(sub.bias)
        nn.init.normal_(self.markov_head.markov_w1.weight, std=0.01)

    def prev_ids(self, input_ids: torch.Tensor, anchors: Anchors) -> torch.Tensor:
        return dspark_prev_ids(input_ids, anchors, self.block_size)

    def objective_inputs(self, hidden: torch.Tensor, input_ids: torch.Tensor, anchors: Anchors) -> dict[str, Any]:
        """The heads' outputs on the step's blocks, for the TV, Markov-biased CE and confidence terms."""
        markov, confidence = self.heads(hidden, self.prev_ids(input_ids, anchors))
        return {"dspark": DSparkHeads(markov, self.markov_head.markov_w2.weight, confidence)}

    def heads(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(Markov features e [N, B, r], confidence logits [N, B] fp32) of backbone output hidden [N, B, H]."""
        prev_emb = self.markov_head.prev_embedding(prev_ids)
        return self.markov_head.features(hidden, prev_emb), self.confidence_head(hidden, prev_emb)


def dspark_prev_ids(input_ids: torch.Tensor, anchors: Anchors, block_size: int) -> torch.Tensor:
    """[N, B] teacher-forced previous tokens of DSpark's slots: prev_k = input_ids[anchor + k] (prev_0 is the anchor).
    A slot past its sequence's end reads the anchor: its label lies outside the sequence, so it is never supervised."""
    positions = anchors.positions[:, None] + torch.arange(block_size, device=input_ids.device)
    inside = positions < anchors.seq_bounds()[1][:, None]
    return input_ids[torch.where(inside, positions, anchors.positions[:, None])]
