"""Warm start: a released drafter's weights as the first weights of this run's drafter (drafter.init_from).

Fine-tuning a released drafter for a fine-tuned target (z-lab/dflash#80; SpecForge, speculators and ModelOpt load
released drafters as initial weights) starts from its weights rather than a fresh initialisation. It applies once, at
the first start of a drafter with no checkpoint: a drafter that resumes takes its checkpoint, which records where its
first weights came from (`WarmStart.record`, saved with every checkpoint after it).

The released drafter must be this drafter: its family, the target's width and vocabulary, its layers, attention
geometry, MLP width, RoPE, layer types, the target layers it reads and its mask token, and the family's own heads.
Anything else is refused in one line naming each difference and the setting that chooses it, since loading it would
either fail on a shape deep in load_state_dict or, worse, train a model that reads its inputs differently from the
one it was released as. The block size may differ (the weights are the same for every block size; DFlash2's
convolution taps are checked against it by the drafter's config).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_ring.common.bounded_read import open_regular
from dflash_ring.common.config.drafter import DrafterConfig
from dflash_ring.common.refusal import Refusal
from dflash_ring.consumer.layouts.drafter_hf_config import drafter_hf_config
from dflash_ring.consumer.modeling.qwen3_blocks import rope_parameters
from dflash_ring.consumer.layouts.drafter_import import ReleasedDrafterError, released_drafter
from dflash_ring.consumer.layouts.export import export_arch
from dflash_ring.consumer.families import family

# What a released drafter's config.json must share with this drafter's, and the setting that chooses each here.
MODEL_KEYS = {
    "hidden_size": "the target (target.path)",
    "vocab_size": "the target (target.path)",
    "num_hidden_layers": "drafter.num_hidden_layers",
    "num_attention_heads": "drafter.num_attention_heads",
    "num_key_value_heads": "drafter.num_key_value_heads",
    "head_dim": "drafter.head_dim",
    "intermediate_size": "drafter.intermediate_size",
    "hidden_act": "the drafter's SwiGLU MLP",
    "rope_parameters": "the target's RoPE, or drafter.rope_theta",
    "layer_types": "drafter.layer_types",
    "mask_token_id": "drafter.mask_token_id",
    "target_layer_ids": "target.layer_ids",
}


class WarmStartError(Refusal, ValueError):
    """drafter.init_from names a drafter that is not this one (another family, width, vocabulary, layers, geometry,
    heads): the user's setting, so one line, exit 2, naming each difference and what chooses it."""


@dataclass(frozen=True)
class WarmStart:
    """Where a drafter's first weights came from: recorded with its checkpoints (`record`)."""

    path: str
    arch: str
    weights_sha256: str

    def record(self) -> dict[str, str]:
        return {"path": self.path, "arch": self.arch, "weights_sha256": self.weights_sha256}


def description(config: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """The values of MODEL_KEYS and the family's own model keys (DrafterFamily.model_keys) in a config.json of our
    export layout, wherever the layout keeps them (top-level or nested in dflash_config)."""
    _, mask_token_id, layer_ids = family(arch).settings(config)
    mask_token_id = mask_token_id if family(arch).reads_mask_token else None
    found = {k: config.get(k) for k in MODEL_KEYS} | {"mask_token_id": mask_token_id, "target_layer_ids": layer_ids}
    # One spelling of the RoPE: transformers 5's save_pretrained writes rope_parameters only, our export both.
    found["rope_parameters"] = config.get("rope_parameters") or rope_parameters(
        config["rope_theta"], config.get("rope_scaling")
    )
    found["sliding_window"] = config.get("sliding_window") if "sliding_attention" in (config["layer_types"]) else None
    nested = config.get("dflash_config") or {}
    return found | {k: config.get(k, nested.get(k)) for k in family(arch).model_keys}


def check_release(
    drafter: DrafterConfig, target_config: Mapping[str, Any], path: str | Path
) -> tuple[Path, str, dict[str, torch.Tensor]]:
    """The released drafter at `path` read and checked against this drafter's settings and target (WarmStartError
    naming each difference): (its directory, its arch, its tensors). A function of its own, needing no built model,
    so that check-config refuses a wrong drafter.init_from before a run, as the drafter's first start would."""
    root = Path(path).expanduser()
    try:
        config, state = released_drafter(root)
    except ReleasedDrafterError as e:
        raise WarmStartError(f"drafter.init_from: {e}") from None
    arch = export_arch(config, str(root / "config.json"))
    if arch != drafter.arch:
        raise WarmStartError(
            f"drafter.init_from {root} is a {family(arch).display} drafter, this run trains arch = {drafter.arch!r}: "
            f"set drafter.arch = {arch!r} (or its recipe), or name a {family(drafter.arch).display} drafter"
        )
    theirs, mine = description(config, arch), description(drafter_hf_config(drafter, target_config), arch)
    choosers = MODEL_KEYS | {"sliding_window": "drafter.sliding_window"} | dict(family(arch).model_keys)
    if differences := [
        f"{k} {theirs[k]!r} there, {mine[k]!r} here ({choosers[k]})" for k in mine if theirs[k] != mine[k]
    ]:
        raise WarmStartError(
            f"drafter.init_from {root} is not this drafter: {'; '.join(differences)}: set those drafter settings "
            "to the released drafter's, or name a drafter of this target and shape"
        )
    return root, arch, state


def warm_start(
    model: torch.nn.Module, drafter: DrafterConfig, target_config: Mapping[str, Any], path: str | Path
) -> WarmStart:
    """Load the drafter at `path` (any layout consumer/layouts/drafter_import.py reads) into `model`, this run's freshly
    built drafter, after checking that it is this drafter (WarmStartError naming each difference otherwise)."""
    root, arch, state = check_release(drafter, target_config, path)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items()}
    if got != expected:  # the description matched, the tensors do not: a file that disagrees with its own config
        name = next(k for k in sorted(set(got) | set(expected)) if got.get(k) != expected.get(k))
        raise WarmStartError(
            f"drafter.init_from {root}: tensor {name} is {got.get(name, 'absent')} in the file, "
            f"{expected.get(name, 'absent')} in the drafter its config.json describes: the file is not that drafter"
        )
    with torch.no_grad():
        model.load_state_dict(state, strict=True)  # cast to the model's dtype and device in place
    return WarmStart(str(root.resolve()), arch, _weights_digest(root))


def _weights_digest(root: Path) -> str:
    """sha256 over the directory's safetensors files in name order: which weights, not just which path."""
    h = hashlib.sha256()
    for file in sorted(root.glob("*.safetensors")):
        with open(open_regular(file, WarmStartError, "drafter.init_from weights"), "rb") as f:  # never a FIFO's wait
            while chunk := f.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()
