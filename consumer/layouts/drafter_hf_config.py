"""The drafter's Hugging Face config.json in the public (z-lab / SpecForge) DFlash format.

The exported config.json must load unchanged in vLLM, SGLang and z-lab's
`trust_remote_code` model, so every key written here follows the published
DFlash checkpoints (z-lab/Qwen3-8B-DFlash-b16, SpecForge configs/qwen3-8b-dflash.json).
z-lab's model class loads it in tests/test_peer_conformance.py (every weight, the same drafts).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from dflash_ring.common.config.drafter import DrafterConfig, target_text_config
from dflash_ring.common.target_geometry import layer_count_key, plain_geometry
from dflash_ring.consumer.families import FAMILIES
from dflash_ring.consumer.modeling.qwen3_blocks import rope_parameters

if TYPE_CHECKING:  # transformers only where a config class is needed: its import costs a drafter's start seconds
    from transformers import PretrainedConfig, Qwen3Config


def _require(target: Mapping[str, Any], key: str) -> Any:
    if target.get(key) is None:
        raise ValueError(
            f"target config has no {key!r} (model_type {target.get('model_type')!r}): "
            "point target.path at the model's own config.json"
        )
    return target[key]


def _first(target: Mapping[str, Any], *keys: str) -> Any:
    """The first of `keys` the config sets: families name the same quantity differently."""
    return next((target[k] for k in keys if target.get(k) is not None), None)


def dense_ffn_width(target: Mapping[str, Any]) -> int:
    """The width of the target's dense FFN: intermediate_size, as LFM2 adjusts it when asked
    (block_auto_adjust_ff_dim: 2/3 of it, times block_ffn_dim_multiplier, up to block_multiple_of)."""
    width = int(_require(target, "intermediate_size"))
    if target.get("block_auto_adjust_ff_dim"):
        width = int(2 * width / 3)
        if target.get("block_ffn_dim_multiplier") is not None:
            width = int(target["block_ffn_dim_multiplier"] * width)
            multiple = int(target.get("block_multiple_of") or 1)
            width = multiple * ((width + multiple - 1) // multiple)
    return width


def drafter_mlp_width(target: Mapping[str, Any]) -> int:
    """The drafter is a dense Qwen3 stack; its MLP gets the width of the FFN the target runs per token.

    Dense targets: their intermediate_size (LFM2: as its MLP adjusts it). MoE targets: top-k x expert width +
    shared expert width, whatever the family calls them: experts num_experts / num_local_experts /
    n_routed_experts / moe_num_experts (ERNIE 4.5); top-k num_experts_per_tok / num_experts_per_token
    (Kimi-Linear, Bailing) / moe_topk (LongCat, Hunyuan) / top_k_experts (Gemma4) / moe_k (ERNIE 4.5); the
    expert width moe_intermediate_size / expert_ffn_hidden_size (LongCat) / intermediate_size (gpt-oss,
    MiniMax-M2, Granite-MoE, whose only width is the expert's); the shared width shared_expert_intermediate_size /
    shared_intermediate_size / moe_shared_expert_intermediate_size, else the shared expert count
    n_shared_experts / num_shared_experts / moe_num_shared_experts / num_shared_expert (Hunyuan) x expert width
    (DeepSeek-V3, Kimi-K2, GLM-4.5: 8 x 2048 + 2048 = 18432 for V3). A value given per layer (Hunyuan's
    moe_topk, moe_intermediate_size and num_shared_expert lists) counts by its largest entry. Gemma4's MoE block runs
    beside its dense MLP: both widths add. Nemotron-H sets experts even for its dense models: MoE only when a layer
    is "moe". For Qwen3-30B-A3B / Qwen3-Coder-30B-A3B this is 8 x 768 = 6144, the dense intermediate_size
    of that config and, as we recall it (not verifiable offline), the width of z-lab's
    Qwen3-Coder-30B-A3B-DFlash. DrafterConfig.intermediate_size overrides this.
    """
    experts = _largest(_first(target, "num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")) or 0
    kinds = target.get("layers_block_type") or target.get("layer_types") or []
    if {"moe", "mlp"} & set(kinds) and "moe" not in kinds:  # Nemotron-H's pattern names its FFN kinds
        experts = 0
    if target.get("enable_moe_block") is False:
        experts = 0
    if not experts:
        return dense_ffn_width(target)
    top_k = _largest(
        _first(target, "num_experts_per_tok", "num_experts_per_token", "moe_topk", "top_k_experts", "moe_k")
    )
    if top_k is None:
        raise ValueError(
            f"target has {experts} experts but no num_experts_per_tok / num_experts_per_token / "
            "moe_topk / top_k_experts / moe_k"
        )
    expert_width = _largest(_first(target, "moe_intermediate_size", "expert_ffn_hidden_size")) or int(
        _require(target, "intermediate_size")
    )
    shared = _largest(
        _first(
            target, "shared_expert_intermediate_size", "shared_intermediate_size", "moe_shared_expert_intermediate_size"
        )
    )
    if shared is None:
        count = _first(target, "n_shared_experts", "num_shared_experts", "moe_num_shared_experts", "num_shared_expert")
        shared = (_largest(count) or 0) * expert_width
    dense = dense_ffn_width(target) if target.get("enable_moe_block") else 0
    return top_k * expert_width + shared + dense


def _largest(value: Any) -> int | None:
    """A config count or width as one int: a per-layer list (Hunyuan's moe_topk) by its largest entry."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return max((int(v) for v in value if v is not None), default=None)
    return int(value)


def _special_floats(value: Any) -> Any:
    """config.json as transformers writes it, back to values: it spells inf/nan as {"__float__": "Infinity"}
    (Mamba's time_step_limit), which its config classes refuse when given as keyword arguments."""
    if isinstance(value, dict):
        if set(value) == {"__float__"}:
            return float(value["__float__"])
        return {k: _special_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_special_floats(v) for v in value]
    return value


def num_target_layers(target_config: Mapping[str, Any] | PretrainedConfig) -> int:
    """The target's decoder layer count as its config class resolves it and HF counts hidden states by:
    Nemotron-H counts its layers_block_type, LongCat-Flash's decoder layers are its num_layers (its
    num_hidden_layers is twice that, one per attention sublayer); neither writes num_hidden_layers."""
    config = target_config
    if isinstance(config, Mapping):
        raw = _special_floats(dict(target_config))
        if raw.get("model_type") is None:  # no class to ask: the count as written
            return int(_require(target_text_config(raw), "num_hidden_layers"))
        if (plain := plain_geometry(target_text_config(raw))) is not None:  # as the producers read it
            return plain[1]
        from transformers import AutoConfig  # the config classes only

        config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    text = config.get_text_config()
    key = layer_count_key(text)  # the producers' count too (common/target_geometry.py): the same layer ids
    layers = getattr(text, key, None)
    if not layers:
        raise ValueError(f"target config class {type(config).__name__} gives no {key}")
    return int(layers)


def drafter_head_dim(target: Mapping[str, Any]) -> int:
    """The drafter's head width. Multi-head latent attention (DeepSeek-V3, Kimi-K2, GLM-5, LongCat: a
    kv_lora_rank) splits q/k into nope and rope parts of a latent, which a Qwen3 head cannot mirror, and
    its configs' head_dim is the rope part only (64): the drafter takes v_head_dim, the width each target
    head writes to o_proj (128 for V3 and K2), so heads x head_dim equals the target's attention output.
    Others: head_dim, else hidden / heads."""
    if target.get("kv_lora_rank"):
        return int(_require(target, "v_head_dim"))
    return int(target.get("head_dim") or int(_require(target, "hidden_size")) // int(target["num_attention_heads"]))


# Rotary types a fixed Qwen3 rotary reproduces everywhere (HF, vLLM, SGLang). dynamic and longrope change
# their frequencies with the sequence length at run time, which an exported drafter config cannot pin down.
DRAFTER_ROPE_TYPES = ("default", "linear", "yarn", "llama3")
# Gemma4's "proportional" RoPE rotates a fraction of each head at the frequencies a full rotary of the same
# base would give it; the drafter rotates its whole head, so for it this is the default RoPE of that base.
_WHOLE_HEAD_ROPE = {"proportional": "default"}
# Keys of a target's rope that describe the target's own attention, not a rotary the drafter could share:
# the drafter rotates its whole head_dim (Qwen3 layers have no partial rotary), and for text tokens
# multimodal RoPE (Qwen3.5's mrope) equals 1-D RoPE, the three sections reading the same position; Ministral 3's
# llama_4_scaling_beta scales the target's queries by position (an attention temperature, not a rotary).
_TARGET_ONLY_ROPE_KEYS = (
    "rope_theta",
    "partial_rotary_factor",
    "mrope_section",
    "mrope_interleaved",
    "llama_4_scaling_beta",
)


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
    if not params and target.get("rope_theta") is None:
        raise ValueError(
            f"target (model_type {target.get('model_type')!r}) has no RoPE: its attention takes no "
            "rotary positions, so there is none to copy; set drafter.rope_theta to give the drafter one"
        )
    if not params:  # transformers 4 spelling
        params = {"rope_theta": target["rope_theta"], **(target.get("rope_scaling") or {})}
    if all(isinstance(v, Mapping) for v in params.values()):  # per layer type (Gemma3)
        if "full_attention" not in params:
            raise ValueError(
                f"target rope_parameters per layer type {sorted(params)} has no 'full_attention' "
                "entry to give the drafter; set drafter.rope_theta"
            )
        params = params["full_attention"]
    rope_type = params.get("rope_type", params.get("type", "default"))
    rope_type = _WHOLE_HEAD_ROPE.get(rope_type, rope_type)
    if rope_type not in DRAFTER_ROPE_TYPES:
        raise ValueError(
            f"target rope_type {rope_type!r} is not representable by the drafter's fixed Qwen3 rotary "
            f"(supported: {', '.join(DRAFTER_ROPE_TYPES)}); set drafter.rope_theta for a plain RoPE"
        )
    scaling = {k: v for k, v in params.items() if k not in _TARGET_ONLY_ROPE_KEYS}
    if rope_type == "default":
        scaling = None
    return {"rope_theta": float(_require(params, "rope_theta")), "rope_scaling": scaling}


TRAINING_KEYS = ("recipe", "loss", "loss_gamma", "dpace_alpha", "kl_weight", "cap_weight", "label", "num_anchors")


def drafter_attention(cfg: DrafterConfig, target: Mapping[str, Any]) -> dict[str, int]:
    """The drafter's heads, key/value heads and head width: the drafter config's where it sets them, else the
    target's (its key/value heads, absent in old Llama configs: as many as its heads)."""
    heads = cfg.num_attention_heads or int(_require(target, "num_attention_heads"))
    kv_heads = cfg.num_key_value_heads or int(target.get("num_key_value_heads") or target["num_attention_heads"])
    if heads % kv_heads:
        origin = ", ".join(
            f"{key} {value} ({'drafter' if getattr(cfg, key) else 'target'})"
            for key, value in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads))
        )
        raise ValueError(
            f"the drafter's {origin}: not a multiple; set drafter.num_attention_heads and "
            "drafter.num_key_value_heads together"
        )
    return {
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": cfg.head_dim or drafter_head_dim(target),
    }


def drafter_geometry(cfg: DrafterConfig, target: Mapping[str, Any]) -> dict[str, Any]:
    """Width, heads, MLP and RoPE of the drafter, from the target's text config (see drafter_mlp_width/_rope) and
    the drafter's own attention geometry where its config sets one (drafter_attention)."""
    return {
        "hidden_size": int(_require(target, "hidden_size")),
        **drafter_attention(cfg, target),
        "intermediate_size": cfg.intermediate_size or drafter_mlp_width(target),
        # A Qwen3 MLP is SwiGLU: vLLM's Qwen3 accepts only silu, and the drafter's MLP is trained from
        # scratch, so the target's activation (Gemma's gelu, gpt-oss's clamped swiglu) is not copied.
        "hidden_act": "silu",
        "rms_norm_eps": float(target.get("rms_norm_eps") or 1e-6),
        **drafter_rope(target, cfg.rope_theta),
        # Kimi-Linear and Bailing configs write it as model_max_length (their config classes map the one to the other).
        "max_position_embeddings": int(
            _first(target, "max_position_embeddings", "model_max_length") or _require(target, "max_position_embeddings")
        ),
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
    layers = num_target_layers(target_config)
    family = FAMILIES[cfg.arch]
    config = family.layout(cfg, layers)
    config |= {
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
        "dflash_training": {key: getattr(cfg, key) for key in TRAINING_KEYS + family.training_keys},
    }
    family.finish_config(config)
    for key in ("bos_token_id", "eos_token_id"):
        if target.get(key) is not None:
            config[key] = target[key]
    return config


def qwen3_config(hf_config: Mapping[str, Any]) -> Qwen3Config:
    """Qwen3Config carrying the DFlash extras (block_size, dflash_config) as attributes, like z-lab's model."""
    import copy

    from transformers import Qwen3Config

    # A deep copy: transformers 5's Qwen3Config writes rope_theta into the rope_scaling dict it is given, which was
    # the caller's (an export then wrote rope_scaling.rope_theta into config.json).
    return Qwen3Config(**{k: copy.deepcopy(v) for k, v in hf_config.items() if k != "model_type"})


# What the drafter's modules read from their config that drafter_hf_config may leave out, with Qwen3Config's defaults.
_MODEL_DEFAULTS = {"initializer_range": 0.02}


def model_config(hf_config: Mapping[str, Any]) -> SimpleNamespace | Qwen3Config:
    """The config a drafter is built from in the training processes: drafter_hf_config's keys as attributes, with
    the RoPE in transformers 5's `rope_parameters` spelling, as Qwen3Config reads them. Not Qwen3Config itself: with
    transformers 5.17 that class's import (its docstring decorator imports the auto-model registry, and with it
    torch.distributed's tensor parallelism, sympy, accelerate and scikit-learn) took a restarted drafter on the H200
    seconds before its first step. A non-default RoPE goes through Qwen3Config, whose rope initialisers
    (transformers' ROPE_INIT_FUNCTIONS) read the class; tests/test_drafter_model.py checks both builds are equal."""
    params = hf_config.get("rope_parameters") or rope_parameters(hf_config["rope_theta"], hf_config.get("rope_scaling"))
    if params.get("rope_type", "default") != "default":
        return qwen3_config(hf_config)
    return SimpleNamespace(
        **(
            _MODEL_DEFAULTS
            | {k: v for k, v in hf_config.items() if k != "model_type"}
            | {"rope_parameters": dict(params)}
        )
    )
