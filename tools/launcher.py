"""`dflash-ring run`: the whole run on one host: supervisor, targets and drafters as separate processes.

The launcher is only a convenience over what systemd does per GPU in
production: it starts each role with the same config file, prefixes their
logs, shows progress read from the ring's rows and the processes' /metrics
(never from log lines, which are for people), turns Ctrl-C into a drain
(every drafter checkpoints), and ends with a summary and an exported drafter.
With no config it runs the embedded default: a tiny trained target and its
corpus, built on first use and cached, on the CPU.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from statistics import fmean, stdev

from rich.console import Console
from rich.table import Table

from dflash_ring.common.config.dump import dump_toml
from dflash_ring.common.config.load import load_config
from dflash_ring.common.config.schema import Config
from dflash_ring.common.config.drafter import DrafterConfig
from dflash_ring.common.config.target import TargetConfig
from dflash_ring.common.layout import Role
from dflash_ring.common.output_dir import OutputDirError, check_output_dir
from dflash_ring.common.metrics import DRAFTER, check_ports_free, run_ports
from dflash_ring.common.ring import Ring, RingNotFound
from dflash_ring.tools.fleet import forward_lines, role_command, scrape, spawn

DEFAULT_CACHE = "~/.cache/dflash_ring"
POLL_S, PRINT_EVERY_S = 2.0, 10.0
# Child processes write lines into prefixed logs: progress bars there are only `\r` fragments, and the
# launcher's own progress line says it all. HF_HUB_* also covers transformers' bars; TQDM_DISABLE the rest.
QUIET_BARS = {"HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1"}


def console() -> Console:
    """stderr console; piped, rich would wrap every line at 80 columns, so it gets room and no wrapping."""
    if sys.stderr.isatty():
        return Console(stderr=True)
    return Console(stderr=True, width=_columns() or 200, soft_wrap=True)


def _columns() -> int:
    """$COLUMNS when it is a positive integer, else 0: a terminal's hint, ignored when it is not one (as shutil and
    rich do), never a ValueError traceback from `COLUMNS=abc dflash-ring run`."""
    text = os.environ.get("COLUMNS", "").strip()
    return int(text) if text.isdigit() else 0


def embedded_run_config(workdir: Path, target: Path, mask_token_id: int, data: Path) -> Config:
    """The embedded default as a Config: the tiny trained target, 1 producer, 2 drafters, CPU, trained on `data`."""
    d = Config()
    cfg = Config(
        run=replace(d.run, name="tiny", run_dir=str(workdir / "locks")),
        ring=replace(d.ring, slots=8, slot_bytes=8 << 20, slot_header_bytes=64 << 10, wait_s=0.05),
        topology=replace(d.topology, producers=1, consumers=2),
        data=replace(
            d.data,
            path=str(data),
            max_length=256,
            max_tokens_per_batch=2048,
            epochs=2,
            cache_dir=str(workdir / "data-cache"),
        ),
        target=replace(
            d.target,
            path=str(target),
            layer_ids=[1, 2],
            mask_token_id=mask_token_id,
            state_dir=str(workdir / "state"),
            device="cpu",
        ),
        drafter=DrafterConfig(num_hidden_layers=2, block_size=8, num_anchors=48),  # derives layer_types: no replace
        train=replace(
            d.train,
            lr=3e-3,
            warmup_ratio=0.05,
            device="cpu",
            anchors_per_group=64,
            average_every_steps=10,
            checkpoint_dir=str(workdir / "checkpoints"),
            checkpoint_every_steps=100,
            log_every_steps=10,
        ),
        tracking=replace(d.tracking, backends=["tensorboard"]),  # curves for `tensorboard --logdir runs/tiny`
    )
    cfg.validate()
    return cfg


EMBEDDED_HEADER = """The embedded default, written by `dflash-ring run`: copy it to start your own.
Only the fields this run sets are here; every other field has its default (common/config/schema.py).
Metrics: /metrics on metrics.bind (127.0.0.1): supervisor port_base (9460), target i port_base + 1 + i,
drafter j port_base + 100 + j."""


def checked_cache(cache_dir: str = DEFAULT_CACHE) -> Path:
    """The embedded default's cache (under $HOME), checked writable before anything is built or printed: with HOME a
    file or read-only the build failed deep inside with '[Errno 20] Not a directory' naming neither HOME nor a fix."""
    cache = Path(cache_dir).expanduser()
    try:
        check_output_dir(cache)
    except OutputDirError as e:
        raise OutputDirError(
            f"the embedded default's cache {cache_dir} (HOME={os.environ.get('HOME', '')!r}): {e}; set HOME to a "
            "directory you can write to"
        ) from None
    return cache


def embedded_config(workdir: Path, cache_dir: str = DEFAULT_CACHE) -> Path:
    """Write the embedded default's config (building the tiny target and its regenerated replies on first
    use); returns its path."""
    from dflash_ring.embedded.tiny_replies import ensure_tiny_replies
    from dflash_ring.embedded.tiny_target import TRAIN_FILE, ensure_tiny_target, read_marker

    cache = checked_cache(cache_dir)
    target = ensure_tiny_target(cache / "tiny-target")
    replies = ensure_tiny_replies(target, target / TRAIN_FILE, cache, workdir)
    cfg = embedded_run_config(workdir, target, read_marker(target)["mask_token_id"], replies)
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "run.toml"
    path.write_text(
        dump_toml(
            cfg,
            header=EMBEDDED_HEADER,
            comments={
                "data.path": "the tiny corpus's prompts with the tiny target's own replies "
                "(regenerate.toml makes them)",
                "target": "the tiny target lives in the cache; `dflash-ring eval --target` takes this path",
                "target.layer_ids": "the target layers the drafter is fed",
            },
        )
    )
    return path


def corpus_replies_config(run_cfg: Path, workdir: Path) -> Path:
    """The embedded run again, on the corpus's own replies: the comparison `dflash-ring run` prints."""
    from dflash_ring.embedded.tiny_target import TRAIN_FILE

    cfg = load_config(run_cfg)
    d = workdir / "corpus-replies"
    cfg = replace(
        cfg,
        run=replace(cfg.run, name="tiny-corpus", run_dir=str(d / "locks")),
        data=replace(cfg.data, path=str(Path(cfg.target.path) / TRAIN_FILE)),
        target=replace(cfg.target, state_dir=str(d / "state")),
        train=replace(cfg.train, checkpoint_dir=str(d / "checkpoints")),
    )
    path = workdir / "corpus-replies.toml"
    path.write_text(dump_toml(cfg, header="The embedded default on the tiny corpus's own replies, for comparison."))
    return path


@dataclass
class DrafterView:
    """What the launcher last saw of one drafter (its /metrics survive only as long as it does)."""

    step: int = 0
    items: int = 0
    loss: float | None = None
    accept: float | None = None
    tokens: float = 0.0
    first_seen: tuple[float, float] | None = None  # (time, tokens) of the first scrape
    last_seen: tuple[float, float] | None = None
    recent: list[tuple[float, float]] = field(default_factory=list)  # (time, tokens) over the last print interval
    recent_tps: float | None = None

    def update(self, now: float, sample: dict[str, float]) -> None:
        tokens = sample.get("dflash_ring_drafter_tokens_total", 0.0)
        # Over a print interval, not between two polls: a CPU step can take longer than a poll.
        self.recent = [(t, n) for t, n in self.recent if now - t <= PRINT_EVERY_S] + [(now, tokens)]
        if now > self.recent[0][0]:
            self.recent_tps = (tokens - self.recent[0][1]) / (now - self.recent[0][0])
        self.first_seen = self.first_seen or (now, tokens)
        self.last_seen, self.tokens = (now, tokens), tokens
        self.step = int(sample.get("dflash_ring_drafter_step", self.step))
        if sample.get("dflash_ring_drafter_steps_total"):  # gauges read 0 until the first step
            self.loss = sample.get("dflash_ring_drafter_loss")
            self.accept = sample.get("dflash_ring_drafter_acceptance_length")

    def mean_tps(self) -> float | None:
        if self.first_seen is None or self.last_seen[0] <= self.first_seen[0]:
            return None
        return (self.last_seen[1] - self.first_seen[1]) / (self.last_seen[0] - self.first_seen[0])


@dataclass
class Progress:
    """The run's numbers from the ring (items, planned, depth, per-row items) and the drafters' /metrics."""

    cfg: Config
    started: float = field(default_factory=time.monotonic)
    ring_seen: bool = False
    ring_gone: bool = False
    consumed: int = 0
    planned: int = 0
    depth: int = 0
    slots: int = 0
    first_item: tuple[float, int] | None = None  # (time, consumed) when items first moved: the rate's origin
    drafters: dict[int, DrafterView] = field(default_factory=dict)

    def poll(self) -> None:
        now = time.monotonic()
        try:
            with Ring.open(self.cfg.run.name) as ring:
                st, self.planned = ring.status(), ring.planned_items()
        except (RingNotFound, OSError, RuntimeError):
            self.ring_gone = self.ring_seen  # once seen, a missing ring means the supervisor removed it: done
            st = None
        if st is not None:
            self.ring_seen = True
            self.consumed, self.depth, self.slots = st.counters["consumed"], st.depth, st.n_slots
            if self.first_item is None and self.consumed:
                self.first_item = (now, self.consumed)
            for row in st.rows:
                if row["role"] == Role.CONSUMER.name.lower():
                    self.drafters.setdefault(row["index"], DrafterView()).items = row["items"]
        if self.cfg.metrics.enabled:
            for j in range(self.cfg.topology.consumers):
                if (sample := scrape(self.cfg.metrics, DRAFTER, j)) is not None:
                    self.drafters.setdefault(j, DrafterView()).update(now, sample)

    def line(self, final: bool = False) -> str | None:
        """One progress line; None once the run is over, but for the `final` one (the last values seen)."""
        if self.ring_gone and not final:
            return None
        if not self.ring_seen:
            return (
                None
                if final
                else (
                    f"waiting for the ring ({time.monotonic() - self.started:.0f}s: "
                    "supervisor starting, models loading)"
                )
            )
        parts = [f"items {self.consumed}/{self.planned or '?'}"]
        if self.planned:
            parts[0] += f" {100 * self.consumed / self.planned:.0f}%"
        rate = eta = None
        if self.first_item is not None and (dt := time.monotonic() - self.first_item[0]) > 0:
            rate = (self.consumed - self.first_item[1]) / dt
            if rate > 0 and self.planned:
                eta = max(0.0, (self.planned - self.consumed) / rate)
        if rate is not None and self.consumed > self.first_item[1]:
            parts.append(f"{rate:.2f}/s")
        parts.append(f"depth {self.depth}/{self.slots}")
        views = [self.drafters[j] for j in sorted(self.drafters)]
        if self.cfg.metrics.enabled and views:
            parts.append("steps " + ",".join(str(v.step) for v in views))
            if losses := [v.loss for v in views if v.loss is not None]:
                parts.append(f"loss {sum(losses) / len(losses):.3f}")
            if accepts := [v.accept for v in views if v.accept is not None]:
                parts.append(f"accept_len {sum(accepts) / len(accepts):.2f}")
            if tps := [v.recent_tps for v in views if v.recent_tps is not None]:
                parts.append(f"drafter tok/s {sum(tps):.0f}")
        parts.append(f"ETA {eta:.0f}s" if eta is not None else "ETA ?")
        return " ".join(parts)


def final_state(checkpoint_dir: str | Path, index: int) -> dict[str, int] | None:
    """A drafter's last checkpoint: the steps and items its own final line reports (its metrics are gone)."""
    from dflash_ring.common.bounded_read import CONFIG_BYTES, read_text
    from dflash_ring.common.lifecycle.checkpoint_choice import resume_order

    root = Path(checkpoint_dir) / f"drafter-{index}"
    try:  # the checkpoint a resume takes first, by the store's rule; its record read by the kind and size rule
        info = json.loads(read_text(resume_order(root)[0] / "trainer.json", CONFIG_BYTES, ValueError, "trainer.json"))
    except (OSError, ValueError, IndexError):
        return None
    return {"step": int(info["step"]), "items": int(info.get("items", 0))}


