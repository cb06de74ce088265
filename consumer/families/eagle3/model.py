"""EAGLE-3's training model: fc over the target's low/mid/high features, one Llama decoder layer whose q/k/v read
[input_layernorm(embedding), hidden_norm(hidden)], the final norm and a draft-vocabulary lm_head, unrolled over
training-time test (shared/reference/eagle3.md 1.2, 2.1-2.2).

Every packed position t is a draft row. Step k feeds the token x_{t+1+k} (teacher-forced) beside the row's own hidden
state from step k - 1 (fc's fused features at step 0) at position t + 1 + k, and attends to the step-0 keys of its
document up to itself (causal) plus its own keys of steps 1..k (the diagonal): what a chain of k drafts sees. A row
whose step runs past its document's end reads token 0 and is never supervised; no other row attends to it.

Tensor names are speculators' Eagle3Speculator names (fc.weight, layers.0.*, norm.weight, lm_head.weight, d2t, t2d),
so a state dict maps 1:1 onto its checkpoints. The embedding is the frozen target's (FrozenTargetHead.embed), never
this model's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask

from dflash_ring.common.config.families.eagle3 import EAGLE3 as EAGLE3_CONFIG
from dflash_ring.consumer.modeling.model import _SDPA_BACKENDS, FLEX_TILE, _apply_rope, _flex_attention
from dflash_ring.consumer.modeling.qwen3_blocks import Qwen3MLP, Qwen3RMSNorm, rope_frequencies

if TYPE_CHECKING:
    from dflash_ring.consumer.modeling.target_head import FrozenTargetHead


class _StepCache:
    """K/V of every step so far, [T, kv_heads, d] each, and the packed batch's document layout."""

    def __init__(self, cu_seqlens: torch.Tensor, length: int) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.cu_seqlens = cu_seqlens
        self.length = length


class Eagle3Attention(nn.Module):
    """Llama attention (no q/k norm) on the 2H-wide [embedding, hidden] input, over the causal + diagonal keys."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        width = 2 * config.hidden_size
        self.q_proj = nn.Linear(width, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: _StepCache, attention: str
    ) -> torch.Tensor:
        heads = (-1, self.head_dim)
        q = _apply_rope(self.q_proj(x).unflatten(-1, heads), *rope)
        cache.keys.append(_apply_rope(self.k_proj(x).unflatten(-1, heads), *rope))
        cache.values.append(self.v_proj(x).unflatten(-1, heads))
        if attention == "flex":
            out = self._flex(q, cache)
        elif attention == "sdpa":
            out = self._sdpa(q, cache)
        else:
            raise ValueError(f"attention must be 'flex' or 'sdpa', got {attention!r}")
        return self.o_proj(out.flatten(1))

    def _sdpa(self, q: torch.Tensor, cache: _StepCache) -> torch.Tensor:
        """One dense masked SDPA call per document: its keys are [step 0 | step 1 | ... | step k] of its rows."""
        groups = self.num_heads // self.num_kv_heads
        bounds = cache.cu_seqlens.tolist()
        steps = len(cache.keys)
        outputs = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            n = end - start
            if not n:
                continue
            eye = torch.eye(n, dtype=torch.bool, device=q.device)
            mask = torch.cat([torch.ones_like(eye).tril(), *([eye] * (steps - 1))], dim=1)

            def keys(parts: list[torch.Tensor]) -> torch.Tensor:
                return torch.cat([p[start:end] for p in parts]).transpose(0, 1).repeat_interleave(groups, dim=0)[None]

            with sdpa_kernel(_SDPA_BACKENDS):  # no cuDNN: it builds a graph per new shape (consumer/modeling/model.py)
                out = F.scaled_dot_product_attention(
                    q[start:end].transpose(0, 1)[None], keys(cache.keys), keys(cache.values), attn_mask=mask
                )
            outputs.append(out[0].transpose(0, 1))
        return torch.cat(outputs)

    def _flex(self, q: torch.Tensor, cache: _StepCache) -> torch.Tensor:
        """One block-sparse flex_attention call: per query tile, the step-0 tiles from its first row's document start
        to itself and one tile per later step (its own rows' keys there)."""
        length, steps = cache.length, len(cache.keys)
        padded = (length + FLEX_TILE - 1) // FLEX_TILE * FLEX_TILE

        def pad(x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x, x.new_zeros(padded - length, *x.shape[1:])])

        keys = torch.cat([pad(k) for k in cache.keys]).transpose(0, 1)[None]
        values = torch.cat([pad(v) for v in cache.values]).transpose(0, 1)[None]
        out = _flex_attention(pad(q).transpose(0, 1)[None], keys, values, _step_mask(cache, padded, steps))
        return out[0, :, :length].transpose(0, 1)


