"""Which target model a producer runs, and which of its layers feed the drafter.

This module stays import-light (json, no torch): every process of a run reads it while
loading its config, because the target's geometry is part of the ring's config fingerprint.
A drafter built for another hidden size, layer count, vocabulary or layer selection is
refused when it attaches, instead of training on features it misreads.

The geometry is read from config.json directly when it names hidden_size, num_hidden_layers and
vocab_size (most families), and otherwise through the family's transformers config class (nemotron_h
derives its layer count from its layer pattern, longcat_flash from num_layers): a key name is never a
reason to refuse a model. Which way is taken depends only on the file, so every role of a run reads the
same geometry; only such configs make a role import transformers (and torch) to read it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from dflash_ring.common.config.paths import OutputDirectory, home_path, ReadPath
from dflash_ring.common.refusal import Refusal
from dflash_ring.common.config.drafter import build_target_layer_ids, target_text_config
from dflash_ring.common.config.ranges import Range

TargetDtype = Literal["auto", "float32", "bfloat16"]
AttnImplementation = Literal["auto", "sdpa", "eager", "flash_attention_2", "flash_attention_3"]
Packing = Literal["auto", "packed", "padded"]


# What config.json names the target's width, decoder layer count and vocabulary, in most families.
GEOMETRY_KEYS = ("hidden_size", "num_hidden_layers", "vocab_size")


class TargetConfigError(Refusal, ValueError):
    """The target settings (or the model they point at) cannot be used; the message says what to fix."""


@dataclass(frozen=True)
class TargetGeometry:
    """What a drafter must agree on with the producers: the shape of every feature row."""

    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    layer_ids: tuple[int, ...]
    mask_token_id: int | None
    ship_final_hidden: bool

    @property
    def feature_width(self) -> int:
        return len(self.layer_ids) * self.hidden_size

    def fingerprint_fields(self) -> dict[str, Any]:
        return {
            "target.hidden_size": self.hidden_size,
            "target.num_hidden_layers": self.num_hidden_layers,
            "target.vocab_size": self.vocab_size,
            "target.layer_ids": list(self.layer_ids),
            "target.mask_token_id": self.mask_token_id,
            "target.ship_final_hidden": self.ship_final_hidden,
        }


@dataclass(frozen=True)
class TargetConfig:
    # A local Hugging Face model directory (config.json + weights); nothing is downloaded.
    path: ReadPath = ""
    # Tokenizer directory; empty means the model directory.
    tokenizer: str = ""
    # Decoder layers whose outputs become features (0-based; HF hidden_states[l + 1]).
    # None: the DFlash rule for num_draft_layers (evenly over 1..L-3, or [L // 2] for one layer).
    layer_ids: list[int] | None = None
    # The DFlash rule picks this many layers (a list of them is built): at most 256, as drafter.num_hidden_layers.
    num_draft_layers: Annotated[int, Range(1, 256)] = 1
    # "auto": bfloat16 on a GPU, float32 on the CPU (where bf16 matmuls are slow and inexact).
    dtype: TargetDtype = "auto"
    # "auto": cuda if available, else cpu; `dflash-ring target --device cuda:N` overrides it.
    device: str = "auto"
    # Also ship the final normed hidden state [tokens, hidden], for a KL loss or target-argmax labels through the
    # frozen LM head. None: shipped exactly when the run's drafter objective needs it (common/config/schema.py).
    ship_final_hidden: bool | None = None
    # The drafter's <|MASK|> row; must be a row of the target embedding. Only checked and fingerprinted here.
    mask_token_id: int | None = None
    # The model's own attention: padded batches and the conformance probe's reference run it; packed batches
    # keep its semantics (producer/packing.py). "auto": HF's choice (sdpa where the model supports it, else eager).
    attn_implementation: AttnImplementation = "auto"
    # "packed": sequences concatenated without padding, refused at start unless the conformance probe shows
    # features equal to each sequence's own forward; "auto": packed when the probe passes, padded (with a
    # warning naming the first layer that differs) otherwise; "padded": no probe, padded batches.
    packing: Packing = "auto"
    # Ranks of one host the target is sharded over with transformers' own tensor-parallel plan (the family's
    # base_model_tp_plan, `tp_plan="auto"`): the producer process leads the group and starts the other ranks
    # (producer/tensor_group.py), on GPUs device .. device + N - 1 (NCCL) or on the CPU (gloo). 1: no group.
    tensor_parallel: Annotated[int, Range(1, 64)] = 1
    # torch.compile each decoder layer on a GPU for packed batches (fuses norms, RoPE, SiLU and residual adds
    # around the matmuls; the first batches compile, later starts load from run.compile_cache_dir).
    compile: bool = True
    # Cursor files (<state_dir>/<run>/producer-<i>.json): where to resume when the ring is gone.
    state_dir: OutputDirectory = field(default_factory=lambda: home_path("~/.cache/dflash_ring/state"))

    def __post_init__(self) -> None:
        if self.layer_ids is not None and (not self.layer_ids or len(set(self.layer_ids)) != len(self.layer_ids)):
            raise TargetConfigError(f"target.layer_ids = {self.layer_ids}: need distinct non-negative layer ids")

    def model_config(self) -> dict[str, Any]:
        """The language-model part of the target's config.json (read as JSON: no weights, no torch)."""
        if not self.path:
            raise TargetConfigError("target.path is empty: set it to a local Hugging Face model directory")
        file = Path(self.path).expanduser() / "config.json"
        try:
            config = json.loads(file.read_text())
        except FileNotFoundError:
            raise TargetConfigError(
                f"target.path: {file} does not exist (a local HF model directory is needed)"
            ) from None
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

    def geometry(self) -> TargetGeometry:
        hidden, layers, vocab = plain_geometry(self.model_config()) or _geometry_from_config_class(self.path)
        ids = tuple(self.resolved_layer_ids(layers))
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < vocab:
            raise TargetConfigError(
                f"target.mask_token_id = {self.mask_token_id} is not a row of the {vocab}-row target embedding"
            )
        return TargetGeometry(hidden, layers, vocab, ids, self.mask_token_id, bool(self.ship_final_hidden))

    def resolved_layer_ids(self, num_hidden_layers: int) -> list[int]:
        ids = (
            list(self.layer_ids)
            if self.layer_ids is not None
            else build_target_layer_ids(num_hidden_layers, self.num_draft_layers)
        )
        # HF's hidden_states[L] is the final *normed* state, not layer L-1's output, so id L-1 would
        # mean two different things; the final state has its own switch (ship_final_hidden).
        if max(ids) > num_hidden_layers - 2:
            raise TargetConfigError(
                f"target layer ids {ids} must lie in 0..{num_hidden_layers - 2} for a {num_hidden_layers}-layer "
                f"target (use target.ship_final_hidden for the final normed state)"
            )
        return ids