class Launch:
    def __init__(self, cfg_path: Path, overrides: list[str], env: dict[str, str] | None = None):
        self.env = {**QUIET_BARS, **(env or {})}
        self.cfg_path = cfg_path
        self.overrides = overrides
        self.cfg: Config = load_config(cfg_path, overrides)
        self.console = console()
        self.progress = Progress(self.cfg)
        self.procs: dict[str, subprocess.Popen] = {}
        self._threads: list[threading.Thread] = []

    def _spawn(self, name: str, reclaim_stale: bool = False) -> None:
        proc = spawn(role_command(name, self.cfg_path, self.overrides, reclaim_stale=reclaim_stale), env=self.env)
        self.procs[name] = proc
        t = threading.Thread(target=forward_lines, args=(name, proc.stdout), daemon=True)
        t.start()
        self._threads.append(t)

    def start(self) -> None:
        t = self.cfg.topology
        check_ports_free(self.cfg.metrics, self.cfg.topology)  # one clear error now, not one per child process
        if self.cfg.drafter.precision == "fp8":  # likewise: the drafters would each refuse it
            from dflash_ring.consumer.modeling.fp8 import check_precision

            check_precision(self.cfg.drafter.precision, self.cfg.train.device)
        if self.cfg.metrics.enabled:
            ports = ", ".join(f"{name} {port}" for name, port in run_ports(self.cfg.metrics, self.cfg.topology).items())
            self.console.print(f"metrics at http://{self.cfg.metrics.bind}:PORT/metrics: {ports}")
        self._spawn("supervisor", reclaim_stale=True)
        for i in range(t.producers):
            self._spawn(f"target-{i}")
        for j in range(t.consumers):
            self._spawn(f"drafter-{j}")

    def wait(self) -> int:
        """Wait for every process; Ctrl-C (or SIGTERM) drains the run through the supervisor."""
        stopping = False

        def drain(*_: object) -> None:
            nonlocal stopping
            sup = self.procs.get("supervisor")
            if sup and sup.poll() is None:
                sup.send_signal(signal.SIGTERM)  # a second Ctrl-C sends a second SIGTERM: stop now
            stopping = True

        old = signal.signal(signal.SIGINT, drain), signal.signal(signal.SIGTERM, drain)
        try:
            printed = polled = 0.0
            while any(p.poll() is None for p in self.procs.values()):
                now = time.monotonic()
                if now - polled >= POLL_S:
                    self.progress.poll()
                    polled = now
                    if now - printed >= PRINT_EVERY_S and (line := self.progress.line()) is not None:
                        print(f"  progress | {line}", file=sys.stderr, flush=True)
                        printed = now
                if self.procs["supervisor"].poll() is not None and not stopping:
                    drain()  # the supervisor died: stop the rest rather than train blind
                elif not stopping and (why := self.cannot_finish()) is not None:
                    print(
                        f"  launcher | {why}: the run cannot finish, so it drains (what the ring holds goes to "
                        "the replay lists) and ends with that exit code",
                        file=sys.stderr,
                        flush=True,
                    )
                    drain()
                time.sleep(0.2)
        finally:
            signal.signal(signal.SIGINT, old[0])
            signal.signal(signal.SIGTERM, old[1])
        if (line := self.progress.line(final=True)) is not None:  # where the run ended, however short it was
            print(f"  progress | {line}", file=sys.stderr, flush=True)
        for t in self._threads:
            t.join(timeout=5)
        return max(abs(p.returncode) for p in self.procs.values())

    def cannot_finish(self) -> str | None:
        """Why the run can no longer end by itself, or None. This launcher restarts nobody (systemd does, under
        the units): a target that failed leaves its shard unfinished, and once every drafter has exited and one
        failed (a full disk under train.checkpoint_dir, a refused setting) nothing trains what the ring holds.
        The supervisor would wait for them for ever; a run that ends with the failure's exit code is seen."""

        def failed(role: str) -> dict[str, int]:
            return {n: p.returncode for n, p in self.procs.items() if n.startswith(role) and p.poll() not in (None, 0)}

        if targets := failed("target-"):
            return ", ".join(f"{n} exited with {rc}" for n, rc in targets.items())
        drafters = [p for n, p in self.procs.items() if n.startswith("drafter-")]
        if drafters and all(p.poll() is not None for p in drafters) and (bad := failed("drafter-")):
            return "every drafter exited (" + ", ".join(f"{n} with {rc}" for n, rc in bad.items()) + ")"
        return None

    def summary(self) -> Table:
        """Steps and items from each drafter's last checkpoint (what its final line says); the rest as last seen."""
        done = {j: final_state(self.cfg.train.checkpoint_dir, j) for j in range(self.cfg.topology.consumers)}
        trained = sum(d["items"] for d in done.values() if d) if all(done.values()) else self.progress.consumed
        table = Table(
            title=f"run {self.cfg.run.name}: {time.monotonic() - self.progress.started:.0f}s, "
            f"{trained} of {self.progress.planned or '?'} planned items trained"
        )
        for col in ("process", "exit", "steps", "items", "loss (last seen)", "accept_len (last seen)", "tok/s"):
            table.add_column(col)
        for name, proc in self.procs.items():
            cells = [""] * 5
            if name.startswith("drafter-"):
                j = int(name.split("-")[1])
                v = self.progress.drafters.get(j, DrafterView())
                done = final_state(self.cfg.train.checkpoint_dir, j)
                tps = v.mean_tps()
                cells = [
                    str(done["step"]) if done else str(v.step),
                    str(done["items"]) if done else str(v.items),
                    f"{v.loss:.4f}" if v.loss is not None else "",
                    f"{v.accept:.2f}" if v.accept is not None else "",
                    f"{tps:.0f}" if tps is not None else "",
                ]
            table.add_row(name, str(proc.returncode), *cells)
        return table


