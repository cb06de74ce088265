"""`dflash-ring`: one command, a subcommand per role and per operator action."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import asdict
from pathlib import Path

# Only light modules here: `--help` and argument errors must not wait for torch or transformers
# (~1.5 s on a small box). The ring (torch, numpy) and every role are imported by the command that runs.
from dflash_ring.common.config import Config, ConfigError, default_runtime_root, load_config
from dflash_ring.common.drafter_config import FP8_RECIPES
from dflash_ring.common.output_dir import OutputDirError, check_output_dir
from dflash_ring.common.refusal import Refusal
from dflash_ring.common.run_name import check_run_name

log = logging.getLogger("dflash_ring")
# bench target --shape choices, named here so `--help` needs no transformers (bench/target_shapes.py holds them).
SHAPE_NAMES = ("tiny", "qwen3-8b", "qwen3.6-27b", "qwen3-30b-a3b", "gpt-oss-20b", "moonlight-16b-a3b",
               "nemotron-3-nano-30b-a3b")


# With torchao installed (the fp8 extra), transformers imports it in every process that loads a model, and at import
# torchao warns about kernels it cannot offer here (its C++/CUDA extensions on a CPU torch or another Python, Triton
# missing) and torch that torchao registers enums the old way: nothing the float8 training uses (Python over
# torch._scaled_mm), and lines that would break a refusal's one line. So torchao logs errors only, unless --verbose,
# and torch's note is dropped by its words (its other warnings still show).
TORCH_IMPORT_NOISE = "%s is an Enum subclass and is now natively supported"


class _TorchImportNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(TORCH_IMPORT_NOISE)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if getattr(args, "verbose", False) else logging.INFO,
        format=f"%(asctime)s {args.command}[%(process)d] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if not getattr(args, "verbose", False):
        logging.getLogger("torchao").setLevel(logging.ERROR)
    logging.getLogger("torch.utils._pytree").addFilter(_TorchImportNoise())
    try:
        return args.func(args)
    except (Refusal, RuntimeError, TimeoutError, MemoryError, OSError) as e:
        # The boundary's one rule (common/refusal.py): an input refused by our code, or by a library while it read
        # or built from the user's file, a missing file, a refused ring: one line that says what and what to do,
        # exit 2. The ring's own errors are among these (ConfigMismatchError and RingHeaderError are
        # RuntimeErrors, RingNotFound an OSError), so naming them needs no import of the ring here.
        print(f"dflash-ring {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return 2


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash-ring", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    def with_config(sp: argparse.ArgumentParser) -> argparse.ArgumentParser:
        sp.add_argument("--config", "-c", help="TOML config file (defaults apply to every missing field)")
        sp.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config field; repeatable")
        sp.add_argument("--verbose", "-v", action="store_true")
        return sp

    sp = with_config(sub.add_parser("run", help="the whole run on this host (no config: the embedded CPU default)"))
    sp.add_argument("--workdir", default="runs/tiny", help="where the embedded default keeps its files")
    sp.add_argument("--no-eval", action="store_true", help="skip the held-out acceptance comparison")
    sp.set_defaults(func=cmd_run)

    sp = with_config(sub.add_parser("chaos", help="kill processes of a real run at random; check nothing was lost"))
    sp.add_argument("--kills", type=int, default=12, help="signals to send (SIGKILL or SIGTERM)")
    sp.add_argument("--seconds", type=float, default=60.0, help="the window they are spread over")
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--whole-run-stops", type=int, default=0,
                    help="also stop the whole run this many times in the window (stop --now, SIGTERM to every "
                         "process, SIGKILL to every process then clean, or a drafter SIGSTOPped then stop --now: "
                         "the supervisor fences it), and start it again")
    sp.add_argument("--stop-modes", default="", metavar="MODE[,MODE...]",
                    help="the whole-run stops to take turns among (default: all of stop-now, sigterm-all, "
                         "sigkill-all, stall-stop-now); e.g. stall-stop-now alone for a run of fenced stragglers")
    sp.add_argument("--standbys", type=int, default=0,
                    help="also run this many warm standbys (drafter --standby), killed and started again like drafters")
    sp.add_argument("--epochs", type=int, default=0, help="epochs of the chaos run (0: outlast the window)")
    sp.add_argument("--workdir", default="runs/chaos")
    sp.add_argument("--no-baseline", action="store_true", help="skip the run without faults")
    sp.add_argument("--json", action="store_true", help="print the report as JSON")
    sp.set_defaults(func=cmd_chaos)

    sp = with_config(sub.add_parser("supervisor", help="create the ring and supervise the run"))
    sp.add_argument("--reclaim-stale", action="store_true",
                    help="discard a dead run's segment instead of refusing to start")
    sp.set_defaults(func=cmd_supervisor)

    sp = with_config(sub.add_parser("status", help="slots by state, depth and processes of a run"))
    sp.add_argument("run", nargs="?", help="run name (default: the config's run.name)")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(func=cmd_status)

    sp = with_config(sub.add_parser("stop", help="drain a run and stop it (or stop at once with --now)"))
    sp.add_argument("run", nargs="?")
    sp.add_argument("--now", action="store_true", help="do not drain: untrained ready items are dropped")
    sp.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the run to end")
    sp.set_defaults(func=cmd_stop)

    sp = with_config(sub.add_parser("clean", help="remove a dead run's segment, semaphores and lock files"))
    sp.add_argument("run", nargs="?")
    sp.set_defaults(func=cmd_clean)

    sp = with_config(sub.add_parser("target", help="run target producer I: the frozen target's features into the ring"))
    sp.add_argument("--index", type=int, required=True)
    sp.add_argument("--device", help="e.g. cuda:0 or cpu (default: target.device)")
    sp.set_defaults(func=cmd_target)

    sp = with_config(sub.add_parser("check-target", help="the conformance probe alone: are packed features exact "
                                                         "for this target, and which batch layout would it run"))
    sp.add_argument("--device", help="e.g. cuda:0 or cpu (default: target.device)")
    sp.add_argument("--json", action="store_true", help="print the report as JSON")
    sp.set_defaults(func=cmd_check_target)

    sp = with_config(sub.add_parser("check-config", help="load and validate a config (file and --set) and exit: "
                                                         "0 when every process would accept it, else 2 and why"))
    sp.set_defaults(func=cmd_check_config)

    sp = sub.add_parser("data", help="the data a run trains on")
    data = sp.add_subparsers(dest="data", required=True)
    dp = with_config(data.add_parser("stats", help="per source and in total: rows, tokens, trained tokens, reply "
                                                   "lengths and share of an epoch, after tokenization"))
    dp.add_argument("--json", action="store_true", help="print the report as JSON")
    dp.set_defaults(func=cmd_data_stats)

    sp = with_config(sub.add_parser("drafter", help="run drafter trainer J: claim ring items and train"))
    who = sp.add_mutually_exclusive_group(required=True)
    who.add_argument("--index", type=int)
    who.add_argument("--standby", nargs="?", const="all", metavar="J[,J...]",
                     help="a warm standby: build the drafter, attach, and take over the first of these drafters "
                          "(default: every one) whose process dies; exit 0 at the run's end if none does")
    sp.add_argument("--device", help="e.g. cuda:0 or cpu (default: train.device)")
    sp.set_defaults(func=cmd_drafter)

    sp = with_config(sub.add_parser("regenerate", help="the target's own replies to the prompts of data.path, written "
                                                       "as a data set (regenerate.output); resumes where it stopped"))
    sp.add_argument("--device", help="hf engine: e.g. cuda:0 or cpu (default: target.device)")
    sp.add_argument("--threads", type=int, default=1,
                    help="CPU threads for torch (default 1: on a shared CPU more threads can be many times slower; "
                         "0: torch's default)")
    sp.add_argument("--json", action="store_true", help="print the summary as JSON")
    sp.set_defaults(func=cmd_regenerate)

    sp = sub.add_parser("report", help="a PNG of loss and acceptance length per drafter and per data source, from "
                                       "the record files a run leaves (no tracker needed); given an eval JSON, a "
                                       "reliability diagram of its DSpark drafter's confidence")
    sp.add_argument("run_dir", help="the run's directory (holding tracking/), or its tracking.dir; or a JSON file "
                                    "of `dflash-ring eval --json` with calibration data (a DSpark drafter's eval)")
    sp.add_argument("--out", help="the PNG to write (default: RUN_DIR/report.png; for EVAL.json, "
                                  "EVAL.reliability.png beside it)")
    sp.set_defaults(func=cmd_report)

    sp = sub.add_parser("export", help="write a training checkpoint as an HF drafter directory (DFlash or DSpark)")
    sp.add_argument("checkpoint", help="a step-N directory, or a checkpoint root (its latest)")
    sp.add_argument("out_dir")
    sp.add_argument("--target", help="the target model directory: a DSpark export ships its embed_tokens and lm_head "
                                     "(default: the target.path recorded in the checkpoint)")
    sp.set_defaults(func=cmd_export)

    sp = sub.add_parser("eval", help="offline acceptance (tau) of a drafter against its target on chat prompts")
    sp.add_argument("--drafter", required=True, help="exported drafter directory")
    sp.add_argument("--target", required=True, help="target model directory (HF format, with tokenizer)")
    sp.add_argument("--data", required=True, help="jsonl of chats; each row's last assistant turn is regenerated")
    sp.add_argument("--max-new-tokens", type=int, default=256)
    sp.add_argument("--limit", type=_at_least_one, default=None, help="evaluate only the first K prompts (K >= 1)")
    sp.add_argument("--device", default="cpu")
    sp.add_argument("--threads", type=int, default=1,
                    help="CPU threads for torch (default 1, as inside `run`: small forwards; 0: torch's default)")
    sp.add_argument("--tree-budget", type=_budgets, default=(), metavar="N[,N...]",
                    help="also verify DDTree draft trees of N draft nodes per round (e.g. 16,64,256), on the same "
                         "prompts; their tau is reported next to the chain's")
    sp.add_argument("--temperature", type=float, default=0.0, metavar="T",
                    help="0 (the default): greedy; T > 0: drafts and target tokens sampled at T, verified losslessly "
                         "(speculative sampling: the output is distributed as the target's own sampling at T)")
    sp.add_argument("--seed", type=int, default=0, help="the sampling's seed at --temperature > 0 (default 0)")
    sp.add_argument("--json", action="store_true", help="print the report as JSON")
    sp.set_defaults(func=cmd_eval)

    sp = sub.add_parser("bench", help="benchmarks that print JSON")
    bench = sp.add_subparsers(dest="bench", required=True)
    bp = bench.add_parser("ring", help="ring throughput against multiprocessing and torch queues")
    bp.add_argument("--json", action="store_true", help="print the JSON report (the default output)")
    bp.add_argument("--sizes-mb", default="1,64,256", help="comma-separated item sizes in MB")
    bp.add_argument("--items", type=int, default=0, help="items per case (0: scale with size)")
    bp.set_defaults(func=cmd_bench_ring)
    bp = bench.add_parser("target", help="target forward alone and into the ring: tokens/s, ratio, FLOP utilization")
    bp.add_argument("--json", action="store_true", help="print the JSON report (the default output)")
    bp.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPE_NAMES),
                    help="random-weight target of this shape (tiny: a CPU smoke run)")
    bp.add_argument("--tiny", action="store_true", help="same as --shape tiny")
    bp.add_argument("--device", help="default: cuda if available, else cpu")
    bp.add_argument("--batches", type=int, default=0, help="timed batches per phase (0: 10, or 3 with --tiny)")
    bp.add_argument("--max-tokens", type=int, default=0, help="tokens per batch (0: 32768, or 2048 with --tiny)")
    bp.add_argument("--draft-layers", type=int, default=5, help="target layers captured, by the DFlash rule")
    bp.add_argument("--final-hidden", action="store_true", help="also ship the final hidden state")
    bp.add_argument("--padded", action="store_true", help="padded batches instead of packed ones")
    bp.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak for MFU (H200: 989)")
    bp.add_argument("--no-compile", action="store_true",
                    help="eager layers only (default on a GPU: eager as the same-run baseline, then compiled layers)")
    bp.add_argument("--profile", action="store_true",
                    help="add the top GPU kernels of one batch (hybrid targets: also of the per-sequence baseline)")
    bp.add_argument("--tensor-parallel", type=_at_least_one, default=1, metavar="N",
                    help="shard the target over N ranks (target.tensor_parallel: NCCL on N GPUs, gloo on the CPU) "
                         "and measure it against one rank of the same weights, same run")
    bp.add_argument("--no-baseline", action="store_true",
                    help="with --tensor-parallel: skip the one-rank run (a shape that does not fit one device)")
    bp.set_defaults(func=cmd_bench_target)
    bp = bench.add_parser("topology", help="target and drafter alone for a shape and recipe: the balanced "
                                           "target:drafter ratio and the layout for a host of GPUs")
    bp.add_argument("--shape", default="qwen3.6-27b", choices=sorted(SHAPE_NAMES), help="target shape")
    bp.add_argument("--recipe", default="ddtree", help="drafter.recipe: paper, dpace, ddtree, dspark")
    bp.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (a smoke run)")
    bp.add_argument("--target-batches", type=int, default=3, help="timed target batches of 32,768 tokens")
    bp.add_argument("--seqs", type=int, default=1, help="drafter samples per step")
    bp.add_argument("--seq-len", type=int, default=4096, help="drafter tokens per sample")
    bp.add_argument("--drafter-steps", type=int, default=5, help="timed drafter steps")
    bp.add_argument("--gpus", type=int, default=8, help="GPUs of the host to lay out")
    bp.add_argument("--profile", action="store_true", help="add the top GPU kernels of both")
    bp.add_argument("--precision", type=_precisions, default=("bf16",),
                    help="drafter.precision of the drafter half, or several comma-separated (bf16,fp8): each drafter "
                         "half against the one target half")
    _fp8_recipe_argument(bp)
    bp.add_argument("--json", action="store_true", help="print the JSON report (the default output)")
    bp.set_defaults(func=cmd_bench_topology)
    bp = bench.add_parser("pipeline", help="random-weight target + drafter as real processes vs each alone; "
                                                 "the balanced topology; with kills, restart times")
    bp.add_argument("--json", action="store_true", help="print the JSON report (the default output)")
    bp.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (a smoke run)")
    bp.add_argument("--seconds", type=float, default=90.0, help="steady-state window measured")
    bp.add_argument("--warmup-steps", type=int, default=0, help="drafter steps before the window (0: 8, tiny 3)")
    bp.add_argument("--workdir", help="where the target, data and logs go (default: a new temporary directory)")
    bp.add_argument("--port-base", type=int, default=19460, help="metrics ports of the bench's processes")
    bp.add_argument("--kill-drafter", action="store_true",
                    help="after the window: SIGKILL the drafter, restart it; its start-up and everyone's tokens/s")
    bp.add_argument("--kill-target", action="store_true",
                    help="after the window (and a drafter kill): SIGKILL the target, restart it; likewise")
    bp.add_argument("--standby", action="store_true",
                    help="with --kill-drafter: a second drafter kill with a warm standby waiting (the first is the "
                         "restart baseline); kill to the first step of the process that took over, its phases")
    bp.set_defaults(func=cmd_bench_pipeline)
    bp = bench.add_parser("regenerate", help="the regenerate hf engine's generated tokens/s vs plain model.generate")
    bp.add_argument("--json", action="store_true", help="print the JSON report (the default output)")
    bp.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPE_NAMES),
                    help="random-weight target of this shape (tiny: a CPU smoke run)")
    bp.add_argument("--device", help="default: cuda if available, else cpu")
    bp.add_argument("--prompts", type=int, default=256)
    bp.add_argument("--max-new-tokens", type=int, default=128)
    bp.add_argument("--batch-size", type=int, default=64)
    bp.add_argument("--batch-tokens", type=int, default=65536)
    bp.set_defaults(func=cmd_bench_regenerate)
    bp = bench.add_parser("loader", help="one core: token arrays -> batches in the slot format, vs the target rate")
    bp.add_argument("--json", action="store_true")
    bp.add_argument("--samples", type=int, default=200_000)
    bp.set_defaults(func=cmd_bench_loader)
    bp = bench.add_parser("drafter", help="one drafter training step: time split and FLOP utilization")
    bp.add_argument("--json", action="store_true")
    bp.add_argument("--tiny", action="store_true", help="a small shape (CPU smoke run)")
    bp.add_argument("--steps", type=int, default=5)
    bp.add_argument("--shape", default="qwen3-8b", choices=sorted(set(SHAPE_NAMES) - {"tiny"}),
                    help="target shape (bench/target_shapes.py); --tiny for the CPU smoke run")
    bp.add_argument("--recipe", default="paper", help="drafter.recipe: paper, dpace, ddtree, dspark")
    bp.add_argument("--seqs", type=_at_least_one, default=None,
                    help="samples per step (default: 4 x 3072 tokens where the step fits the GPU, else as many "
                         "samples of the shape's length as fit; given values that do not fit are refused)")
    bp.add_argument("--seq-len", type=_at_least_one, default=None, help="tokens per sample (default: see --seqs)")
    bp.add_argument("--gpu-memory-gib", type=_positive, default=None,
                    help="GPU memory the step must fit, by the estimate of bench/drafter_memory.py, checked before "
                         "anything is built (default: the visible GPU's total; given without a GPU, the shape is "
                         "checked as a GPU would run it, then the CPU smoke run follows)")
    bp.add_argument("--anchors", type=int, default=None, help="anchors per sample (default: the recipe's)")
    bp.add_argument("--anchors-per-group", type=int, default=64, help="blocks per SDPA call (--attention sdpa)")
    bp.add_argument("--attention", choices=["auto", "flex", "sdpa"], default="auto")
    bp.add_argument("--loss-chunk", type=int, default=1024, help="rows of [rows, vocab] logits at once")
    bp.add_argument("--no-check", action="store_true", help="skip the flex-vs-sdpa gradient comparison (GPU)")
    bp.add_argument("--profile", action="store_true", help="add the top GPU kernels of two steps")
    bp.add_argument("--no-compile", action="store_true", help="run the decoder layers eagerly")
    bp.add_argument("--precision", choices=["bf16", "fp8"], default="bf16",
                    help="drafter.precision: the trainable linears in bf16 or FP8 (refused without a capable GPU)")
    _fp8_recipe_argument(bp)
    bp.add_argument("--compile-cache", default="",
                    help="persistent compile cache root (run.compile_cache_dir); run twice to see a warm start")
    bp.set_defaults(func=cmd_bench_drafter)
    bp = bench.add_parser("precision", help="FP8 quality guard (GPU): the same drafter, seed and learnable synthetic "
                                            "items trained in bf16 and in fp8; both curves and the final ratios")
    bp.add_argument("--steps", type=_at_least_one, default=300)
    bp.add_argument("--shape", default="qwen3-8b", choices=sorted(set(SHAPE_NAMES) - {"tiny"}), help="target shape")
    bp.add_argument("--tiny", action="store_true", help="a small member of the shape's family (a quick GPU smoke run)")
    bp.add_argument("--recipe", default="paper", help="drafter.recipe: paper, dpace, ddtree, dspark")
    bp.add_argument("--seqs", type=_at_least_one, default=1, help="samples per step")
    bp.add_argument("--seq-len", type=_at_least_one, default=2048, help="tokens per sample")
    bp.add_argument("--seed", type=int, default=0, help="initial weights, items and anchors")
    bp.add_argument("--every", type=_at_least_one, default=10, help="steps per point of the curves")
    _fp8_recipe_argument(bp)
    bp.set_defaults(func=cmd_bench_precision)
    bp = bench.add_parser("recipes", help="the embedded default trained with each recipe: chain and tree tau on the "
                                          "same held-out prompts, two seeds (CPU, ~1 h)")
    bp.add_argument("--workdir", default="runs/bench-recipes", help="where the runs and recipes.jsonl go")
    bp.add_argument("--variants", default="paper,dpace,ddtree,paper+target_argmax",
                    help="comma-separated: paper, dpace, ddtree, paper+target_argmax, dspark")
    bp.add_argument("--seeds", default="0,1", help="comma-separated train/data seeds")
    bp.add_argument("--tree-budget", type=_budgets, default=(16, 64, 256), metavar="N[,N...]")
    bp.add_argument("--prompts", type=_at_least_one, default=100, help="held-out prompts evaluated")
    bp.add_argument("--max-new-tokens", type=_at_least_one, default=64)
    bp.set_defaults(func=cmd_bench_recipes)
    bp = bench.add_parser("checkpoint", help="a checkpoint's cost to the training step: in the step vs in the "
                                             "background")
    bp.add_argument("--tiny", action="store_true", help="a small shape (CPU smoke run)")
    bp.add_argument("--every", type=_at_least_one, default=100,
                    help="steps between checkpoints (costs are reported as a fraction of this many steps)")
    bp.add_argument("--steps", type=_at_least_one, default=10, help="baseline steps before and after the checkpoints")
    bp.add_argument("--dir", default=None, help="where to write the checkpoints (a fresh directory in it, removed "
                                               "after; default: the system's temporary directory)")
    bp.set_defaults(func=cmd_bench_checkpoint)
    return p


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _fp8_recipe_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fp8-recipe", choices=FP8_RECIPES, default="rowwise",
                        help="drafter.fp8_recipe: torchao's float8 recipe where a drafter trains in fp8")


def _precisions(text: str) -> tuple[str, ...]:
    precisions = tuple(dict.fromkeys(part.strip() for part in text.split(",")))
    if bad := [p for p in precisions if p not in ("bf16", "fp8")]:
        raise argparse.ArgumentTypeError(f"expected bf16, fp8 or both comma-separated, got {bad}")
    return precisions


# The largest --tree-budget a tree eval verifies: a round holds its (N + 1) x (prefix + N + 1) float mask, the
# target's N + 1 rows of logits ([N + 1, vocab], 2.4 GiB in float32 at 4096 nodes and Qwen3's 151,936 rows) and
# the N x N ancestor matrix at once, and building the tree pops up to N paths from a heap; the measured budgets
# are 1..256 (docs/benchmarks.md), so 4096 leaves room without letting a typo take the host's memory.
MAX_TREE_BUDGET = 4096


def _budgets(text: str) -> tuple[int, ...]:
    try:
        budgets = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated node counts such as 16,64,256, got {text!r}")
    if bad := [b for b in budgets if b < 1]:
        raise argparse.ArgumentTypeError(f"a tree budget counts draft nodes and must be at least 1, got {bad}")
    if bad := [b for b in budgets if b > MAX_TREE_BUDGET]:
        raise argparse.ArgumentTypeError(
            f"a tree budget is at most {MAX_TREE_BUDGET} draft nodes, got {bad}: each round holds an "
            f"(N + 1) x (prefix + N + 1) attention mask and N + 1 rows of target logits at once")
    return budgets


def _config(args: argparse.Namespace) -> Config:
    return load_config(args.config, args.set)


def _run_and_lock_dir(args: argparse.Namespace) -> tuple[str, Path]:
    """The run an operator command is about, and its lock directory; a RUN argument is checked like run.name."""
    cfg = _config(args)
    if args.run is not None:
        check_run_name(args.run, f"the RUN argument of `dflash-ring {args.command}`")
    if args.run and args.run != cfg.run.name:
        if cfg.run.run_dir:
            raise ConfigError(f"run {args.run!r} differs from the config's run.name {cfg.run.name!r}")
        return args.run, default_runtime_root() / args.run
    return cfg.run.name, cfg.lock_dir()


def cmd_run(args: argparse.Namespace) -> int:
    from dflash_ring.tools.launcher import run

    return run(args.config, args.set, args.workdir, evaluate=not args.no_eval)


def cmd_chaos(args: argparse.Namespace) -> int:
    from dflash_ring.tools.chaos import RUN_STOP_MODES, ChaosOptions, run_chaos
    from dflash_ring.tools.chaos_report import format_report, report_json

    modes = tuple(args.stop_modes.split(",")) if args.stop_modes else RUN_STOP_MODES
    if unknown := sorted(set(modes) - set(RUN_STOP_MODES)):
        print(f"dflash-ring chaos: error: --stop-modes {','.join(unknown)}: not a whole-run stop; choose among "
              f"{', '.join(RUN_STOP_MODES)}", file=sys.stderr)
        return 2
    opts = ChaosOptions(kills=args.kills, seconds=args.seconds, seed=args.seed, workdir=Path(args.workdir),
                        config=args.config, overrides=args.set, epochs=args.epochs, baseline=not args.no_baseline,
                        whole_run_stops=args.whole_run_stops, stop_modes=modes, standbys=args.standbys)
    if why := opts.refusal():
        print(f"dflash-ring chaos: error: {why}", file=sys.stderr)
        return 2
    report = run_chaos(opts)
    print(report_json(report) if args.json else format_report(report))
    return 0 if report["passed"] else 1


def cmd_supervisor(args: argparse.Namespace) -> int:
    from dflash_ring.common.startup import Startup
    from dflash_ring.supervisor.supervisor import Supervisor

    startup = Startup("supervisor")
    startup.mark("imports")
    cfg = _config(args)
    startup.mark("config")
    sup = Supervisor(cfg, startup, reclaim_stale=args.reclaim_stale)
    try:
        sup.start()
        return sup.run()
    finally:
        sup.close()


def cmd_status(args: argparse.Namespace) -> int:
    from dflash_ring.common.liveness import live_lock_files
    from dflash_ring.common.ring import Ring

    run, lock_dir = _run_and_lock_dir(args)
    with Ring.open(run) as ring:
        st = ring.status()
        lock_dir = ring.lock_dir or lock_dir  # where its processes hold their locks, whatever our config says
    live = {p.stem for p in live_lock_files(lock_dir)}
    for row in st.rows:
        row["alive"] = f"{row['role']}-{row['index']}" in live
    report = asdict(st) | {"depth": st.depth}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    c = st.counters
    print(f"run {st.run}: {st.n_slots} slots x {st.slot_bytes / 2**20:.1f} MiB, depth {st.depth}")
    print("slots: " + ", ".join(f"{k} {v}" for k, v in st.slots_by_state.items()))
    print(f"items: produced {c['produced']}, consumed {c['consumed']}, redelivered {c['redelivered']}, "
          f"reclaimed {c['reclaimed']}, corrupt {c['corrupt']}")
    print(f"producers done: {c['producers_done']}; drain {c['drain']}; shutdown {c['shutdown']}; "
          f"supervisor adoptions {c['supervisor_adoptions']}")
    print(f"{'role':<11}{'index':>5}{'pid':>9}{'alive':>7}{'status':>9}{'heartbeat':>11}{'items':>9}{'restarts':>9}")
    for r in st.rows:
        print(f"{r['role']:<11}{r['index']:>5}{r['pid']:>9}{'yes' if r['alive'] else 'no':>7}{r['status']:>9}"
              f"{r['heartbeat_age_s']:>10.1f}s{r['items']:>9}{r['restarts']:>9}")
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    from dflash_ring.common.layout import Counter
    from dflash_ring.common.ring import Ring
    from dflash_ring.common.layout import STOP_DRAIN, STOP_NOW

    run, _ = _run_and_lock_dir(args)
    with Ring.open(run) as ring:
        request = STOP_NOW if args.now else STOP_DRAIN
        ring.set_flag(Counter.STOP_REQUEST, max(request, ring.counter(Counter.STOP_REQUEST)))
        ring.broadcast()
    print(f"asked run {run!r} to stop{' now' if args.now else ' after draining'}; waiting up to {args.timeout:.0f}s")
    deadline = time.monotonic() + args.timeout
    while Ring.exists(run):
        if time.monotonic() > deadline:
            print(f"run {run!r} has not ended after {args.timeout:.0f}s: is its supervisor running?", file=sys.stderr)
            return 1
        time.sleep(0.2)
    print(f"run {run!r} stopped")
    return 0


def cmd_clean(args: argparse.Namespace) -> int:
    from dflash_ring.supervisor.cleanup import clean

    run, lock_dir = _run_and_lock_dir(args)
    cfg = _config(args)
    removed = clean(run, lock_dir, cfg.target.state_dir, cfg.train.checkpoint_dir)
    print(f"removed {', '.join(removed)}" if removed else f"nothing of run {run!r} was left")
    return 0


def _checked_index(cfg: Config, role: str, index: int, flag: str = "--index") -> int:
    """Before any loading: an index the run's topology has."""
    n = cfg.topology.producers if role == "producers" else cfg.topology.consumers
    if not 0 <= index < n:
        raise ConfigError(f"{flag} {index} is out of range: topology.{role} = {n}, so the index is 0..{n - 1} "
                          f"(raise topology.{role} in the config to add one)")
    return index


