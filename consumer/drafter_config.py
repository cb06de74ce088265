"""DFlash drafter hyper-parameters and the public (z-lab / SpecForge) HF config format.

The exported config.json must load unchanged in vLLM, SGLang and z-lab's
`trust_remote_code` model, so every key written here follows the published
DFlash checkpoints (z-lab/Qwen3-8B-DFlash-b16, SpecForge configs/qwen3-8b-dflash.json).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PretrainedConfig, Qwen3Config

# Paper A.1: gamma for the exp(-(k-1)/gamma) position decay, per block size.
PAPER_LOSS_GAMMA: dict[int, float] = {16: 7.0, 10: 5.0, 8: 4.0}

ATTENTION_TYPES = ("full_attention", "sliding_attention")


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Target layers whose outputs feed the drafter: spread evenly over 1..L-3.

    Must equal the rule in z-lab/SpecForge/SGLang, because serving stacks
    recompute it from num_target_layers when dflash_config omits the list.
    """
    if num_target_layers < 1 or num_draft_layers < 1:
        raise ValueError(f"need >= 1 target and draft layer, got {num_target_layers}, {num_draft_layers}")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    # Small targets get repeated ids (e.g. [1, 1] for 4 layers): kept, as the reference rule does.
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclass
class DrafterConfig:
    """What the trainer chooses; everything else is copied from the target's config."""

    num_hidden_layers: int = 1
    block_size: int = 16
    num_anchors: int = 512
    # None -> paper rule for block_size (B16->7, B10->5, B8->4); other sizes must set it.
    loss_gamma: float | None = None
    kl_weight: float = 0.0
    mask_token_id: int | None = None
    # None -> build_target_layer_ids(num_target_layers, num_hidden_layers).
    target_layer_ids: list[int] | None = None
    # None -> every layer "full_attention"; "sliding_attention" layers need sliding_window.
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    # Rows of [rows, vocab] logits alive at once in the loss; bounds peak memory.
    loss_chunk_tokens: int = 1024

    def __post_init__(self) -> None:
        if self.loss_gamma is None:
            if self.block_size not in PAPER_LOSS_GAMMA:
                raise ValueError(
                    f"no paper loss_gamma for block_size={self.block_size} "
                    f"(known: {PAPER_LOSS_GAMMA}); set loss_gamma explicitly"
                )
            self.loss_gamma = PAPER_LOSS_GAMMA[self.block_size]
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        self._validate()

    def _validate(self) -> None:
        if self.num_hidden_layers < 1 or self.block_size < 2 or self.num_anchors < 1:
            raise ValueError("need num_hidden_layers >= 1, block_size >= 2, num_anchors >= 1")
        if not (self.loss_gamma > 0 and math.isfinite(self.loss_gamma)):
            raise ValueError(f"loss_gamma must be a positive number, got {self.loss_gamma}")
        if self.kl_weight < 0 or self.loss_chunk_tokens < 1:
            raise ValueError("need kl_weight >= 0 and loss_chunk_tokens >= 1")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        if unknown := set(self.layer_types) - set(ATTENTION_TYPES):
            raise ValueError(f"unknown layer_types {sorted(unknown)}; expected {ATTENTION_TYPES}")
        if "sliding_attention" in self.layer_types and (self.sliding_window or 0) < self.block_size:
            raise ValueError("sliding_attention layers need sliding_window >= block_size")

    def resolved_target_layer_ids(self, num_target_layers: int) -> list[int]:
        ids = self.target_layer_ids or build_target_layer_ids(num_target_layers, self.num_hidden_layers)
        if not all(0 <= i < num_target_layers for i in ids):
            raise ValueError(f"target_layer_ids {ids} out of range for {num_target_layers} target layers")
        return list(ids)


def target_text_config(target_config: Mapping[str, Any] | PretrainedConfig) -> dict[str, Any]:
    """The language-model part of a target config (multimodal targets nest it under text_config)."""
    config = target_config.to_dict() if isinstance(target_config, PretrainedConfig) else dict(target_config)
    text = config.get("text_config")
    return dict(text) if text else config


def _rope_keys(target: Mapping[str, Any]) -> dict[str, Any]:
    """rope_theta/rope_scaling as published checkpoints spell them (transformers 5 nests them in rope_parameters)."""
    params = target.get("rope_parameters")
    if not params:
        return {"rope_theta": target["rope_theta"], "rope_scaling": target.get("rope_scaling")}
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling.get("rope_type", "default") == "default":
        scaling = None
    return {"rope_theta": params["rope_theta"], "rope_scaling": scaling}


def drafter_hf_config(
    cfg: DrafterConfig,
    target_config: Mapping[str, Any] | PretrainedConfig,
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, Any]:
    """config.json of the drafter in the public DFlash format; width and RoPE are the target's."""
    if cfg.mask_token_id is None:
        raise ValueError("mask_token_id is unset; use the target's first unused embedding row (151669 for Qwen3)")
    target = target_text_config(target_config)
    if not 0 <= cfg.mask_token_id < target["vocab_size"]:
        raise ValueError(f"mask_token_id {cfg.mask_token_id} is not a row of the target embedding")
    num_target_layers = target["num_hidden_layers"]
    head_dim = target.get("head_dim") or target["hidden_size"] // target["num_attention_heads"]
    config: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": cfg.block_size,
        "num_target_layers": num_target_layers,
        "dflash_config": {
            "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": cfg.resolved_target_layer_ids(num_target_layers),
        },
        "num_hidden_layers": cfg.num_hidden_layers,
        "hidden_size": target["hidden_size"],
        "num_attention_heads": target["num_attention_heads"],
        "num_key_value_heads": target["num_key_value_heads"],
        "head_dim": head_dim,
        "intermediate_size": target["intermediate_size"],
        "hidden_act": target.get("hidden_act", "silu"),
        "rms_norm_eps": target["rms_norm_eps"],
        **_rope_keys(target),
        "max_position_embeddings": target["max_position_embeddings"],
        "vocab_size": target["vocab_size"],
        "layer_types": list(cfg.layer_types),
        "sliding_window": cfg.sliding_window,
        "use_sliding_window": "sliding_attention" in cfg.layer_types,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "dtype": str(dtype).removeprefix("torch."),
    }
    for key in ("bos_token_id", "eos_token_id"):
        if target.get(key) is not None:
            config[key] = target[key]
    return config


def qwen3_config(hf_config: Mapping[str, Any]) -> Qwen3Config:
    """Qwen3Config carrying the DFlash extras (block_size, dflash_config) as attributes, like z-lab's model."""
    return Qwen3Config(**{k: v for k, v in hf_config.items() if k != "model_type"})


def block_size_of(config: Qwen3Config) -> int:
    """Newer checkpoints move block_size into dflash_config; SGLang reads both, so do we."""
    return int(config.dflash_config.get("block_size", getattr(config, "block_size", 0)))
