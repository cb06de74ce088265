"""dump_toml is the one writer of run configs: what it writes, load_config reads back equal."""

from __future__ import annotations

import dataclasses
import os
import tomllib
import typing
from pathlib import Path

import pytest

from dflash_ring.common.config.dump import _toml_value, dump_toml
from dflash_ring.common.config.load import load_config
from dflash_ring.common.config.paths import path_setting

from support import build_target, load_tokenizer
from dflash_ring.common.config.schema import Config, ConfigError


def _changed(value: typing.Any, hint: typing.Any) -> typing.Any:
    """A value of the field's type that differs from its default (strings that need escaping)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if args and typing.get_origin(hint) not in (list, typing.Literal):  # X | None: a value of X
        hint = args[0]
        args = list(typing.get_args(hint))
    if typing.get_origin(hint) is typing.Literal:
        return next(a for a in args if a != value)
    if hint is bool:
        return not value
    if hint is int:
        return (value or 0) + 1_234_567
    if hint is float:
        return 0.1 + (value or 0) / 3
    if hint is str:
        return 'a "b" \\c\td\né\x7f'
    (item,) = typing.get_args(hint)
    if dataclasses.is_dataclass(item):  # a list of tables ([[data.sources]]): every field of each changed
        hints = typing.get_type_hints(item)
        return [
            item(
                **{f.name: _changed(getattr(item(path=path), f.name), hints[f.name]) for f in dataclasses.fields(item)}
                | {"path": path}
            )
            for path in ("a.jsonl", "b/c d.jsonl")
        ]
    if typing.get_origin(item) is typing.Literal:  # a list of choices (tracking.backends): two of them
        return list(typing.get_args(item))[:2]
    return [item(1), item(2)] if item is not str else ["x", 'y"']


def test_every_field_round_trips_through_toml():
    cfg, expected = Config(), {}
    for section in dataclasses.fields(Config):
        value = getattr(cfg, section.name)
        hints = typing.get_type_hints(type(value))
        for f in dataclasses.fields(value):
            object.__setattr__(value, f.name, _changed(getattr(value, f.name), hints[f.name]))
        expected[section.name] = dataclasses.asdict(value)
    text = dump_toml(cfg, full=True)
    assert tomllib.loads(text) == expected
    assert tomllib.loads(dump_toml(cfg)) == expected  # nothing is a default any more


def test_a_run_config_round_trips_and_writes_only_what_differs(tmp_path):
    cfg = load_config(
        None,
        [
            "run.name=tiny",
            f"run.run_dir={tmp_path / 'locks'}",
            "ring.slots=4",
            "ring.slot_bytes=8388608",
            "topology.consumers=2",
            "target.layer_ids=[1, 2]",
            "target.mask_token_id=642",
            "train.lr=3e-3",
            "data.path=/data/a b.jsonl",
        ],
    )
    text = dump_toml(cfg, header="written by a test\ncopy me", comments={"metrics": "ports", "train.lr": "peak"})
    path = tmp_path / "run.toml"
    path.write_text(text)
    assert load_config(path) == cfg
    assert text.startswith("# written by a test\n# copy me\n")
    assert "[supervisor]" not in text and "[metrics]" not in text  # all defaults: no section
    assert "consumers" not in text  # 2 is the default
    assert "slot_bytes = 8_388_608" in text and "# peak\nlr = 0.003" in text
    full = tmp_path / "full.toml"
    full.write_text(dump_toml(cfg, full=True))
    assert load_config(full) == cfg
    assert "[supervisor]" in full.read_text() and "mask_token_id = 642" in full.read_text()


def test_defaults_write_an_empty_config(tmp_path):
    assert dump_toml(Config()) == "\n"
    (tmp_path / "c.toml").write_text(dump_toml(Config()))
    assert load_config(tmp_path / "c.toml") == Config()


def test_derived_fields_are_left_out(tmp_path):
    """drafter.layer_types follows num_hidden_layers: written, it would contradict an edited layer count."""
    cfg = load_config(None, ["drafter.num_hidden_layers=3"])
    text = dump_toml(cfg)
    assert "layer_types" not in text and "num_hidden_layers = 3" in text
    (tmp_path / "c.toml").write_text(text.replace("= 3", "= 4"))
    assert load_config(tmp_path / "c.toml").drafter.layer_types == ["full_attention"] * 4
    assert "layer_types" in dump_toml(
        load_config(
            None,
            [
                "drafter.num_hidden_layers=2",
                'drafter.layer_types=["sliding_attention", "full_attention"]',
                "drafter.sliding_window=64",
            ],
        )
    )


# --- what load_config refuses of the file itself and of every string setting, in one ConfigError ---------------


def _string_settings() -> list[tuple[str, str, bool]]:
    """(section, key, a list of strings?) of every string field (or list of strings) of every section, and of a
    [[data.sources]] entry ("data.sources")."""
    found = []
    for section in dataclasses.fields(Config):
        cls = typing.get_type_hints(Config)[section.name]
        for f in dataclasses.fields(cls):
            hint = typing.get_type_hints(cls)[f.name]
            if str in (hint, *typing.get_args(hint)) or _is_string_list(hint):
                found.append((section.name, f.name, _is_string_list(hint)))
            if typing.get_origin(hint) is list and dataclasses.is_dataclass(item := typing.get_args(hint)[0]):
                item_hints = typing.get_type_hints(item)
                found += [(f"{section.name}.{f.name}", g, False) for g, h in item_hints.items() if h is str]
    return found


def _is_string_list(hint: typing.Any) -> bool:
    return any(typing.get_origin(h) is list and typing.get_args(h) == (str,) for h in (hint, *typing.get_args(hint)))


STRING_SETTINGS = _string_settings()


@pytest.mark.parametrize("bad", ["a\x00b", "a\nb", "a\rb", "\x1b[31m", "a\x7f"], ids=["nul", "lf", "cr", "esc", "del"])
@pytest.mark.parametrize("section,key,is_list", STRING_SETTINGS, ids=[f"{s}.{k}" for s, k, _ in STRING_SETTINGS])
def test_a_control_character_in_any_string_setting_is_refused_by_name(tmp_path, section, key, is_list, bad):
    """Every string setting is one line (a path, a name, a host, a URL): a NUL would be a ValueError from the OS
    later, a line break a path no one meant; refused as the file is read, naming the key."""
    value = _toml_value(bad, key)
    if is_list:
        value = f"[{value}]"
    if section == "data.sources":
        text = f'[[data.sources]]\npath = "a.jsonl"\n{key} = {value}\n' if key != "path" else f"[[data.sources]]\n"
        text += f"path = {value}\n" if key == "path" else ""
    else:
        text = f"[{section}]\n{key} = {value}\n"
    (tmp_path / "c.toml").write_text(text)
    with pytest.raises(ConfigError, match=f"{key}.*control character"):
        load_config(tmp_path / "c.toml")
    if section != "data.sources":
        with pytest.raises(ConfigError, match=f"{key}.*control character"):
            load_config(None, [f"{section}.{key}={value}"])


def test_string_settings_are_found():
    found = {(section, key) for section, key, _ in STRING_SETTINGS}
    assert {("run", "name"), ("data.sources", "path"), ("tracking", "dir"), ("regenerate", "base_urls")} <= found


def _fifo(tmp_path):
    os.mkfifo(tmp_path / "c.toml")
    return tmp_path / "c.toml"


def _directory(tmp_path):
    (tmp_path / "c.toml").mkdir()
    return tmp_path / "c.toml"


@pytest.mark.parametrize(
    "make,says",
    [
        (_fifo, "is a FIFO, not a regular file"),  # its read waited for a writer forever
        (_directory, "is a directory, not a regular file"),  # was [Errno 21] without the key or the fix
        (lambda tmp_path: Path("/dev/zero"), "is a device, not a regular file"),
        (lambda tmp_path: (tmp_path / "c.toml").write_bytes(b"\xef\xbb\xbf[run]\n") and tmp_path / "c.toml", "BOM"),
        (lambda tmp_path: "", "--config is empty"),
    ],
    ids=["fifo", "directory", "device", "bom", "empty-path"],
)
def test_a_config_path_that_is_no_toml_file_is_one_config_error(tmp_path, make, says):
    with pytest.raises(ConfigError, match=says):
        load_config(make(tmp_path))


@pytest.mark.parametrize(
    "overrides,says",
    [
        (['data.path="a b.jsonl'], "is not a valid TOML value"),  # was the path '"a b.jsonl', quote and all
        (["data.path='a.jsonl"], "is not a valid TOML value"),
        (["target.layer_ids=[1, 2"], "is not a valid TOML value"),  # was the string '[1, 2'
        (["data.sources={path = 'a'"], "is not a valid TOML value"),
    ],
    ids=["unclosed-double-quote", "unclosed-single-quote", "unclosed-array", "unclosed-table"],
)
def test_an_override_that_is_broken_toml_is_refused(overrides, says):
    with pytest.raises(ConfigError, match=says):
        load_config(None, overrides)


def test_a_bare_word_override_is_the_word_without_surrounding_spaces():
    cfg = load_config(None, [" run.name = x ", "data.path=/data/run #1.jsonl", "target.device = cpu"])
    assert (cfg.run.name, cfg.data.path, cfg.target.device) == ("x", "/data/run #1.jsonl", "cpu")
    # A key set twice: the last wins, as chaos and the benches rely on (they append their keys to the user's).
    assert load_config(None, ["ring.slots=1", "ring.slots=2"]).ring.slots == 2


def _path_settings() -> list[tuple[str, str, bool]]:
    """(section, key, a directory the run writes?) of every path setting (PathSetting in its type); a
    [[data.sources]] entry's as section "data.sources"."""
    found = []

    def walk(cls: type, section: str) -> None:
        hints = typing.get_type_hints(cls, include_extras=True)
        for f in dataclasses.fields(cls):
            hint = hints[f.name]
            if typing.get_origin(hint) is list and dataclasses.is_dataclass(item := typing.get_args(hint)[0]):
                walk(item, f"{section}.{f.name}")
            elif typing.get_origin(hint) is typing.Annotated:
                if (setting := path_setting(tuple(typing.get_args(hint)[1:]))) is not None:
                    found.append((section, f.name, setting.output))

    for section in dataclasses.fields(Config):
        walk(typing.get_type_hints(Config)[section.name], section.name)
    return found