def cmd_target(args: argparse.Namespace) -> int:
    from dflash_ring.common.startup import Startup
    from dflash_ring.producer.process import run_producer

    startup = Startup(f"target {args.index}")
    startup.mark("imports")
    cfg = _config(args)
    startup.mark("config")
    return run_producer(cfg, _checked_index(cfg, "producers", args.index), args.device, startup)


def cmd_check_target(args: argparse.Namespace) -> int:
    from dflash_ring.producer.conformance import choose_packing, report_json
    from dflash_ring.producer.target import TargetModel, resolve_device
    from dflash_ring.common.target_config import TargetConfigError
    from dflash_ring.consumer.head_loader import probe_target_head

    cfg = _config(args).target
    mode = cfg.packing
    # Refusals of the model (TargetConfigError, HeadProbeError) are one line at main's boundary.
    target = TargetModel.load(cfg, resolve_device(args.device or cfg.device), packed=False)
    report = choose_packing(target, "auto" if mode == "packed" else mode)  # report first, refuse below
    head, head_errors = probe_target_head(cfg.path)  # what the drafter derives at its start
    if args.json:
        body = json.loads(report_json(report, mode, target.packed))
        body["head"] = {**head.to_json(), "verified_relative_error": asdict(head_errors)}
        print(json.dumps(body, indent=2))
    else:
        print(f"target {cfg.path}: layers {target.layer_ids} captured of {len(target.decoder.layers)}")
        if report is not None:
            print(f"probe: sequences of {report.lengths} tokens on {report.device}\n{report.table()}\n{report.summary()}")
        print(f"target.packing = {mode!r}: {'packed' if target.packed else 'padded'} batches")
        print(f"drafter head: {head.describe()} (relative error: embedding {head_errors.embedding:.2g}, "
              f"logits {head_errors.logits:.2g})")
    if mode == "packed" and not target.packed:
        print("dflash-ring check-target: error: target.packing = \"packed\" would refuse to start: "
              "set it to \"auto\" or \"padded\"", file=sys.stderr)
        return 2
    return 0


