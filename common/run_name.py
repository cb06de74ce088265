"""Run names: one check for every way a name comes in (config, `--set`, the RUN of status/stop/clean).

A run name becomes a path component (its lock directory under the runtime root) and part
of the POSIX IPC names (`/dflash-ring.<run>`), so it must never be able to point anywhere
else: no `.` or `..`, no slash, nothing hidden, nothing an IPC name cannot hold.
"""

from __future__ import annotations

import re

from dflash_ring.common.refusal import Refusal

RUN_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,47}$")
RULE = "1-48 characters of [A-Za-z0-9_.-], starting with a letter or digit"


class RunNameError(Refusal, ValueError):
    """A run name that could leave the lock directory or the IPC namespace; the message says where it came from."""


def is_valid(name: object) -> bool:
    return isinstance(name, str) and bool(RUN_NAME_RE.match(name))


def check_run_name(name: object, source: str = "run.name") -> str:
    """Return name if it is a safe run name, else raise RunNameError naming its source and the rule."""
    if not is_valid(name):
        raise RunNameError(
            f"run name {name!r} (from {source}) is not allowed: a run name is {RULE}, because it "
            f"names the run's lock directory and shared memory; use such a name"
        )
    return name  # type: ignore[return-value]
