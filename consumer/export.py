"""Write and read drafters in the public layouts: config.json + model.safetensors + the model's code.

Two layouts, told apart by config.json's `architectures`:
- DFlash (["DFlashDraftModel"], z-lab / SpecForge): settings nested in dflash_config, the drafter's own tensors
  only (the target's embed/lm_head are shared at serve time); dflash.py is consumer/hf_dflash.py copied verbatim.
- DSpark (["Qwen3DSparkModel"], DeepSeek's flat layout: vLLM's "dspark" method, SGLang's DSPARK): settings
  top-level, the tensors with no prefix plus the target's embed_tokens.weight and lm_head.weight (SGLang refuses
  a checkpoint without them; a tied target's lm_head is its embedding); dspark.py is consumer/hf_dspark.py.
- DFlash2 (["DFlash2DraftModel"], z-lab's): settings nested in dflash_config, top-level is_causal false (its sliding
  layers train bidirectional in the block), the codebooks stored without .weight; dflash2.py is consumer/hf_dflash2.py,
  shipped with the dflash2_blocks.py it imports.
config.json's auto_map points transformers' AutoModel (trust_remote_code) at the code file, so that path gives the
real drafter, not a bare Qwen3Model.

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
from dflash_ring.common.refusal import Refusal
from dflash_ring.common.safetensors_check import check_safetensors_file

from dflash_ring.common.config.drafter import DrafterConfig
from dflash_ring.consumer.drafter_hf_config import drafter_hf_config, qwen3_config
from .dspark_heads import check_dspark_head
from .model import DFlashDraftModel, drafter_class
from .target_head import FrozenTargetHead, HeadSpec

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
MODEL_CODE_NAME = "dflash.py"  # what config.json's auto_map names ("dflash.DFlashDraftModel")
MODEL_CODE_SOURCE = Path(__file__).with_name("hf_dflash.py")
DSPARK_CODE_NAME = "dspark.py"  # "dspark.Qwen3DSparkModel"
DSPARK_CODE_SOURCE = Path(__file__).with_name("hf_dspark.py")
TARGET_HEAD_KEY = "dflash_target_head"

ARCHITECTURES = {"dflash": ["DFlashDraftModel"], "dspark": ["Qwen3DSparkModel"], "dflash2": ["DFlash2DraftModel"]}
ARCH_NAMES = {"dflash": "DFlash", "dspark": "DSpark", "dflash2": "DFlash2"}
MODEL_CODE = {
    "dflash": (MODEL_CODE_NAME, MODEL_CODE_SOURCE),
    "dspark": (DSPARK_CODE_NAME, DSPARK_CODE_SOURCE),
    "dflash2": ("dflash2.py", Path(__file__).with_name("hf_dflash2.py")),
}
# Files the model code imports (relative imports, which transformers' trust_remote_code copies along).
MODEL_CODE_IMPORTS = {"dflash2": (("dflash2_blocks.py", Path(__file__).with_name("dflash2_blocks.py")),)}
# DFlash2's dflash_config keys for a target head's transforms (z-lab's dflash_generate and compute_logits read them).
DFLASH2_HEAD_KEYS = {
    "embed_scale": "input_embedding_scale",
    "logit_multiplier": "output_multiplier",
    "logit_softcap": "final_logit_softcapping",
}
# The target's head in a DSpark export: in the file, not parameters of our DSparkDraftModel (its FrozenTargetHead).
HEAD_TENSORS = ("embed_tokens.weight", "lm_head.weight")


class ExportDirError(Refusal, ValueError):
    """A drafter directory that load_drafter cannot take as asked: a config.json that is not JSON or names no
    layout we write, an export of another layout than the caller serves, a config.json its weights or the model
    it describes do not match, a DSpark export of another target. The user's directory, so one line (exit 2)."""


def export_arch(config: Mapping[str, Any], source: str = "config.json") -> str:
    """ "dflash", "dspark" or "dflash2", by the config's architectures; anything else refused naming the layouts."""
    found = config.get("architectures")
    for arch, names in ARCHITECTURES.items():
        if found == names:
            return arch
    raise ExportDirError(
        f"{source}: architectures is {found}, neither {ARCHITECTURES['dflash']} (DFlash), "
        f"{ARCHITECTURES['dflash2']} (DFlash2) nor {ARCHITECTURES['dspark']} (DSpark)"
    )