PATH_SETTINGS = _path_settings()


def _one_setting(tmp_path: Path, section: str, key: str, value: str) -> Path:
    entry = f'[[data.sources]]\npath = "a.jsonl"\n' if section == "data.sources" else f"[{section}]\n"
    if section == "data.sources" and key == "path":
        entry = "[[data.sources]]\n"
    (tmp_path / "c.toml").write_text(f"{entry}{key} = {_toml_value(value, key)}\n")
    return tmp_path / "c.toml"


def _value(cfg: Config, section: str, key: str) -> str:
    if section == "data.sources":
        return getattr(cfg.data.sources[0], key)
    return getattr(getattr(cfg, section), key)


def test_path_settings_are_found():
    found = {(section, key) for section, key, _ in PATH_SETTINGS}
    assert {("train", "checkpoint_dir"), ("data.sources", "path"), ("target", "path"), ("run", "run_dir")} <= found
    assert {(s, k) for s, k, output in PATH_SETTINGS if output} >= {("tracking", "dir"), ("regenerate", "output")}


@pytest.mark.parametrize("section,key,output", PATH_SETTINGS, ids=[f"{s}.{k}" for s, k, _ in PATH_SETTINGS])
def test_every_path_setting_expands_home_once_as_it_is_read(tmp_path, section, key, output):
    """`~/x` is $HOME/x for every reader: some modules expanded it and some did not (the drafters wrote their
    journals under $HOME, the supervisor sealed them in ./~); `~nosuchuser` is refused by key."""
    cfg = load_config(_one_setting(tmp_path, section, key, "~/x"))
    assert _value(cfg, section, key) == os.path.expanduser("~/x") != "~/x"
    with pytest.raises(ConfigError, match=f"{key} = '~nosuchuser9/x': ~nosuchuser9 names no user"):
        load_config(_one_setting(tmp_path, section, key, "~nosuchuser9/x"))


