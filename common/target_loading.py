"""Loading a target with transformers: its config class, the causal LM built from it on the meta device against its
weights (check-config's look), and the model with its weights. Whatever transformers raises while it reads the
directory or builds from it becomes one TargetConfigError naming the directory (the loading phase's rule:
common/refusal.py). Loading, not configuration, so it is not in common/config/ (settings as data); here in
common/ because producers (the target they run), drafters (the frozen head, the evaluation) and the CLI load
targets. torch and transformers are imported where a function needs them: importing this module costs nothing.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dflash_ring.common.config.target import TargetConfigError
from dflash_ring.common.refusal import Refusal


def load_target_hf_config(path: str | Path) -> Any:
    """The target's transformers config (PretrainedConfig) from its local directory: the one place the project
    has transformers read a target's config.json, so every command that loads a target refuses a config.json
    transformers will not take (a field of the wrong type: "hidden_size": [64], 1e400, NaN; an unknown
    model_type; a file that is not JSON) in one line naming the file and the field, as TargetConfigError."""
    from transformers import AutoConfig  # the installed config classes only, never modeling code

    from dflash_ring.common.bounded_read import CONFIG_BYTES, regular_size

    file = Path(path).expanduser() / "config.json"
    try:  # the kind and size rule before transformers opens it (a FIFO would block it, /dev/zero never end)
        regular_size(file, TargetConfigError, "target config", CONFIG_BYTES)
    except (FileNotFoundError, NotADirectoryError):  # else transformers takes the path for a hub repo id
        raise TargetConfigError(
            f"target {Path(path).expanduser()}: no config.json there (a local HF model directory)"
        ) from None
    try:
        return AutoConfig.from_pretrained(Path(path).expanduser(), local_files_only=True)
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001 (the reading phase's rule: whatever transformers raises reading the
        # file is the file's: strict-dataclass validation errors, a dtype it cannot name (AttributeError), ...)
        why = " ".join(str(e).split())[:500] or type(e).__name__
        raise TargetConfigError(
            f"target config {file}: transformers refuses it ({why}); fix that field of the "
            "file or point target.path at another model"
        ) from None


@contextmanager
def building_from(path: str | Path) -> Iterator[None]:
    """While transformers builds (or loads) a model from the target directory: whatever it raises there, but for
    our own refusals and running out of memory, is the directory's fault (a config.json that its config class
    takes yet the model code cannot build: zero heads divide by zero, a negative width is a negative dimension;
    weights of other shapes than config.json gives), so it becomes one TargetConfigError naming the directory,
    the library's exception and its message. The rule for the loading phase, at every place a target is built;
    errors after it (our code running the model) still show their traceback."""
    import torch

    try:
        yield
    except (Refusal, MemoryError, torch.OutOfMemoryError):
        raise
    except Exception as e:  # noqa: BLE001 (the phase's rule, see above)
        why = " ".join(str(e).split())[:500] or "no message"
        if type(e).__name__ == "SafetensorError":  # damage the header check cannot see: the weights', not config's
            raise TargetConfigError(
                f"target {Path(path).expanduser()}: its safetensors weights do not load ({why}); copy or download "
                "them again"
            ) from None
        raise TargetConfigError(
            f"target {Path(path).expanduser()}: transformers cannot build the model its "
            f"config.json describes ({type(e).__name__}: {why}); fix config.json (or the "
            "weights) or point target.path at another model"
        ) from None


def check_target_builds(path: str | Path) -> None:
    """What a role does with the target directory short of reading its weights, for `check-config`: its config
    class (load_target_hf_config), the causal LM built from it on the meta device (no memory, no weights: the
    arithmetic the config class does not validate), and where there are safetensors weights, every tensor of that
    model that the weights hold has their shape (a config.json of another width than its weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    from dflash_ring.common.safetensors_check import FLOAT_DTYPES, weight_dtypes, weight_shapes

    config = load_target_hf_config(path)
    check_generation_config(path)
    with building_from(path), torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    root = Path(path).expanduser()
    stored = weight_shapes(root)
    for name, shape in stored.items():  # shapes first: a model of another width is named as such
        if name in expected and expected[name] != shape:
            raise TargetConfigError(
                f"target {root}: config.json makes {name} of shape "
                f"{list(expected[name])}, its weights hold {list(shape)}: fix config.json or "
                "point target.path at the model these weights belong to"
            )
    if stored and stored.keys() <= expected.keys():  # names as the model's own: none renamed or fused on loading
        shared: dict[int, list[str]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            shared.setdefault(id(param), []).append(name)
        if missing := sorted(names[0] for names in shared.values() if not any(n in stored for n in names)):
            raise TargetConfigError(
                f"target {root}: its weights lack {len(missing)} tensor(s) the model needs ({', '.join(missing[:3])}"
                f"{', ...' if len(missing) > 3 else ''}), which transformers would start at random: copy or "
                "download the weights again (model.safetensors.index.json and every shard it names)"
            )
    if getattr(config, "quantization_config", None) is None:  # a quantized checkpoint's dtypes are its quantizer's
        floats = {k for k, v in model.state_dict().items() if v.is_floating_point()}
        for name, dtype in weight_dtypes(root).items():
            if name in floats and dtype not in FLOAT_DTYPES:
                raise TargetConfigError(
                    f"target {root}: its weights hold {name} as {dtype}, not a floating type "
                    f"({', '.join(FLOAT_DTYPES)}), and config.json has no quantization_config that says how to read "
                    "it: transformers would cast it to floats as it is; use the model's own floating-point weights"
                )


_TOKEN_ID_KEYS = ("eos_token_id", "bos_token_id", "pad_token_id", "decoder_start_token_id")


def check_generation_config(path: str | Path) -> None:
    """The target's generation_config.json, where it has one, as what reads it needs: a JSON object whose token ids
    are ids (a non-negative integer or a list of them). transformers reads it beside the weights and takes a file
    that is not JSON in silence, and a string eos_token_id would be an end of reply no token ever matches."""
    from dflash_ring.common.bounded_read import CONFIG_BYTES, read_text

    file = Path(path).expanduser() / "generation_config.json"
    if not file.is_file():
        return
    try:
        body = json.loads(read_text(file, CONFIG_BYTES, TargetConfigError, "generation config"))
    except (ValueError, RecursionError) as e:
        if isinstance(e, TargetConfigError):
            raise
        raise TargetConfigError(
            f"target generation config {file} is not valid JSON ({type(e).__name__}: {e}); fix it or remove it"
        ) from None
    if not isinstance(body, dict):
        raise TargetConfigError(f"target generation config {file} is not a JSON object; fix it or remove it")
    for key in _TOKEN_ID_KEYS:
        value = body.get(key)
        ids = value if isinstance(value, list) else [value]
        if value is not None and not all(type(i) is int and i >= 0 for i in ids):  # noqa: E721 (a bool is no id)
            raise TargetConfigError(
                f"target generation config {file}: {key} = {json.dumps(value)} is not a token id (a non-negative "
                "integer or a list of them); fix it or remove the file"
            )


def load_target_lm(path: str | Path, **kwargs: Any) -> Any:
    """The target's causal LM with its weights (AutoModelForCausalLM.from_pretrained(path, **kwargs)), refused in one
    line naming the directory unless its weights fit what config.json builds: check_target_builds first (shapes,
    dtypes), then every tensor the model needs must be in the weights. transformers would start a missing one at
    random (an index whose weight_map leaves tensors out, a shard without them) and say so only in its load report,
    so a producer would publish the features of a model nobody trained; that report is held back and becomes the
    refusal, or is logged as before when nothing is missing (unexpected keys: harmless)."""
    import logging

    from transformers import AutoModelForCausalLM

    root = Path(path).expanduser()
    check_target_builds(root)
    reports: list[logging.LogRecord] = []
    report_logger = logging.getLogger("transformers.modeling_utils")

    def hold(record: logging.LogRecord) -> bool:
        if "LOAD REPORT" in str(record.msg):
            reports.append(record)
            return False
        return True

    report_logger.addFilter(hold)
    try:
        with building_from(root):
            model, info = AutoModelForCausalLM.from_pretrained(str(root), output_loading_info=True, **kwargs)
    finally:
        report_logger.removeFilter(hold)
    if missing := sorted(info.get("missing_keys") or ()):
        raise TargetConfigError(
            f"target {root}: its weights lack {len(missing)} tensor(s) the model needs ({', '.join(missing[:3])}"
            f"{', ...' if len(missing) > 3 else ''}), which transformers would start at random: copy or download "
            "the weights again (model.safetensors.index.json and every shard it names)"
        )
    for record in reports:
        report_logger.handle(record)
    return model