def _step_mask(cache: _StepCache, padded: int, steps: int) -> BlockMask:
    """The causal + diagonal mask of step `steps - 1` over keys [step 0 | ... | step k], each padded to `padded`
    rows; the padding rows are a document of their own."""
    device, cu = cache.cu_seqlens.device, cache.cu_seqlens
    lengths = torch.cat([cu.diff(), cu.new_tensor([padded - cache.length])])
    starts = torch.cat([cu[:-1], cu.new_tensor([cache.length])]).repeat_interleave(lengths)
    tiles = padded // FLEX_TILE
    row = torch.arange(tiles, device=device)
    first = starts[row * FLEX_TILE] // FLEX_TILE  # the step-0 tiles a query tile may see start here
    own = row - first + 1
    slot = torch.arange(steps * tiles, device=device)[None]  # BlockMask reads the kv tile count off this width
    later = slot - own[:, None] + 1  # the step of each slot after the step-0 tiles
    indices = torch.where(slot < own[:, None], first[:, None] + slot, torch.where(later < steps, later * tiles, 0))
    indices = torch.where((slot >= own[:, None]) & (later < steps), indices + row[:, None], indices)
    counts = own + steps - 1

    def mask_mod(b, h, q_idx, kv_idx):
        key = kv_idx % padded
        causal = (kv_idx < padded) & (key <= q_idx) & (starts[key] == starts[q_idx])
        return causal | (key == q_idx)

    return BlockMask.from_kv_blocks(
        counts.to(torch.int32)[None, None],
        indices.clamp(max=steps * tiles - 1).to(torch.int32)[None, None],
        BLOCK_SIZE=FLEX_TILE,
        mask_mod=mask_mod,
        seq_lengths=(padded, steps * padded),
    )


class Eagle3DecoderLayer(nn.Module):
    """speculators' Eagle3 first layer (Llama): the embedding and the hidden state normed apart, concatenated in that
    order; the attention's residual is the raw hidden state, or its norm with norm_before_residual."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Eagle3Attention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(hidden, eps=eps)
        self.hidden_norm = Qwen3RMSNorm(hidden, eps=eps)
        self.post_attention_layernorm = Qwen3RMSNorm(hidden, eps=eps)
        self.norm_before_residual = bool(config.norm_before_residual)

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: _StepCache,
        attention: str,
    ) -> torch.Tensor:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = residual + self.self_attn(torch.cat([self.input_layernorm(embeds), normed], dim=-1), rope, cache, attention)
        return x + self.mlp(self.post_attention_layernorm(x))


def eagle3_settings(config: Any) -> tuple[list[int], int]:
    """(target_layer_ids in our output-of-layer numbering, ttt_steps) of an EAGLE-3 config: the layout keeps the
    layers as EAGLE's hidden_states indices (eagle_aux_hidden_state_layer_ids = ours + 1), and our exports the TTT
    depth in dflash_training; a release that records none (EAGLE's, SpecForge's) drafts the recipe's depth."""
    read = config.get if isinstance(config, dict) else lambda key: getattr(config, key, None)
    layers = read("eagle_config")["eagle_aux_hidden_state_layer_ids"]
    steps = (read("dflash_training") or {}).get("ttt_steps", EAGLE3_CONFIG.defaults["ttt_steps"])
    return [i - 1 for i in layers], int(steps)