# What a tensor-parallel plan splits N ways: attention heads (column-wise q, k, v) and the MLP's inner width
# (column-wise gate/up, row-wise down). A count N does not divide would split inside a head or leave ranks
# unequal shards, so it is refused before any rank starts.
SHARDED_COUNTS = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "moe_intermediate_size")


def tensor_parallel_refusal(cfg: TargetConfig) -> str | None:
    """Why target.tensor_parallel cannot shard this target (None: it can): a count the ranks do not divide (from
    config.json, no torch), or a family whose transformers config has no tensor-parallel plan (its config class:
    the one place this needs transformers). One line, naming the families that have a plan."""
    n = cfg.tensor_parallel
    if n == 1:
        return None
    config = cfg.model_config()
    for key in SHARDED_COUNTS:
        value = config.get(key)
        if type(value) is int and value % n:  # noqa: E721 (a bool is no count)
            return (
                f"target.tensor_parallel = {n} does not divide the target's {key} = {value}: use a divisor "
                f"of it (the ranks shard it evenly)"
            )
    text = load_target_hf_config(cfg.path).get_text_config()
    if not getattr(text, "base_model_tp_plan", None):
        return (
            f"target.tensor_parallel = {n} refused: transformers has no tensor-parallel plan for "
            f"{text.model_type!r} (set target.tensor_parallel = 1); families with one: "
            f"{', '.join(tensor_parallel_families())}"
        )
    return None


