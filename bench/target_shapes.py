"""Random-weight targets of every family we support, built from each family's own HF config class.

One place names the families and the real shapes: the conformance tests build them tiny, `bench target
--shape NAME` builds them at full size on the GPU. Nothing is downloaded; only the config classes of the
installed transformers are used, so a family this transformers lacks is refused by name.
"""

from __future__ import annotations

from typing import Any

import transformers
from transformers import PretrainedConfig

# family -> (config class, causal-LM class): the text model as AutoModelForCausalLM loads it.
FAMILIES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
    # The published Qwen3.5/3.6 checkpoints are the multimodal wrapper (text under text_config and
    # model.language_model.*); AutoModelForCausalLM loads its text part.
    "qwen3_5_vl": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration"),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM"),
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM"),
    "gemma4_text": ("Gemma4TextConfig", "Gemma4ForCausalLM"),
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM"),
    "granite": ("GraniteConfig", "GraniteForCausalLM"),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM"),
    "cohere": ("CohereConfig", "CohereForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM"),
    # Dense attention (sliding : full where the family has both).
    "gemma": ("GemmaConfig", "GemmaForCausalLM"),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM"),
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM"),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM"),
    "hunyuan_v1_dense": ("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM"),
    "seed_oss": ("SeedOssConfig", "SeedOssForCausalLM"),
    "apertus": ("ApertusConfig", "ApertusForCausalLM"),
    "arcee": ("ArceeConfig", "ArceeForCausalLM"),
    "glm4": ("Glm4Config", "Glm4ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM"),
    "ministral3": ("Ministral3Config", "Ministral3ForCausalLM"),
    # Mixture of experts.
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM"),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM"),
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM"),
    "hy_v3": ("HYV3Config", "HYV3ForCausalLM"),
    "exaone_moe": ("ExaoneMoeConfig", "ExaoneMoeForCausalLM"),
    "dots1": ("Dots1Config", "Dots1ForCausalLM"),
    "solar_open": ("SolarOpenConfig", "SolarOpenForCausalLM"),
    "afmoe": ("AfmoeConfig", "AfmoeForCausalLM"),
    "cohere2_moe": ("Cohere2MoeConfig", "Cohere2MoeForCausalLM"),
    "mimo_v2_flash": ("MiMoV2FlashConfig", "MiMoV2FlashForCausalLM"),  # q/k heads wider than v heads
    # Multi-head latent attention (producer/packing.py says how packing keeps it exact).
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
    "glm4_moe_lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM"),
    "youtu": ("YoutuConfig", "YoutuForCausalLM"),
    "longcat_flash": ("LongcatFlashConfig", "LongcatFlashForCausalLM"),
    # MLA with DeepSeek sparse attention: padded batches only (PADDED_ONLY).
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM"),
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM"),
    # Hybrid state-space families: Mamba2 mixers (Mamba1 in jamba and zamba) among attention layers.
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM"),
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM"),  # attention and Mamba2 side by side in each layer
    "bamba": ("BambaConfig", "BambaForCausalLM"),
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM"),
    "zamba2": ("Zamba2Config", "Zamba2ForCausalLM"),  # one shared attention block feeding its "hybrid" layers
    "jamba": ("JambaConfig", "JambaForCausalLM"),
    "zamba": ("ZambaConfig", "ZambaForCausalLM"),  # Mamba1; the shared attention block as in zamba2
    # Other recurrent mixers among attention layers: short convolutions (LFM2-MoE, LFM3), Kimi Delta Attention beside
    # MLA (Kimi-Linear, Bailing's Ling/Ring hybrids), Gated DeltaNet (OLMo-hybrid), lightning attention (MiniMax-01).
    "lfm2_moe": ("Lfm2MoeConfig", "Lfm2MoeForCausalLM"),
    "lfm3": ("Lfm3Config", "Lfm3ForCausalLM"),
    "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM"),
    "bailing_hybrid": ("BailingHybridConfig", "BailingHybridForCausalLM"),
    "olmo_hybrid": ("OlmoHybridConfig", "OlmoHybridForCausalLM"),
    "minimax": ("MiniMaxConfig", "MiniMaxForCausalLM"),  # padded batches only (PADDED_ONLY)
}
# Families whose sparse-attention indexer packing refuses by name (producer/packing.py packing_refusal).
SPARSE_INDEXER = frozenset({"glm_moe_dsa", "deepseek_v32"})
# Families the target runs on padded batches only, and the tests check that it does: the indexer families, and
# MiniMax-01, whose lightning attention (a decaying linear-attention state carried over the row, with no Conv1d that
# packing.recurrent_mixers would find) the conformance probe catches leaking across a pack, so "packed" is refused
# and "auto" runs padded batches (exact).
PADDED_ONLY = SPARSE_INDEXER | {"minimax"}

