"""DFlash drafter for transformers' `AutoModel.from_pretrained(dir, trust_remote_code=True)`.

dflash-ring's export copies this file verbatim as `dflash.py` next to config.json ("auto_map":
{"AutoModel": "dflash.DFlashDraftModel"}), so an exported drafter loads with its real architecture
and weights (fc, hidden_norm, layers, norm) wherever transformers runs, without dflash-ring. Hence it
imports only torch and transformers. The math is the training model's (dflash_ring.consumer.modeling.model),
checked equal by tests/test_drafter_families.py:

    context = hidden_norm(fc(concat of the target's hidden states at dflash_config.target_layer_ids))
    per layer: queries from the block, keys/values from [context ; block], q_norm/k_norm then RoPE,
    no causal mask (sliding layers: the last sliding_window positions up to the query's own)

The block is [anchor, MASK x (B-1)] embedded by the *target's* embedding; the output hidden states
go through the target's lm_head. Neither ships here: pass `noise_embedding` already embedded.
There is no KV cache: each call takes the whole context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3PreTrainedModel,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    rotate_half,
)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on [b, heads, L, d] with cos/sin [b, L, d]."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class DFlashAttention(nn.Module):
    """Queries from the block only; keys/values from [context ; block] through shared k/v projections."""

    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        self.sliding_window = config.sliding_window if layer_types[layer_idx] == "sliding_attention" else None

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(*x.shape[:2], -1, self.head_dim).transpose(1, 2)

    def forward(self, x, context, cos, sin, position_ids, attention_mask=None):
        ctx_len = context.shape[1]
        both = torch.cat([context, x], dim=1)
        q = _rotate(self.q_norm(self._heads(self.q_proj(x))), cos[:, ctx_len:], sin[:, ctx_len:])
        k = _rotate(self.k_norm(self._heads(self.k_proj(both))), cos, sin)
        v = self._heads(self.v_proj(both))
        mask = attention_mask
        if self.sliding_window is not None:  # key positions in (query - window, query]
            query_pos, key_pos = position_ids[:, ctx_len:, None], position_ids[:, None, :]
            window = (key_pos <= query_pos) & (key_pos > query_pos - self.sliding_window)
            mask = window[:, None] if mask is None else mask & window[:, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).flatten(2))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, context, cos, sin, position_ids, attention_mask=None):
        # The fused context is not re-normed per layer: only the block gets input_layernorm.
        x = x + self.self_attn(self.input_layernorm(x), context, cos, sin, position_ids, attention_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(Qwen3PreTrainedModel):
    """Parameter names as in the public DFlash checkpoints: layers.*, fc, hidden_norm, norm (no prefix)."""

    config_class = Qwen3Config
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        dflash = getattr(config, "dflash_config", None)
        if dflash is None:
            raise ValueError(
                f"config has no dflash_config: not a DFlash drafter (architectures ['DFlashDraftModel']) "
                f"but architectures {getattr(config, 'architectures', None)}; a DSpark drafter "
                "(architectures ['Qwen3DSparkModel']) loads with the dspark.py its export ships"
            )
        self.block_size = int(dflash.get("block_size", getattr(config, "block_size", 0)))
        self.mask_token_id = int(dflash["mask_token_id"])
        self.target_layer_ids = list(dflash["target_layer_ids"])
        hidden = config.hidden_size
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.fc = nn.Linear(len(self.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.post_init()

    def target_features(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The context this drafter reads, from a target forward's output_hidden_states (layer l -> index l + 1)."""
        return torch.cat([hidden_states[i + 1] for i in self.target_layer_ids], dim=-1)

    def forward(
        self,
        noise_embedding: torch.Tensor,
        target_hidden: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values=None,
        use_cache: bool = False,
        **kwargs,
    ) -> torch.Tensor:
        """Draft hidden states [b, q, H], final-normed, for blocks after a context.

        noise_embedding: [b, q, H] the block embedded by the target; target_hidden: [b, c, n*H] the
        target's features of the context (target_features); position_ids: [b, c + q], by default
        0..c+q-1 (the block right after its context); attention_mask: optional bool [b, 1, q, c + q],
        True = attend, combined with the sliding windows.
        """
        if past_key_values is not None or use_cache:
            raise ValueError("this DFlash drafter has no KV cache: pass the whole context as target_hidden each call")
        if target_hidden.shape[-1] != self.fc.in_features:
            raise ValueError(
                f"target_hidden width {target_hidden.shape[-1]} != {self.fc.in_features} "
                f"(hidden states of target layers {self.target_layer_ids}, concatenated)"
            )
        batch, ctx_len, q_len = noise_embedding.shape[0], target_hidden.shape[1], noise_embedding.shape[1]
        if position_ids is None:
            position_ids = torch.arange(ctx_len + q_len, device=noise_embedding.device).expand(batch, -1)
        x = noise_embedding.to(self.fc.weight.dtype)
        context = self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))
        cos, sin = self.rotary_emb(x, position_ids)
        for layer in self.layers:
            x = layer(x, context, cos, sin, position_ids, attention_mask)
        return self.norm(x)