def _describe(arch: str) -> str:
    return f"a {ARCH_NAMES[arch]} drafter (architectures {ARCHITECTURES[arch]})"


def _check_weights(
    state: Mapping[str, torch.Tensor],
    expected: Mapping[str, torch.Tensor],
    source: str,
    arch: str = "dflash",
    error: type[ValueError] = ValueError,
) -> None:
    """Refuse, naming the offending tensors, when names or shapes differ from what the config implies. `error`:
    ExportDirError where the state is a user's file (load_drafter); exporting, the state is the model we built, so
    a mismatch stays a plain ValueError."""
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    wrong_shape = sorted(
        f"{k}: {tuple(state[k].shape)} != {tuple(expected[k].shape)}"
        for k in set(state) & set(expected)
        if state[k].shape != expected[k].shape
    )
    if missing or unexpected or wrong_shape:
        raise error(
            f"{source} does not match its {ARCH_NAMES[arch]} config: missing {missing}, unexpected {unexpected}, "
            f"wrong shapes {wrong_shape}"
        )


def _expected_state(config: Mapping[str, Any], arch: str = "dflash") -> dict[str, torch.Tensor]:
    """Names and shapes the config implies, without allocating real weights (DSpark: with the target's head)."""
    with torch.device("meta"):
        state = drafter_class(arch)(qwen3_config(config)).state_dict()
        if arch == "dspark":
            state |= {name: torch.empty(config["vocab_size"], config["hidden_size"]) for name in HEAD_TENSORS}
    return state


def _settings(config: Mapping[str, Any], arch: str) -> tuple[int, int, list[int]]:
    """(block_size, mask_token_id, target_layer_ids) where the layout keeps them."""
    where = config if arch == "dspark" else config["dflash_config"]
    block_size = config["dflash_config"]["block_size"] if arch == "dflash2" else config["block_size"]
    return block_size, where["mask_token_id"], where["target_layer_ids"]


def export_drafter(
    model: DFlashDraftModel,
    drafter_config: DrafterConfig,
    target_config: Mapping[str, Any] | PretrainedConfig,
    out_dir: str | Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
    head_spec: HeadSpec | None = None,
    head: FrozenTargetHead | None = None,
) -> Path:
    """Write the drafter: its weights and model code, in the layout of drafter_config.arch.

    head: the target's frozen head the drafter trained with. A DSpark export needs it (its embed_tokens and lm_head
    ship in the file); a DFlash export reads only its spec. head_spec (default: head's), the target head the drafter
    trained with (the head probe's result), is recorded as `dflash_target_head`: a server must apply the same
    embedding scale, logit multiplier and softcap when it embeds the drafter's block and scores its drafts with the
    target's head (serving stacks ignore the key; a DSpark drafter's target head is always plain).
    """
    out = Path(out_dir)
    if out.exists():
        raise FileExistsError(f"{out} exists; export never overwrites a drafter in place")
    arch = drafter_config.arch
    if model.sample_from_anchor != (arch == "dspark"):
        model_arch = "dspark" if model.sample_from_anchor else "dflash"
        raise ValueError(
            f"the model is {_describe(model_arch)}, its drafter config says arch = {arch!r} "
            f"({_describe(arch)}): export it with the config it was trained with"
        )
    if head_spec is None and head is not None:
        head_spec = head.spec
    config = drafter_hf_config(drafter_config, target_config, dtype=dtype)
    if head_spec is not None:
        config[TARGET_HEAD_KEY] = head_spec.to_json()
        if arch == "dflash2":  # where z-lab's DFlash2 reads them
            config["dflash_config"] |= {
                key: getattr(head_spec, ours)
                for ours, key in DFLASH2_HEAD_KEYS.items()
                if getattr(head_spec, ours) is not None
            }
    exported = _settings(config, arch)
    if exported != (model.block_size, model.mask_token_id, model.target_layer_ids):
        raise ValueError(f"config (block_size, mask_token_id, target_layer_ids) {exported} differs from the model's")
    state = {k: v.detach().to(device="cpu", dtype=dtype).contiguous() for k, v in model.state_dict().items()}
    if arch == "dspark":
        if head is None:
            raise ValueError(
                "a DSpark export ships the target's embed_tokens and lm_head (SGLang refuses a checkpoint "
                "without them): pass the target's head (head=FrozenTargetHead)"
            )
        check_dspark_head(head.spec)
        # Clones: a tied target's lm_head is its embedding, and safetensors refuses tensors that share memory.
        state |= {
            name: weight.detach().to(device="cpu", dtype=dtype).clone()
            for name, weight in zip(HEAD_TENSORS, (head.embed_weight, head.lm_head_weight))
        }
    _check_weights(state, _expected_state(config, arch), "model", arch)
    code = (MODEL_CODE[arch], *MODEL_CODE_IMPORTS.get(arch, ()))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        save_file(state, tmp / WEIGHTS_NAME, metadata={"format": "pt"})
        for code_name, code_source in code:
            (tmp / code_name).write_bytes(code_source.read_bytes())
        for path in (tmp / CONFIG_NAME, tmp / WEIGHTS_NAME, *(tmp / code_name for code_name, _ in code), tmp):
            fsync(path)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync(out.parent)
    return out


