"""The allowed range of every numeric config setting, declared with the field and checked by the loader.

A field declares its range in its type, `lr: Annotated[float, Range(low_open=True)]` or one of the aliases
below (`Positive`, `Seconds`, ...); `load_config` (`_coerce` in common/config/load.py) checks every number it reads,
in every section, from a file or `--set`, before the section's own `__post_init__` sees it. A numeric field that
declares nothing gets the rule `Range()`: a finite number >= 0 (an int also at most INT64_MAX). The rule is
declared rather than written as a check per field because hand-written checks each forgot something: `lr <= 0`
is false for NaN, a negative sleep was a traceback, a trillion epochs a producer that never published. So the
sections' own checks are only the semantic ones (one field against another); direct construction in code (tests,
the launcher) is trusted and not range-checked.

Import-light (no torch): every section module imports it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any

# TOML's integers are 64-bit signed (tomllib reads larger ones anyway); counters, tensors and the ring header hold
# int64 too, so no int setting goes past it.
INT64_MAX = 2**63 - 1
# Longest duration any setting may name. Longer is no wait a run means, and time.sleep, lock, threading and
# timedelta timeouts overflow (a traceback, later) somewhere past 1e9 s.
WEEK_S = 7 * 24 * 3600.0


@dataclass(frozen=True)
class Range:
    """Allowed values of one numeric field: low..high, each end included unless `*_open`; None: no bound (ints are
    still capped at INT64_MAX). `finite = False` lets inf, -inf and nan through (no field asks for it yet)."""

    low: float | None = 0
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    finite: bool = True

    def allows(self, value: int | float) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return not self.finite
        high = self._high(type(value))
        return (self.low is None or value > self.low or (value == self.low and not self.low_open)) and (
            high is None or value < high or (value == high and not self.high_open)
        )

    def describe(self, kind: type) -> str:
        """What the refusal says is allowed: 'a finite number > 0', 'an integer >= 1 and <= 10_000'."""
        what = "an integer" if kind is int else "a finite number" if self.finite else "a number"
        ends = []
        if self.low is not None:
            ends.append(f"{'>' if self.low_open else '>='} {_number(self.low, kind)}")
        if (high := self._high(kind)) is not None:
            ends.append(f"{'<' if self.high_open else '<='} {_number(high, kind)}")
        return " and ".join([f"{what} {ends[0]}", *ends[1:]]) if ends else what

    def _high(self, kind: type) -> float | None:
        if kind is int:
            return INT64_MAX if self.high is None else min(self.high, INT64_MAX)
        return self.high


def _number(x: float, kind: type) -> str:
    if x == INT64_MAX:
        return "2**63 - 1"
    if kind is int or float(x).is_integer():
        return f"{int(x):_}" if abs(x) >= 100_000 else str(int(x))
    return repr(float(x))


DEFAULT = Range()  # the rule for a numeric field that declares nothing
Positive = Annotated[float, Range(low_open=True)]  # lr, a gamma, a RoPE base, a source's weight
Share = Annotated[float, Range(high=1, high_open=True)]  # [0, 1): a share of rows or of steps
Fraction = Annotated[float, Range(high=1)]  # [0, 1]
Seconds = Annotated[float, Range(high=WEEK_S)]  # a wait that may be 0 (no wait)
PositiveSeconds = Annotated[float, Range(high=WEEK_S, low_open=True)]  # a period or timeout that must pass
AtLeastOne = Annotated[int, Range(low=1)]  # a size or an interval in steps


def range_of(extras: tuple[Any, ...]) -> Range | None:
    """The Range among an Annotated type's extras, if any."""
    return next((e for e in extras if isinstance(e, Range)), None)


def refusal(name: str, value: int | float, bound: Range) -> str | None:
    """The one-line error for `value` outside `bound` (naming the key, the value and the range), or None."""
    if bound.allows(value):
        return None
    return f"{name} = {_shown(value)}: must be {bound.describe(type(value))}"


def _shown(value: int | float) -> str:
    if isinstance(value, int):
        return f"{value:_}" if abs(value) >= 100_000 else str(value)  # as dump_toml writes it
    return repr(value)
