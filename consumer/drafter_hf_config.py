"""The drafter's Hugging Face config.json in the public (z-lab / SpecForge) DFlash format.

The exported config.json must load unchanged in vLLM, SGLang and z-lab's
`trust_remote_code` model, so every key written here follows the published
DFlash checkpoints (z-lab/Qwen3-8B-DFlash-b16, SpecForge configs/qwen3-8b-dflash.json).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from transformers import PretrainedConfig, Qwen3Config

from dflash_ring.common.drafter_config import DrafterConfig, target_text_config


def _require(target: Mapping[str, Any], key: str) -> Any:
    if target.get(key) is None:
        raise ValueError(f"target config has no {key!r} (model_type {target.get('model_type')!r}): "
                         "point target.path at the model's own config.json")
    return target[key]


def drafter_mlp_width(target: Mapping[str, Any]) -> int:
    """The drafter is a dense Qwen3 stack; its MLP gets the width of the FFN the target runs per token.

    Dense targets: their intermediate_size. MoE targets: top-k x expert width + shared expert width
    (qwen3_moe, qwen3_next, qwen3_5_moe: moe_intermediate_size; gpt_oss, whose only width
    intermediate_size is the expert's). For Qwen3-30B-A3B / Qwen3-Coder-30B-A3B this is 8 x 768 = 6144,
    the dense intermediate_size of that config and, as we recall it (not verifiable offline), the width
    of z-lab's Qwen3-Coder-30B-A3B-DFlash. Qwen3.5-MoE configs have no dense width at all, which is why
    one rule for every MoE beats copying intermediate_size (which gpt-oss would give as one expert's).
    DrafterConfig.intermediate_size overrides this.
    """
    experts = target.get("num_experts") or target.get("num_local_experts") or 0
    if not experts:
        return int(_require(target, "intermediate_size"))
    expert_width = target.get("moe_intermediate_size") or _require(target, "intermediate_size")
    return int(_require(target, "num_experts_per_tok") * expert_width
               + (target.get("shared_expert_intermediate_size") or 0))


# Rotary types a fixed Qwen3 rotary reproduces everywhere (HF, vLLM, SGLang). dynamic and longrope change
# their frequencies with the sequence length at run time, which an exported drafter config cannot pin down.
DRAFTER_ROPE_TYPES = ("default", "linear", "yarn", "llama3")
# Keys of a target's rope that describe the target's own attention, not a rotary the drafter could share:
# the drafter rotates its whole head_dim (Qwen3 layers have no partial rotary), and for text tokens
# multimodal RoPE (Qwen3.5's mrope) equals 1-D RoPE, the three sections reading the same position.
_TARGET_ONLY_ROPE_KEYS = ("rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved")


def drafter_rope(target: Mapping[str, Any], rope_theta: float | None = None) -> dict[str, Any]:
    """rope_theta/rope_scaling of the drafter, as published checkpoints spell them (top-level keys).

    Taken from the target: the drafter's attention is its own (it never reuses the target's q/k), but a
    base and scaling built for the target's context length suit the drafter's context too. Gemma3 has one
    rope per layer type: the drafter takes the full-attention one (its layers read the whole context;
    the sliding one's small base is tuned to a short window). Unrepresentable types are refused.
    """
    if rope_theta is not None:
        return {"rope_theta": float(rope_theta), "rope_scaling": None}
    params = target.get("rope_parameters")
    if not params:  # transformers 4 spelling
        params = {"rope_theta": _require(target, "rope_theta"), **(target.get("rope_scaling") or {})}
    if all(isinstance(v, Mapping) for v in params.values()):  # per layer type (Gemma3)
        if "full_attention" not in params:
            raise ValueError(f"target rope_parameters per layer type {sorted(params)} has no 'full_attention' "
                             "entry to give the drafter; set drafter.rope_theta")
        params = params["full_attention"]
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in DRAFTER_ROPE_TYPES:
        raise ValueError(f"target rope_type {rope_type!r} is not representable by the drafter's fixed Qwen3 rotary "
                         f"(supported: {', '.join(DRAFTER_ROPE_TYPES)}); set drafter.rope_theta for a plain RoPE")
    scaling = {k: v for k, v in params.items() if k not in _TARGET_ONLY_ROPE_KEYS}
    if rope_type == "default":
        scaling = None
    return {"rope_theta": float(_require(params, "rope_theta")), "rope_scaling": scaling}


TRAINING_KEYS = ("recipe", "loss", "loss_gamma", "dpace_alpha", "kl_weight", "cap_weight", "label", "num_anchors")


def drafter_geometry(cfg: DrafterConfig, target: Mapping[str, Any]) -> dict[str, Any]:
    """Width, heads, MLP and RoPE of the drafter, from the target's text config (see drafter_mlp_width/_rope)."""
    hidden, heads = int(_require(target, "hidden_size")), int(_require(target, "num_attention_heads"))
    kv_heads = int(target.get("num_key_value_heads") or heads)  # absent in old Llama configs: no GQA
    if heads % kv_heads:
        raise ValueError(f"target has {heads} attention heads for {kv_heads} key/value heads: not a multiple")
    return {
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": int(target.get("head_dim") or hidden // heads),
        "intermediate_size": cfg.intermediate_size or drafter_mlp_width(target),
        # A Qwen3 MLP is SwiGLU: vLLM's Qwen3 accepts only silu, and the drafter's MLP is trained from
        # scratch, so the target's activation (Gemma's gelu, gpt-oss's clamped swiglu) is not copied.
        "hidden_act": "silu",
        "rms_norm_eps": float(target.get("rms_norm_eps") or 1e-6),
        **drafter_rope(target, cfg.rope_theta),
        "max_position_embeddings": int(_require(target, "max_position_embeddings")),
        "vocab_size": int(_require(target, "vocab_size")),
    }


def drafter_hf_config(
    cfg: DrafterConfig,
    target_config: Mapping[str, Any] | PretrainedConfig,
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, Any]:
    """config.json of the drafter in the public DFlash format; width and RoPE are the target's."""
    if cfg.mask_token_id is None:
        raise ValueError("mask_token_id is unset; use the target's first unused embedding row (151669 for Qwen3)")
    target = target_text_config(target_config)
    if not 0 <= cfg.mask_token_id < _require(target, "vocab_size"):
        raise ValueError(f"mask_token_id {cfg.mask_token_id} is not a row of the target embedding")
    num_target_layers = int(_require(target, "num_hidden_layers"))
    config: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"],
        # transformers' AutoModel with trust_remote_code reads this; vLLM and SGLang ignore it.
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "block_size": cfg.block_size,
        "num_target_layers": num_target_layers,
        "dflash_config": {
            "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": cfg.resolved_target_layer_ids(num_target_layers),
        },
        "num_hidden_layers": cfg.num_hidden_layers,
        **drafter_geometry(cfg, target),
        "layer_types": list(cfg.layer_types),
        "sliding_window": cfg.sliding_window,
        "use_sliding_window": "sliding_attention" in cfg.layer_types,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "dtype": str(dtype).removeprefix("torch."),
        # How it was trained (the resolved recipe): serving stacks ignore it, a reader of the export need not
        # find the run's config to know the objective.
        "dflash_training": {key: getattr(cfg, key) for key in TRAINING_KEYS},
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
