"""Write and read drafters in the public layouts: config.json + model.safetensors + the model's code.

Each family's layout (consumer/families/<name>/: its config.json keys, the code shipped beside the weights, the
target tensors its file carries) is told apart by config.json's `architectures`: z-lab's DFlash and DFlash2,
DeepSeek's flat DSpark. config.json's auto_map points transformers' AutoModel (trust_remote_code) at the code file,
so that path gives the real drafter, not a bare Qwen3Model. A family may also be written in vLLM speculators'
save_pretrained layout (layout "speculators": DrafterFamily.speculators_layout, EAGLE-3's Eagle3Speculator, which
`vllm serve <dir>` serves alone since it names its verifier), the same tensors under another config.json and no code.

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
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file

from dflash_ring.common.durable import fsync
from dflash_ring.common.bounded_read import CONFIG_BYTES, read_text
from dflash_ring.common.refusal import Refusal
from dflash_ring.common.safetensors_check import check_safetensors_file

from dflash_ring.common.config.drafter import DrafterConfig
from dflash_ring.consumer.layouts.drafter_hf_config import drafter_hf_config, qwen3_config
from dflash_ring.consumer.families import FAMILIES, family, family_of, family_of_layout
from dflash_ring.consumer.families.family import DrafterFamily
from dflash_ring.consumer.training.nonfinite import first_non_finite

from dflash_ring.consumer.modeling.model import DFlashDraftModel
from dflash_ring.consumer.modeling.target_head import FrozenTargetHead, HeadSpec

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
if TYPE_CHECKING:  # a drafter imports this module at start (warm start): transformers only where it is needed
    from transformers import PretrainedConfig

TARGET_HEAD_KEY = "dflash_target_head"


class ExportDirError(Refusal, ValueError):
    """A drafter directory that load_drafter cannot take as asked: a config.json that is not JSON or names no
    layout we write, an export of another layout than the caller serves, a config.json its weights or the model
    it describes do not match, a DSpark export of another target. The user's directory, so one line (exit 2)."""


class ExportLayoutError(Refusal, ValueError):
    """An export asked in a layout that cannot describe the drafter: speculators' for a family we write no
    speculators layout of, or without the target it must name as its verifier. The user's choice: one line, exit 2."""


# "native": the family's own layout (z-lab's DFlash and DFlash2, DeepSeek's flat DSpark, EAGLE's flat EAGLE-3).
LAYOUTS = ("native", "speculators")


class NonFiniteExport(Refusal, ValueError):
    """A drafter whose weights hold NaN or inf: served, every draft would be rejected (or the server fail). One line."""


def export_arch(config: Mapping[str, Any], source: str = "config.json") -> str:
    """The family name of the layout config.json's architectures names; anything else refused naming the layouts."""
    found = family_of_layout(config)
    if found is None:
        *others, last = (f"{list(f.architectures)} ({f.display})" for f in FAMILIES.values())
        raise ExportDirError(
            f"{source}: architectures is {config.get('architectures')}, neither {', '.join(others)} nor {last}"
        )
    return found.name


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
            f"{source} does not match its {family(arch).display} config: missing {missing}, unexpected {unexpected}, "
            f"wrong shapes {wrong_shape}"
        )


def _odd_dtype(stored: torch.Tensor, expected: torch.Tensor) -> bool:
    """A weight not in float16, bfloat16 or float32, or an index map (EAGLE-3's d2t, t2d) not in its own dtype."""
    if expected.is_floating_point():
        return not stored.is_floating_point() or stored.element_size() < 2
    return stored.dtype != expected.dtype


def _expected_state(config: Mapping[str, Any], arch: str = "dflash") -> dict[str, torch.Tensor]:
    """Names and shapes the config implies, without allocating real weights (with the target tensors the family's
    file carries)."""
    with torch.device("meta"):
        state = family(arch).model(qwen3_config(config)).state_dict()
        state |= {name: torch.empty(config["vocab_size"], config["hidden_size"]) for name in family(arch).head_tensors}
    return state


