"""EAGLE-3 in vLLM speculators' own layout (Eagle3DraftModel.save_pretrained: `speculators_model_type` "eagle3",
shared/reference/eagle3.md 4.2), both ways: read as a warm start's release (`speculators_keys`, the hook
consumer/layouts/drafter_import.py calls) and written by `dflash-ring export --layout speculators`
(`speculators_layout`, consumer/layouts/export.py).

Why a second layout beside the flat LlamaForCausalLMEagle3 (this package's __init__): its config.json names the
verifier and the number of drafts (speculators_config), so `vllm serve <dir>` alone serves the drafter, and
speculators' trainer fine-tunes it as it is; SGLang has no reader for it and takes the flat one. The tensors are the
model's own names in both directions (fc, layers.0.*, norm, lm_head, and d2t, t2d with a reduced vocabulary); the
file carries no embedding (vLLM shares the target's, speculators' loader leaves it to the verifier).

The traps (eagle3.md 4.4): the layer ids are HF hidden_states indices (ours + 1, as the flat layout keeps them);
vLLM reads an absent norm_before_residual as true in this layout and speculators' own class as false, so it is
always written and a release without it is refused; EAGLE-3.1's norm_before_fc, fc_norm and norm_output, a
trained embedding, a Qwen3 layer (q/k norms), more than one layer and MLP biases have no equivalent in our model
and are refused in one line, as drafter_import refuses a window, attention biases, another activation, a partial
rotary and another target width for every family.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from dflash_ring.common.config.families.eagle3 import EAGLE3 as CONFIG
from dflash_ring.consumer.families.eagle3.model import eagle3_settings
from dflash_ring.consumer.modeling.qwen3_blocks import rope_parameters

# EAGLE-3.1's options (eagle3.md 1.2) and speculators' trained embedding: what each would change in the drafter.
NO_EQUIVALENT = {
    "norm_before_fc": "an RMSNorm over the concatenated target features before fc",
    "fc_norm": "an RMSNorm per target feature before fc",
    "norm_output": "the final norm's output fed to the next step",
    "embed_requires_grad": "its own trained embedding, where ours embeds with the target's",
}
# Our settings a speculators config has no key for, kept beside its keys (speculators and vLLM ignore them): the
# mask token our layout records, how the drafter trained, and the target head's transforms (export.TARGET_HEAD_KEY).
OURS = ("mask_token_id", "dflash_training", "dflash_target_head")
# The decoder layer's keys, as LlamaConfig spells them, that the flat layout keeps top-level.
LAYER_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "max_position_embeddings",
    "vocab_size",
    "attention_bias",
    "attention_dropout",
    "tie_word_embeddings",
)


def speculators_keys(
    source: Mapping[str, Any], key: Callable[[str], Any], refuse: Callable[[str], Exception]
) -> dict[str, Any]:
    """Our DrafterConfig settings of a speculators Eagle3 config.json (its transformer_layer_config already checked
    to be a JSON object, and for a window, biases, the activation and the RoPE, by drafter_import)."""
    for name, what in NO_EQUIVALENT.items():
        if source.get(name):
            raise refuse(f"{name} true ({what})")
    layer = source["transformer_layer_config"]
    model_type = layer.get("model_type", "qwen3")  # speculators reads a config without one as Qwen3's
    if model_type != "llama":
        raise refuse(
            f"transformer_layer_config model_type {model_type!r} (ours is EAGLE's Llama layer, without q/k norms)"
        )
    if layer.get("num_hidden_layers") != 1:
        raise refuse(f"transformer_layer_config num_hidden_layers {layer.get('num_hidden_layers')} (ours has one)")
    if layer.get("mlp_bias"):
        raise refuse("transformer_layer_config mlp_bias true")
    ids = key("eagle_aux_hidden_state_layer_ids")
    if not ids or min(ids) < 1:
        raise refuse(f"eagle_aux_hidden_state_layer_ids {ids} (a feature of the embedding output, id 0)")
    return {
        "target_layer_ids": [i - 1 for i in ids],  # HF hidden_states indices: ours + 1
        "draft_vocab_size": key("draft_vocab_size"),
        "norm_before_residual": bool(key("norm_before_residual")),  # absent: refused (vLLM: true, speculators: false)
        # The drafts per round are the server's (speculators_config's speculative_tokens), not the weights': a
        # release that records no ttt_steps reads as the recipe's depth (eagle3_settings).
        "block_size": CONFIG.defaults["block_size"],
        # EAGLE-3 reads no mask token; our layout keeps the key: our export's, else 0.
        "mask_token_id": source.get("mask_token_id", 0),
    }


def speculators_layout(config: Mapping[str, Any], verifier: Mapping[str, Any]) -> dict[str, Any]:
    """speculators' Eagle3 config.json of the drafter our flat export describes (`config`, finished: draft_vocab_size
    and target_hidden_size written as sizes), naming `verifier` ({name_or_path, architectures}) and drafting a
    chain of the ttt_steps the drafter trained with."""
    _, steps = eagle3_settings(dict(config))
    layer = {
        "model_type": "llama",
        **{name: config[name] for name in LAYER_KEYS},
        "mlp_bias": False,
        "rope_parameters": rope_parameters(config["rope_theta"], config.get("rope_scaling")),
    }
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": steps,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": dict(verifier),
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": config["draft_vocab_size"],
        "norm_before_residual": config["norm_before_residual"],
        "target_hidden_size": config["target_hidden_size"],
        "eagle_aux_hidden_state_layer_ids": config["eagle_config"]["eagle_aux_hidden_state_layer_ids"],
        **{name: False for name in NO_EQUIVALENT},
        "tie_word_embeddings": False,
        "dtype": config["dtype"],
        **{name: config[name] for name in OURS if name in config},
    }
