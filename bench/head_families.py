"""Tiny members of the target families the drafter side checks beyond bench/target_shapes.FAMILIES.

Each entry is the family's own config class and CausalLM class in the installed transformers, with the
smallest keys that keep its mechanisms (MLA latent dims consistent, Mamba heads x head dim = the SSM
width, a layer pattern as long as the layer count, per-layer embeddings shrunk); the geometry shared by
every tiny target (hidden 64, 4 heads of 16, 2 key/value heads, MLP 128; MoE: 2 of 4 experts of 32 plus
a shared one) is tiny_head_config's. Kept apart from FAMILIES so the target side can add its own
entries for the same families without this module changing.
"""

from __future__ import annotations

from typing import Any

import transformers
from transformers import PretrainedConfig

_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
_MLA = dict(num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16,
            v_head_dim=16)
_DEEPSEEK_MOE = dict(**_MOE, n_routed_experts=4, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1)
_MAMBA = dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
              mamba_chunk_size=16, use_cache=False)


def _pattern(n: int, every: int, one: str, rest: str) -> list[str]:
    """`rest` everywhere but each `every`-th layer, which is `one` (e.g. 3 sliding : 1 full)."""
    return [one if (i + 1) % every == 0 else rest for i in range(n)]


# model_type -> (config class, CausalLM class, tiny keys: a dict, or a function of the layer count and vocab).
HEAD_FAMILIES: dict[str, tuple[str, str, Any]] = {
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {**_MLA, **_DEEPSEEK_MOE}),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", _DEEPSEEK_MOE),
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM",
                    {**_MLA, **_DEEPSEEK_MOE, "index_topk": 8, "index_head_dim": 16, "index_n_heads": 2}),
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM",
                   dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)),
    "gemma4_text": ("Gemma4TextConfig", "Gemma4ForCausalLM", lambda n, vocab: dict(
        sliding_window=16, hidden_size_per_layer_input=8, vocab_size_per_layer_input=vocab, global_head_dim=16,
        layer_types=_pattern(n, 3, "full_attention", "sliding_attention"))),
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", lambda n, vocab: dict(
        block_multiple_of=16, layer_types=_pattern(n, 3, "full_attention", "conv"))),
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM", lambda n, vocab: dict(
        layers_block_type=(["mamba", "moe", "attention", "mlp"] * n)[:n], mamba_num_heads=8, mamba_head_dim=16,
        ssm_state_size=16, n_groups=1, chunk_size=16, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, moe_shared_expert_intermediate_size=32, use_mamba_kernels=False, use_cache=False)),
    "longcat_flash": ("LongcatFlashConfig", "LongcatFlashForCausalLM", lambda n, vocab: dict(
        **_MLA, head_dim=8, num_layers=n // 2, n_routed_experts=4, zero_expert_num=2, moe_topk=2, expert_ffn_hidden_size=32,
        ffn_hidden_size=128)),
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM", dict(
        **_MAMBA, mamba_d_ssm=128, embedding_multiplier=5.656854249492381, lm_head_multiplier=0.0390625)),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(embedding_multiplier=12.0, logits_scaling=8.0)),
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", lambda n, vocab: dict(
        **_MAMBA, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, shared_intermediate_size=32,
        embedding_multiplier=12.0, logits_scaling=10.0,
        layer_types=_pattern(n, 3, "attention", "mamba"))),
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(logit_scale=0.0625)),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", lambda n, vocab: dict(
        logit_scale=0.125, sliding_window=16, layer_types=_pattern(n, 4, "full_attention", "sliding_attention"))),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(sliding_window=16, final_logit_softcapping=30.0)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {}),
}


def head_model_class(family: str) -> type:
    return getattr(transformers, HEAD_FAMILIES[family][1])


def tiny_head_config(family: str, *, vocab_size: int, hidden_size: int = 64, num_hidden_layers: int = 6,
                     **extra: Any) -> PretrainedConfig:
    """A CPU-sized member of `family`; `extra` overrides any key (e.g. tie_word_embeddings)."""
    if family not in HEAD_FAMILIES:
        raise ValueError(f"unknown head family {family!r}; known: {sorted(HEAD_FAMILIES)}")
    config_name, _, tiny = HEAD_FAMILIES[family]
    config_cls = getattr(transformers, config_name, None)
    if config_cls is None:
        raise ValueError(f"transformers {transformers.__version__} has no {config_name} (family {family})")
    keys: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=hidden_size // 4, intermediate_size=2 * hidden_size,
        max_position_embeddings=4096, tie_word_embeddings=False,
    )
    family_keys = tiny(num_hidden_layers, vocab_size) if callable(tiny) else tiny
    if "kv_lora_rank" in family_keys and "head_dim" not in family_keys:
        keys.pop("head_dim")  # MLA: the q/k/v head dims are the latent ones (LongCat's rotary reads head_dim)
    keys.update(family_keys)
    keys.update(extra)
    return config_cls(**keys)
