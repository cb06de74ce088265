"""Argument types the CLI's commands and the benchmarks' own parsers (bench/NAME.py: add_arguments) share: a bad
value is argparse's one usage line and exit 2, before anything is built."""

from __future__ import annotations

import argparse

from dflash_ring.common.config.drafter import FP8_RECIPES, RECIPES

# The largest --tree-budget a tree eval verifies: a round holds its (N + 1) x (prefix + N + 1) float mask, the
# target's N + 1 rows of logits ([N + 1, vocab], 2.4 GiB in float32 at 4096 nodes and Qwen3's 151,936 rows) and
# the N x N ancestor matrix at once, and building the tree pops up to N paths from a heap; the measured budgets
# are 1..256 (docs/benchmarks.md), so 4096 leaves room without letting a typo take the host's memory.
MAX_TREE_BUDGET = 4096


def at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


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
