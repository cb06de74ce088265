"""Reading a run config: one TOML file, then `--set section.key=value` overrides, into a `Config`.

Every key is checked against the dataclasses of common/config/schema.py: an unknown key is an error that
names it and the known ones, and each value is coerced to its field's type and checked against its
declared range (common/config/ranges.py), so a bad value is one line naming the key, never a traceback.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import tomllib
import types
import typing

from dflash_ring.common.bounded_read import CONFIG_BYTES, read_text
from dflash_ring.common.config.paths import expanded, path_setting
from dflash_ring.common.config.ranges import DEFAULT, Range, range_of, refusal
from dflash_ring.common.config.schema import Config, ConfigError


def load_config(path: str | os.PathLike | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Read a TOML file (or start from defaults) and apply `section.key=value` overrides."""
    raw: dict[str, typing.Any] = {}
    if path is not None:
        if not os.fspath(path):
            raise ConfigError("--config is empty: give the path of a TOML config file (or leave --config out)")
        try:
            text = read_text(path, CONFIG_BYTES, ConfigError, "config file")
            if text.startswith("\ufeff"):  # TOML has no byte-order mark; tomllib's word for it is 'Invalid statement'
                raise ConfigError(
                    f"config file {path} starts with a byte-order mark (BOM): save it as UTF-8 without BOM"
                )
            raw = tomllib.loads(text)
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    for item in overrides:  # a key set twice: the last wins (chaos and the benches append theirs to the user's)
        section, key, value = _parse_override(item)
        raw.setdefault(section, {})[key] = value
    cfg = _build(Config, raw, "")
    cfg.validate()
    return cfg


def check_overrides(overrides: typing.Sequence[str]) -> None:
    """Each `--set` alone: its form, its key and its value's type and range, as load_config checks them, without the
    file they will apply to or the checks of one field against another. For a command that builds its config
    later (`run`'s embedded default, chaos): a typo is refused before anything is built or printed."""
    sections = typing.get_type_hints(Config)
    for item in overrides:
        section, key, value = _parse_override(item)
        if section not in sections:
            raise _unknown(section, "", {f.name for f in dataclasses.fields(Config)})
        fields = {f.name for f in dataclasses.fields(sections[section])}
        if key not in fields:
            raise _unknown(key, section, fields)
        _coerce(value, typing.get_type_hints(sections[section], include_extras=True)[key], f"{section}.{key}")


def _unknown(key: str, where: str, known: set[str]) -> ConfigError:
    place = f"[{where}]" if where else "the top level"
    return ConfigError(f"unknown config key {key!r} in {place}; known keys: {', '.join(sorted(known))}")


def _parse_override(item: str) -> tuple[str, str, typing.Any]:
    name, sep, text = item.partition("=")
    section, dot, key = name.strip().partition(".")
    if not sep or not dot or not section or not key:
        raise ConfigError(f"--set {item!r}: expected section.key=value")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError as e:
        text = text.strip()
        if text[:1] in QUOTES_AND_BRACKETS:
            # It was meant as TOML (a quoted string, an array, a table): read as a bare word it would be a string
            # holding the stray quote or bracket, a setting the user never wrote.
            raise ConfigError(
                f"--set {item!r}: {text!r} is not a valid TOML value ({e}); quote a string whole, as in "
                f"{section}.{key}='\"text\"' in the shell, and write arrays as [1, 2]"
            ) from None
        value = text  # a bare word is a string
    return section, key, value


QUOTES_AND_BRACKETS = "\"'[{"  # how a TOML string, array or inline table starts


def _build(cls: type, raw: typing.Any, where: str) -> typing.Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"[{where}] must be a table, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls, include_extras=True)  # with each field's declared Range
    known = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in known:
            raise _unknown(key, where, known)
    values = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            continue
        name = f"{where}.{f.name}" if where else f.name
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            values[f.name] = _build(hint, raw[f.name], name)
        else:
            values[f.name] = _coerce(raw[f.name], hint, name)
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"[{where}]: {e}") from None


def _coerce(value: typing.Any, hint: typing.Any, name: str, bound: Range | None = None) -> typing.Any:
    """`value` as the field's type, or a ConfigError naming `name`; a number also within its declared `bound`
    (common/config/ranges.py: from an Annotated hint, else the rule for every number, DEFAULT)."""
    if dataclasses.is_dataclass(hint):  # a table in a list of tables ([[data.sources]])
        return _build(hint, value, name)
    origin = typing.get_origin(hint)
    if origin is typing.Annotated:
        inner, *extras = typing.get_args(hint)
        value = _coerce(value, inner, name, range_of(tuple(extras)) or bound)
        if path_setting(tuple(extras)) is not None and (path := expanded(value)) != value:
            if path is None:
                raise ConfigError(
                    f"{name} = {value!r}: {value.split('/')[0]} names no user of this host, so the path cannot "
                    "be expanded: write it out in full"
                )
            value = path  # ~ expanded here, once, for every reader of the setting (common/config/paths.py)
        return value
    if origin is typing.Literal:
        if value not in typing.get_args(hint):
            raise ConfigError(f"{name} = {value!r}: expected one of {', '.join(map(repr, typing.get_args(hint)))}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        options = [arg for arg in args if arg is not type(None)]
        for arg in options:
            try:
                return _coerce(value, arg, name, bound)
            except ConfigError as e:
                if len(options) == 1:  # X | None: X's own message
                    raise e from None
        raise ConfigError(f"{name} = {value!r}: expected {hint}")
    if origin is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(f"{name} = {value!r}: expected a list")
        return [_coerce(v, item, f"{name}[{i}]") for i, v in enumerate(value)]
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        value = _as_float(value)
    if hint is bool and not isinstance(value, bool):
        raise ConfigError(f"{name} = {value!r}: expected true or false")
    if hint is int and isinstance(value, bool):
        raise ConfigError(f"{name} = {value!r}: expected an integer")
    if not isinstance(value, hint):
        raise ConfigError(f"{name} = {value!r}: expected {hint.__name__}, got {type(value).__name__}")
    if hint in (int, float) and (why := refusal(name, value, bound or DEFAULT)):
        raise ConfigError(why)
    if hint is str and (bad := CONTROL.search(value)):
        raise ConfigError(
            f"{name} = {value!r}: holds the control character {bad.group()!r}; every string setting is one line "
            "(a path, a name, a host, a URL) and a path cannot hold NUL: remove it"
        )
    return value


# Characters no string setting may hold: every one is a single line of text (a path, a name, a device, a host,
# a URL, an environment variable's name), and NUL cannot even be passed to the OS (a ValueError, later).
CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _as_float(value: int) -> float:
    """An int written for a float field; one past a float's range is inf (refused as not finite, not a traceback)."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf
