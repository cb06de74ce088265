"""A target's config.json, any values: `check-config` and `check-target` either accept it or refuse it in one line,
exit 2; never another exception, whatever layer raised it (issue 34 goal 4: the CLI's error rule).

The values are written into the config.json of a tiny real target (weights saved by transformers, read back by its
loader): wrong types (lists, strings, objects, null, booleans), numbers out of any range (huge, negative, zero, NaN,
+-Infinity and 1e400 written as JSON text), keys removed, a few at once. Both commands run in-process through
cli.main, the same parsing and error path as the command line: one process for every example.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from dflash_ring.cli import main
from support import build_target

# Deterministic in CI: examples derived from the test alone, no example database.
EXAMPLES = dict(
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
MASK = 405  # an unused embedding row of the tiny target (95 is "}", which its template uses)
# JSON text Python's json module does not write from a value: overflow to inf, and the non-standard constants
# transformers' reader (json.load) accepts.
RAW = ("1e400", "-1e400", "NaN", "Infinity", "-Infinity")


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> tuple[Path, str]:
    model = build_target(tmp_path_factory.mktemp("fuzz") / "model", "qwen3", layers=4)
    return model, (model / "config.json").read_text()


def values() -> st.SearchStrategy:
    """A config.json value of any JSON type, or one of RAW (as its text)."""
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.sampled_from([0, 1, -1, 2**31, 2**63]),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=4),
    )
    return st.one_of(
        scalars,
        st.sampled_from(RAW).map(lambda t: ("raw", t)),
        st.lists(scalars, max_size=2),
        st.dictionaries(st.text(max_size=3), scalars, max_size=2),
    )


# The keys a qwen3 target's config.json has that shape the model (the rest: ids, names, flags) and a few it
# has not; each mutation sets one to a value, or removes it (None).
KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "vocab_size",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "rope_parameters",
    "tie_word_embeddings",
    "model_type",
    "architectures",
    "layer_types",
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
    "attention_bias",
    "hidden_act",
    "pad_token_id",
    "dtype",
    "num_layers",
    "text_config",
)
mutations = st.lists(
    st.tuples(st.sampled_from(KEYS), st.one_of(st.just(None), values().map(lambda v: ("set", v)))),
    min_size=1,
    max_size=3,
)


def mutated(base: str, changes: list[tuple[str, object]]) -> str:
    """config.json with `changes` applied; RAW values spliced in as JSON text."""
    config, raw = json.loads(base), {}
    for key, change in changes:
        if change is None:
            config.pop(key, None)
            continue
        value = change[1]
        if isinstance(value, tuple):  # ("raw", text): a placeholder replaced after dumping
            raw[f"@raw{len(raw)}@"] = value[1]
            value = f"@raw{len(raw) - 1}@"
        config[key] = value
    text = json.dumps(config)
    for placeholder, token in raw.items():
        text = text.replace(json.dumps(placeholder), token)
    return text


def one_line_or_ok(command: str, model: Path) -> tuple[int, str]:
    """`dflash-ring <command>` on the target in-process: (exit code, stderr). Anything but SystemExit or a return
    escaping cli.main fails the test with its traceback, as it would end the command."""
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            rc = main(
                [
                    command,
                    "--set",
                    f'target.path="{model}"',
                    "--set",
                    f"target.mask_token_id={MASK}",
                    "--set",
                    'target.device="cpu"',
                    "--set",
                    "metrics.enabled=false",
                ]
            )
        except SystemExit as e:
            rc = e.code
    text = err.getvalue()
    if rc != 0:
        last = text.strip().splitlines()[-1] if text.strip() else ""
        assert rc == 2 and last.startswith(f"dflash-ring {command}: error: ") and "Traceback" not in text, (rc, text)
    return rc, text


@settings(max_examples=150, **EXAMPLES)
@given(changes=mutations)
@example(changes=[("hidden_size", ("set", [64]))])
@example(changes=[("hidden_size", ("set", ("raw", "1e400")))])
@example(changes=[("num_hidden_layers", ("set", ("raw", "NaN")))])
@example(changes=[("num_attention_heads", ("set", 0))])
@example(changes=[("hidden_size", ("set", 65))])
@example(changes=[("model_type", None)])
@example(changes=[("text_config", ("set", True))])
def test_check_config_accepts_or_refuses_any_config_json_in_one_line(target, changes):
    model, base = target
    (model / "config.json").write_text(mutated(base, changes))
    try:
        one_line_or_ok("check-config", model)
    finally:
        (model / "config.json").write_text(base)


@pytest.mark.slow
@settings(max_examples=20, **EXAMPLES)
@given(changes=mutations)
@example(changes=[("hidden_size", ("set", [64]))])
@example(changes=[("num_attention_heads", ("set", 0))])
@example(changes=[("intermediate_size", ("set", -5))])
@example(changes=[("tie_word_embeddings", ("set", True))])
@example(changes=[("text_config", ("set", True))])
def test_check_target_accepts_or_refuses_any_config_json_in_one_line(target, changes):
    """The model loaded for real (weights included), its features probed and its head checked against the stored
    tensors' values (what check-config, reading headers only, cannot see: a tie_word_embeddings flag the weights
    contradict)."""
    model, base = target
    (model / "config.json").write_text(mutated(base, changes))
    try:
        one_line_or_ok("check-target", model)
    finally:
        (model / "config.json").write_text(base)


def test_the_fuzzed_target_is_accepted_unchanged_and_the_listed_values_refused(target):
    """The rule can fail: the unchanged target passes both checks, and each value issue 34 lists is refused."""
    model, base = target
    assert one_line_or_ok("check-config", model)[0] == 0
    for key, raw in (
        ("hidden_size", "[64]"),
        ("hidden_size", "1e400"),
        ("num_hidden_layers", "NaN"),
        ("num_attention_heads", "0"),
        ("hidden_size", "65"),
    ):
        (model / "config.json").write_text(mutated(base, [(key, ("set", ("raw", raw)))]))
        try:
            rc, text = one_line_or_ok("check-config", model)
        finally:
            (model / "config.json").write_text(base)
        assert rc == 2 and str(model) in text.strip().splitlines()[-1], (key, raw, text)
