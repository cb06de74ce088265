"""Every config setting, any value: the config check accepts it within its declared range, or refuses it in one line
that names the key (exit 2); never a traceback, never a hang (issue 23 items 4 and 5).

The settings are discovered from the dataclasses (every field of every section of Config, and of a [[data.sources]]
entry), so a new field is covered as it is added. Each value is written into a TOML file and checked with
`dflash-ring check-config`: in-process through cli.main (the same parsing, loading and error path as the command,
a few examples per field), and as a real subprocess with a timeout for a smaller sample across all fields.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from dflash_ring.cli import main
from dflash_ring.common.config.dump import _toml_value
from dflash_ring.common.config.load import load_config
from dflash_ring.common.config.schema import Config
from dflash_ring.common.config.ranges import DEFAULT, INT64_MAX, Range, range_of

PREFIX = "dflash-ring check-config: error: "
# Deterministic in CI: examples derived from the test alone, no example database.
EXAMPLES = dict(
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
SOURCE = "data.sources[0]"  # a [[data.sources]] entry's fields are set in an entry that has a path


@dataclasses.dataclass(frozen=True)
class Setting:
    """One config key: where it goes in the file and the type it is declared with (Annotated extras kept)."""

    section: str  # "train", or "data.sources[0]" for a field of a [[data.sources]] entry
    key: str
    hint: typing.Any

    @property
    def name(self) -> str:
        return f"{self.section}.{self.key}"


def _settings() -> list[Setting]:
    found = []
    for section in dataclasses.fields(Config):
        cls = typing.get_type_hints(Config)[section.name]
        hints = typing.get_type_hints(cls, include_extras=True)
        for f in dataclasses.fields(cls):
            found.append(Setting(section.name, f.name, hints[f.name]))
            item = _table_list_item(hints[f.name])
            if item is not None:
                item_hints = typing.get_type_hints(item, include_extras=True)
                found += [
                    Setting(f"{section.name}.{f.name}[0]", g.name, item_hints[g.name]) for g in dataclasses.fields(item)
                ]
    return found


def _table_list_item(hint: typing.Any) -> type | None:
    """The dataclass of a list-of-tables field (data.sources: DataSource), else None."""
    if typing.get_origin(hint) is list and dataclasses.is_dataclass(arg := typing.get_args(hint)[0]):
        return arg
    return None


SETTINGS = _settings()


# --- values: of the declared type and of every other, at and past the edges of the declared range ---------------


def _strip(hint: typing.Any) -> tuple[typing.Any, Range | None]:
    """The plain type of a hint without None and Annotated, and the Range declared on it."""
    bound = None
    while True:
        origin = typing.get_origin(hint)
        if origin is typing.Annotated:
            hint, *extras = typing.get_args(hint)
            bound = range_of(tuple(extras)) or bound
        elif origin in (typing.Union, __import__("types").UnionType):
            hint = next(a for a in typing.get_args(hint) if a is not type(None))
        else:
            return hint, bound


TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)  # any text UTF-8 can carry
SCALARS = st.one_of(
    st.booleans(),
    TEXT,
    st.just(""),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 1e308]),
    st.integers(-(2**70), 2**70),
    st.sampled_from([-1, 0, 1, INT64_MAX, INT64_MAX + 1, 10**12, -(2**63) - 1]),
)
ANY = st.one_of(
    SCALARS, st.lists(SCALARS, max_size=3), st.dictionaries(st.sampled_from(["a", "path"]), SCALARS, max_size=2)
)


def _numbers(kind: type, bound: Range) -> st.SearchStrategy:
    """Numbers of `kind` around every edge of `bound` (and the odd ones: nan, inf, huge)."""
    edges = [e for e in (bound.low, bound.high) if e is not None] + [0]
    if kind is int:
        near = st.sampled_from(edges).flatmap(lambda e: st.integers(int(e) - 2, int(e) + 2))
        return st.one_of(near, st.integers(-(2**64), 2**64), st.integers(-5, 20))
    near = st.sampled_from(edges).flatmap(
        lambda e: st.sampled_from([e, math.nextafter(e, math.inf), math.nextafter(e, -math.inf), e + 0.5])
    )
    return st.one_of(near, st.floats(allow_nan=True, allow_infinity=True), st.integers(-3, 3))


def _of_type(hint: typing.Any) -> st.SearchStrategy:
    """Values of the declared type (TOML has no None: an optional field gets its other type)."""
    kind, bound = _strip(hint)
    if typing.get_origin(kind) is typing.Literal:
        return st.one_of(st.sampled_from(typing.get_args(kind)), TEXT)
    if kind in (int, float):
        return _numbers(kind, bound or DEFAULT)
    if kind is bool:
        return st.booleans()
    if kind is str:
        return TEXT
    if typing.get_origin(kind) is list:
        item = typing.get_args(kind)[0]
        if dataclasses.is_dataclass(item):
            return st.lists(st.fixed_dictionaries({"path": st.sampled_from(["a.jsonl", ""])}), max_size=2)
        return st.lists(_of_type(item), max_size=3)
    raise AssertionError(f"no value strategy for {kind!r}: extend _of_type for the new field type")


def _values(setting: Setting) -> st.SearchStrategy:
    return st.one_of(_of_type(setting.hint), ANY)


# --- writing a value and checking the outcome ----------------------------------------------------------------------


def _toml(v: typing.Any) -> str:
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    return _toml_value(v, "test")


def _config_text(setting: Setting, value: typing.Any) -> str:
    if setting.section == SOURCE:
        entry = {"path": "a.jsonl"} | {setting.key: value}
        return "[[data.sources]]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in entry.items())
    return f"[{setting.section}]\n{setting.key} = {_toml(value)}\n"


def check_config_in_process(path: Path) -> tuple[int, str]:
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = main(["check-config", "--config", str(path)])
    return code, err.getvalue()


def check_config_subprocess(path: Path) -> tuple[int, str]:
    out = subprocess.run(
        [sys.executable, "-m", "dflash_ring", "check-config", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )  # a hang fails here, not the run
    return out.returncode, out.stderr


def _out_of_range(obj: typing.Any, where: str) -> list[str]:
    """Every number of a loaded config (or table) outside its field's declared range, by key."""
    bad = []
    hints = typing.get_type_hints(type(obj), include_extras=True)
    for f in dataclasses.fields(obj):
        bad += _value_out_of_range(getattr(obj, f.name), hints[f.name], f"{where}{f.name}")
    return bad


