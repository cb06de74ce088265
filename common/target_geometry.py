"""A target's geometry as every role reads it from the target's directory: the language-model part of its
config.json, and the counts (hidden size, decoder layers, vocabulary) that, met with the [target] settings
(TargetConfig.geometry), join the ring's config fingerprint. Reading a file is loading, so it is here and not in
common/config/ (settings as data); here in common/ because producers, drafters, the supervisor (the ring's
fingerprint) and the CLI all read it.

This module stays import-light (json, no torch): every process of a run reads it at its start. The geometry is
read from config.json directly when it names hidden_size, num_hidden_layers and vocab_size (most families), and
otherwise through the family's transformers config class (nemotron_h derives its layer count from its layer
pattern, longcat_flash from num_layers): a key name is never a reason to refuse a model. Which way is taken
depends only on the file, so every role of a run reads the same geometry; only such configs make a role import
transformers (and torch) to read it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash_ring.common.bounded_read import CONFIG_BYTES, read_text
from dflash_ring.common.config.drafter import target_text_config
from dflash_ring.common.config.target import TargetConfig, TargetConfigError, TargetGeometry
from dflash_ring.common.target_loading import load_target_hf_config

# What config.json names the target's width, decoder layer count and vocabulary, in most families.
GEOMETRY_KEYS = ("hidden_size", "num_hidden_layers", "vocab_size")


def read_model_config(cfg: TargetConfig) -> dict[str, Any]:
    """The language-model part of the target's config.json (read as JSON: no weights, no torch)."""
    if not cfg.path:
        raise TargetConfigError("target.path is empty: set it to a local Hugging Face model directory")
    file = Path(cfg.path).expanduser() / "config.json"
    try:
        config = json.loads(read_text(file, CONFIG_BYTES, TargetConfigError, "target config"))
    except FileNotFoundError:
        raise TargetConfigError(f"target.path: {file} does not exist (a local HF model directory is needed)") from None
    except TargetConfigError:
        raise  # not a regular file, past its cap, not UTF-8: named by read_text
    except json.JSONDecodeError as e:
        raise TargetConfigError(f"target.path: {file} is not valid JSON: {e}") from None
    except (UnicodeDecodeError, RecursionError) as e:
        raise TargetConfigError(f"target.path: {file} is not a JSON text ({type(e).__name__})") from None
    if not isinstance(config, dict) or not isinstance(config.get("text_config") or {}, dict):
        what = "the file" if not isinstance(config, dict) else "its text_config"
        raise TargetConfigError(
            f"target.path: {file}: {what} is not a JSON object; point target.path at a Hugging Face model directory"
        )
    return target_text_config(config)


def target_geometry(cfg: TargetConfig) -> TargetGeometry:
    """The geometry of the target cfg.path names, as every role reads it: its counts from config.json (plain_geometry,
    else its config class), met with the settings' layer ids and mask token (TargetConfig.geometry)."""
    return cfg.geometry(*(plain_geometry(read_model_config(cfg)) or _geometry_from_config_class(cfg.path)))


def plain_geometry(text_config: dict[str, Any]) -> tuple[int, int, int] | None:
    """(hidden, layers, vocab) as a text config.json writes them, or None where only its config class can say: a
    count missing or not a positive integer, or a num_layers beside num_hidden_layers that differs from it
    (LongCat-Flash saved by transformers 5.17 writes num_hidden_layers = 2 x num_layers). The one rule every role
    reads the target's geometry by (the producers' fingerprint, the drafter's layer count), and the one that keeps
    transformers' config classes, whose import costs a drafter seconds at each start, out of most starts."""
    if text_config.get("num_layers") not in (None, text_config.get("num_hidden_layers")):
        return None
    if all(type(text_config.get(k)) is int and text_config[k] > 0 for k in GEOMETRY_KEYS):  # noqa: E721
        return tuple(text_config[k] for k in GEOMETRY_KEYS)
    return None


def _geometry_from_config_class(path: str) -> tuple[int, int, int]:
    """Hidden size, decoder layer count and vocabulary as transformers reads them: the family's config class
    (through get_text_config) resolves renamed and derived keys, and the layer count is the one HF counts
    hidden states by (its output recorder's key: longcat_flash's num_layers, not its 2 x num_layers attention
    sublayers)."""
    text = load_target_hf_config(path).get_text_config()
    keys = ("hidden_size", layer_count_key(text), "vocab_size")
    values = tuple(getattr(text, k, None) for k in keys)
    file = Path(path).expanduser() / "config.json"
    for key, value in zip(keys, values):
        if type(value) is not int or value < 1:  # noqa: E721 (a bool is no count)
            raise TargetConfigError(
                f"target config {file}: {key} = {value!r} as its config class "
                f"{type(text).__name__} reads it: must be a positive integer"
            )
    return values


def layer_count_key(text_config: Any) -> str:
    """The config attribute counting the decoder layers whose outputs are HF's hidden states (num_hidden_layers
    unless the causal LM's output recorder names another; recorders without num_hidden_layers_key predate it)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        model_cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(text_config)]
    except KeyError:
        return "num_hidden_layers"
    recorder = (getattr(model_cls, "_can_record_outputs", None) or {}).get("hidden_states")
    key = getattr(recorder, "num_hidden_layers_key", None) or "num_hidden_layers"
    if key != "num_hidden_layers":
        return key
    # A transformers whose recorder does not name LongCat-Flash's count (5.17, seen on the H200) counts by
    # num_hidden_layers, which that config derives as 2 x num_layers (one per attention sublayer) while its
    # decoder has num_layers layers: the layer ids would name other layers.
    layers, other = getattr(text_config, "num_hidden_layers", None), getattr(text_config, "num_layers", None)
    if isinstance(other, int) and isinstance(layers, int) and other != layers:
        import transformers

        raise TargetConfigError(
            f"{type(text_config).__name__}: transformers {transformers.__version__} does not say whether num_layers "
            f"({other}) or num_hidden_layers ({layers}) counts the decoder layers whose outputs are the hidden states; "
            "use a transformers whose output recorder names it (5.24 does)"
        )
    return "num_hidden_layers"