def tensor_parallel_families() -> list[str]:
    """The model types whose installed transformers config carries a tensor-parallel plan (base_model_tp_plan)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return sorted(
        name for name, config_class in CONFIG_MAPPING.items() if getattr(config_class, "base_model_tp_plan", None)
    )


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


def load_target_hf_config(path: str | Path) -> Any:
    """The target's transformers config (PretrainedConfig) from its local directory: the one place the project
    has transformers read a target's config.json, so every command that loads a target refuses a config.json
    transformers will not take (a field of the wrong type: "hidden_size": [64], 1e400, NaN; an unknown
    model_type; a file that is not JSON) in one line naming the file and the field, as TargetConfigError."""
    from transformers import AutoConfig  # the installed config classes only, never modeling code

    file = Path(path).expanduser() / "config.json"
    if not file.is_file():  # else transformers takes the path for a hub repo id and says so
        raise TargetConfigError(f"target {Path(path).expanduser()}: no config.json there (a local HF model directory)")
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


def load_target_tokenizer(path: str | Path) -> Any:
    """The target's tokenizer (and chat template) from its local directory (target.tokenizer, else target.path):
    the one place the project has transformers read a tokenizer, so every command refuses tokenizer files
    transformers will not take (tokenizer.json or tokenizer_config.json not JSON, truncated, not UTF-8, of the
    wrong shape; a special token or setting of the wrong type, caught by encoding a probe text; no tokenizer file
    at all) in one line naming the directory,
    as TargetConfigError, like load_target_hf_config does for config.json. The chat template's type is checked
    here too: what renders it expects text."""
    from transformers import AutoTokenizer

    root = Path(path).expanduser()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(root), local_files_only=True)
        tokenizer("a probe", add_special_tokens=False)  # settings that load yet break encoding (model_max_length)
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001 (the reading phase's rule, as load_target_hf_config's)
        why = " ".join(str(e).split())[:500] or "no message"
        raise TargetConfigError(
            f"target tokenizer {root}: transformers cannot load it ({type(e).__name__}: {why}); fix or replace its "
            "tokenizer files (tokenizer.json, tokenizer_config.json, chat_template.jinja) or point "
            "target.tokenizer at another"
        ) from None
    if tokenizer.chat_template:  # none at all: ChatEncoder says what to do
        try:  # the template apply_chat_template renders: a named set's "default"
            template = tokenizer.get_chat_template()
        except ValueError as e:
            template = e
        if not isinstance(template, str):
            what = template if isinstance(template, ValueError) else f"it is a {type(template).__name__}"
            raise TargetConfigError(
                f"target tokenizer {root}: its chat_template is not the text of a Jinja template ({what}); fix "
                "chat_template in tokenizer_config.json (or write chat_template.jinja)"
            )
    return tokenizer


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


def check_token_ids(max_id: int, vocab_size: int, tokenizer: str | Path, model: str | Path, where: str) -> None:
    """Refuse token ids the target has no embedding row for: a tokenizer that is not the model's (target.tokenizer
    set to another, tokenizer files copied from another model) gives ids past config.json's vocab_size, which the
    model's embedding indexes out of range (a traceback on the CPU, a device-side assert on a GPU)."""
    if max_id >= vocab_size:
        raise TargetConfigError(
            f"{where} holds token id {max_id}, past the {vocab_size} embedding rows of the target {model} "
            f"(config.json vocab_size): the tokenizer {tokenizer} is not this model's; use the model's own"
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
