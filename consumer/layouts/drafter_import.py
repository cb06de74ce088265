"""A released drafter directory read as a warm start's first weights (drafter.init_from): its config.json in our
export layout and its tensors in our names, whichever of the public layouts it was saved in.

Why a reader of its own: load_drafter reads only the layouts we write, and a drafter someone else released may come
from vLLM's `speculators` trainer, whose save_pretrained writes another config.json (and, for DFlash and DFlash2, the
same `architectures` as z-lab's, so that key alone would take it for ours). Layouts, told apart in this order:
- speculators (a `speculators_model_type` naming one of our families): the drafter's Qwen3 settings nested
  in `transformer_layer_config`, the block settings top-level, `aux_hidden_state_layer_ids` counting the target's
  HF hidden_states (0 is the embedding: their id i is our target layer i - 1, as speculators' own z-lab converter
  maps them). The tensors carry our names already (layers.*, fc, hidden_norm, norm; DFlash2's convolutions and
  candidate_selector codebooks; DSpark's markov_head and confidence_head); the target's own (embed_tokens,
  lm_head, verifier_lm_head, verifier_norm) are left out of the file by their save and dropped here if present.
  EAGLE-3's (Eagle3Speculator) keeps its settings under keys of its own, which its family's hook reads
  (consumer/families/eagle3/speculators.py); its lm_head, d2t and t2d are the drafter's own.
- ours = z-lab's DFlash and DFlash2, DeepSeek's flat DSpark (config.json `architectures`, consumer/layouts/export.py):
  read as load_drafter reads them; a DSpark file's embed_tokens and lm_head (the target's) are dropped, and DFlash2's
  codebooks as z-lab's save_pretrained names them (`.weight`, its nn.Embedding) take our names.
The returned config is shaped as consumer/drafter_hf_config.drafter_hf_config writes it for the arch, less what a
speculators config does not record (num_target_layers, and how it was trained: dflash_training, DSpark's
num_anchors); `consumer.export._expected_state`, `qwen3_config` and `family(arch).model` build the model from it,
and the state loads into that model with strict=True. The target's tensors are never returned: the run's own
target head serves them.

What a speculators drafter may be that ours cannot reproduce exactly is refused in one line (ReleasedDrafterError):
a reduced draft vocabulary (d2t/t2d maps, its own lm_head) but EAGLE-3's (its model maps one as speculators'),
DFlash or DFlash2 drafting from the anchor or DSpark not, sliding-window layers (their window keeps the W context
tokens before the anchor for every slot of a block; ours, z-lab's and SpecForge's keep the last W keys of each slot's
own position), no Markov or confidence head (or a confidence head without the Markov embedding), attention biases,
another MLP activation, a partial rotary, a target layer id of 0 (the embedding), and EAGLE-3's own options (its
hook's refusals). Reading is safetensors-only: a pickle (.bin, .pt) is code, never loaded.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from dflash_ring.common.config.drafter import DrafterConfig
from dflash_ring.common.bounded_read import CONFIG_BYTES, read_text
from dflash_ring.common.refusal import Refusal
from dflash_ring.common.safetensors_check import check_safetensors_file
from dflash_ring.consumer.layouts.drafter_hf_config import drafter_rope
from dflash_ring.consumer.layouts.export import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    ExportDirError,
    _check_weights,
    _expected_state,
    _odd_dtype,
    export_arch,
)
from dflash_ring.consumer.families import FAMILIES, family

# The target's tensors a released drafter may carry (speculators' names; DSpark's embed_tokens/lm_head are ours too):
# the run's target head serves them, so they are dropped, their shapes checked.
TARGET_TENSORS = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


class ReleasedDrafterError(Refusal, ValueError):
    """A drafter directory drafter.init_from names that cannot start our model exactly: unreadable, of an unknown
    layout, or saved with an option our drafters have no equivalent for. The user's directory: one line, exit 2."""


