"""A target directory's files besides config.json, damaged any way: what reads them either takes them or refuses
them in one line (a Refusal: cli.main prints it, exit 2), never another exception (issue 34 goal 4: the CLI's
error rule; config.json itself: test_target_config_fuzz.py).

The tokenizer files (tokenizer.json, tokenizer_config.json, chat_template.jinja) of a tiny real target are cut
short, overwritten with bytes, other JSON values or fields of the wrong type, and read back the way every command
does (producer/pretokenized.target_tokenizer, then the ChatEncoder a producer tokenizes with).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from dflash_ring.common.chat_encoding import BadRow, ChatEncoder
from dflash_ring.common.config.target import TargetConfig
from dflash_ring.common.refusal import Refusal
from dflash_ring.producer.pretokenized import target_tokenizer
from dflash_ring.embedded.tiny_tokenizer import tiny_chat_tokenizer

EXAMPLES = dict(
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
ROW = {"messages": [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello world"}]}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tok") / "tok"
    tiny_chat_tokenizer(d)
    return d


def _copy(base: Path, root: Path) -> Path:
    d = root / "copy"
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(base, d)
    return d


def loads_or_refuses(d: Path) -> str:
    """'ok' when the tokenizer loads and encodes a row or skips it as a bad row (a data set of only such rows is
    its own one-line refusal: test_producer_data), else the Refusal's message; any other exception fails."""
    encoder = None
    try:
        encoder = ChatEncoder(target_tokenizer(TargetConfig(tokenizer=str(d))), max_length=64, enable_thinking=False)
        encoder.encode(ROW)
    except BadRow:
        assert encoder is not None
    except Refusal as e:
        return str(e)
    return "ok"