def run(config: str | None, overrides: list[str], workdir: str = "runs/tiny", evaluate: bool = True) -> int:
    con = console()
    work = Path(workdir)
    embedded = config is None
    if embedded:
        checked_cache()  # before the banner: a refusal is the command's one line
        con.print("embedded default: tiny trained target (built and cached on first use), 1 target, 2 drafters, CPU")
        cfg_path = embedded_config(work)
        con.print(f"config: {cfg_path} (copy it to start your own); tiny target: {load_config(cfg_path).target.path}")
    else:
        cfg_path = Path(config)
    trained = train_and_export(cfg_path, overrides, embedded, con)
    if isinstance(trained, int):
        return trained
    cfg, exported, steps = trained
    if embedded and evaluate:
        con.print("the same run on the corpus's own replies, for comparison:")
        other = train_and_export(corpus_replies_config(cfg_path, work), overrides, embedded, con)
        if isinstance(other, int):
            return other
        _compare(
            cfg.drafter,
            cfg.target,
            Path(cfg.train.checkpoint_dir).parent / "drafter-untrained",
            {
                "trained on the target's regenerated replies": (exported, steps),
                "trained on the corpus's replies": other[1:],
            },
            con,
        )
    return 0


def train_and_export(
    cfg_path: Path, overrides: list[str], embedded: bool, con: Console
) -> tuple[Config, Path, int] | int:
    """One whole run, then drafter 0's last checkpoint exported beside the checkpoints (drafter/); the exit
    code if a process failed."""
    # Several CPU processes on a few cores: one thread each, or they thrash (a 20-30x slowdown seen here).
    launch = Launch(cfg_path, overrides, env={"OMP_NUM_THREADS": "1"} if embedded else None)
    if note := launch.cfg.drafter.recipe_note():
        con.print(f"[yellow]note: {note}[/]")
    out_dir = Path(launch.cfg.train.checkpoint_dir).parent / "drafter"
    launch.start()
    rc = launch.wait()
    con.print(launch.summary())
    _curves(Path(launch.cfg.train.checkpoint_dir).parent, launch.cfg.tracking_dir(), launch.cfg.tracking.backends, con)
    if rc != 0:
        con.print(f"[red]a process exited with {rc}: see its lines above[/]")
        return rc
    from dflash_ring.consumer.training.checkpoint import export_checkpoint

    if out_dir.exists():
        import shutil

        shutil.rmtree(out_dir)
    exported = export_checkpoint(Path(launch.cfg.train.checkpoint_dir) / "drafter-0", out_dir)
    con.print(f"exported drafter: {exported}")
    done = final_state(launch.cfg.train.checkpoint_dir, 0)
    return launch.cfg, exported, done["step"] if done else 0