def cmd_check_config(args: argparse.Namespace) -> int:
    """What every role does first (load_config: types, each number's range, the sections' own checks), alone:
    the cheap way to vet a config before a run, and what tests/test_config_bounds.py drives. With
    drafter.precision = "fp8" also what a drafter checks first: this host's GPU (train.device) and torchao. Then
    tracking.dir as a drafter checks it at start. With a target.path that exists, also its config.json as every
    role reads it, the drafter's settings against it, and the model transformers builds from it (on the meta
    device) against its weights' shapes."""
    cfg = _config(args)
    if cfg.drafter.precision == "fp8":
        from dflash_ring.consumer.fp8 import check_precision  # torch: only for a config that needs a GPU's look

        check_precision(cfg.drafter.precision, cfg.train.device)
    # The output directories a role refuses at its start (tracking.dir: every drafter's record file).
    try:
        check_output_dir(cfg.tracking_dir())
    except (OutputDirError, OSError) as e:  # OSError: a path it cannot even stat
        raise ConfigError(f"tracking.dir: {e}") from None
    if cfg.target.path and Path(cfg.target.path).expanduser().is_dir():
        # What every role reads of the target (config.json's geometry) and what a drafter checks against it (mask
        # token, layers); then the model as transformers builds it from config.json, on the meta device, against
        # the weights' shapes (common/target_config.check_target_builds): config classes and headers, no weights.
        from dflash_ring.common.config import drafter_target_settings
        from dflash_ring.common.target_config import check_target_builds

        drafter_target_settings(cfg.drafter, cfg.target)
        check_target_builds(cfg.target.path)
        if cfg.target.tensor_parallel > 1:  # the target's counts and family, this host's devices
            from dflash_ring.producer.target import resolve_device
            from dflash_ring.producer.tensor_group import check_group

            check_group(cfg.target, resolve_device(cfg.target.device))
    print(f"config OK: run {cfg.run.name!r}" + (f" from {args.config}" if args.config else " (defaults)"))
    return 0


