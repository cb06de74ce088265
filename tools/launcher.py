"""`dflash-ring run`: the whole run on one host: supervisor, targets and drafters as separate processes.

The launcher is only a convenience over what systemd does per GPU in
production: it starts each role with the same config file, prefixes their
logs, shows progress read from the ring and the drafters' log lines, turns
Ctrl-C into a drain (every drafter checkpoints), and ends with a summary and
an exported drafter. With no config it runs the embedded default: a tiny
trained target and its corpus, built on first use and cached, on the CPU.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from dflash_ring.common.config import Config, load_config
from dflash_ring.common.metrics import check_ports_free, run_ports
from dflash_ring.common.ring import Ring, RingNotFound

STEP_LINE = re.compile(
    r"step (?P<step>\d+)/(?P<total>\d+) loss (?P<loss>[\d.]+) .*accept_len (?P<accept>[\d.]+) .*tok/s (?P<tps>\d+)"
)
DEFAULT_CACHE = "~/.cache/dflash_ring"


def embedded_config(workdir: Path, cache_dir: str = DEFAULT_CACHE) -> Path:
    """Write the embedded default's config: the tiny trained target, 1 producer, 2 drafters, CPU."""
    from dflash_ring.embedded.tiny_target import TRAIN_FILE, ensure_tiny_target, read_marker

    target = ensure_tiny_target(Path(cache_dir).expanduser() / "tiny-target")
    mask = read_marker(target)["mask_token_id"]
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "run.toml"
    path.write_text(f"""# The embedded default: written by `dflash-ring run`; copy it to start your own.
[run]
name = "tiny"
run_dir = "{workdir / 'locks'}"

[ring]
slots = 4
slot_bytes = 8_388_608
slot_header_bytes = 65536
wait_s = 0.05

[topology]
producers = 1
consumers = 2

[data]
path = "{target / TRAIN_FILE}"
max_length = 256
max_tokens_per_batch = 2048
epochs = 3
cache_dir = "{workdir / 'data-cache'}"

[target]
path = "{target}"
layer_ids = [1, 2]
mask_token_id = {mask}
state_dir = "{workdir / 'state'}"
device = "cpu"

[drafter]
num_hidden_layers = 2
block_size = 8
num_anchors = 48

[train]
lr = 3e-3
warmup_ratio = 0.05
device = "cpu"
anchors_per_group = 64
average_every_steps = 10
checkpoint_dir = "{workdir / 'checkpoints'}"
checkpoint_every_steps = 100
log_every_steps = 10

[metrics]
# /metrics per process: supervisor port_base, target i port_base + 1 + i, drafter j port_base + 100 + j
enabled = true
bind = "127.0.0.1"
port_base = 9460
""")
    return path


@dataclass
class Progress:
    started: float = field(default_factory=time.monotonic)
    steps: dict[int, dict[str, float]] = field(default_factory=dict)

    def record(self, drafter: int, line: str) -> None:
        if m := STEP_LINE.search(line):
            self.steps[drafter] = {k: float(v) for k, v in m.groupdict().items()}


