"""DFlash2 drafter for transformers' `AutoModel.from_pretrained(dir, trust_remote_code=True)`.

dflash-ring's export of an arch = "dflash2" drafter copies this file as `dflash2.py` and consumer/dflash2_blocks.py
as `dflash2_blocks.py` next to config.json ("auto_map": {"AutoModel": "dflash2.DFlash2DraftModel"}), so the drafter
loads with its real architecture wherever transformers runs, without dflash-ring: it imports only torch,
transformers and that second file. The math is the training model's
(dflash_ring.consumer.modeling.model.DFlash2DraftModel), checked equal with z-lab's DFlash2DraftModel by
tests/test_peer_conformance.py:

    context = hidden_norm(fc(concat of the target's hidden states at dflash_config.target_layer_ids))
    per layer: h = norm(x); h, d = attention_conv.prepare(h); x += attention_conv.finish(attn(h), d); the same with
    mlp_conv around the MLP (the convolutions run along the block: one block per batch row here)
    attention: queries from the block, keys/values from [context ; block]; causal as the engines read config.json
    (top-level is_causal, then dflash_config.causal, else sliding layers causal): DFlash2's export says
    is_causal false; sliding layers keep the last sliding_window keys of the query's position

`propose` walks the candidate selector from the anchor (greedy at temperature 0, else sampled). The block is
[anchor, MASK x (B-1)] embedded by the *target's* embedding (times dflash_config.input_embedding_scale when set);
the output goes through the target's lm_head (compute_logits applies output_multiplier and final_logit_softcapping
when set). There is no KV cache: each call takes the whole context.
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

from .dflash2_blocks import CandidateSelector, GroupedDynamicCausalConv


def _setting(config: Qwen3Config, key: str, default=None):
    """A drafter setting where DFlash2 checkpoints keep it: dflash_config first, then top level."""
    nested = getattr(config, "dflash_config", None) or {}
    return nested[key] if key in nested else getattr(config, key, default)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class DFlash2Attention(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        sliding = layer_types[layer_idx] == "sliding_attention"
        self.sliding_window = config.sliding_window if sliding else None
        causal = getattr(config, "is_causal", None)
        if causal is None:
            causal = (getattr(config, "dflash_config", None) or {}).get("causal")
        self.is_causal = sliding if causal is None else bool(causal)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(*x.shape[:2], -1, self.head_dim).transpose(1, 2)

    def forward(self, x, context, cos, sin, position_ids, attention_mask=None):
        ctx_len = context.shape[1]
        both = torch.cat([context, x], dim=1)
        q = _rotate(self.q_norm(self._heads(self.q_proj(x))), cos[:, ctx_len:], sin[:, ctx_len:])
        k = _rotate(self.k_norm(self._heads(self.k_proj(both))), cos, sin)
        v = self._heads(self.v_proj(both))
        query_pos, key_pos = position_ids[:, ctx_len:, None], position_ids[:, None, :]
        visible = torch.ones_like(key_pos <= query_pos)
        if self.is_causal:
            visible = visible & (key_pos <= query_pos)
        if self.sliding_window is not None:
            visible = visible & (key_pos > query_pos - self.sliding_window)
            if not self.is_causal:
                visible = visible & (key_pos < query_pos + self.sliding_window)
        mask = visible[:, None] if attention_mask is None else attention_mask & visible[:, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).flatten(2))


class DFlash2DecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DFlash2Attention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        kernel, group = int(_setting(config, "conv_kernel_size")), int(_setting(config, "conv_group_size"))
        self.attention_conv = GroupedDynamicCausalConv(config.hidden_size, kernel, group)
        self.mlp_conv = GroupedDynamicCausalConv(config.hidden_size, kernel, group)

    def forward(self, x, context, cos, sin, position_ids, attention_mask=None):
        h, delta = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.self_attn(h, context, cos, sin, position_ids, attention_mask), delta)
        h, delta = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(h), delta)


class DFlash2DraftModel(Qwen3PreTrainedModel):
    """Parameter names as z-lab's DFlash2 checkpoints store them: layers.* (with attention_conv, mlp_conv), fc,
    hidden_norm, norm, candidate_selector.{predecessor_codebook, successor_codebook, hidden_projection.weight}."""

    config_class = Qwen3Config
    _no_split_modules = ["DFlash2DecoderLayer"]

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        self.block_size = int(_setting(config, "block_size"))
        self.mask_token_id = int(_setting(config, "mask_token_id"))
        self.target_layer_ids = list(_setting(config, "target_layer_ids"))
        hidden = config.hidden_size
        self.layers = nn.ModuleList(DFlash2DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.fc = nn.Linear(len(self.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.candidate_selector = CandidateSelector(
            config.vocab_size, hidden, int(_setting(config, "selector_rank")), int(_setting(config, "selector_top_k"))
        )
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
        """Draft hidden states [b, B, H], final-normed, of one block per row after its context (see hf_dflash.py):
        noise_embedding [b, B, H], target_hidden [b, c, n*H], position_ids [b, c + B] (default 0..c+B-1)."""
        if past_key_values is not None or use_cache:
            raise ValueError("this DFlash2 drafter has no KV cache: pass the whole context as target_hidden each call")
        batch, ctx_len, q_len = noise_embedding.shape[0], target_hidden.shape[1], noise_embedding.shape[1]
        if position_ids is None:
            position_ids = torch.arange(ctx_len + q_len, device=noise_embedding.device).expand(batch, -1)
        x = noise_embedding.to(self.fc.weight.dtype)
        context = self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))
        cos, sin = self.rotary_emb(x, position_ids)
        for layer in self.layers:
            x = layer(x, context, cos, sin, position_ids, attention_mask)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        logits = lm_head(hidden) * float(_setting(self.config, "output_multiplier", 1.0) or 1.0)
        cap = _setting(self.config, "final_logit_softcapping")
        return logits if not cap else torch.tanh(logits / float(cap)) * float(cap)

    def propose(
        self,
        hidden: torch.Tensor,
        anchor_ids: torch.Tensor,
        lm_head: nn.Module,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ):
        """The selector's walk over the drafting slots' hidden states [b, B-1, H] from anchor_ids [b]:
        (path [b, B-1], candidates [b, B-1, K], scores [b, B-1, K]; softmax(scores / T) is q over the candidates)."""
        return self.candidate_selector.walk(
            hidden, self.compute_logits(hidden, lm_head), anchor_ids, temperature, generator
        )