json_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.text(max_size=4),
    st.lists(st.one_of(st.integers(), st.text(max_size=3)), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
damage = st.one_of(
    st.tuples(st.just("cut"), st.sampled_from(FILES), st.floats(0, 0.999)),
    st.tuples(st.just("bytes"), st.sampled_from(FILES), st.binary(max_size=16)),
    st.tuples(st.just("value"), st.sampled_from(FILES[:2]), json_values),
    st.tuples(
        st.just("field"),
        st.just("tokenizer_config.json"),
        st.tuples(st.sampled_from(["eos_token", "pad_token", "chat_template", "model_max_length"]), json_values),
    ),
    st.tuples(st.just("remove"), st.sampled_from(FILES), st.none()),
)


def damaged(d: Path, how: str, name: str, arg) -> None:
    f = d / name
    if how == "cut":
        raw = f.read_bytes()
        f.write_bytes(raw[: int(len(raw) * arg)])
    elif how == "bytes":
        f.write_bytes(arg)
    elif how == "value":
        f.write_text(json.dumps(arg))
    elif how == "field":
        key, value = arg
        body = json.loads(f.read_text())
        body[key] = value
        f.write_text(json.dumps(body))
        if key == "chat_template":
            (d / "chat_template.jinja").unlink()  # else the file's template wins over the field
    else:
        f.unlink()


@settings(max_examples=120, **EXAMPLES)
@given(change=damage)
@example(change=("bytes", "tokenizer.json", b"not json"))
@example(change=("cut", "tokenizer.json", 0.5))
@example(change=("value", "tokenizer.json", []))
@example(change=("bytes", "tokenizer.json", b"\xff\xfe{}"))
@example(change=("remove", "tokenizer.json", None))
@example(change=("bytes", "tokenizer_config.json", b"{oops"))
@example(change=("value", "tokenizer_config.json", [1]))
@example(change=("field", "tokenizer_config.json", ("eos_token", 5)))
@example(change=("field", "tokenizer_config.json", ("chat_template", 5)))
@example(change=("field", "tokenizer_config.json", ("model_max_length", "")))
@example(change=("bytes", "chat_template.jinja", b"\xff\xfe"))
@example(change=("bytes", "chat_template.jinja", b"{% for %}"))
@example(change=("bytes", "chat_template.jinja", b"{{ raise_exception('no') }}"))
def test_damaged_tokenizer_files_load_or_are_refused_in_one_line(tokenizer_dir, tmp_path, change):
    d = _copy(tokenizer_dir, tmp_path)
    damaged(d, *change)
    said = loads_or_refuses(d)
    assert said == "ok" or str(d) in said, said


def test_the_listed_tokenizer_damage_is_refused_naming_the_directory(tokenizer_dir, tmp_path):
    cases = [
        (("bytes", "tokenizer.json", b"not json"), "JSONDecodeError"),
        (("cut", "tokenizer.json", 0.5), "transformers cannot load it"),
        (("value", "tokenizer_config.json", [1]), "transformers cannot load it"),
        (("field", "tokenizer_config.json", ("eos_token", 5)), "eos_token"),
        (("field", "tokenizer_config.json", ("model_max_length", "")), "transformers cannot load it"),
        (("field", "tokenizer_config.json", ("chat_template", 5)), "not the text of a Jinja template (it is a int)"),
        (("bytes", "chat_template.jinja", b"{% for %}"), "cannot render a minimal user/assistant chat"),
    ]
    for change, says in cases:
        d = _copy(tokenizer_dir, tmp_path)
        damaged(d, *change)
        said = loads_or_refuses(d)
        assert says in said and str(d) in said, (change, said)


def test_a_named_template_set_renders_its_default(tokenizer_dir, tmp_path):
    """tokenizer_config.json may hold a list of named templates (transformers reads it as a dict): the producer
    renders the one apply_chat_template renders, "default"; a set without one is refused."""
    d = _copy(tokenizer_dir, tmp_path)
    template = (d / "chat_template.jinja").read_text()
    damaged(d, "field", "tokenizer_config.json", ("chat_template", [{"name": "default", "template": template}]))
    assert loads_or_refuses(d) == "ok"
    d = _copy(tokenizer_dir, tmp_path)
    damaged(d, "field", "tokenizer_config.json", ("chat_template", [{"name": "tool_use", "template": template}]))
    assert "multiple chat templates with no default" in loads_or_refuses(d)


# --- the weights: model.safetensors, its index, generation_config.json ----------------------------------------


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    from support import build_target

    return build_target(tmp_path_factory.mktemp("target") / "model", "qwen3", layers=4)


def _header(f: Path) -> tuple[dict, bytes]:
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write_header(f: Path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    f.write_bytes(len(text).to_bytes(8, "little") + text + data)


def _shard(d: Path, keep: int | None = None, value=None) -> None:
    """model.safetensors split in two shards with an index; `keep` tensors only in its weight_map, or every entry
    of the map set to `value`."""
    from safetensors.torch import load_file, save_file

    state = load_file(d / "model.safetensors")
    (d / "model.safetensors").unlink()
    names = sorted(state)
    half = len(names) // 2
    for i, part in enumerate((names[:half], names[half:])):
        save_file({k: state[k] for k in part}, d / f"s{i}.safetensors", metadata={"format": "pt"})
    weight_map = {k: f"s{int(i >= half)}.safetensors" for i, k in enumerate(names)}
    if keep is not None:
        weight_map = dict(list(weight_map.items())[:keep])
    if value is not None:
        weight_map = {k: value for k in weight_map}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _retyped(dtype: str):
    def change(d: Path) -> None:
        import torch
        from safetensors.torch import load_file, save_file

        state = load_file(d / "model.safetensors")
        save_file({k: v.to(getattr(torch, dtype)) for k, v in state.items()}, d / "model.safetensors")

    return change


def _header_field(field: str, value) -> object:
    def change(d: Path) -> None:
        header, data = _header(d / "model.safetensors")
        name = sorted(k for k in header if k != "__metadata__")[0]
        if field == "__metadata__":
            header[field] = value
        elif field == "overlap":
            header[sorted(k for k in header if k != "__metadata__")[1]]["data_offsets"] = header[name]["data_offsets"]
        else:
            header[name][field] = value
        _write_header(d / "model.safetensors", header, data)

    return change


def _drop_a_tensor(d: Path) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(d / "model.safetensors")
    del state[next(k for k in sorted(state) if "layers.0.input_layernorm" in k)]
    save_file(state, d / "model.safetensors", metadata={"format": "pt"})


# (change to the target directory, what the one line says, whether check-config sees it too: it reads headers only,
# and sees a missing tensor where the checkpoint's names are the model's own; the producer's load sees every one)
WEIGHT_DAMAGE = {
    "index-maps-to-numbers": (lambda d: _shard(d, value=1), "maps tensors to 1, not the file name of a shard", True),
    "index-maps-outside": (
        lambda d: _shard(d, value="../model.safetensors"),
        "maps tensors to '../model.safetensors'",
        True,
    ),
    "index-maps-nothing": (lambda d: _shard(d, keep=0), "maps no tensor to a shard", True),
    "index-leaves-tensors-out": (lambda d: _shard(d, keep=3), "its weights lack", True),
    "a-tensor-missing": (_drop_a_tensor, "lack 1 tensor(s) the model needs (model.layers.0.input_layernorm", True),
    "int8-weights": (_retyped("int8"), "as I8, not a floating type", True),
    "float8-weights": (_retyped("float8_e4m3fn"), "as F8_E4M3, not a floating type", True),
    "header-unknown-dtype": (_header_field("dtype", "Q9"), "no valid data_offsets, shape and dtype", True),
    "header-shape-lies": (_header_field("shape", [3, 3]), "does not take", True),
    "header-metadata-a-list": (_header_field("__metadata__", [1]), "__metadata__ is not an object of strings", True),
    "header-overlapping-tensors": (_header_field("overlap", None), "where the one before it ends", True),
    "generation-config-not-json": (
        lambda d: (d / "generation_config.json").write_text("{bad"),
        "generation_config.json is not valid JSON",
        True,
    ),
    "generation-config-a-list": (
        lambda d: (d / "generation_config.json").write_text("[1]"),
        "generation_config.json is not a JSON object",
        True,
    ),
    "generation-config-eos-a-string": (
        lambda d: (d / "generation_config.json").write_text('{"eos_token_id": "x"}'),
        'eos_token_id = "x" is not a token id',
        True,
    ),
}


@pytest.mark.parametrize("case", list(WEIGHT_DAMAGE))
def test_damaged_target_weights_are_refused_in_one_line(target_dir, tmp_path, case):
    """Every damage is refused by the producer's load (load_causal_lm, as `target`, `check-target`, `regenerate` and
    `eval` load a target), naming the directory or file; check-config (headers only) refuses the ones it can see.
    Before, some were tracebacks (an index mapping to a number), and int8/float8 weights or tensors left out of the
    weights loaded in silence: cast integers, or tensors started at random."""
    import torch

    from dflash_ring.common.target_loading import check_target_builds
    from dflash_ring.producer.target import load_causal_lm

    change, says, check_config = WEIGHT_DAMAGE[case]
    d = _copy(target_dir, tmp_path)
    change(d)
    with pytest.raises(Refusal) as e:
        load_causal_lm(TargetConfig(path=str(d), dtype="float32"), torch.device("cpu"))
    assert says in str(e.value) and str(d) in str(e.value), str(e.value)
    if check_config:
        with pytest.raises(Refusal) as e:
            check_target_builds(d)
        assert says in str(e.value), str(e.value)


def test_float16_weights_and_the_undamaged_target_load(target_dir, tmp_path):
    import torch

    from dflash_ring.common.target_loading import check_target_builds
    from dflash_ring.producer.target import load_causal_lm

    d = _copy(target_dir, tmp_path)
    _retyped("float16")(d)
    for root in (target_dir, d):
        check_target_builds(root)
        load_causal_lm(TargetConfig(path=str(root), dtype="float32"), torch.device("cpu"))


header_values = st.one_of(
    json_values,
    st.lists(st.integers(-2, 2**20), max_size=3),
    st.sampled_from(["F32", "F16", "BF16", "I8", "BOOL", "F4", "Q9", ""]),
)


@settings(max_examples=150, **EXAMPLES)
@given(
    tensor=st.integers(0, 10),
    field=st.sampled_from(["dtype", "shape", "data_offsets", None]),
    value=header_values,
    metadata=st.one_of(st.none(), json_values),
)
@example(tensor=0, field="data_offsets", value=[0, 0], metadata=None)
@example(tensor=1, field="shape", value=[1], metadata=None)
@example(tensor=0, field="dtype", value="I8", metadata=None)
def test_a_header_the_check_passes_is_one_safetensors_reads(target_dir, tmp_path, tensor, field, value, metadata):
    """The header check is the format's rule: whatever header passes it, safetensors itself opens the file and
    reads every tensor; whatever it cannot read, the check refuses first (DamagedWeightsError, one line)."""
    from safetensors import SafetensorError, safe_open

    from dflash_ring.common.safetensors_check import DamagedWeightsError, check_safetensors_file

    f = tmp_path / "model.safetensors"
    header, data = _header(target_dir / "model.safetensors")
    names = sorted(k for k in header if k != "__metadata__")
    if field is not None:
        header[names[tensor % len(names)]][field] = value
    if metadata is not None:
        header["__metadata__"] = metadata
    _write_header(f, header, data)
    try:
        check_safetensors_file(f)
    except DamagedWeightsError:
        return
    try:
        with safe_open(str(f), "pt") as st_file:
            for name in st_file.keys():
                st_file.get_tensor(name)
    except SafetensorError as e:
        pytest.fail(f"the check passed a header safetensors refuses: {e}")


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn", "bool"])
def test_the_drafter_s_head_refuses_weights_it_would_use_as_is(target_dir, tmp_path, dtype):
    """The drafter reads the target's embedding and lm_head straight from the safetensors (no transformers load):
    stored as integers or FP8, they were cast and trained against in silence."""
    from dflash_ring.consumer.modeling.head_loader import probe_target_head

    d = _copy(target_dir, tmp_path)
    _retyped(dtype)(d)
    with pytest.raises(Refusal, match="not float16, bfloat16 or float32"):
        probe_target_head(d)


def test_a_tied_target_stores_no_lm_head_and_passes(tmp_path):
    """check-config's completeness rule counts a tied lm_head as stored with the embedding it shares."""
    from safetensors import safe_open

    from dflash_ring.common.target_loading import check_target_builds
    from support import save_tiny_qwen3

    save_tiny_qwen3(tmp_path / "tied", tie_word_embeddings=True)
    with safe_open(str(tmp_path / "tied" / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()
    check_target_builds(tmp_path / "tied")