OUTPUT_DIRECTORIES = [(s, k) for s, k, output in PATH_SETTINGS if output]


@pytest.mark.parametrize("section,key", OUTPUT_DIRECTORIES, ids=[f"{s}.{k}" for s, k in OUTPUT_DIRECTORIES])
def test_check_config_refuses_a_file_where_a_run_writes_a_directory(tmp_path, capsys, section, key):
    """check-config says 0 only when every role would accept the config: a file in place of any directory the run
    writes into is refused by key there (only tracking.dir was; the others passed, and a role failed at its start
    with an OSError naming neither the setting nor what to do)."""
    from dflash_ring.cli import main

    (tmp_path / "afile").write_text("x")
    assert (
        main(
            [
                "check-config",
                "--config",
                str(_one_setting(tmp_path, section, key, str(tmp_path / "afile"))),
                "--set",
                f"train.checkpoint_dir={tmp_path / 'ckpt'}",
            ]
            if key != "checkpoint_dir"
            else ["check-config", "--config", str(_one_setting(tmp_path, section, key, str(tmp_path / "afile")))]
        )
        == 2
    )
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"dflash-ring check-config: error: {section}.{key}: output directory "), line
    assert "is not a directory; choose another path" in line, line


def test_check_config_says_the_target_was_not_checked_when_this_host_has_none(tmp_path, capsys):
    """A config vetted away from its GPU host passes without its target: the OK says the target was not checked
    (it claimed the whole config, which every role then refused for its target.path)."""
    from dflash_ring.cli import main

    assert main(["check-config"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == (
        "not checked: the target: target.path is not set (every role needs it: a local HF model directory)"
    )
    assert main(["check-config", "--set", f'target.path="{tmp_path / "nowhere"}"']) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "config OK: run 'default' (defaults)"
    assert out[1] == f"not checked: the target: target.path {tmp_path / 'nowhere'} is not a directory on this host"
    target = build_target(tmp_path / "target", "qwen3", layers=4, hidden=32)
    mask = f"target.mask_token_id={len(load_tokenizer(target))}"
    assert main(["check-config", "--set", f'target.path="{target}"', "--set", mask]) == 0
    assert capsys.readouterr().out.splitlines() == ["config OK: run 'default' (defaults)"]  # checked: nothing unsaid