def load_drafter(
    path: str | Path,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    arch: str | None = "dflash",
    target_head: FrozenTargetHead | None = None,
) -> DFlashDraftModel:
    """Load an exported drafter (DFlashDraftModel, DSparkDraftModel or DFlash2DraftModel); dtype None keeps the
    stored dtype.

    arch: the layout the caller serves, "dflash" (the default: what every caller before DSpark decodes), "dspark",
    "dflash2", or None for any; an export of another is refused in one line naming both. A DSpark export's embed_tokens
    and lm_head are checked by shape and not loaded into the model (the target's head serves them); with
    target_head they must equal its embedding and lm_head (as the export's dtype rounds them), or the drafter was
    exported for another target.
    """
    root = Path(path)
    config_file = root / CONFIG_NAME
    try:
        config = json.loads(config_file.read_text())
    except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, nested past the parser's recursion
        raise ExportDirError(f"{config_file} is not a JSON config ({type(e).__name__}: {e})") from None
    if not isinstance(config, dict):
        raise ExportDirError(
            f"{config_file} is not a JSON object (got {type(config).__name__}): export the drafter again"
        )
    found = export_arch(config, str(config_file))
    if arch is not None and found != arch:
        raise ExportDirError(f"{root} is {_describe(found)}, {_describe(arch)} is expected here")
    try:
        expected = _expected_state(config, found)
    except (KeyError, TypeError, ValueError) as e:  # a key missing or of the wrong type, as Qwen3Config or our model
        raise ExportDirError(
            f"{config_file}: the {ARCH_NAMES[found]} drafter it describes cannot be built ({type(e).__name__}: {e})"
        ) from None
    weights = root / WEIGHTS_NAME
    check_safetensors_file(weights)  # a truncated or damaged file: one line naming it, not safetensors' traceback
    state = load_file(weights)
    _check_weights(state, expected, str(weights), found, ExportDirError)
    if odd := [k for k, v in state.items() if not v.is_floating_point() or v.element_size() < 2]:
        raise ExportDirError(
            f"{weights}: {odd[0]} is stored as {state[odd[0]].dtype}, not float16, bfloat16 or float32 (an export "
            "writes the drafter's own floating-point weights; these would be cast as they are): export it again"
        )
    if found == "dspark":
        stored = [state.pop(name) for name in HEAD_TENSORS]
        if target_head is not None:
            for name, tensor, theirs in zip(
                HEAD_TENSORS, stored, (target_head.embed_weight, target_head.lm_head_weight)
            ):
                if not torch.equal(theirs.detach().to(device="cpu", dtype=tensor.dtype), tensor):
                    raise ExportDirError(
                        f"{weights}: {name} differs from the target's: this drafter was exported for another target"
                    )
    model = drafter_class(found)(qwen3_config(config))
    model.load_state_dict(state, strict=True)
    return model.to(device=device, dtype=dtype or state["fc.weight"].dtype)