class Eagle3DraftModel(nn.Module):
    """The training model (unrolled over ttt_steps by `forward`) and the chain drafter's single step."""

    sample_from_anchor = False  # a round drafts block_size - 1 = ttt_steps tokens after the last committed one

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.target_layer_ids, steps = eagle3_settings(config)
        self.block_size = steps + 1
        self.mask_token_id = int(config.mask_token_id)
        hidden, vocab, draft_vocab = config.hidden_size, config.vocab_size, config.draft_vocab_size
        if config.num_hidden_layers != 1:
            raise ValueError(f"an EAGLE-3 drafter has one decoder layer, config says {config.num_hidden_layers}")
        self.fc = nn.Linear(len(self.target_layer_ids) * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([Eagle3DecoderLayer(config)])
        self.norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, draft_vocab, bias=False)
        if draft_vocab < vocab:
            # Until a mapping built from the training data's token counts is loaded (load_vocab_mapping): the lowest
            # ids, as speculators' builder pads a mapping whose data names too few tokens.
            self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
            self.register_buffer("t2d", torch.arange(vocab) < draft_vocab)
        inv_freq, self._rope_scaling = rope_frequencies(config)
        self._inv_freq = inv_freq.to(torch.float32)  # fp32 whatever the model's dtype (as DFlashDraftModel)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=config.initializer_range)

    @property
    def draft_ids(self) -> torch.Tensor | None:
        """The target ids of the draft vocabulary's rows ([Vd], ascending), or None where it is the target's."""
        d2t = getattr(self, "d2t", None)
        return None if d2t is None else torch.arange(d2t.numel(), device=d2t.device) + d2t

    def load_vocab_mapping(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """speculators' d2t (int64 offsets: target id = i + d2t[i]) and t2d (bool over the target's vocabulary)."""
        if getattr(self, "d2t", None) is None:
            raise ValueError("this EAGLE-3 drafter drafts over the target's whole vocabulary: it has no d2t/t2d")
        selected = torch.arange(d2t.numel(), device=d2t.device) + d2t
        if (
            d2t.shape != self.d2t.shape
            or t2d.shape != self.t2d.shape
            or not torch.equal(t2d.nonzero().squeeze(1), selected.to(t2d.device))
        ):
            raise ValueError(
                f"d2t {tuple(d2t.shape)} / t2d {tuple(t2d.shape)} do not describe this drafter's {self.d2t.numel()} "
                f"draft ids among {self.t2d.numel()} (t2d must select exactly the ids i + d2t[i], ascending)"
            )
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def compile_layers(self, include_fc: bool = False) -> None:
        """As DFlashDraftModel.compile_layers: the decoder layer's norms, RoPE and MLP fused around the matmuls."""
        for layer in self.layers:
            layer.compile(dynamic=True)
        if include_fc:
            self.fc.compile(dynamic=True)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self._inv_freq.to(positions.device)[None, :]
        angles = torch.cat([freqs, freqs], dim=-1)
        return (angles.cos() * self._rope_scaling).to(dtype), (angles.sin() * self._rope_scaling).to(dtype)

    def forward(
        self,
        features: torch.Tensor,
        input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        head: FrozenTargetHead,
        steps: int,
        *,
        attention: str = "sdpa",
    ) -> list[torch.Tensor]:
        """Training-time test: the rows' hidden states after each of `steps` teacher-forced steps, [T, H] each,
        before the final norm (what the next step reads; self.logits(h) at row t, step k drafts token t + 2 + k)."""
        unroll = Unroll(self, features, cu_seqlens, head, attention)
        return [unroll.step(teacher_ids(input_ids, cu_seqlens, k)) for k in range(steps)]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of hidden states from `forward` or `step`."""
        return self.lm_head(self.norm(hidden))


def teacher_ids(input_ids: torch.Tensor, cu_seqlens: torch.Tensor, step: int) -> torch.Tensor:
    """[T] the token row t reads at `step`: x_{t+1+step}, or 0 past the end of t's document (never supervised)."""
    length = input_ids.shape[0]
    token = torch.arange(length, device=input_ids.device) + 1 + step
    ends = cu_seqlens[1:].repeat_interleave(cu_seqlens.diff())
    return torch.where(token < ends, input_ids[token.clamp(max=length - 1)], 0)


class Unroll:
    """TTT steps over a packed batch, one `step` call each: training feeds the data's tokens (teacher_ids), the
    chain drafter its own drafts at the last row. Row t's step k sits at position t + 1 + k of its document."""

    def __init__(
        self,
        model: Eagle3DraftModel,
        features: torch.Tensor,
        cu_seqlens: torch.Tensor,
        head: FrozenTargetHead,
        attention: str,
    ) -> None:
        if features.shape[-1] != model.fc.in_features:
            raise ValueError(
                f"features width {features.shape[-1]} != {model.fc.in_features} (n_target_layers * hidden)"
            )
        length = features.shape[0]
        if int(cu_seqlens[-1]) != length:
            raise ValueError(f"cu_seqlens ends at {int(cu_seqlens[-1])}, the features have {length} rows")
        self.model, self.head, self.attention = model, head, attention
        rows = torch.arange(length, device=features.device)
        self.positions = rows + 1 - cu_seqlens[:-1].repeat_interleave(cu_seqlens.diff())
        self.hidden = model.fc(features.to(model.fc.weight.dtype))
        self.cache = _StepCache(cu_seqlens, length)
        self.done = 0

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows' hidden states [T, H] after one more step that reads token ids [T]."""
        hidden = self.hidden
        embeds = self.head.embed(ids).to(hidden.dtype)
        rope = self.model._rope(self.positions + self.done, hidden.dtype)
        for layer in self.model.layers:
            hidden = layer(embeds, hidden, rope, self.cache, self.attention)
        self.hidden, self.done = hidden, self.done + 1
        return hidden