def _value_out_of_range(value: typing.Any, hint: typing.Any, name: str) -> list[str]:
    kind, bound = _strip(hint)
    if dataclasses.is_dataclass(value):
        return _out_of_range(value, f"{name}.")
    if isinstance(value, list):
        item = typing.get_args(kind)[0] if typing.get_args(kind) else typing.Any
        return [b for i, v in enumerate(value) for b in _value_out_of_range(v, item, f"{name}[{i}]")]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [] if (bound or DEFAULT).allows(value) else [f"{name} = {value!r}"]
    return []


def assert_outcome(setting: Setting, path: Path, code: int, stderr: str) -> None:
    """Accepted and every number in range, or exit 2 with one line naming the key; a traceback is neither."""
    assert "Traceback" not in stderr, stderr
    if code == 0:
        cfg = load_config(path)
        assert not (bad := _out_of_range(cfg, "")), f"{path.read_text()!r} accepted with {bad}"
        return
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(PREFIX), (code, stderr)
    section = setting.section.split("[")[0].split(".")[0]
    assert section in lines[0] and setting.key in lines[0], (
        f"{path.read_text()!r}: the error names neither {setting.name!r}: {lines[0]}"
    )


@pytest.mark.parametrize("setting", SETTINGS, ids=[s.name for s in SETTINGS])
def test_any_value_of_any_setting_is_accepted_in_range_or_refused_by_name(setting, tmp_path):
    path = tmp_path / "c.toml"

    @settings(max_examples=12, **EXAMPLES)
    @given(value=_values(setting))
    def check(value):
        path.write_text(_config_text(setting, value))
        assert_outcome(setting, path, *check_config_in_process(path))

    check()


@pytest.mark.processes
@settings(max_examples=40, **EXAMPLES)
@given(data=st.data())
def test_the_real_command_accepts_or_refuses_in_one_line(data, tmp_path):
    setting = data.draw(st.sampled_from(SETTINGS), label="setting")
    path = tmp_path / "c.toml"
    path.write_text(_config_text(setting, data.draw(_values(setting), label="value")))
    assert_outcome(setting, path, *check_config_subprocess(path))


def test_every_number_has_a_range_and_every_duration_an_upper_bound():
    """The rule covers every numeric field (DEFAULT where none is declared); a field in seconds also declares an
    upper bound, since sleeps and timeouts overflow past ~1e9 s (a traceback, later) rather than wait."""
    numeric = [s for s in SETTINGS if _strip(s.hint)[0] in (int, float)]
    assert len(numeric) > 40
    unbounded = [s.name for s in numeric if s.key.endswith("_s") and (_strip(s.hint)[1] or DEFAULT).high is None]
    assert not unbounded, f"durations without an upper bound: {unbounded}"
    defaults = Config()
    assert not _out_of_range(defaults, ""), "a default lies outside its own declared range"
