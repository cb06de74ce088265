"""Writing a run config back as TOML that `load_config` reads back equal: the one writer of run configs
(the launcher's copies, the trackers' and checkpoints' record of what a run chose).
"""

from __future__ import annotations

import dataclasses
import typing

from dflash_ring.common.config.schema import Config, ConfigError


def dump_toml(
    cfg: Config, *, full: bool = False, header: str = "", comments: typing.Mapping[str, str] | None = None
) -> str:
    """`cfg` as TOML that `load_config` reads back equal: the one writer of run configs.

    By default only fields that differ from the defaults, and that the section does not derive from
    its other fields, are written: a copied file then says what this run chose and keeps following the
    code's defaults for the rest (an edited num_hidden_layers is not contradicted by a stale
    layer_types). `full` writes every
    field (None, which TOML cannot spell, is every optional field's default, so it is left out).
    `header` becomes leading comment lines; `comments` maps "section" or "section.key" to a
    comment line written above it.
    """
    comments = comments or {}
    defaults = Config()
    out = [f"# {line}".rstrip() for line in header.splitlines()]
    for section in dataclasses.fields(Config):
        value = getattr(cfg, section.name)
        kept = _kept_fields(value, getattr(defaults, section.name), full)
        tables = {name: kept.pop(name) for name, v in list(kept.items()) if _is_table_list(v)}
        lines = []
        for name, v in kept.items():
            if note := comments.get(f"{section.name}.{name}"):
                lines.append(f"# {note}")
            lines.append(f"{name} = {_toml_value(v, f'{section.name}.{name}')}")
        if lines:
            if out:
                out.append("")
            if note := comments.get(section.name):
                out.append(f"# {note}")
            out += [f"[{section.name}]", *lines]
        for name, entries in tables.items():  # after the section's own keys: TOML puts them in its table
            for i, entry in enumerate(entries):
                fields = _kept_fields(entry, None, full)
                out += [
                    "",
                    f"[[{section.name}.{name}]]",
                    *(f"{k} = {_toml_value(v, f'{section.name}.{name}[{i}].{k}')}" for k, v in fields.items()),
                ]
    return "\n".join(out) + "\n"


def _kept_fields(value: typing.Any, default: typing.Any, full: bool) -> dict[str, typing.Any]:
    """The fields of one table that `dump_toml` writes: all (bar None) when `full`, else those that differ from
    `default` (from the type's own defaults where `default` is None) and that the table does not derive from
    its other fields (drafter.layer_types from its layers, a source's name from its path)."""
    kept = {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if getattr(value, f.name) is not None}
    if full:
        return kept
    for f in dataclasses.fields(value):
        if default is not None:
            same = getattr(default, f.name) == kept.get(f.name)
        else:
            same = f.default is not dataclasses.MISSING and f.default == kept.get(f.name)
        if same:
            kept.pop(f.name, None)
    for name in reversed(list(kept)):
        trial = {k: v for k, v in kept.items() if k != name}
        try:
            if type(value)(**trial) == value:
                kept = trial
        except (TypeError, ValueError):
            pass
    return kept


def _is_table_list(v: typing.Any) -> bool:
    return isinstance(v, list) and bool(v) and all(dataclasses.is_dataclass(x) for x in v)


def _toml_value(v: typing.Any, name: str) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return f"{v:_}" if abs(v) >= 100_000 else str(v)  # 8_388_608 reads better than 8388608
    if isinstance(v, float):
        return repr(v)  # shortest exact form; inf, -inf and nan are TOML's own spellings
    if isinstance(v, str):
        return (
            '"'
            + "".join(_TOML_ESCAPES.get(c) or (f"\\u{ord(c):04x}" if ord(c) < 0x20 or c == "\x7f" else c) for c in v)
            + '"'
        )
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x, name) for x in v) + "]"
    raise ConfigError(f"{name} = {v!r}: a {type(v).__name__} cannot be written as TOML")


_TOML_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}
