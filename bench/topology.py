"""`dflash-ring bench topology`: the balanced target:drafter layout for a target shape and drafter recipe.

A run's throughput is bounded by whichever side is slower in total, so the layout to choose follows from two
rates measured alone on one GPU, in this process, one after the other (each frees the GPU for the next):

  T: `bench target` for the shape: packed batches, the producer's compiled forward (tokens/s of one target GPU);
  D: `bench drafter` for the shape and recipe: one training step on random features (tokens/s of one drafter GPU).

Targets and drafters in the ratio D:T keep both busy: 1 / (1/T + 1/D) tokens per GPU-second at any scale. On a
host of N GPUs the layout is the integer split t + d = N that maximises min(t T, d D) (the ring makes any ratio
balance by itself; this says which ratio wastes least). Both report's full JSON are kept beside the summary.

Not measured here: target and drafter running together through the ring (`bench pipeline` does that for the
Qwen3-8B shape, at 0.92 of the balanced figure on one shared GPU); a 27B-class target and its drafter do not fit
one GPU together with room to spare.
"""

from __future__ import annotations

import argparse
import gc
import json
from datetime import datetime, timezone
from typing import Any

import torch

from dflash_ring.common.arguments import (
    at_least_one,
    attention_geometry_argument,
    fp8_recipe_argument,
    recipe_argument,
)
from dflash_ring.consumer.modeling.fp8 import check_precision

from .drafter import run_drafter_bench
from .progress import progress
from .target import run_target_bench
from .target_shapes import SHAPES

# The pipeline this project replaces: 19.4k tokens/s on 8 GPUs (5 targets + 3 drafters), a Qwen3.6-27B target,
# the DDTree recipe (issue 25).
REPLACED_PIPELINE = {"tokens_per_s": 19_400, "gpus": 8, "targets": 5, "drafters": 3}


def best_layout(target_tps: float, drafter_tps: float, gpus: int) -> dict[str, Any]:
    """The split of `gpus` into targets and drafters (at least one each) that trains the most tokens per second."""
    t = max(range(1, gpus), key=lambda t: (min(t * target_tps, (gpus - t) * drafter_tps), -t))
    rate = min(t * target_tps, (gpus - t) * drafter_tps)
    return {
        "gpus": gpus,
        "targets": t,
        "drafters": gpus - t,
        "tokens_per_s": round(rate, 1),
        "tokens_per_gpu_s": round(rate / gpus, 1),
        "bound_by": "targets" if t * target_tps < (gpus - t) * drafter_tps else "drafters",
    }


