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