def cmd_data_stats(args: argparse.Namespace) -> int:
    from dflash_ring.producer.data_stats import data_stats, print_table
    from dflash_ring.producer.pretokenized import load_sources, target_tokenizer

    cfg = _config(args)
    sources = load_sources(cfg.data, target_tokenizer(cfg.target))  # the producer's tokenization and cache
    stats = data_stats(sources, cfg.data.eval_fraction, cfg.data.seed)
    if args.json:
        print(stats.to_json())
    else:
        print_table(stats)
    return 0


def cmd_drafter(args: argparse.Namespace) -> int:
    from dflash_ring.common.startup import Startup
    from dflash_ring.consumer.process import run_drafter

    startup = Startup("drafter standby" if args.standby else f"drafter {args.index}")
    startup.mark("imports")
    cfg = _config(args)
    startup.mark("config")
    if args.standby is None:
        return run_drafter(cfg, [_checked_index(cfg, "consumers", args.index)], args.device, startup)
    return run_drafter(cfg, _standby_indices(cfg, args.standby), args.device, startup, standby=True)


def _standby_indices(cfg: Config, text: str) -> list[int]:
    """`--standby`'s drafters: "all", or indices the run's topology has, each once."""
    if text == "all":
        return list(range(cfg.topology.consumers))
    try:
        indices = [int(x) for x in text.split(",")]
    except ValueError:
        raise ConfigError(f"--standby {text!r}: expected drafter indices like 0,1,2 (or nothing: every "
                          "drafter)") from None
    if len(set(indices)) != len(indices):
        raise ConfigError(f"--standby {text!r} names a drafter twice")
    return [_checked_index(cfg, "consumers", i, "--standby") for i in indices]


def cmd_regenerate(args: argparse.Namespace) -> int:
    import datasets
    import torch
    import transformers
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from dflash_ring.common.metrics import REGENERATE, RegenerateMetrics, serve
    from dflash_ring.producer.regenerate import check_settings, format_summary, regenerate, summary_json
    from dflash_ring.tools.launcher import console

    cfg = _config(args)
    check_settings(cfg.regenerate, cfg.data, cfg.target)  # before the metrics port, the data set or the model
    datasets.disable_progress_bars()  # the one progress display is ours
    transformers.utils.logging.disable_progress_bar()
    if args.threads:
        torch.set_num_threads(args.threads)
    metrics = RegenerateMetrics(serve(cfg.metrics, cfg.run.name, REGENERATE))
    bar = Progress(TextColumn("regenerating"), BarColumn(), MofNCompleteColumn(), TextColumn("rows"),
                   TextColumn("{task.fields[rate]}"), TextColumn("ETA"), TimeRemainingColumn(),
                   console=console(), disable=not sys.stderr.isatty())
    tasks: list = []

    def progress(done: int, total: int) -> None:
        if not tasks:  # created at the first report, so rows finished by earlier starts do not count as speed
            tasks.append(bar.add_task("rows", total=total, completed=done, rate=""))
            return
        speed = bar.tasks[0].speed
        bar.update(tasks[0], completed=done, rate=f"{speed:.1f} rows/s" if speed else "")

    handlers = [h for h in logging.getLogger().handlers if isinstance(h, logging.StreamHandler)]
    try:
        with bar:
            for h in handlers:  # log lines above the bar, not through it
                h.setStream(sys.stderr)
            summary = regenerate(cfg.regenerate, cfg.data, cfg.target, device=args.device, metrics=metrics,
                                 progress=progress)
    except KeyboardInterrupt:
        print("dflash-ring regenerate: interrupted; finished shards are kept: run the same command again to resume",
              file=sys.stderr)
        return 130
    finally:
        for h in handlers:
            h.setStream(sys.__stderr__)
    print(summary_json(summary) if args.json else format_summary(summary))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from dflash_ring.consumer.checkpoint import export_checkpoint

    check_output_dir(args.out_dir)  # before loading anything

    print(f"exported {export_checkpoint(args.checkpoint, args.out_dir, args.target)}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from dflash_ring.tools.report import write_report

    out, what = write_report(Path(args.run_dir), Path(args.out) if args.out else None)
    print(f"{out}: {what}")
    return 0


def cmd_bench_loader(args: argparse.Namespace) -> int:
    from dflash_ring.bench.loader import run_loader_bench

    print(json.dumps(run_loader_bench(args.samples), indent=2))
    return 0


def cmd_bench_drafter(args: argparse.Namespace) -> int:
    from dflash_ring.bench.drafter import run_drafter_bench

    print(json.dumps(run_drafter_bench(args.tiny, args.steps, seqs=args.seqs, seq_len=args.seq_len,
                                       anchors=args.anchors, shape=args.shape, recipe=args.recipe,
                                       anchors_per_group=args.anchors_per_group,
                                       attention=args.attention, loss_chunk=args.loss_chunk,
                                       check=not args.no_check, profile=args.profile,
                                       compile=not args.no_compile, compile_cache=args.compile_cache,
                                       gpu_memory_gib=args.gpu_memory_gib, precision=args.precision,
                                       fp8_recipe=args.fp8_recipe), indent=2))
    return 0


def cmd_bench_precision(args: argparse.Namespace) -> int:
    from dflash_ring.bench.precision import run_precision_bench

    print(json.dumps(run_precision_bench(steps=args.steps, shape=args.shape, recipe=args.recipe, seqs=args.seqs,
                                         seq_len=args.seq_len, seed=args.seed, every=args.every, tiny=args.tiny,
                                         fp8_recipe=args.fp8_recipe),
                     indent=2))
    return 0


def cmd_bench_checkpoint(args: argparse.Namespace) -> int:
    from dflash_ring.bench.checkpoint import run_checkpoint_bench

    print(json.dumps(run_checkpoint_bench(args.tiny, args.every, args.steps, args.dir), indent=2))
    return 0


def cmd_bench_regenerate(args: argparse.Namespace) -> int:
    from dflash_ring.bench.regenerate import run_regenerate_bench

    print(json.dumps(run_regenerate_bench(shape=args.shape, device=args.device, prompts=args.prompts,
                                          max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                                          batch_tokens=args.batch_tokens), indent=2))
    return 0


def cmd_bench_ring(args: argparse.Namespace) -> int:
    from dflash_ring.bench.ring import run_ring_bench

    report = run_ring_bench([float(s) for s in args.sizes_mb.split(",")], args.items)
    print(json.dumps(report, indent=2))
    return 0


def cmd_bench_pipeline(args: argparse.Namespace) -> int:
    from dflash_ring.bench.pipeline import run_pipeline_bench

    report = run_pipeline_bench(tiny=args.tiny, seconds=args.seconds, warmup_steps=args.warmup_steps,
                                workdir=args.workdir, port_base=args.port_base, kill_drafter=args.kill_drafter,
                                kill_target=args.kill_target, standby=args.standby)
    print(json.dumps(report, indent=2))
    return 0


def cmd_bench_recipes(args: argparse.Namespace) -> int:
    from dflash_ring.bench.recipes import run_recipes_bench

    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        print(f"dflash-ring bench recipes: error: --seeds takes comma-separated integers, got {args.seeds!r}",
              file=sys.stderr)
        return 2
    try:
        report = run_recipes_bench(args.workdir, variants=args.variants.split(","), seeds=seeds,
                                   budgets=args.tree_budget, prompts=args.prompts, max_new_tokens=args.max_new_tokens)
    except ValueError as e:
        print(f"dflash-ring bench recipes: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2))
    return 0


def cmd_bench_target(args: argparse.Namespace) -> int:
    from dflash_ring.bench.target import run_target_bench

    if args.tensor_parallel > 1:
        from dflash_ring.bench.target_parallel import run_tensor_parallel_bench

        report = run_tensor_parallel_bench(shape="tiny" if args.tiny else args.shape, device=args.device,
                                           tensor_parallel=args.tensor_parallel, batches=args.batches,
                                           max_tokens=args.max_tokens, draft_layers=args.draft_layers,
                                           packed=not args.padded, baseline=not args.no_baseline)
        print(json.dumps(report, indent=2))
        return 0

    report = run_target_bench(shape="tiny" if args.tiny else args.shape, device=args.device, batches=args.batches, max_tokens=args.max_tokens,
                              draft_layers=args.draft_layers, final_hidden=args.final_hidden, packed=not args.padded,
                              peak_flops=args.peak_tflops * 1e12, compile=not args.no_compile, profile=args.profile)
    print(json.dumps(report, indent=2))
    return 0


def cmd_bench_topology(args: argparse.Namespace) -> int:
    from dflash_ring.bench.topology import run_topology_bench

    report = run_topology_bench(shape=args.shape, recipe=args.recipe, tiny=args.tiny,
                                target_batches=args.target_batches, seqs=args.seqs, seq_len=args.seq_len,
                                drafter_steps=args.drafter_steps, gpus=args.gpus, profile=args.profile,
                                precisions=args.precision, fp8_recipe=args.fp8_recipe)
    print(json.dumps(report, indent=2))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from dflash_ring.common.device import checked_device
    from dflash_ring.consumer.evaluate import evaluate_drafter, format_report, report_json

    checked_device(args.device)  # before any model loads
    try:
        report = evaluate_drafter(args.drafter, args.target, args.data, max_new_tokens=args.max_new_tokens,
                                  limit=args.limit, device=args.device, cpu_threads=args.threads or None,
                                  tree_budgets=args.tree_budget, temperature=args.temperature, seed=args.seed)
    except (OSError, ValueError) as e:  # missing files, a drafter of another target, a malformed data row
        print(f"dflash-ring eval: error: {e}", file=sys.stderr)
        return 2
    print(report_json(report) if args.json else format_report(report))
    return 0