def released_drafter(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config in our export layout, state in our tensor names) of the drafter saved at `path`, in any layout the
    module docstring names; the target's own tensors dropped (the state loads strict into family(arch).model(
    qwen3_config(config)), arch = export_arch(config))."""
    root = Path(path)
    config_file = root / CONFIG_NAME
    if not (config_file.exists() or config_file.is_symlink()):  # one of another kind: refused below, naming it
        raise ReleasedDrafterError(
            f"{config_file} does not exist: drafter.init_from names a drafter directory (config.json and "
            "model.safetensors), as export writes or a released drafter ships"
        )
    # The kind rule (common/bounded_read.py): a FIFO, a directory or a device is refused naming it, unread.
    text = read_text(config_file, CONFIG_BYTES, ReleasedDrafterError, "drafter config")
    try:
        source = json.loads(text)
    except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, nested past the parser's recursion
        raise ReleasedDrafterError(f"{config_file} is not a JSON config ({type(e).__name__}: {e})") from None
    if not isinstance(source, dict):
        raise ReleasedDrafterError(f"{config_file} is not a JSON object (got {type(source).__name__})")
    if "speculators_model_type" in source:
        config = _from_speculators(source, str(config_file))
    else:
        try:
            export_arch(source, str(config_file))
        except ExportDirError as e:
            raise ReleasedDrafterError(
                f"{e}, and it has no speculators_model_type (vLLM speculators' layout): not a drafter layout we read"
            ) from None
        config = source
        scaling = config.get("rope_scaling")
        if isinstance(scaling, dict) and "rope_theta" in scaling and scaling["rope_theta"] == config.get("rope_theta"):
            # Our exports before qwen3_config copied its input wrote it so (transformers 5's Qwen3Config adds
            # rope_theta to the rope_scaling dict it is given): not a key drafter_hf_config writes.
            config["rope_scaling"] = {k: v for k, v in scaling.items() if k != "rope_theta"}
    arch = export_arch(config)
    try:
        expected = _expected_state(config, arch)
    except (KeyError, TypeError, ValueError) as e:  # a key missing or of the wrong type, as Qwen3Config or our model
        raise ReleasedDrafterError(
            f"{config_file}: the {family(arch).display} drafter it describes cannot be built ({type(e).__name__}: {e})"
        ) from None
    weights = _weights_file(root)
    check_safetensors_file(weights)  # a truncated or damaged file: one line naming it, not safetensors' traceback
    state = load_file(weights)
    own = {k: v for k, v in expected.items() if k not in family(arch).head_tensors}  # the model's, not the target's
    _drop_target_tensors(state, config, weights, own)
    _our_names(state, family(arch).released_names, weights)
    _check_weights(state, own, str(weights), arch, ReleasedDrafterError)
    if odd := [k for k, v in state.items() if _odd_dtype(v, expected[k])]:
        raise ReleasedDrafterError(
            f"{weights}: {odd[0]} is stored as {state[odd[0]].dtype}, not float16, bfloat16 or float32: a quantised "
            "drafter cannot start training; use its full-precision release"
        )
    if "speculators_model_type" in source:  # the stored tensors' dtype, as an export records its own
        config["dtype"] = str(state["fc.weight"].dtype).removeprefix("torch.")
    return config, state


def _weights_file(root: Path) -> Path:
    """model.safetensors, or a one-line refusal saying what the directory holds instead."""
    weights = root / WEIGHTS_NAME
    if weights.is_file():
        return weights
    if pickles := sorted(p.name for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES):
        raise ReleasedDrafterError(
            f"{root} holds {', '.join(pickles)} but no {WEIGHTS_NAME}: pickle checkpoints run code when loaded and "
            "are never read; convert the drafter to safetensors where you trust it (save_pretrained writes one)"
        )
    if (root / f"{WEIGHTS_NAME}.index.json").is_file():
        raise ReleasedDrafterError(
            f"{root} holds sharded weights ({WEIGHTS_NAME}.index.json), not one {WEIGHTS_NAME}: a drafter is one "
            "file; save it again with a larger max_shard_size"
        )
    raise ReleasedDrafterError(f"{weights} does not exist: the drafter's weights are missing from {root}")


def _drop_target_tensors(
    state: dict[str, torch.Tensor], config: Mapping[str, Any], weights: Path, own: Mapping[str, torch.Tensor]
) -> None:
    """Remove the target's tensors, refusing one of another shape (a drafter of another vocabulary or width); a name
    the family's model owns (`own`: EAGLE-3's lm_head over its draft vocabulary, its d2t and t2d) stays."""
    vocab, hidden = config["vocab_size"], config["hidden_size"]
    shapes = {name: (vocab, hidden) for name in TARGET_TENSORS} | {"verifier_norm.weight": (hidden,)}
    for name in TARGET_TENSORS:
        if name in state and name not in own and tuple(state.pop(name).shape) != shapes[name]:
            raise ReleasedDrafterError(
                f"{weights}: {name} is not {list(shapes[name])} (the target's vocabulary x width its config "
                "describes): a drafter for another target or with its own vocabulary cannot start ours"
            )
    if reduced := sorted({"d2t", "t2d"} & set(state) - set(own)):
        raise ReleasedDrafterError(
            f"{weights} holds {reduced}: a reduced draft vocabulary, which this family's drafters (the target's whole "
            "vocabulary through its lm_head) have no equivalent for; start from a full-vocabulary drafter"
        )


def _our_names(state: dict[str, torch.Tensor], names: Mapping[str, str], weights: Path) -> None:
    """The family's tensors under our names where a release spells them otherwise (DrafterFamily.released_names)."""
    for theirs, ours in names.items():
        if theirs in state:
            if ours in state:
                raise ReleasedDrafterError(f"{weights} holds both {ours} and {theirs}: which one is the drafter's?")
            state[ours] = state.pop(theirs)


