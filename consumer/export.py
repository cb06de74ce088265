"""Write and read drafters in the public DFlash layout: config.json + model.safetensors + dflash.py.

dflash.py is consumer/hf_dflash.py copied verbatim: config.json's auto_map points transformers'
AutoModel (trust_remote_code) at it, so that path gives the real drafter, not a bare Qwen3Model.

Export is atomic (temp dir in the same parent, fsync, rename) so a crash never
leaves a half-written drafter where a server or a resume would pick it up.
Reading is safetensors-only: a checkpoint is data, never code to unpickle.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import PretrainedConfig

from dflash_ring.common.durable import fsync

from dflash_ring.common.drafter_config import DrafterConfig
from dflash_ring.consumer.drafter_hf_config import drafter_hf_config, qwen3_config
from .model import DFlashDraftModel
from .target_head import HeadSpec

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
MODEL_CODE_NAME = "dflash.py"  # what config.json's auto_map names ("dflash.DFlashDraftModel")
MODEL_CODE_SOURCE = Path(__file__).with_name("hf_dflash.py")
TARGET_HEAD_KEY = "dflash_target_head"


def _check_weights(state: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], source: str) -> None:
    """Refuse, naming the offending tensors, when names or shapes differ from what the config implies."""
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    wrong_shape = sorted(
        f"{k}: {tuple(state[k].shape)} != {tuple(expected[k].shape)}"
        for k in set(state) & set(expected)
        if state[k].shape != expected[k].shape
    )
    if missing or unexpected or wrong_shape:
        raise ValueError(
            f"{source} does not match its DFlash config: missing {missing}, unexpected {unexpected}, "
            f"wrong shapes {wrong_shape}"
        )


def _expected_state(config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Names and shapes the config implies, without allocating real weights."""
    with torch.device("meta"):
        return DFlashDraftModel(qwen3_config(config)).state_dict()


def export_drafter(
    model: DFlashDraftModel,
    drafter_config: DrafterConfig,
    target_config: Mapping[str, Any] | PretrainedConfig,
    out_dir: str | Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
    head_spec: HeadSpec | None = None,
) -> Path:
    """Write the drafter (its weights and model code; the target's embed/lm_head are shared at serve time).

    head_spec, the target head the drafter trained with (the head probe's result), is recorded as
    `dflash_target_head`: a server must apply the same embedding scale, logit multiplier and softcap when
    it embeds the drafter's block and scores its drafts with the target's head (serving stacks ignore the key).
    """
    out = Path(out_dir)
    if out.exists():
        raise FileExistsError(f"{out} exists; export never overwrites a drafter in place")
    config = drafter_hf_config(drafter_config, target_config, dtype=dtype)
    if head_spec is not None:
        config[TARGET_HEAD_KEY] = head_spec.to_json()
    dflash = config["dflash_config"]
    exported = (config["block_size"], dflash["mask_token_id"], dflash["target_layer_ids"])
    if exported != (model.block_size, model.mask_token_id, model.target_layer_ids):
        raise ValueError(f"config (block_size, mask_token_id, target_layer_ids) {exported} differs from the model's")
    state = {k: v.detach().to(device="cpu", dtype=dtype).contiguous() for k, v in model.state_dict().items()}
    _check_weights(state, _expected_state(config), "model")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        save_file(state, tmp / WEIGHTS_NAME, metadata={"format": "pt"})
        (tmp / MODEL_CODE_NAME).write_bytes(MODEL_CODE_SOURCE.read_bytes())
        for path in (tmp / CONFIG_NAME, tmp / WEIGHTS_NAME, tmp / MODEL_CODE_NAME, tmp):
            fsync(path)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync(out.parent)
    return out


def load_drafter(
    path: str | Path, *, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> DFlashDraftModel:
    """Load an exported drafter; dtype None keeps the stored dtype."""
    root = Path(path)
    config = json.loads((root / CONFIG_NAME).read_text())
    if config.get("architectures") != ["DFlashDraftModel"]:
        raise ValueError(f"{root}: architectures is {config.get('architectures')}, not ['DFlashDraftModel']")
    state = load_file(root / WEIGHTS_NAME)
    _check_weights(state, _expected_state(config), str(root / WEIGHTS_NAME))
    model = DFlashDraftModel(qwen3_config(config))
    model.load_state_dict(state, strict=True)
    return model.to(device=device, dtype=dtype or state["fc.weight"].dtype)
