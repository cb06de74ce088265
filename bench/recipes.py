"""`dflash-ring bench recipes`: the embedded default's tiny run trained with each recipe, evaluated alike.

Every variant is the embedded default (`dflash-ring run`: the tiny trained target, 1 target process, 2
drafters, CPU, the target's regenerated replies) with one recipe on top, on the tiny run's drafter geometry
(2 layers, B=8, 48 anchors, set explicitly by the embedded config, so a recipe brings its objective only:
loss, position weights, KL, CAP, layer pattern). Each trained drafter (drafter 0's last checkpoint,
exported) is evaluated on the same held-out prompts by chain verification and by tree verification at each
budget. Every variant runs once per seed (train.seed and data.seed), so the spread between seeds is the
run-to-run noise the differences between recipes must exceed.

Ratios are against the `paper` variant of the same seed, in the same bench run. Results are appended to
`<workdir>/recipes.jsonl` and printed on stderr (bench/progress.py) as each run finishes, so an interrupted
bench keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from statistics import fmean
from typing import Any

from dflash_ring.bench.progress import progress
from dflash_ring.common.arguments import at_least_one, output_directory, tree_budgets
from dflash_ring.common.refusal import Refusal

# variant -> its `--set` overrides on the embedded config.
VARIANTS: dict[str, list[str]] = {
    "paper": ["drafter.recipe=paper"],
    "dpace": ["drafter.recipe=dpace"],
    "ddtree": ["drafter.recipe=ddtree"],
    "paper+target_argmax": ["drafter.recipe=paper", "drafter.label=target_argmax"],
    # DSpark on the embedded geometry (B=8: 8 drafts a block, DFlash's 7); chain verification only, as eval
    # verifies a DSpark drafter (its Markov head makes every draft depend on the one before: no tree).
    "dspark": ["drafter.recipe=dspark"],
    # DFlash2 on the embedded geometry (2 layers, B=8: the released checkpoint's block too), its convolutions and
    # selector at the recipe's sizes (K 16 of the tiny vocabulary, rank 256). The recipe's layers are all sliding,
    # window 2048: wider than the tiny run's sequences (data.max_length 256), so the window never cuts and the
    # layers attend as full bidirectional ones inside the block here. Chain verification only: eval decodes a
    # DFlash2 drafter through its selector, which scores each draft with the one before it (no tree).
    "dflash2": ["drafter.recipe=dflash2"],
}
NO_TREE = {"dspark", "dflash2"}
BASELINE = "paper"


class UnknownVariant(Refusal, ValueError):
    """A variant name the bench does not know: the user's, refused in one line (exit 2) before anything is built."""


