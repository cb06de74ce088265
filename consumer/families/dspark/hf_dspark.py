"""DSpark drafter for transformers' `AutoModel.from_pretrained(dir, trust_remote_code=True)`.

dflash-ring's export of a DSpark drafter copies this file verbatim as `dspark.py` next to config.json ("auto_map":
{"AutoModel": "dspark.Qwen3DSparkModel"}), so the export loads with its real architecture and every weight
wherever transformers runs, without dflash-ring: it imports only torch and transformers. The checkpoint is
DeepSeek's flat Qwen3DSparkModel layout (what vLLM's "dspark" method and SGLang's DSPARK load): no `model.`
prefix, the target's embed_tokens and lm_head shipped as the drafter's own (frozen in training), every setting
top-level in config.json. The math is the training model's (dflash_ring.consumer.modeling.model.DSparkDraftModel and
consumer/dspark_heads.py), checked equal in fp32 by tests/test_peer_conformance.py:

    backbone (DFlash unchanged): context = hidden_norm(fc(concat of the target's hidden states at target_layer_ids));
        per layer: queries from the block, keys/values from [context ; block], q_norm/k_norm then RoPE, no mask
        inside the block; the block's output final-normed: h [.., B, H]
    the block is [anchor, MASK x (B-1)] at positions a .. a+B-1, and every slot drafts: slot k predicts token a+k+1
    logits_k = lm_head(h_k) + markov_w2(e_k), with prev_k the token before slot k's (prev_0 = the anchor; serving
        feeds back the token drafted at slot k-1) and
        vanilla: e_k = W1[prev_k]
        gated:   e_k = sigmoid(gate_proj([h_k ; W1[prev_k]])) * W1[prev_k]
        rnn:     g, c, o = joint_proj([s_{k-1} ; W1[prev_k] ; h_k]);
                 s_k = sigmoid(g) s_{k-1} + (1 - sigmoid(g)) tanh(c); e_k = tanh(o); s_{-1} = 0
    confidence_k = proj([h_k ; W1[prev_k]]) in fp32: the logit of P(slot k accepted | every earlier slot accepted)

There is no KV cache: each call takes the whole context. Drafting a block: h = model(model.embed_tokens(block),
target_hidden, position_ids), then left to right sample slot k from compute_logits(h)[.., k, :] +
markov_bias(prev, h)[.., k, :] and append the sample to prev (the rnn head's bias at slot k depends on prev_0..k).
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

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on [b, heads, L, d] with cos/sin [b, L, d]."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class DSparkAttention(nn.Module):
    """Queries from the block only; keys/values from [context ; block] through shared k/v projections."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.head_dim = config.head_dim
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(*x.shape[:2], -1, self.head_dim).transpose(1, 2)

    def forward(self, x, context, cos, sin, attention_mask=None):
        ctx_len = context.shape[1]
        both = torch.cat([context, x], dim=1)
        q = _rotate(self.q_norm(self._heads(self.q_proj(x))), cos[:, ctx_len:], sin[:, ctx_len:])
        k = _rotate(self.k_norm(self._heads(self.k_proj(both))), cos, sin)
        v = self._heads(self.v_proj(both))
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attention_mask, enable_gqa=self.num_heads != self.num_kv_heads
        )
        return self.o_proj(out.transpose(1, 2).flatten(2))


class DSparkDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.self_attn = DSparkAttention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, context, cos, sin, attention_mask=None):
        # The fused context is not re-normed per layer: only the block gets input_layernorm.
        x = x + self.self_attn(self.input_layernorm(x), context, cos, sin, attention_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DSparkMarkovHead(nn.Module):
    """markov_w1 [V, r] indexed by the previous token, markov_w2 [V, r] to the vocabulary; gated/rnn add a
    projection."""

    def __init__(self, vocab_size: int, rank: int, hidden_size: int, kind: str) -> None:
        super().__init__()
        self.kind, self.rank = kind, rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def features(self, hidden: torch.Tensor, prev_emb: torch.Tensor) -> torch.Tensor:
        """e [n, B, r] from h [n, B, H] and W1[prev] [n, B, r]."""
        if self.kind == "vanilla":
            return prev_emb
        hidden = hidden.to(prev_emb.dtype)
        if self.kind == "gated":
            return torch.sigmoid(self.gate_proj(torch.cat([hidden, prev_emb], dim=-1))) * prev_emb
        state, out = prev_emb.new_zeros(prev_emb.shape[0], self.rank), []
        for k in range(prev_emb.shape[1]):
            gate, candidate, output = self.joint_proj(torch.cat([state, prev_emb[:, k], hidden[:, k]], -1)).chunk(3, -1)
            gate = torch.sigmoid(gate)
            state = gate * state + (1 - gate) * torch.tanh(candidate)
            out.append(torch.tanh(output))
        return torch.stack(out, dim=1)


class DSparkConfidenceHead(nn.Module):
    def __init__(self, input_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)


def check_dspark_config(config: Qwen3Config) -> None:
    """Refuse, in one line naming both layouts, a config that is not a DSpark drafter's (a DFlash export's above all:
    its nested dflash_config, slot 0 drafting nothing, would load here as garbage)."""
    architectures = getattr(config, "architectures", None) or []
    if getattr(config, "dflash_config", None) is not None or "DFlashDraftModel" in architectures:
        raise ValueError(
            f"this is a DFlash drafter (architectures {architectures}, a nested dflash_config), not a "
            "DSpark one (architectures ['Qwen3DSparkModel']): load it with its own dflash.py"
        )
    missing = [
        k
        for k in ("block_size", "target_layer_ids", "mask_token_id", "markov_rank", "markov_head_type")
        if getattr(config, k, None) is None
    ]
    if missing:
        raise ValueError(f"config has no {missing}: not a DSpark drafter (architectures ['Qwen3DSparkModel'])")
    if config.markov_head_type not in MARKOV_HEAD_TYPES:
        raise ValueError(f"markov_head_type {config.markov_head_type!r} is not one of {MARKOV_HEAD_TYPES}")
    if not getattr(config, "sample_from_anchor", True) or getattr(config, "dspark_bonus_anchor", False):
        raise ValueError(
            "this model drafts from the anchor (sample_from_anchor true): the 1+N bonus-anchor layout is another model"
        )
    if not (getattr(config, "enable_confidence_head", True) and getattr(config, "confidence_head_with_markov", True)):
        raise ValueError(
            "this model has the confidence head fed with the Markov embedding (enable_confidence_head "
            "and confidence_head_with_markov true)"
        )
    if any(t != "full_attention" for t in (getattr(config, "layer_types", None) or [])):
        raise ValueError(f"DSpark drafters have full_attention layers only, config has {config.layer_types}")


class Qwen3DSparkModel(Qwen3PreTrainedModel):
    """Parameter names as DeepSeek's Qwen3DSparkModel checkpoints (no prefix): embed_tokens, layers.*, fc, hidden_norm,
    norm, lm_head, markov_head.*, confidence_head.proj."""

    config_class = Qwen3Config
    _no_split_modules = ["DSparkDecoderLayer"]

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        check_dspark_config(config)
        self.block_size = int(config.block_size)
        self.mask_token_id = int(config.mask_token_id)
        self.target_layer_ids = list(config.target_layer_ids)
        hidden, vocab, rank = config.hidden_size, config.vocab_size, int(config.markov_rank)
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(DSparkDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.fc = nn.Linear(len(self.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.markov_head = DSparkMarkovHead(vocab, rank, hidden, config.markov_head_type)
        self.confidence_head = DSparkConfidenceHead(hidden + rank)
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
        """Backbone hidden states h [b, q, H], final-normed, for blocks after a context.

        noise_embedding: [b, q, H] the block embedded (embed_tokens); target_hidden: [b, c, n*H] the target's features
        of the context (target_features); position_ids: [b, c + q], by default 0..c+q-1 (the block right after its
        context); attention_mask: optional bool [b, 1, q, c + q], True = attend.
        """
        if past_key_values is not None or use_cache:
            raise ValueError("this DSpark drafter has no KV cache: pass the whole context as target_hidden each call")
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
            x = layer(x, context, cos, sin, attention_mask)
        return self.norm(x)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The backbone's logits lm_head(h), before the Markov bias."""
        return self.lm_head(hidden_states.to(self.lm_head.weight.dtype))

    def _blocks(self, prev_token_ids: torch.Tensor, hidden_states: torch.Tensor):
        if prev_token_ids.shape != hidden_states.shape[:-1]:
            raise ValueError(
                f"prev_token_ids {tuple(prev_token_ids.shape)} must be hidden_states' "
                f"{tuple(hidden_states.shape[:-1])} (one previous token per slot)"
            )
        lead = prev_token_ids.shape[:-1]
        return (
            lead,
            prev_token_ids.reshape(-1, prev_token_ids.shape[-1]),
            hidden_states.reshape(-1, *hidden_states.shape[-2:]),
        )

    def markov_bias(self, prev_token_ids: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """The Markov head's logit bias [.., B, V] for slots whose previous tokens are prev_token_ids [.., B] (slot 0:
        the anchor) and whose backbone output is hidden_states [.., B, H]; the rnn head runs along the B axis."""
        lead, prev, hidden = self._blocks(prev_token_ids, hidden_states)
        head = self.markov_head
        features = head.features(hidden, head.markov_w1(prev))
        bias = F.linear(features.to(head.markov_w2.weight.dtype), head.markov_w2.weight)
        return bias.reshape(*lead, *bias.shape[1:])

    def draft_logits(self, prev_token_ids: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """logits_k = lm_head(h_k) + Markov bias(prev_k): the distribution slot k drafts from, given prev."""
        return self.compute_logits(hidden_states) + self.markov_bias(prev_token_ids, hidden_states)

    def confidence_logits(self, prev_token_ids: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """Confidence logits [.., B] in fp32: sigmoid gives P(slot k accepted | every earlier slot accepted)."""
        self._blocks(prev_token_ids, hidden_states)
        prev_emb = self.markov_head.markov_w1(prev_token_ids)
        proj = self.confidence_head.proj
        features = torch.cat([hidden_states.float(), prev_emb.float()], dim=-1)
        return F.linear(features, proj.weight.float(), proj.bias.float()).squeeze(-1)