def _from_speculators(source: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Our export config of a vLLM speculators save_pretrained config.json, refusing what has no exact equivalent."""
    from transformers import AutoConfig, Qwen3Config

    arch = source["speculators_model_type"]
    if arch not in FAMILIES:
        raise ReleasedDrafterError(
            f"{where}: speculators_model_type {arch!r} is not a drafter we train (speculators' "
            f"{', '.join(FAMILIES)} are read)"
        )

    def refuse(what: str) -> ReleasedDrafterError:
        return ReleasedDrafterError(
            f"{where}: a speculators {family(arch).display} drafter with {what}; ours has no equivalent, so it cannot "
            "start this run exactly: start from a drafter without it, or train from scratch"
        )

    def key(name: str) -> Any:
        if source.get(name) is None:
            raise ReleasedDrafterError(f"{where}: no {name}, which a speculators {family(arch).display} config sets")
        return source[name]

    layer_dict = key("transformer_layer_config")
    if not isinstance(layer_dict, dict):
        raise ReleasedDrafterError(f"{where}: transformer_layer_config is not a JSON object")
    try:  # as speculators reads it (DFlashSpeculatorConfig.validate_transformer_config): defaults and derived keys
        config_class = (
            type(AutoConfig.for_model(model_type=layer_dict["model_type"]))
            if "model_type" in layer_dict
            else Qwen3Config
        )
        layer = config_class(**layer_dict)
    except (KeyError, TypeError, ValueError) as e:
        raise ReleasedDrafterError(
            f"{where}: transformer_layer_config does not load ({type(e).__name__}: {e})"
        ) from None
    hidden, heads = layer.hidden_size, layer.num_attention_heads
    vocab, fam = layer.vocab_size, family(arch)
    if not 0 < key("draft_vocab_size") <= vocab:
        raise ReleasedDrafterError(
            f"{where}: draft_vocab_size {source['draft_vocab_size']} is not in 1..{vocab} (the target's vocabulary)"
        )
    if source["draft_vocab_size"] < vocab and "draft_vocab_size" not in fam.config.own_keys:  # EAGLE-3's d2t/t2d
        raise refuse(f"a reduced draft vocabulary ({source['draft_vocab_size']} of the target's {vocab}, d2t/t2d maps)")
    if bool(source.get("sample_from_anchor")) != fam.config.drafts_from_anchor:
        raise refuse(f"sample_from_anchor {bool(source.get('sample_from_anchor'))}")
    layer_types = list(getattr(layer, "layer_types", None) or ["full_attention"] * layer.num_hidden_layers)
    if any(t != "full_attention" for t in layer_types):
        raise refuse(f"layer_types {layer_types} (their sliding window counts from the anchor, ours from each slot)")
    if getattr(layer, "attention_bias", False):
        raise refuse("attention_bias true")
    if layer.hidden_act != "silu":
        raise refuse(f"hidden_act {layer.hidden_act!r} (a Qwen3 drafter MLP is SwiGLU)")
    if source.get("target_hidden_size") not in (None, hidden):
        raise refuse(f"target_hidden_size {source['target_hidden_size']} != hidden_size {hidden}")
    params = dict(getattr(layer, "rope_parameters", None) or {})
    if "sliding_attention" in params:  # speculators' flatten_rope_parameters: the sliding one serves every layer
        params = dict(params["sliding_attention"])
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise refuse(f"a partial rotary (partial_rotary_factor {params['partial_rotary_factor']})")
    try:
        rope = drafter_rope({"rope_parameters": params})
    except (KeyError, ValueError) as e:
        raise refuse(f"its RoPE {params} ({e})") from None
    own = fam.speculators_keys(source, key, refuse)
    if "target_layer_ids" not in own:  # the block families' keys of the settings the family's hook gave none of
        aux = key("aux_hidden_state_layer_ids")
        if not aux or min(aux) < 1:
            raise refuse(f"aux_hidden_state_layer_ids {aux} (a feature of the embedding output, id 0)")
        own["target_layer_ids"] = [i - 1 for i in aux]
    own |= {name: key(name) for name in ("mask_token_id", "block_size") if name not in own}
    try:  # the family's own layout of these settings (loss_gamma: a training value the layout does not record)
        settings = DrafterConfig(
            arch=arch,
            num_hidden_layers=layer.num_hidden_layers,
            loss_gamma=1.0,
            init_from=str(Path(where).parent),  # its weights, and EAGLE-3's draft vocabulary maps, are this release's
            **own,
        )
    except ValueError as e:
        raise ReleasedDrafterError(f"{where}: its settings are not a drafter of ours ({e})") from None
    # Written for as many target layers as its ids need; what speculators does not record is left out: the
    # target's layer count, and the training's anchors (DSpark's layout writes them).
    config: dict[str, Any] = fam.layout(settings, max(settings.target_layer_ids) + 1)
    config.pop("num_target_layers")
    config.pop("num_anchors", None)
    config |= {
        "num_hidden_layers": layer.num_hidden_layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(layer, "num_key_value_heads", None) or heads,
        "head_dim": getattr(layer, "head_dim", None) or hidden // heads,  # as speculators' attention reads it
        "intermediate_size": layer.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": float(layer.rms_norm_eps),
        **rope,
        "max_position_embeddings": layer.max_position_embeddings,
        "vocab_size": vocab,
        "layer_types": layer_types,
        "sliding_window": None,
        "use_sliding_window": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
    }
    fam.finish_config(config)
    for name in ("bos_token_id", "eos_token_id"):
        if getattr(layer, name, None) is not None:
            config[name] = getattr(layer, name)
    return config