def run_recipes_bench(
    workdir: str | Path,
    variants: Sequence[str] = tuple(VARIANTS),
    seeds: Sequence[int] = (0, 1),
    budgets: Sequence[int] = (16, 64, 256),
    prompts: int = 100,
    max_new_tokens: int = 64,
) -> dict:
    from dflash_ring.consumer.evaluation.evaluate import evaluate_drafter
    from dflash_ring.embedded.tiny_target import HELDOUT_FILE
    from dflash_ring.tools.launcher import console, embedded_config, train_and_export

    if unknown := [v for v in variants if v not in VARIANTS]:
        raise UnknownVariant(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    work = Path(workdir)
    cfg_path = embedded_config(work)  # builds (or finds cached) the tiny target and its regenerated replies
    results = work / "recipes.jsonl"
    con = console()
    runs = []
    for seed in seeds:  # every variant of a seed before the next seed: a partial bench still compares them
        for variant in variants:
            run_dir = work / f"{variant.replace('+', '-')}-seed{seed}"
            overrides = [
                *VARIANTS[variant],
                f"train.seed={seed}",
                f"data.seed={seed}",
                f"run.name=bench-recipes-{variant.replace('+', '-')}-{seed}",
                f"run.run_dir={run_dir / 'locks'}",
                f"train.checkpoint_dir={run_dir / 'checkpoints'}",
                f"target.state_dir={run_dir / 'state'}",
                "metrics.enabled=false",  # nothing listens: benches beside other runs cannot collide on ports
            ]
            started = time.monotonic()
            trained = train_and_export(cfg_path, overrides, True, con)
            if isinstance(trained, int):
                raise RuntimeError(f"the {variant} run (seed {seed}) failed with exit code {trained}")
            cfg, exported, steps = trained
            train_s = time.monotonic() - started
            started = time.monotonic()
            report = evaluate_drafter(
                exported,
                cfg.target.path,
                Path(cfg.target.path) / HELDOUT_FILE,
                limit=prompts,
                max_new_tokens=max_new_tokens,
                tree_budgets=() if variant in NO_TREE else budgets,
            )
            run = {
                "variant": variant,
                "seed": seed,
                "overrides": VARIANTS[variant],
                "steps": steps,
                "drafter": {
                    k: getattr(cfg.drafter, k)
                    for k in (
                        "recipe",
                        "arch",
                        "num_hidden_layers",
                        "block_size",
                        "num_anchors",
                        "loss",
                        "loss_gamma",
                        "kl_weight",
                        "cap_weight",
                        "label",
                        "layer_types",
                    )
                },
                "train_s": round(train_s, 1),
                "eval_s": round(time.monotonic() - started, 1),
                "chain_tau": report.tau,
                "chain_rounds": report.rounds,
                "tree_tau": {str(t.budget): t.tau for t in report.trees},
                "tree_same_tokens_as_chain": {str(t.budget): t.same_tokens_as_chain for t in report.trees},
                "tokens_generated": report.tokens_generated,
            }
            with results.open("a") as f:
                f.write(json.dumps(run) + "\n")
            progress("recipes", "run", run)
            runs.append(run)
    return {
        "bench": "recipes",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "machine": platform.machine(),
        "prompts": prompts,
        "max_new_tokens": max_new_tokens,
        "budgets": list(budgets),
        "seeds": list(seeds),
        "baseline": BASELINE,
        "table": summarize_runs(runs, budgets),
        "runs": runs,
    }


def summarize_runs(runs: Sequence[dict[str, Any]], budgets: Sequence[int]) -> list[dict[str, Any]]:
    """Per variant: each figure's mean and its spread (max - min) over seeds, and the mean over seeds of its
    ratio to the baseline variant's figure of the same seed (where that seed's baseline ran)."""
    figures = ["chain_tau", *(f"tree_tau_{b}" for b in budgets)]

    def value(run: dict[str, Any], figure: str) -> float | None:
        return run["chain_tau"] if figure == "chain_tau" else run["tree_tau"].get(figure.removeprefix("tree_tau_"))

    baseline = {r["seed"]: r for r in runs if r["variant"] == BASELINE}
    table = []
    for variant in dict.fromkeys(r["variant"] for r in runs):
        mine = [r for r in runs if r["variant"] == variant]
        row: dict[str, Any] = {"variant": variant, "seeds": [r["seed"] for r in mine]}
        for figure in figures:
            values = [v for r in mine if (v := value(r, figure)) is not None]
            if not values:  # a variant that is not tree-verified (NO_TREE)
                continue
            ratios = [value(r, figure) / value(baseline[r["seed"]], figure) for r in mine if r["seed"] in baseline]
            row[figure] = {
                "mean": round(fmean(values), 3),
                "spread": round(max(values) - min(values), 3),
                **({"vs_baseline": round(fmean(ratios), 3)} if ratios else {}),
            }
        table.append(row)
    return table


def seed_list(text: str) -> tuple[int, ...]:
    """`--seeds`: refused as argparse's usage line and exit 2 before any run, as the other options are."""
    try:
        return tuple(int(s) for s in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes comma-separated integers, got {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`dflash-ring bench recipes`'s own options (cli.py registers every bench by name, and hands it the rest)."""
    parser.add_argument(
        "--workdir", type=output_directory, default="runs/bench-recipes", help="where the runs and recipes.jsonl go"
    )
    parser.add_argument(
        "--variants",
        default="paper,dpace,ddtree,paper+target_argmax",
        help=f"comma-separated, of: {', '.join(VARIANTS)}",  # from VARIANTS: a new variant is listed as it is added
    )
    parser.add_argument("--seeds", type=seed_list, default=(0, 1), help="comma-separated train/data seeds")
    parser.add_argument("--tree-budget", type=tree_budgets, default=(16, 64, 256), metavar="N[,N...]")
    parser.add_argument("--prompts", type=at_least_one, default=100, help="held-out prompts evaluated")
    parser.add_argument("--max-new-tokens", type=at_least_one, default=64)


def main(args: argparse.Namespace) -> int:
    # An unknown variant (UnknownVariant) and what eval refuses are one line at cli.main's boundary; anything else
    # is a bug and keeps its traceback.
    report = run_recipes_bench(
        args.workdir,
        variants=args.variants.split(","),
        seeds=args.seeds,
        budgets=args.tree_budget,
        prompts=args.prompts,
        max_new_tokens=args.max_new_tokens,
    )
    print(json.dumps(report, indent=2))
    return 0
