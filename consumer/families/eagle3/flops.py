"""The model FLOPs of one EAGLE-3 training step, for `bench drafter`'s MFU: the block families' count
(bench/drafter.py step_flops) reads blocks of anchors, which an unrolled step over every row does not have."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dflash_ring.common.config.drafter import DrafterConfig
from dflash_ring.consumer.modeling.model import Anchors


def eagle3_step_flops(
    cfg: Mapping[str, Any],
    geometry: Mapping[str, Any],
    drafter: DrafterConfig,
    n_ctx_layers: int,
    tokens: int,
    blocks: Anchors,
    supervised: int,
    teacher_positions: int,
) -> float:
    """Forward and backward (x3) of what trains, forward only of the target's distribution: fc once over every row;
    at each of the ttt_steps steps the one layer over every row (q/k/v from [embedding, hidden], 2H wide; o; the
    SwiGLU MLP) and causal attention (row t sees its document's rows up to t and its own k earlier steps); the
    draft's head over the draft vocabulary per supervised (row, step), and the teacher's head once per label
    position (`teacher_positions`, forward only: the objective computes it once for every step that reads it)."""
    g = geometry  # the drafter's (layouts/drafter_hf_config.py drafter_geometry)
    h, hd = g["hidden_size"], g["head_dim"]
    q, kv = g["num_attention_heads"] * hd, g["num_key_value_heads"] * hd
    vocab = drafter.draft_vocab_size or cfg["vocab_size"]
    lengths = blocks.cu_seqlens.diff().double()
    mean_position = float((lengths * (lengths - 1) / 2).sum()) / max(tokens, 1)  # a row's keys before it, mean
    steps = drafter.ttt_steps
    fc = 2 * tokens * n_ctx_layers * h * h
    layer = 2 * tokens * (2 * h * (q + 2 * kv) + q * h + 3 * h * g["intermediate_size"])
    attention = sum(2 * 2 * tokens * (mean_position + 1 + k) * q for k in range(steps))
    trainable = fc + steps * layer + attention + 2 * h * vocab * supervised
    return 3 * trainable + 2 * h * vocab * teacher_positions