# Families whose config counts decoder layers under another key (longcat_flash: num_hidden_layers is derived as
# 2 x num_layers, one per attention sublayer). `num_hidden_layers` below always means decoder layers.
LAYER_COUNT_KEYS = {"longcat_flash": "num_layers"}


def _layer_pattern(family: str, layers: int) -> dict[str, Any]:
    """Each family's own layer mix, as its published configs lay it out."""
    if family in ("qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_vl"):  # 3 Gated DeltaNet : 1 full
        return {"layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]}
    if family == "gpt_oss":  # alternating, sliding first
        return {"layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]}
    if family in ("gemma4_text", "cohere2"):  # 2 sliding : 1 full, so the probe's depth reaches a full layer
        return {"layer_types": ["full_attention" if (i + 1) % 3 == 0 else "sliding_attention" for i in range(layers)]}
    if family == "lfm2":  # short convolutions between attention layers
        return {"layer_types": ["full_attention" if i % 3 == 2 else "conv" for i in range(layers)]}
    if family == "gemma3":  # 5 sliding : 1 full
        return {"layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]}
    if family == "nemotron_h":  # Mamba2 (M), MoE (E), attention (*): "MEM*E" repeated, the Nano-3 mix
        return {"hybrid_override_pattern": ("MEM*E" * layers)[:layers]}
    if family == "bamba":  # Mamba2 with an attention layer every third
        return {"attn_layer_indices": list(range(1, layers, 3))}
    if family == "granitemoehybrid":
        return {"layer_types": ["full_attention" if i % 3 == 1 else "linear_attention" for i in range(layers)]}
    if family == "zamba2":  # every third layer also runs the shared attention block first
        return {"layers_block_type": ["hybrid" if i % 3 == 1 else "linear_attention" for i in range(layers)]}
    if family == "jamba":  # attention every third layer, MoE every second
        return dict(attn_layer_period=3, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1)
    if family == "zamba":  # as zamba2
        return {"layers_block_type": ["hybrid" if i % 3 == 1 else "linear_attention" for i in range(layers)]}
    if family == "lfm2_moe":  # as lfm2
        return {"layer_types": ["full_attention" if i % 3 == 2 else "conv" for i in range(layers)]}
    if family == "lfm3":  # convolutions between alternately sliding and full attention layers
        return {"layer_types": [("conv", "sliding_attention", "conv", "full_attention")[i % 4] for i in range(layers)]}
    if family == "minimax":  # lightning (linear) attention with a softmax layer every third (the real one: eighth)
        return {"layer_types": ["full_attention" if i % 3 == 2 else "linear_attention" for i in range(layers)]}
    if family in ("kimi_linear", "bailing_hybrid"):  # 3 KDA : 1 MLA (Bailing's real ones: 5 : 1)
        return {"layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]}
    if family == "afmoe":  # 3 sliding : 1 full
        return {"layer_types": ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(layers)]}
    if family == "mimo_v2_flash":  # full first, then sliding (the real one: 1 full : 5 sliding)
        return {"layer_types": ["full_attention" if i % 3 == 0 else "sliding_attention" for i in range(layers)]}
    if family == "hunyuan_v1_moe":  # its published configs give top-k and shared experts per layer
        return dict(moe_topk=[2] * layers, num_shared_expert=[1] * layers)
    return {}


def family_config(
    family: str,
    *,
    vocab_size: int,
    hidden_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    head_dim: int,
    intermediate_size: int,
    max_position_embeddings: int = 4096,
    **extra: Any,
) -> PretrainedConfig:
    """A config of `family` with the given geometry; `extra` sets family keys (experts, windows, linear heads)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown target family {family!r}; known: {sorted(FAMILIES)}")
    config_cls = getattr(transformers, FAMILIES[family][0], None)
    if config_cls is None:
        raise ValueError(f"transformers {transformers.__version__} has no {FAMILIES[family][0]} (family {family})")
    text: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        **_layer_pattern(family, num_hidden_layers),
    )
    text.update(extra)
    if family in LAYER_COUNT_KEYS:
        text[LAYER_COUNT_KEYS[family]] = text.pop("num_hidden_layers")
    if family == "qwen3_5_vl":
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden_size)
        return config_cls(text_config=text, vision_config=vision, tie_word_embeddings=False)
    return config_cls(**text)


def model_class(family: str) -> type:
    return getattr(transformers, FAMILIES[family][1])


def _tiny_extra(family: str, hidden: int) -> dict[str, Any]:
    linear = dict(
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
    )
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden // 2)
    # Multi-head latent attention: qk heads of 8 (nope) + 8 (rope) against v heads of 12, as unequal as the real ones
    # (the varlen kernel takes one head dim: producer/packing.py); head_dim is the rope part, as MLA configs define it.
    mla = dict(
        num_key_value_heads=4,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=12,
        head_dim=8,
    )
    # DeepSeek-style MoE: routed experts beside a shared one, the first layer dense. Only for the families that have
    # it: a config class keeps keys it does not know, and the drafter reads a target's MoE width from its keys.
    deepseek_moe = dict(
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=hidden // 2,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
    )
    mamba2 = dict(mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=16, mamba_chunk_size=16)
    return {
        "mistral": dict(sliding_window=16),
        "qwen3_moe": moe,
        "gemma3": dict(sliding_window=16),
        "gpt_oss": dict(sliding_window=16, num_local_experts=4, num_experts_per_tok=2),
        "qwen3_next": dict(**linear, **moe, shared_expert_intermediate_size=hidden // 2),
        "qwen3_5": linear,
        "qwen3_5_vl": linear,
        "qwen3_5_moe": dict(**linear, **moe, shared_expert_intermediate_size=hidden // 2),
        "glm4_moe": dict(
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            moe_intermediate_size=hidden // 2,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
        ),
        "minimax_m2": dict(num_local_experts=4, num_experts_per_tok=2),
        # Gemma-4: full layers with their own (wider) head dim; no per-layer input embeddings (as the 31B).
        "gemma4_text": dict(sliding_window=16, global_head_dim=2 * hidden // 4, hidden_size_per_layer_input=0),
        "lfm2": dict(conv_L_cache=3, block_auto_adjust_ff_dim=False),
        # Head transforms at values unlike 1, so the drafter's head probe must find each
        # (tests/test_drafter_families.py).
        "cohere2": dict(sliding_window=16, logit_scale=0.125),
        "cohere": dict(logit_scale=0.0625),
        "gemma2": dict(sliding_window=16, final_logit_softcapping=30.0),
        "granite": dict(embedding_multiplier=12.0, logits_scaling=8.0),
        "deepseek_v3": dict(**mla, **deepseek_moe),
        "youtu": mla,  # dense MLA
        "deepseek_v2": dict(**mla, **deepseek_moe, topk_method="greedy"),
        "glm4_moe_lite": dict(**mla, **deepseek_moe),
        # Enough indexer heads that no index score is an exact tie at 0 (ReLU of every head), which would make the
        # top-k pick among ties differently for rows of other widths: the padded batch against each sequence alone.
        "glm_moe_dsa": dict(**mla, **deepseek_moe, index_topk=16, index_head_dim=16, index_n_heads=8),
        # LongCat-Flash: two MLA sublayers per decoder layer, zero (identity) experts beside the routed ones.
        "longcat_flash": dict(
            mla,
            ffn_hidden_size=2 * hidden,
            n_routed_experts=4,
            expert_ffn_hidden_size=hidden // 2,
            moe_topk=2,
            zero_expert_num=2,
        ),
        # Chunked scans with chunks shorter than the test sequences, so state crosses chunk boundaries too.
        "nemotron_h": dict(
            mamba_num_heads=4,
            mamba_head_dim=16,
            ssm_state_size=16,
            n_groups=2,
            chunk_size=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=hidden // 2,
            moe_shared_expert_intermediate_size=hidden // 2,
            n_shared_experts=1,
        ),
        "falcon_h1": dict(
            **mamba2,
            mamba_d_ssm=hidden,
            mamba_d_head=16,
            mamba_rms_norm=True,
            embedding_multiplier=5.656854249492381,
            lm_head_multiplier=0.0390625,
        ),
        "bamba": mamba2,
        "granitemoehybrid": dict(
            **mamba2,
            num_local_experts=4,
            num_experts_per_tok=2,
            shared_intermediate_size=hidden,
            embedding_multiplier=12.0,
            logits_scaling=10.0,
        ),
        "zamba2": dict(mamba_d_state=16, n_mamba_heads=4, mamba_ngroups=2, chunk_size=16),
        "jamba": dict(mamba_d_state=8, mamba_dt_rank=8, num_experts=4, num_experts_per_tok=2),
        "zamba": dict(mamba_d_state=8, n_mamba_heads=2),
        "olmo3": dict(sliding_window=16),
        "exaone4": dict(sliding_window=16),
        "phi3": dict(sliding_window=16),
        "starcoder2": dict(sliding_window=16),
        "qwen2_moe": dict(moe, shared_expert_intermediate_size=hidden // 2),
        "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
        "olmoe": dict(num_experts=4, num_experts_per_tok=2),
        "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=12.0, logits_scaling=8.0),
        "ernie4_5_moe": dict(
            moe_num_experts=4,
            moe_k=2,
            moe_intermediate_size=hidden // 2,
            moe_num_shared_experts=1,
            moe_layer_start_index=1,
        ),
        "hunyuan_v1_moe": dict(num_experts=4),  # experts (and the shared one) intermediate_size wide
        "hy_v3": dict(num_experts=4, num_experts_per_tok=2, num_shared_experts=1, moe_intermediate_size=hidden // 2),
        "exaone_moe": dict(
            sliding_window=16,
            num_experts=4,
            num_experts_per_tok=2,
            num_shared_experts=1,
            moe_intermediate_size=hidden // 2,
            first_k_dense_replace=1,
        ),
        "dots1": dict(deepseek_moe),
        "solar_open": dict(
            n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=hidden // 2
        ),
        # Arcee's Trinity: muP scales the embedding by sqrt(H), which the head probe must find.
        "afmoe": dict(
            sliding_window=16,
            num_experts=4,
            num_experts_per_tok=2,
            num_shared_experts=1,
            moe_intermediate_size=hidden // 2,
            num_dense_layers=1,
            mup_enabled=True,
        ),
        "cohere2_moe": dict(sliding_window=16, num_experts=4, num_experts_per_tok=2, logit_scale=0.25),
        "mimo_v2_flash": dict(
            sliding_window=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=hidden // 2,
            v_head_dim=12,
        ),
        "deepseek_v32": dict(**mla, **deepseek_moe, index_topk=16, index_head_dim=16, index_n_heads=8),
        "lfm2_moe": dict(
            conv_L_cache=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden // 2, num_dense_layers=1
        ),
        "lfm3": dict(sliding_window=16, conv_L_cache=3),
        # Kimi-Linear's MLA takes no RoPE (q_lora_rank None as published); KDA heads of 16.
        "kimi_linear": dict(
            mla,
            q_lora_rank=None,
            num_local_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            moe_intermediate_size=hidden // 2,
            first_k_dense_replace=1,
            linear_head_dim=16,
            linear_num_heads=4,
            linear_conv_kernel_dim=4,
        ),
        "bailing_hybrid": dict(
            mla,
            q_lora_rank=None,
            num_experts=4,
            num_experts_per_tok=2,
            num_shared_experts=1,
            moe_intermediate_size=hidden // 2,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            linear_head_dim=16,
            linear_num_heads=4,
            linear_conv_kernel_dim=4,
        ),
        "olmo_hybrid": linear,
        # Lightning-attention blocks shorter than the test sequences, so its state crosses blocks too.
        "minimax": dict(num_local_experts=4, num_experts_per_tok=2, block_size=16),
    }.get(family, {})


def tiny_config(
    family: str, *, vocab_size: int, hidden_size: int = 64, num_hidden_layers: int = 6, **extra: Any
) -> PretrainedConfig:
    """A CPU-sized member of `family`: every mechanism of the real one (windows shorter than test sequences)."""
    keys = dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden_size // 4, intermediate_size=2 * hidden_size
    )
    keys.update(_tiny_extra(family, hidden_size))
    keys.update(extra)
    return family_config(
        family, vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers, **keys
    )


# Real shapes for `bench target --shape`: published configs' geometry, random weights.
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny": (
        "qwen3",
        dict(
            hidden_size=128,
            num_hidden_layers=8,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            intermediate_size=384,
            vocab_size=1024,
            max_position_embeddings=4096,
        ),
    ),
    "qwen3-8b": (
        "qwen3",
        dict(
            hidden_size=4096,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=12288,
            vocab_size=151936,
            max_position_embeddings=40960,
            rope_theta=1e6,
        ),
    ),
    # Qwen3.6-27B: 64 layers, 3 Gated DeltaNet : 1 gated full attention.
    "qwen3.6-27b": (
        "qwen3_5",
        dict(
            hidden_size=5120,
            num_hidden_layers=64,
            num_attention_heads=24,
            num_key_value_heads=4,
            head_dim=256,
            intermediate_size=17408,
            vocab_size=248320,
            max_position_embeddings=262144,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_num_key_heads=16,
            linear_num_value_heads=48,
        ),
    ),
    "qwen3-30b-a3b": (
        "qwen3_moe",
        dict(
            hidden_size=2048,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_experts=128,
            num_experts_per_tok=8,
            vocab_size=151936,
            max_position_embeddings=40960,
            rope_theta=1e6,
        ),
    ),
    "gpt-oss-20b": (
        "gpt_oss",
        dict(
            hidden_size=2880,
            num_hidden_layers=24,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=64,
            intermediate_size=2880,
            num_local_experts=32,
            num_experts_per_tok=4,
            sliding_window=128,
            vocab_size=201088,
            max_position_embeddings=131072,
        ),
    ),
    # Moonlight-16B-A3B (moonshotai, DeepSeek-V3 architecture): MLA without a query LoRA, qk heads of 128 + 64 (rope)
    # against v heads of 128; 64 routed experts (6 per token) beside 2 shared, the first layer dense.
    "moonlight-16b-a3b": (
        "deepseek_v3",
        dict(
            hidden_size=2048,
            num_hidden_layers=27,
            num_attention_heads=16,
            num_key_value_heads=16,
            head_dim=64,
            intermediate_size=11264,
            moe_intermediate_size=1408,
            n_routed_experts=64,
            num_experts_per_tok=6,
            n_shared_experts=2,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            routed_scaling_factor=2.446,
            norm_topk_prob=True,
            vocab_size=163840,
            max_position_embeddings=8192,
            rope_theta=50000.0,
        ),
    ),
    # Nemotron-3-Nano-30B-A3B (~60 GB in bf16): 52 layers, 23 Mamba2 (M), 23 MoE (E: 128 routed experts, top 6, one
    # shared expert, relu2), 6 GQA attention (*, no RoPE). Sure: the layer counts, hidden 2688, 32/2 heads, 128
    # experts / 6 active / 1 shared of 3712, the vocabulary. From memory of its config.json, not checked against
    # the file: the exact pattern string, the Mamba geometry (64 heads of 64, state 128, 8 groups, chunk 128), the
    # routed expert width 1856, routed_scaling_factor 2.5 and the context length. No dense MLP layer ("-"), so
    # intermediate_size builds nothing.
    "nemotron-3-nano-30b-a3b": (
        "nemotron_h",
        dict(
            hybrid_override_pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
            hidden_size=2688,
            num_hidden_layers=52,
            num_attention_heads=32,
            num_key_value_heads=2,
            head_dim=128,
            intermediate_size=1856,
            mamba_num_heads=64,
            mamba_head_dim=64,
            ssm_state_size=128,
            n_groups=8,
            conv_kernel=4,
            chunk_size=128,
            n_routed_experts=128,
            num_experts_per_tok=6,
            n_shared_experts=1,
            moe_intermediate_size=1856,
            moe_shared_expert_intermediate_size=3712,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            vocab_size=131072,
            max_position_embeddings=262144,
        ),
    ),
}


def shape_config(name: str) -> PretrainedConfig:
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {sorted(SHAPES)}")
    family, keys = SHAPES[name]
    return family_config(family, **keys)