def topology(target_tps: float, drafter_tps: float, gpus: int = 8) -> dict[str, Any]:
    balanced = 1.0 / (1.0 / target_tps + 1.0 / drafter_tps)
    layout = best_layout(target_tps, drafter_tps, gpus)
    replaced = REPLACED_PIPELINE["tokens_per_s"] / REPLACED_PIPELINE["gpus"]
    at_replaced = min(REPLACED_PIPELINE["targets"] * target_tps, REPLACED_PIPELINE["drafters"] * drafter_tps)
    return {
        "target_tokens_per_s": round(target_tps, 1),
        "drafter_tokens_per_s": round(drafter_tps, 1),
        "drafters_per_target": round(target_tps / drafter_tps, 2),
        "balanced_tokens_per_gpu_s": round(balanced, 1),
        f"layout_{gpus}_gpus": layout,
        "replaced_pipeline_layout_5_plus_3_tokens_per_gpu_s": round(at_replaced / REPLACED_PIPELINE["gpus"], 1),
        "replaced_pipeline_tokens_per_gpu_s": round(replaced, 1),
        "ratio_balanced_to_replaced_pipeline": round(balanced / replaced, 3),
    }


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def run_topology_bench(
    *,
    shape: str = "qwen3.6-27b",
    recipe: str = "ddtree",
    tiny: bool = False,
    target_batches: int = 3,
    seqs: int = 1,
    seq_len: int = 4096,
    drafter_steps: int = 5,
    gpus: int = 8,
    profile: bool = False,
    precisions: tuple[str, ...] = ("bf16",),
    fp8_recipe: str = "rowwise",
    drafter_attention: tuple[int, int, int] | None = None,
) -> dict[str, Any]:
    """precisions: drafter.precision values whose drafter half runs against the one target half (the first one's
    figures are the report's "drafter" and "topology", the others' under "other_precisions")."""
    for precision in precisions:  # an FP8 drafter that cannot run here is refused before the target's minutes
        check_precision(precision, "auto")
    target = run_target_bench(shape="tiny" if tiny else shape, batches=target_batches, profile=profile)
    progress(
        "topology",
        "target",
        {
            "tokens_per_s": target["forward_tokens_per_s"],
            "mfu": target["mfu"]["forward"],
            "probe_passed": target["probe"]["passed"],
        },
    )
    _free()
    target_tps = target["forward_tokens_per_s"]
    halves = {}
    for precision in precisions:
        drafter = run_drafter_bench(
            tiny,
            drafter_steps,
            seqs=seqs,
            seq_len=seq_len,
            shape=shape,
            recipe=recipe,
            check=False,
            profile=profile,
            precision=precision,
            fp8_recipe=fp8_recipe,
            drafter_attention=drafter_attention,
        )
        part = "drafter" if precision == precisions[0] else f"drafter-{precision}"
        progress("topology", part, {"tokens_per_s": drafter["tokens_per_s"], "mfu": drafter["mfu"]})
        _free()
        halves[precision] = {"drafter": drafter, "topology": topology(target_tps, drafter["tokens_per_s"], gpus)}
    drafter = halves[precisions[0]]["drafter"]
    return {
        "benchmark": "topology",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "shape": target["model"]["shape"],
        "recipe": drafter["recipe"],
        "drafter_tokens_per_step": drafter["shape"]["seqs"] * drafter["shape"]["seq_len"],
        "drafter_block_positions_per_token": round(
            drafter["shape"]["anchors_per_seq"] * drafter["shape"]["block_size"] / drafter["shape"]["seq_len"], 2
        ),
        "target_mean_sequence_tokens": target["batches"]["mean_length"],
        "precision": precisions[0],
        "topology": halves[precisions[0]]["topology"],
        "target": target,
        "drafter": drafter,
        "other_precisions": {p: halves[p] for p in precisions[1:]},
    }


def precisions(text: str) -> tuple[str, ...]:
    precisions = tuple(dict.fromkeys(part.strip() for part in text.split(",")))
    if bad := [p for p in precisions if p not in ("bf16", "fp8")]:
        raise argparse.ArgumentTypeError(f"expected bf16, fp8 or both comma-separated, got {bad}")
    return precisions


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`dflash-ring bench topology`'s own options (cli.py registers every bench by name, and hands it the rest)."""
    parser.add_argument("--shape", default="qwen3.6-27b", choices=sorted(SHAPES), help="target shape")
    recipe_argument(parser, default="ddtree")
    attention_geometry_argument(parser)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (a smoke run)")
    parser.add_argument("--target-batches", type=at_least_one, default=3, help="timed target batches of 32,768 tokens")
    parser.add_argument("--seqs", type=at_least_one, default=1, help="drafter samples per step")
    parser.add_argument("--seq-len", type=at_least_one, default=4096, help="drafter tokens per sample")
    parser.add_argument("--drafter-steps", type=at_least_one, default=5, help="timed drafter steps")
    parser.add_argument("--gpus", type=at_least_one, default=8, help="GPUs of the host to lay out")
    parser.add_argument("--profile", action="store_true", help="add the top GPU kernels of both")
    parser.add_argument(
        "--precision",
        type=precisions,
        default=("bf16",),
        help="drafter.precision of the drafter half, or several comma-separated (bf16,fp8): each "
        "drafter half against the one target half",
    )
    fp8_recipe_argument(parser)
    parser.add_argument("--json", action="store_true", help="print the JSON report (the default output)")


def main(args: argparse.Namespace) -> int:
    report = run_topology_bench(
        shape=args.shape,
        recipe=args.recipe,
        tiny=args.tiny,
        target_batches=args.target_batches,
        seqs=args.seqs,
        seq_len=args.seq_len,
        drafter_steps=args.drafter_steps,
        gpus=args.gpus,
        profile=args.profile,
        precisions=args.precision,
        fp8_recipe=args.fp8_recipe,
        drafter_attention=args.drafter_attention,
    )
    print(json.dumps(report, indent=2))
    return 0