class Launch:
    def __init__(self, cfg_path: Path, overrides: list[str], env: dict[str, str] | None = None):
        self.env = dict(os.environ, **(env or {}))
        self.cfg_path = cfg_path
        self.overrides = overrides
        self.cfg: Config = load_config(cfg_path, overrides)
        self.console = Console(stderr=True)
        self.progress = Progress()
        self.procs: dict[str, subprocess.Popen] = {}
        self._threads: list[threading.Thread] = []

    def _spawn(self, name: str, *args: str) -> None:
        sets = [a for o in self.overrides for a in ("--set", o)]
        cmd = [sys.executable, "-m", "dflash_ring", *args, "--config", str(self.cfg_path), *sets]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                env=self.env)
        self.procs[name] = proc
        t = threading.Thread(target=self._forward, args=(name, proc), daemon=True)
        t.start()
        self._threads.append(t)

    def _forward(self, name: str, proc: subprocess.Popen) -> None:
        drafter = int(name.split("-")[1]) if name.startswith("drafter-") else None
        for line in proc.stdout:
            line = line.rstrip()
            if drafter is not None:
                self.progress.record(drafter, line)
            print(f"{name:>10} | {line}", file=sys.stderr, flush=True)

    def start(self) -> None:
        t = self.cfg.topology
        check_ports_free(self.cfg)  # one clear error now, not one per child process
        if self.cfg.metrics.enabled:
            ports = ", ".join(f"{name} {port}" for name, port in run_ports(self.cfg).items())
            self.console.print(f"metrics at http://{self.cfg.metrics.bind}:PORT/metrics: {ports}")
        self._spawn("supervisor", "supervisor", "--reclaim-stale")
        for i in range(t.producers):
            self._spawn(f"target-{i}", "target", "--index", str(i))
        for j in range(t.consumers):
            self._spawn(f"drafter-{j}", "drafter", "--index", str(j))

    def status_line(self) -> str:
        try:
            with Ring.open(self.cfg.run.name) as ring:
                st = ring.status()
                planned = ring.planned_items()
        except (RingNotFound, OSError, RuntimeError):
            return "waiting for the ring"
        c = st.counters
        elapsed = time.monotonic() - self.progress.started
        rate = c["consumed"] / elapsed if elapsed else 0.0
        eta = (planned - c["consumed"]) / rate if rate and planned else float("nan")
        steps = self.progress.steps.values()
        loss = sum(s["loss"] for s in steps) / len(steps) if steps else float("nan")
        accept = sum(s["accept"] for s in steps) / len(steps) if steps else float("nan")
        tps = sum(s["tps"] for s in steps)
        return (f"items {c['consumed']}/{planned or '?'} ({rate:.1f}/s) depth {st.depth}/{st.n_slots} "
                f"drafter tok/s {tps:.0f} loss {loss:.3f} accept_len {accept:.2f} ETA {eta:.0f}s")

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
            last = 0.0
            while any(p.poll() is None for p in self.procs.values()):
                if time.monotonic() - last > 10:
                    print(f"  progress | {self.status_line()}", file=sys.stderr, flush=True)
                    last = time.monotonic()
                if self.procs["supervisor"].poll() is not None and not stopping:
                    drain()  # the supervisor died: stop the rest rather than train blind
                time.sleep(0.5)
        finally:
            signal.signal(signal.SIGINT, old[0])
            signal.signal(signal.SIGTERM, old[1])
        for t in self._threads:
            t.join(timeout=5)
        return max(abs(p.returncode) for p in self.procs.values())

    def summary(self) -> Table:
        table = Table(title=f"run {self.cfg.run.name}: {time.monotonic() - self.progress.started:.0f}s")
        for col in ("process", "exit", "steps", "loss", "accept_len", "tok/s"):
            table.add_column(col)
        for name, proc in self.procs.items():
            s = self.progress.steps.get(int(name.split("-")[1])) if name.startswith("drafter-") else None
            table.add_row(name, str(proc.returncode), *(
                [f"{s['step']:.0f}", f"{s['loss']:.4f}", f"{s['accept']:.2f}", f"{s['tps']:.0f}"] if s else ["", "", "", ""]))
        return table


def run(config: str | None, overrides: list[str], workdir: str = "runs/tiny", evaluate: bool = True) -> int:
    console = Console(stderr=True)
    work = Path(workdir)
    embedded = config is None
    if embedded:
        console.print("embedded default: tiny trained target (built and cached on first use), 1 target, 2 drafters, CPU")
        cfg_path = embedded_config(work)
    else:
        cfg_path = Path(config)
    # Several CPU processes on a few cores: one thread each, or they thrash (a 20-30x slowdown seen here).
    launch = Launch(cfg_path, overrides, env={"OMP_NUM_THREADS": "1"} if embedded else None)
    out_dir = Path(launch.cfg.train.checkpoint_dir).parent / "drafter"
    launch.start()
    rc = launch.wait()
    console.print(launch.summary())
    if rc != 0:
        console.print(f"[red]a process exited with {rc}: see its lines above[/]")
        return rc
    from dflash_ring.consumer.checkpoint import export_checkpoint

    if out_dir.exists():
        import shutil
        shutil.rmtree(out_dir)
    exported = export_checkpoint(Path(launch.cfg.train.checkpoint_dir) / "drafter-0", out_dir)
    console.print(f"exported drafter: {exported}")
    if embedded and evaluate:
        _compare_with_untrained(launch.cfg, exported, console)
    return 0


def _compare_with_untrained(cfg: Config, exported: Path, console: Console) -> None:
    """Acceptance on held-out prompts, trained drafter against an untrained one of the same shape."""
    import torch

    from dflash_ring.consumer.evaluate import evaluate_drafter
    from dflash_ring.consumer.export import export_drafter
    from dflash_ring.consumer.model import build_drafter
    from dflash_ring.consumer.process import resolve_drafter_config, target_config_dict
    from dflash_ring.embedded.tiny_target import HELDOUT_FILE

    torch.set_num_threads(1)  # tiny models: threads only add overhead on a shared box
    heldout = Path(cfg.target.path) / HELDOUT_FILE
    untrained_dir = exported.parent / "drafter-untrained"
    if not untrained_dir.exists():
        torch.manual_seed(0)
        drafter_cfg = resolve_drafter_config(cfg)
        export_drafter(build_drafter(drafter_cfg, target_config_dict(cfg.target.path)), drafter_cfg,
                       target_config_dict(cfg.target.path), untrained_dir)
    table = Table(title="acceptance length on held-out prompts (greedy, lossless)")
    table.add_column("drafter")
    table.add_column("tau (mean accepted + 1)")
    table.add_column("rounds")
    for name, path in (("untrained", untrained_dir), ("trained", exported)):
        report = evaluate_drafter(path, cfg.target.path, heldout, limit=32, max_new_tokens=64)
        table.add_row(name, f"{report.tau:.2f}", str(report.rounds))
    console.print(table)
