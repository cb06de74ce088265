"""Each bench's figures on stderr the moment they are measured, one line per group of figures.

A bench on a leased GPU can be cut off by a time limit before it prints its final JSON; what it printed on
stderr by then is kept. Every line is `<bench> <part>: <JSON object>` (the convention `bench topology`
started), so a reader can pick the lines out of any log with the prefix, and the JSON after it loads as is.
The final report on stdout is unchanged by this.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from typing import Any


def progress(bench: str, part: str, figures: Mapping[str, Any]) -> None:
    """One line on stderr, flushed at once: `bench part: {figures as JSON}`."""
    print(f"{bench} {part}: {json.dumps(dict(figures))}", file=sys.stderr, flush=True)
