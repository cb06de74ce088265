"""Argument types the CLI's commands and the benchmarks' own parsers (bench/NAME.py: add_arguments) share: a bad
value is argparse's one usage line and exit 2, before anything is built.

The rule: every numeric option declares its range by its type here (at_least_one, non_negative, port, seed,
seconds, positive_number), never a bare `type=int`/`type=float`: those took -1, 0, nan and inf, which ended later in a
traceback, a wait without end or a silent nothing (tests/test_cli_errors.py checks every parser for it)."""

from __future__ import annotations

import argparse
import math

from dflash_ring.common.config.drafter import FP8_RECIPES, RECIPES
from dflash_ring.common.config.ranges import WEEK_S
from dflash_ring.common.output_dir import OutputDirError, check_output_dir

# The largest --tree-budget a tree eval verifies: a round holds its (N + 1) x (prefix + N + 1) float mask, the
# target's N + 1 rows of logits ([N + 1, vocab], 2.4 GiB in float32 at 4096 nodes and Qwen3's 151,936 rows) and
# the N x N ancestor matrix at once, and building the tree pops up to N paths from a heap; the measured budgets
# are 1..256 (docs/benchmarks.md), so 4096 leaves room without letting a typo take the host's memory.
MAX_TREE_BUDGET = 4096


def at_least_one(text: str) -> int:
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative(text: str) -> int:
    """A count where 0 means a default (threads, batches): never negative."""
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def cpu_threads(text: str) -> int:
    """torch's CPU threads (0: torch's default): at most this host's cores (common/host_bounds.py), since more only
    share them, and 100000 was a segfault inside torch after the models had loaded."""
    from dflash_ring.common.host_bounds import cores

    value = non_negative(text)
    if value > (n := cores()):
        raise argparse.ArgumentTypeError(f"this host has {n} CPU core{'s' if n != 1 else ''}: at most {n}, got {value}")
    return value


def port(text: str) -> int:
    value = _integer(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 1..65535, got {value}")
    return value


def seconds(text: str) -> float:
    """A wait or a window: a finite number of seconds > 0, at most a week (as every duration of the config:
    common/config/ranges.py). NaN made `now > deadline` never true, a wait without end."""
    value = positive_number(text)
    if value > WEEK_S:
        raise argparse.ArgumentTypeError(f"must be at most {WEEK_S:.0f} s (a week), got {text}")
    return value


def positive_number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def seed(text: str) -> int:
    """A random seed: 0..2**32 - 1, what every generator takes (numpy refuses a negative one)."""
    value = _integer(text)
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"a seed is 0..{2**32 - 1}, got {value}")
    return value


def output_directory(text: str) -> str:
    """A directory the command creates files in (--workdir, --dir): checked before anything runs, so a file in its
    place, an unwritable or read-only one is argparse's error naming the option, not an [Errno 17] from a mkdir
    deep inside (after the embedded target was built)."""
    try:
        check_output_dir(text)
    except (OutputDirError, OSError) as e:  # OSError: a path it cannot even stat
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def tree_budgets(text: str) -> tuple[int, ...]:
    try:
        budgets = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated node counts such as 16,64,256, got {text!r}")
    if bad := [b for b in budgets if b < 1]:
        raise argparse.ArgumentTypeError(f"a tree budget counts draft nodes and must be at least 1, got {bad}")
    if bad := [b for b in budgets if b > MAX_TREE_BUDGET]:
        raise argparse.ArgumentTypeError(
            f"a tree budget is at most {MAX_TREE_BUDGET} draft nodes, got {bad}: each round holds an "
            f"(N + 1) x (prefix + N + 1) attention mask and N + 1 rows of target logits at once"
        )
    return budgets


def fp8_recipe_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--fp8-recipe",
        choices=FP8_RECIPES,
        default="rowwise",
        help="drafter.fp8_recipe: torchao's float8 recipe where a drafter trains in fp8",
    )


def recipe_argument(parser: argparse.ArgumentParser, default: str) -> None:
    """--recipe of the benches that build a drafter: a name in RECIPES, checked by argparse (an unknown one was the
    drafter config's ValueError, a traceback, once the bench had loaded torch), its help listing them all."""
    parser.add_argument(
        "--recipe", choices=tuple(RECIPES), default=default, help=f"drafter.recipe, of: {', '.join(RECIPES)}"
    )


def attention_geometry(text: str) -> tuple[int, int, int]:
    """HEADS,KV_HEADS,HEAD_DIM (e.g. 32,8,128): the drafter's own attention geometry, checked as its config checks
    it (argparse prints the reason in one line, exit 2)."""
    try:
        heads, kv_heads, head_dim = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not HEADS,KV_HEADS,HEAD_DIM (three integers, e.g. 32,8,128)")
    if min(heads, kv_heads, head_dim) < 1 or heads % kv_heads or head_dim % 2 or max(heads, kv_heads, head_dim) > 1024:
        raise argparse.ArgumentTypeError(
            f"{text!r}: heads a multiple of the key/value heads, an even head width, each from 1 to 1024"
        )
    return heads, kv_heads, head_dim


def attention_geometry_argument(parser: argparse.ArgumentParser) -> None:
    """--drafter-attention of the benches that build a drafter: drafter.num_attention_heads, num_key_value_heads and
    head_dim (default: the target's), to time a released drafter's geometry beside a target of another."""
    parser.add_argument(
        "--drafter-attention",
        type=attention_geometry,
        default=None,
        metavar="HEADS,KV_HEADS,HEAD_DIM",
        help="the drafter's own attention geometry, e.g. 32,8,128 (the released 27B-class drafters'); "
        "default: the target's",
    )
