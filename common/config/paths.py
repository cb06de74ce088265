"""Path settings: declared with the field, handled by the loader once for every one of them.

A field holding a path declares it in its type, `Annotated[str, PathSetting()]` or one of the aliases below:
`load_config` (`_coerce` in common/config/load.py) expands a leading `~` (or `~user`) as it reads the value, so
every process and every module sees the same path; before, some expanded it and some did not (the drafters wrote
journals under $HOME/x for `train.checkpoint_dir = "~/x"`, the supervisor looked for them in ./~/x). A directory a
run writes into (`OutputDirectory`) is also checked by `dflash-ring check-config` (`output_directories`): a file in
its place, an unwritable or read-only one is refused there by key, as each role would refuse it at its start.

Import-light (no torch): every section module imports it.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass
from typing import Annotated


@dataclass(frozen=True)
class PathSetting:
    """A string setting that names a file or directory; `output`: a directory the run writes into."""

    output: bool = False


ReadPath = Annotated[str, PathSetting()]  # a file or directory the run reads (data, a model, a secret)
OutputDirectory = Annotated[str, PathSetting(output=True)]  # a directory the run creates and writes into


def path_setting(extras: tuple[typing.Any, ...]) -> PathSetting | None:
    """The PathSetting among an Annotated type's extras, if any."""
    return next((e for e in extras if isinstance(e, PathSetting)), None)


def expanded(value: str) -> str | None:
    """`value` with a leading ~ or ~user expanded; None when it names a user this host does not have."""
    if not value.startswith("~"):
        return value
    out = os.path.expanduser(value)
    return None if out.startswith("~") else out


def home_path(value: str) -> str:
    """A default under ~ as the loader would read it (expanded), so a loaded config equals one built in code."""
    return expanded(value) or value


def output_directories(obj: typing.Any, where: str = "") -> list[tuple[str, str]]:
    """(key, path) of every non-empty OutputDirectory setting of a loaded config (or one of its sections)."""
    found = []
    hints = typing.get_type_hints(type(obj), include_extras=True)
    for f in dataclasses.fields(obj):
        value, name = getattr(obj, f.name), f"{where}{f.name}"
        if dataclasses.is_dataclass(value):
            found += output_directories(value, f"{name}.")
        elif typing.get_origin(hints[f.name]) is Annotated and value:
            setting = path_setting(tuple(typing.get_args(hints[f.name])[1:]))
            if setting is not None and setting.output:
                found.append((name, value))
    return found
