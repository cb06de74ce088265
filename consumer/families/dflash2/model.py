"""DFlash2's training model: DFlash layers with the grouped dynamic causal convolutions around their attention and
MLP, and the candidate selector after the target's head (dflash2_blocks.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dflash_ring.consumer.families.dflash2.dflash2_blocks import CandidateSelector, GroupedDynamicCausalConv
from dflash_ring.consumer.training.loss import SelectorInputs
from dflash_ring.consumer.modeling.model import Anchors, DFlashDecoderLayer, DFlashDraftModel, block_size_of

if TYPE_CHECKING:
    from transformers import Qwen3Config


class DFlash2DecoderLayer(DFlashDecoderLayer):
    """A DFlash layer with DFlash2's grouped dynamic causal convolution around its attention and its MLP
    (consumer/dflash2_blocks.py): taps along each block of B rows, never across."""

    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        dflash = config.dflash_config
        self.block_size = block_size_of(config)
        kernel, group = int(dflash["conv_kernel_size"]), int(dflash["conv_group_size"])
        self.attention_conv = GroupedDynamicCausalConv(config.hidden_size, kernel, group)
        self.mlp_conv = GroupedDynamicCausalConv(config.hidden_size, kernel, group)

    def forward(self, x, context, block_rope, context_rope, groups):
        blocks = x.view(-1, self.block_size, x.shape[-1])  # [N, B, H]: rows are whole blocks
        h, delta = self.attention_conv.prepare(self.input_layernorm(blocks))
        attended = self.self_attn(h.flatten(0, 1), context, block_rope, context_rope, groups)
        blocks = blocks + self.attention_conv.finish(attended.view_as(blocks), delta)
        h, delta = self.mlp_conv.prepare(self.post_attention_layernorm(blocks))
        return (blocks + self.mlp_conv.finish(self.mlp(h), delta)).view_as(x)


class DFlash2DraftModel(DFlashDraftModel):
    """DFlash2 (z-lab's DFlash2DraftModel): the DFlash layout (slot 0 the anchor) with each layer's convolutions,
    sliding layers bidirectional inside the block, and the candidate selector after the target's head."""

    sliding_causal = False

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)  # the convolutions start as the identity: _make_layer builds them after the init
        dflash = config.dflash_config
        self.candidate_selector = CandidateSelector(
            config.vocab_size,
            config.hidden_size,
            int(dflash["selector_rank"]),
            int(dflash["selector_top_k"]),
            config.initializer_range,
        )
        for layer in self.layers:  # the Linear init above drew kernel_projection: back to the identity
            layer.attention_conv.reset_parameters()
            layer.mlp_conv.reset_parameters()

    def _make_layer(self, config: Qwen3Config, layer_idx: int) -> nn.Module:
        return DFlash2DecoderLayer(config, layer_idx)

    def objective_inputs(self, hidden: torch.Tensor, input_ids: torch.Tensor, anchors: Anchors) -> dict[str, Any]:
        """The selector's inputs on the step's blocks, for its K-way CE against the true predecessor's candidates."""
        chooser = self.candidate_selector
        context = chooser.context(hidden, self.prev_ids(input_ids, anchors))
        return {"selector": SelectorInputs(context, chooser.successor_codebook, chooser.top_k)}

    def prev_ids(self, input_ids: torch.Tensor, anchors: Anchors) -> torch.Tensor:
        """[N, B] teacher-forced predecessors: slot k's is input_ids[anchor + k - 1] (slot 0 never drafts: the anchor;
        past the sequence's end, the anchor, never supervised)."""
        return _predecessors(input_ids, anchors, self.block_size)


def _predecessors(input_ids: torch.Tensor, anchors: Anchors, block_size: int) -> torch.Tensor:
    """[N, B]: input_ids[anchor + k - 1] for k >= 1 (inside the sequence, else the anchor), the anchor at k = 0."""
    offsets = (torch.arange(block_size, device=input_ids.device) - 1).clamp_min(0)
    positions = anchors.positions[:, None] + offsets
    inside = positions < anchors.seq_bounds()[1][:, None]
    return input_ids[torch.where(inside, positions, anchors.positions[:, None])]