def _curves(run_dir: Path, tracking_dir: Path, backends: list[str], con: Console) -> None:
    """Where the run's curves are: its report picture (drawn now from the drafters' record files) and TensorBoard's.
    `run_dir`: the directory of train.checkpoint_dir; `tracking_dir`: Config.tracking_dir()."""
    from dflash_ring.tools.report import ReportError, write_report

    source = run_dir if tracking_dir == run_dir / "tracking" else tracking_dir
    try:
        picture, what = write_report(source)
        con.print(f"report: {picture} ({what}); again with `dflash-ring report {source}`")
    except ReportError as e:
        con.print(f"[yellow]no report picture: {e}[/]")
    if "tensorboard" in backends:
        con.print(f"curves: `tensorboard --logdir {tracking_dir / 'tensorboard'}` (one run per drafter)")


def _compare(
    drafter: DrafterConfig,
    target: TargetConfig,
    untrained_dir: Path,
    trained: dict[str, tuple[Path, int]],
    con: Console,
) -> None:
    """Acceptance on held-out prompts: the trained drafters against an untrained one of the same shape (exported to
    `untrained_dir` once)."""
    import torch

    from dflash_ring.consumer.evaluation.evaluate import evaluate_drafter
    from dflash_ring.consumer.layouts.export import export_drafter
    from dflash_ring.consumer.families.build import build_drafter
    from dflash_ring.consumer.training.process import resolve_drafter_config, target_config_dict
    from dflash_ring.embedded.tiny_target import HELDOUT_FILE
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" bars: `\r` fragments when piped

    heldout = Path(target.path) / HELDOUT_FILE
    if not untrained_dir.exists():
        torch.manual_seed(0)
        drafter_cfg = resolve_drafter_config(drafter, target)
        export_drafter(
            build_drafter(drafter_cfg, target_config_dict(target.path)),
            drafter_cfg,
            target_config_dict(target.path),
            untrained_dir,
        )
    table = Table(title="acceptance length on held-out prompts (greedy, lossless)")
    table.add_column("drafter")
    table.add_column("steps")
    table.add_column("tau (mean accepted + 1)")
    table.add_column("rounds")
    per_prompt = {}
    for name, (path, steps) in {"untrained": (untrained_dir, 0), **trained}.items():
        report = evaluate_drafter(path, target.path, heldout, limit=100, max_new_tokens=64)
        table.add_row(name, str(steps), f"{report.tau:.2f}", str(report.rounds))
        per_prompt[name] = report.tau_per_prompt
    con.print(table)
    (first, a), (second, b) = list(per_prompt.items())[-2:]
    if (diff := paired_difference(a, b)) is not None:
        mean, half, n = diff
        con.print(
            f"{first} minus {second}: tau {mean:+.2f} ± {half:.2f} (95% interval over the {n} prompts, "
            f"paired: the same prompts decoded by both)"
        )


def paired_difference(a: list[float | None], b: list[float | None]) -> tuple[float, float, int] | None:
    """Mean of the per-prompt differences a - b and its 95% interval's half-width (normal approximation), over the
    prompts both scored; None under two such prompts. The spread the run reports for its comparison: which prompts
    happen to be held out. The spread between training runs (seeds) is measured in docs/benchmarks.md."""
    diffs = [x - y for x, y in zip(a, b) if x is not None and y is not None]
    if len(diffs) < 2:
        return None
    return fmean(diffs), 1.96 * stdev(diffs) / math.sqrt(len(diffs)), len(diffs)