def export_drafter(
    model: DFlashDraftModel,
    drafter_config: DrafterConfig,
    target_config: Mapping[str, Any] | PretrainedConfig,
    out_dir: str | Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
    head_spec: HeadSpec | None = None,
    head: FrozenTargetHead | None = None,
    layout: str = "native",
    verifier: str | None = None,
) -> Path:
    """Write the drafter: its weights and model code, in the layout of drafter_config.arch's family (`layout`
    "native"), or its weights in speculators' layout of the family ("speculators"), whose config.json names
    `verifier` (the target's path or hub id, as `vllm serve` is to find it) and the target's architectures.

    head: the target's frozen head the drafter trained with. A family whose file carries the target's tensors (DSpark:
    embed_tokens and lm_head) needs it; the others read only its spec. head_spec (default: head's), the target head
    the drafter trained with (the head probe's result), is recorded as `dflash_target_head`: a server must apply the
    same embedding scale, logit multiplier and softcap when it embeds the drafter's block and scores its drafts with the
    target's head (serving stacks ignore the key; a DSpark drafter's target head is always plain).
    """
    out = Path(out_dir)
    if out.exists():
        raise FileExistsError(f"{out} exists; export never overwrites a drafter in place")
    arch = drafter_config.arch
    fam = family(arch)
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is none of {LAYOUTS}")
    if layout == "speculators":
        if fam.speculators_layout is None:
            writers = [f.display for f in FAMILIES.values() if f.speculators_layout is not None]
            raise ExportLayoutError(
                f"layout 'speculators' (vLLM speculators' save_pretrained) is written for {', '.join(writers)} "
                f"drafters, not {fam.describe()}: export it in its own layout (leave --layout out)"
            )
        if not verifier:
            raise ExportLayoutError(
                f"a {fam.display} export in speculators' layout names its verifier (the target, which `vllm serve` "
                "loads beside it), and none is known: pass the target model (dflash-ring export --target DIR)"
            )
    if (model_family := family_of(model)) is not fam:
        raise ValueError(
            f"the model is {model_family.describe()}, its drafter config says arch = {arch!r} "
            f"({fam.describe()}): export it with the config it was trained with"
        )
    if head_spec is None and head is not None:
        head_spec = head.spec
    config = drafter_hf_config(drafter_config, target_config, dtype=dtype)
    if head_spec is not None:
        config[TARGET_HEAD_KEY] = head_spec.to_json()
        fam.write_head_spec(config, head_spec)
    exported = fam.settings(config)
    if exported != (model.block_size, model.mask_token_id, model.target_layer_ids):
        raise ValueError(f"config (block_size, mask_token_id, target_layer_ids) {exported} differs from the model's")
    state = {  # index maps (EAGLE-3's d2t, t2d) keep their integer and boolean dtypes
        k: v.detach().to(device="cpu", dtype=dtype if v.is_floating_point() else v.dtype).contiguous()
        for k, v in model.state_dict().items()
    }
    if fam.head_tensors:
        if head is None:
            raise ValueError(
                f"a {fam.display} export ships the target's "
                f"{' and '.join(name.removesuffix('.weight') for name in fam.head_tensors)} (SGLang refuses a "
                "checkpoint without them): pass the target's head (head=FrozenTargetHead)"
            )
        fam.check_head(head.spec)
        # Clones: a tied target's lm_head is its embedding, and safetensors refuses tensors that share memory.
        state |= {
            name: weight.detach().to(device="cpu", dtype=dtype).clone()
            for name, weight in zip(fam.head_tensors, (head.embed_weight, head.lm_head_weight))
        }
    _check_weights(state, _expected_state(config, arch), "model", arch)
    if bad := first_non_finite(state):  # in the export's dtype: a float16 export overflows where float32 did not
        raise NonFiniteExport(
            f"export refused: {bad[0]} holds {bad[1]} (as {str(dtype).removeprefix('torch.')}): the drafter's "
            "training diverged before this state; export an earlier checkpoint (a step-NNNNNNNN directory)"
        )
    code = fam.code
    if layout == "speculators":  # speculators' loader and vLLM's build the model from config.json alone
        architectures = (
            target_config.get("architectures")
            if isinstance(target_config, Mapping)
            else getattr(target_config, "architectures", None)
        )
        config = fam.speculators_layout(config, {"name_or_path": verifier, "architectures": list(architectures or [])})
        code = ()
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
    """Load an exported drafter as its family's training model; dtype None keeps the stored dtype.

    arch: the family the caller serves, "dflash" (the default: what every caller before DSpark decodes), another name
    of consumer/families, or None for any; an export of another is refused in one line naming both. The target
    tensors a family's file carries (DSpark's embed_tokens and lm_head) are checked by shape and not loaded into the
    model (the target's head serves them); with target_head they must equal its embedding and lm_head (as the
    export's dtype rounds them), or the drafter was exported for another target.
    """
    root = Path(path)
    config_file = root / CONFIG_NAME
    text = read_text(config_file, CONFIG_BYTES, ExportDirError, "drafter config")  # a FIFO, a device: refused, unread
    try:
        config = json.loads(text)
    except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, nested past the parser's recursion
        raise ExportDirError(f"{config_file} is not a JSON config ({type(e).__name__}: {e})") from None
    if not isinstance(config, dict):
        raise ExportDirError(
            f"{config_file} is not a JSON object (got {type(config).__name__}): export the drafter again"
        )
    found = export_arch(config, str(config_file))
    if arch is not None and found != arch:
        raise ExportDirError(f"{root} is {family(found).describe()}, {family(arch).describe()} is expected here")
    try:
        expected = _expected_state(config, found)
    except (KeyError, TypeError, ValueError) as e:  # a key missing or of the wrong type, as Qwen3Config or our model
        raise ExportDirError(
            f"{config_file}: the {family(found).display} drafter it describes cannot be built ({type(e).__name__}: {e})"
        ) from None
    weights = root / WEIGHTS_NAME
    check_safetensors_file(weights)  # a truncated or damaged file: one line naming it, not safetensors' traceback
    state = load_file(weights)
    _check_weights(state, expected, str(weights), found, ExportDirError)
    if odd := [k for k, v in state.items() if _odd_dtype(v, expected[k])]:
        raise ExportDirError(
            f"{weights}: {odd[0]} is stored as {state[odd[0]].dtype}, not float16, bfloat16 or float32 (an export "
            "writes the drafter's own floating-point weights; these would be cast as they are): export it again"
        )
    if head_tensors := family(found).head_tensors:
        stored = [state.pop(name) for name in head_tensors]
        if target_head is not None:
            for name, tensor, theirs in zip(
                head_tensors, stored, (target_head.embed_weight, target_head.lm_head_weight)
            ):
                if not torch.equal(theirs.detach().to(device="cpu", dtype=tensor.dtype), tensor):
                    raise ExportDirError(
                        f"{weights}: {name} differs from the target's: this drafter was exported for another target"
                    )
    model = family(found).model(qwen3_config(config))
    model.load_state_dict(state, strict=True)
    return model.to(device=device, dtype=dtype or state["fc.weight"].dtype)
