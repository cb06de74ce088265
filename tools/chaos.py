"""`dflash-ring chaos`: kill processes of a real run at random and prove nothing was lost.

One invocation runs two pipelines on this host, each as real processes (supervisor, targets,
drafters) with the ledger on (`run.ledger_dir`, common/lifecycle/ledger.py):

1. a baseline without faults (same config, one epoch), for the throughput it reaches;
2. the chaos run, sized to outlast the fault window. Once training is under way, `kills`
   signals go out at seeded random moments within `seconds`, to random targets, drafters and
   the supervisor (with target.tensor_parallel > 1, half of a target's SIGKILLs go to one of its group's other
   ranks: its leader goes down with it, and is restarted as any dead target is): SIGKILL, or SIGTERM (a target or
   drafter then stops cleanly; the supervisor drains the run, after which the whole run is started again, as an
   operator would).
   A restarter (tools/restarter.py) brings back every process that was signalled or exited
   non-zero, after a random delay, with the command it was started with (Restart=on-failure).
   With `whole_run_stops`, the whole run is also stopped that many times at random moments, in one
   of three ways (`stop --now`; SIGTERM to every process at once, as `systemctl stop` of the run's
   target does; SIGKILL to every process, then `dflash-ring clean`), and started again once all
   have exited. What the ring held then goes to the producers' replay lists (supervisor/unfinished.py).

Then it checks, from the ledgers (tools/reconcile.py) and the file system, and reports
(tools/chaos_report.py):

- every batch of every epoch (producer, epoch, position: the producers' plan) was trained exactly
  once, and every held-out batch (data.eval_fraction: the chaos run holds 5% out) evaluated exactly
  once and never trained: a drafter releases a slot only after training on it (or evaluating it), so
  a `train` (or `eval`) record is undone only by
  what befalls an unreleased slot (delivered again after its holder died, or produced again from a
  replay list after the ring was removed); none is missing, none is lost in flight;
- a batch seen twice by drafters is explained only by redelivery (same item number, higher delivery
  count, the first holder killed) or by a replay between the two;
- no producer published a batch twice other than as a replay (its cursor commits at publish);
- every process exited within the timeout after the run (no hang); after `dflash-ring clean`
  no segment, semaphore or lock file of the run is left;
- every drafter's final checkpoint loads and exports through `dflash-ring export`'s code.

Documented windows (what a kill may cost, by design, without a batch going missing):

- redelivery: a drafter killed between claiming a slot and releasing it (after training on it)
  leaves the slot READING; the reaper, or its successor, makes it READY again and another
  drafter takes it (deliveries + 1). Its `got` and `train` records may then appear twice; the
  first `train` is undone (its update went with the killed process). Nothing is lost in flight.
- un-checkpointed updates: batches a killed drafter trained after its last durable checkpoint
  died with it, and are produced again from its sealed journal (common/lifecycle/trained_journal.py) and
  trained by someone: `trained_then_replayed_after_crash`. One of them never produced again is
  `trained_then_lost_with_crash`, a failure.
"""

from __future__ import annotations

import math
import os
import random
import signal
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from dflash_ring.common.config.load import load_config
from dflash_ring.common.config.schema import Config, RunConfig
from dflash_ring.common.lifecycle.ledger import read_ledger
from dflash_ring.common.lifecycle.ledger_events import (
    DrafterStart,
    Exited,
    ProducerStart,
    Published,
    ShardDone,
    StartupDone,
    SupervisorStart,
    Trained,
    is_one_of,
    kind,
)
from dflash_ring.common.ring import Ring, RingNotFound
from dflash_ring.common.ring.segment import leftover_files
from dflash_ring.tools.fleet import cli_command
from dflash_ring.tools.journal_edits import edit_after_kill
from dflash_ring.tools.reconcile import read_ledgers, reconcile, throughput
from dflash_ring.tools.restarter import Restarter

# The embedded tiny default, made small enough per batch that a minute holds many items and kills.
CHAOS_DEFAULTS = [
    "topology.producers=2",
    "topology.consumers=3",
    'data.split="train[:600]"',
    "data.max_tokens_per_batch=256",
    "data.eval_fraction=0.05",  # held-out items go through every kill too: evaluated exactly once, never trained
    "drafter.num_hidden_layers=1",
    "drafter.num_anchors=16",
    "train.checkpoint_every_steps=10",
    "train.average_every_steps=10",
    "train.log_every_steps=50",
    "supervisor.exit_timeout_s=15",  # a stalled drafter is given up on (fenced) after this long
]
ROLE_SHARES = {"supervisor": 0.2, "target": 0.35, "drafter": 0.45}
SUPERVISOR_SIGTERM_SHARE = 0.2  # a supervisor SIGTERM drains the run: it is then restarted as a whole
WORKER_SIGTERM_SHARE = 0.3


# stall-stop-now: a drafter SIGSTOPped, then `stop --now`: the supervisor fences it (SIGKILL) once it has been
# silent supervisor.exit_timeout_s, before handing what it held to the replay lists.
RUN_STOP_MODES = ("stop-now", "sigterm-all", "sigkill-all", "stall-stop-now")


@dataclass
class ChaosOptions:
    kills: int
    seconds: float
    seed: int
    workdir: Path
    config: str | None = None
    overrides: list[str] = field(default_factory=list)
    epochs: int = 0  # 0: enough to outlast the fault window, from the baseline's throughput
    baseline: bool = True
    restart_delay_s: tuple[float, float] = (0.5, 4.0)
    exit_timeout_s: float = 120.0
    whole_run_stops: int = 0  # also stop the whole run this many times (taking turns among stop_modes), start it again
    stop_modes: tuple[str, ...] = RUN_STOP_MODES
    standbys: int = 0  # warm standbys (`drafter --standby`, processes standby-N) beside the drafters, killed like them
    # After each drafter SIGKILL, edit the journals it and earlier dead drafters left (tools/journal_edits.py): the
    # ledger check then proves no edit made a batch train twice or vanish.
    journal_edits: bool = True

    def refusal(self) -> str | None:
        """Why these options cannot do what they ask, before anything starts (None: they can). The fault window
        opens when the first kill is due (Phase.execute: `kills` and training under way), and the whole-run stops
        are scheduled inside it, so stops without kills would never happen and the run would pass untested."""
        if self.kills < 0 or self.whole_run_stops < 0 or self.epochs < 0 or self.standbys < 0:
            return (
                f"--kills {self.kills}, --whole-run-stops {self.whole_run_stops}, --epochs {self.epochs}, "
                f"--standbys {self.standbys}: none may be negative"
            )
        if not self.seconds > 0 or self.seconds == float("inf"):
            return f"--seconds {self.seconds}: the fault window must be a finite number of seconds > 0"
        if self.whole_run_stops and not self.kills:
            return (
                f"--whole-run-stops {self.whole_run_stops} with --kills 0: the stops are scheduled in the fault "
                "window, which the first kill opens, so none would happen; give --kills 1 or more"
            )
        return self._bounds()

    def _bounds(self) -> str | None:
        """The run's processes and time bound what it can do (common/host_bounds.py's rule: before anything
        starts). A warm standby waits for a dead drafter's seat, so there is one at most per drafter (more are idle
        processes holding a model each). A process is killed again only once restarted (restart_delay_s[0] at
        the soonest), so the window holds at most processes x seconds / that delay kills (10^8 was a schedule
        built in memory, then a run that never ended)."""
        cfg = chaos_config(self.config, self.overrides)
        producers, consumers, ranks = cfg.topology.producers, cfg.topology.consumers, cfg.target.tensor_parallel
        if cfg.drafter.precision == "fp8":  # what every drafter would refuse at its start, restarted forever
            from dflash_ring.consumer.modeling.fp8 import Fp8Unavailable, check_precision

            try:
                check_precision(cfg.drafter.precision, cfg.train.device)
            except Fp8Unavailable as e:
                return str(e)  # it names drafter.precision itself
        if cfg.train.device != "auto":  # a device no drafter can run on: each refuses it, restarted forever
            from dflash_ring.common.device import DeviceError
            from dflash_ring.consumer.training.process import pick_device

            try:
                pick_device(cfg.train.device, 0)
            except DeviceError as e:
                return f"train.device: {e}"
        if self.standbys > consumers:
            return (
                f"--standbys {self.standbys}: the run has {consumers} drafters (topology.consumers), and a standby "
                f"waits for a dead drafter's seat: at most {consumers}"
            )
        processes = 1 + producers * ranks + consumers + self.standbys
        most = int(processes * self.seconds / max(self.restart_delay_s[0], 0.1))
        if self.kills > most:
            return (
                f"--kills {self.kills} in --seconds {self.seconds:g}: the run's {processes} processes, each killed "
                f"again only once restarted ({self.restart_delay_s[0]:g} s at the soonest), take at most {most}; "
                "lower --kills or give more --seconds"
            )
        return None


def chaos_config(config: str | None, overrides: list[str]) -> Config:
    """The chaos run's config as far as it is known before anything is built: the user's config with --set, or the
    embedded default's under CHAOS_DEFAULTS in what bounds the run (topology, the drafters' precision and device;
    the rest is written once the tiny target is built)."""
    if config is not None:
        return load_config(config, overrides)
    known = ("topology.", "target.tensor_parallel", "drafter.precision", "drafter.fp8_recipe", "train.device")
    return load_config(None, [s for s in [*CHAOS_DEFAULTS, *overrides] if s.startswith(known)])


@dataclass
class Kill:
    t: float
    name: str
    role: str
    signal: str
    pid: int


# ---- configuration of one phase -------------------------------------------------------------------


def phase_overrides(base: list[str], name: str, directory: Path, epochs: int) -> list[str]:
    d = directory.resolve()
    sets = list(base) + [
        f"run.name={name}",
        f'run.run_dir="{d / "locks"}"',
        f'run.ledger_dir="{d / "ledger"}"',
        "run.attach_timeout_s=300",  # a loaded 2-core box can take a minute to start a supervisor
        f'train.checkpoint_dir="{d / "checkpoints"}"',
        f'target.state_dir="{d / "state"}"',
        f"data.epochs={epochs}",
        "supervisor.reap_interval_s=0.2",
        "metrics.enabled=false",  # fixed ports would collide with a run beside this one
    ]
    return sets


# ---- the ledger, reconciled -------------------------------------------------------------------------


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))], 2)


def _p50_max(values: list[float]) -> dict[str, float | None]:
    return {"p50": _percentile(values, 0.5), "max": _percentile(values, 1.0)}


def recoveries(
    kills: list[Kill], spawns: list[tuple[float, str, int]], ledgers: dict[str, list[dict[str, Any]]]
) -> tuple[dict[str, list[float]], int]:
    """Seconds from each kill to its role's next incarnation doing work, by role; and kills never recovered.

    The next incarnation of a killed process is the process started again under its name, or whichever process
    works next in its ledger (the seat's): with standbys (`--standbys`), a standby started long before takes a
    killed drafter's seat, and the drafter started again for that index waits as a standby."""
    work = {"supervisor": (SupervisorStart,), "target": (Published, ShardDone), "drafter": (Trained, Exited)}
    first_work: dict[int, float] = {}
    workers: dict[str, set[int]] = {}  # ledger (seat) name -> pids that worked in it
    for name, recs in ledgers.items():
        kinds = work[name.split("-")[0]]
        for r in recs:
            if is_one_of(r, *kinds):
                workers.setdefault(name, set()).add(r["pid"])
                first_work.setdefault(r["pid"], r["t"])
    times: dict[str, list[float]] = {}
    unrecovered = 0
    for k in kills:
        seats = {k.name} | {name for name, pids in workers.items() if k.pid in pids}  # a standby's: the one it took
        nxt = {pid for t, name, pid in spawns if name == k.name and t >= k.t}
        nxt |= {pid for name in seats for pid in workers.get(name, set())}
        done = min(
            (first_work[pid] for pid in nxt - {k.pid} if pid in first_work and first_work[pid] >= k.t), default=None
        )
        if done is None:
            unrecovered += 1
        else:
            times.setdefault(k.role, []).append(done - k.t)
    return times, unrecovered


def startup_phases(ledgers: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per role: how many starts reached their first useful work, and p50/max of each start-up phase and the total
    (the `startup` ledger records, common/lifecycle/startup.py)."""
    by_role: dict[str, list[dict[str, Any]]] = {}
    for name, recs in ledgers.items():
        by_role.setdefault(name.split("-")[0], []).extend(r for r in recs if kind(r) == StartupDone.KIND)
    out = {}
    for role, recs in sorted(by_role.items()):
        phases: dict[str, list[float]] = {}
        for r in recs:
            for phase, s in r["phases"].items():
                phases.setdefault(phase, []).append(s)
        out[role] = {
            "starts": len(recs),
            "total_s": _p50_max([r["total"] for r in recs]),
            "phases_s": {phase: _p50_max(xs) for phase, xs in phases.items()},
        }
    return out


# ---- one phase: start, (kill,) wait, check -------------------------------------------------------------


class Phase:
    def __init__(
        self, label: str, cfg_path: Path, sets: list[str], directory: Path, env: dict[str, str], opts: ChaosOptions
    ):
        self.label, self.cfg_path, self.sets, self.dir, self.opts = label, cfg_path, sets, directory, opts
        self.cfg: Config = load_config(cfg_path, sets)
        self.run = self.cfg.run.name
        self.restarter = Restarter(
            cfg_path, sets, directory / "logs", env, random.Random(opts.seed + 1), opts.restart_delay_s
        )
        self.kills: list[Kill] = []
        self.window: tuple[float, float] | None = None
        self.full_restarts = 0
        self.run_stops: list[dict[str, Any]] = []
        self.hung: list[str] = []
        self.failures: list[str] = []
        self.journal_edits: list[dict[str, str]] = []
        self._edited: set[str] = set()
        self._edit_rng = random.Random(opts.seed + 2)

    def names(self) -> list[str]:
        t = self.cfg.topology
        return (
            ["supervisor"]
            + [f"target-{i}" for i in range(t.producers)]
            + [f"drafter-{j}" for j in range(t.consumers)]
            + [f"standby-{k}" for k in range(self.opts.standbys)]
        )

    def ledger_dir(self) -> Path:
        return Path(self.cfg.run.ledger_dir)

    def _training(self) -> float | None:
        """Time of the first trained batch, once there is one."""
        first = None
        for path in self.ledger_dir().glob("drafter-*.jsonl"):
            for r in read_ledger(path).records:
                if kind(r) == Trained.KIND:
                    first = r["t"] if first is None else min(first, r["t"])
                    break
        return first

    def _joined(self) -> set[int]:
        """Pids that joined the run (their ledger's start record; the supervisor's after taking its row)."""
        pids = set()
        for path in self.ledger_dir().glob("*.jsonl"):
            pids |= {
                r["pid"]
                for r in read_ledger(path).records
                if is_one_of(r, SupervisorStart, ProducerStart, DrafterStart)
            }
        return pids

    def _all_done(self) -> bool:
        """Every producer's last ledger record says its shard is done: the run is complete."""
        n = self.cfg.topology.producers
        lasts = [read_ledger(p).records[-1:] for p in self.ledger_dir().glob("target-*.jsonl")]
        return len(lasts) == n and all(last and kind(last[0]) == ShardDone.KIND for last in lasts)

    def _ring_flags(self) -> tuple[bool, bool] | None:
        """(draining, shutting down) of the live ring; None when there is none."""
        try:
            with Ring.open(self.run) as ring:
                return ring.draining, ring.shutting_down
        except (RingNotFound, OSError, RuntimeError):
            return None

    def stop_whole_run(self, mode: str, rng: random.Random) -> bool:
        """Stop every process of the run at once (`mode`), wait for all to exit, and start the run again.
        False when something hung."""
        r, t0 = self.restarter, time.time()
        stalled = None  # a joined drafter (one holding its row): stalled, it is what the supervisor must fence
        if mode == "stall-stop-now":
            joined = self._joined()
            drafters = [n for n in r.alive() if n.startswith("drafter") and r.procs[n].pid in joined]
            if drafters:
                stalled = rng.choice(drafters)
                r.signal(stalled, signal.SIGSTOP)
        if mode in ("stop-now", "stall-stop-now"):
            subprocess.Popen(
                cli_command("stop", "--now", "--timeout", "300", config=self.cfg_path, sets=self.sets),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        else:
            sig = signal.SIGTERM if mode == "sigterm-all" else signal.SIGKILL
            for name in r.alive():
                r.signal(name, sig)
        deadline = time.monotonic() + self.opts.exit_timeout_s + 60
        while r.alive():
            if stalled is not None and r.procs["supervisor"].poll() is not None:
                # The stall ends (a GC pause, a debugger detaching): fenced, it is dead; were it not, it would
                # now train and checkpoint what it held, and the restart would train that again.
                if r.procs[stalled].poll() is None:
                    r.procs[stalled].send_signal(signal.SIGCONT)
                stalled = None
            # A process started again (after an earlier kill) that has not joined waits for a ring that is going
            # away, holding nothing: stop it, as `systemctl stop` would.
            # Not the supervisor: a stop request waits for one (systemd restarts it; so does the restarter here).
            joined = self._joined() | {r.procs["supervisor"].pid}
            for name in r.alive():
                if r.procs[name].pid not in joined and r.procs[name].pid not in r.stopped_late[name]:
                    r.stop_unjoined(joined)
                    break
            if time.monotonic() > deadline:
                self.hung = r.alive()
                self.failures.append(f"after a whole-run {mode}, still alive: {', '.join(self.hung)}")
                return False
            r.poll(restart=False)
            time.sleep(0.2)
        r.poll(restart=False)
        cleaned = None
        if mode == "sigkill-all":
            cleaned = _clean(self.cfg_path, self.sets)  # hands what the dead ring held to the replay lists
            if cleaned.returncode != 0:
                self.failures.append(f"`dflash-ring clean` after a whole-run SIGKILL failed: {cleaned.stderr[-300:]}")
        self.run_stops.append({"t": round(t0, 2), "mode": mode, "stopped_in_s": round(time.time() - t0, 1)})
        r.clear_pending()
        time.sleep(rng.uniform(*self.opts.restart_delay_s))
        for name in self.names():
            r.start(name)
        return True

    def execute(self, kills: int, seconds: float, deadline_s: float) -> None:
        rng = random.Random(self.opts.seed)
        r = self.restarter
        if leftovers(self.cfg.run):  # of an earlier invocation that was cut short
            clean_before = _clean(self.cfg_path, self.sets)
            if clean_before.returncode != 0:
                raise RuntimeError(f"`dflash-ring clean` before the {self.label} run failed: {clean_before.stderr}")
        started = time.monotonic()
        for name in self.names():
            r.start(name)
        schedule: list[tuple[float, str, str]] = []
        drained_by_us = False
        while True:
            now = time.monotonic()
            if now - started > deadline_s:
                self.failures.append(f"{self.label} run did not finish within {deadline_s:.0f}s: hung")
                self.hung = r.alive()
                break
            if self.window is None and kills and self._training() is not None:
                self.window = (time.time(), time.time() + seconds)
                at = sorted(rng.uniform(0, seconds) for _ in range(kills))
                roles = _roles(kills, rng)
                schedule = [(now + a, role, _signal_for(role, rng)) for a, role in zip(at, roles)]
                stops = self.opts.whole_run_stops
                modes = [self.opts.stop_modes[i % len(self.opts.stop_modes)] for i in range(stops)]
                rng.shuffle(modes)
                schedule += [(now + rng.uniform(0, seconds), "run", mode) for mode in modes]
                schedule.sort()
            exited = r.poll(restart=not r.over)
            sup = exited.get("supervisor")
            if sup is not None and sup == 0:
                if drained_by_us and not self._all_done():
                    # Drained on our SIGTERM: the run is stopped, not finished. Start it again as a whole.
                    r.stop_unjoined(self._joined())
                    if not r.wait_all_exit(self.opts.exit_timeout_s):
                        self.hung = r.alive()
                        self.failures.append(f"after a drain, still alive: {', '.join(self.hung)}")
                        break
                    drained_by_us = False
                    self.full_restarts += 1
                    time.sleep(rng.uniform(*self.opts.restart_delay_s))
                    r.clear_pending()
                    for name in self.names():
                        r.start(name)
                else:
                    r.over = True
            if r.over:
                r.stop_unjoined(self._joined())
                if not r.wait_all_exit(self.opts.exit_timeout_s):
                    self.hung = r.alive()
                    self.failures.append(
                        f"still alive {self.opts.exit_timeout_s:.0f}s after the run ended: {', '.join(self.hung)}"
                    )
                break
            if schedule and schedule[0][0] <= now and not drained_by_us:
                flags = self._ring_flags()
                if flags is None or flags[0] or flags[1]:
                    # No run in progress right now (it is starting again): postpone every kill alike,
                    # so that they do not all land in one burst when it is back.
                    lag = now + 0.5 - schedule[0][0]
                    schedule = [(t + lag, role, sig) for t, role, sig in schedule]
                elif schedule[0][1] == "run":
                    _, _, mode = schedule.pop(0)
                    if not self.stop_whole_run(mode, rng):
                        break
                else:
                    _, role, sig = schedule.pop(0)
                    victim = r.pick(role, rng)
                    if victim is None:
                        schedule.insert(0, (now + 0.5, role, sig))
                    else:
                        if victim == "supervisor" and sig == "SIGTERM":
                            drained_by_us = True
                        rank = self._kill_rank(victim, rng) if sig == "SIGKILL" else None
                        pid = rank if rank is not None else r.signal(victim, getattr(signal, sig))
                        role = "drafter" if victim.startswith("standby-") else victim.split("-")[0]
                        self.kills.append(Kill(time.time(), victim, role, sig if rank is None else "SIGKILL-rank", pid))
                        if role == "drafter" and sig == "SIGKILL" and self.opts.journal_edits and _dead(pid):
                            self.journal_edits += edit_after_kill(
                                self.cfg.train.checkpoint_dir, pid, self._edit_rng, self._edited
                            )
            time.sleep(0.05)
        if self.hung:
            r.kill_all()
        self.unsent = len(schedule)
        if self.window is not None and self.kills:  # postponed kills stretch the window
            self.window = (self.window[0], max(self.window[1], self.kills[-1].t))

    def _kill_rank(self, victim: str, rng: random.Random) -> int | None:
        """With tensor-parallel target groups (target.tensor_parallel > 1), half of a target's SIGKILLs go to one of
        its group's other ranks instead: its leader must go down with it (exit 1) and the restarter bring the group
        back as one. The pid killed, or None (the leader itself is to be killed)."""
        if not victim.startswith("target-") or self.cfg.target.tensor_parallel == 1 or rng.random() < 0.5:
            return None
        ranks = group_ranks(self.restarter.procs[victim].pid)
        if not ranks:  # the leader has not started its ranks yet
            return None
        pid = rng.choice(ranks)
        self.restarter.signalled.add(victim)
        os.kill(pid, signal.SIGKILL)
        return pid


def _dead(pid: int, timeout_s: float = 5.0) -> bool:
    """Whether child `pid` has exited, waiting up to `timeout_s`, without reaping it (the restarter's poll records
    the exit): a journal is edited only once nothing can still write to it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None:
                return True
        except ChildProcessError:
            return True
        time.sleep(0.01)
    return False


def group_ranks(leader: int) -> list[int]:
    """The live child processes of a target group's leader: its ranks (producer/tensor_group.py)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state, parent = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
        except OSError:  # gone meanwhile
            continue
        if int(parent) == leader and state != "Z":
            found.append(int(entry.name))
    return sorted(found)


def _roles(n: int, rng: random.Random) -> list[str]:
    roles = ["supervisor", "target", "drafter"][: min(n, 3)]
    roles += rng.choices(list(ROLE_SHARES), weights=list(ROLE_SHARES.values()), k=n - len(roles))
    rng.shuffle(roles)
    return roles


def _signal_for(role: str, rng: random.Random) -> str:
    share = SUPERVISOR_SIGTERM_SHARE if role == "supervisor" else WORKER_SIGTERM_SHARE
    return "SIGTERM" if rng.random() < share else "SIGKILL"


def _clean(cfg_path: Path, sets: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cli_command("clean", config=cfg_path, sets=sets), capture_output=True, text=True, timeout=120)


def leftovers(run: RunConfig) -> list[str]:
    """What a run left behind: its shared-memory objects and its lock directory's files."""
    found = [str(p) for p in leftover_files(run.name)]
    lock_dir = run.lock_dir()
    if lock_dir.exists():
        found += [str(p) for p in lock_dir.iterdir()] or [str(lock_dir)]
    return found


def _checkpoints(checkpoint_dir: str, consumers: int, out: Path) -> dict[str, Any]:
    """Each drafter's latest checkpoint under train.checkpoint_dir, exported to `out` (or why not)."""
    from dflash_ring.consumer.training.checkpoint import CheckpointStore, export_checkpoint

    result = {}
    for j in range(consumers):
        root = Path(checkpoint_dir) / f"drafter-{j}"
        try:
            ckpt = CheckpointStore(root).load_latest()
            if ckpt is None:
                result[f"drafter-{j}"] = {"error": f"no checkpoint under {root}"}
                continue
            exported = export_checkpoint(root, out / f"drafter-{j}")
            result[f"drafter-{j}"] = {"step": ckpt.step, "exported": str(exported)}
        except Exception as e:  # reported, not raised: the report must come out
            result[f"drafter-{j}"] = {"error": f"{type(e).__name__}: {e}"}
    return result


def run_chaos(opts: ChaosOptions) -> dict[str, Any]:
    from dflash_ring.tools.launcher import embedded_config

    work = opts.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    base_sets: list[str] = []
    if opts.config is None:
        cfg_path = embedded_config(work)
        base_sets = list(CHAOS_DEFAULTS)
    else:
        cfg_path = Path(opts.config).resolve()
    base_sets += opts.overrides
    env = {"PYTHONUNBUFFERED": "1"}
    env.setdefault("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    started = time.time()
    report: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "seed": opts.seed,
        "kills_requested": opts.kills,
        "seconds": opts.seconds,
        "config": str(cfg_path),
        "overrides": base_sets,
    }
    failures: list[str] = []

    base_rate, per_epoch = None, None
    if opts.baseline:
        d = work / "baseline"
        _fresh(d)
        sets = phase_overrides(base_sets, f"chaos{opts.seed}-base", d, 1)
        phase = Phase("baseline", cfg_path, sets, d, env, opts)
        phase.execute(0, 0, deadline_s=900)
        ledgers, _ = read_ledgers(phase.ledger_dir())
        rec = reconcile(ledgers)
        thr = throughput(ledgers, None)
        base_rate = thr["items_per_s"]
        per_epoch = rec["planned_batches"]
        report["baseline"] = {
            "epochs": 1,
            "planned_batches": per_epoch,
            "trained": rec["trained_batches"],
            "missing": rec["missing"],
            **thr,
            "failures": phase.failures + rec["problems"],
        }
        failures += [f"baseline: {f}" for f in phase.failures + rec["problems"]]
        if leftovers(phase.cfg.run):
            failures.append(f"baseline: left behind {leftovers(phase.cfg.run)}")
            _clean(phase.cfg_path, phase.sets)

    epochs = opts.epochs
    if not epochs:
        if base_rate and per_epoch:
            # Enough to outlast the fault window at fault-free speed; the faults only stretch the run.
            epochs = max(2, math.ceil(base_rate * opts.seconds / per_epoch))
        else:
            epochs = 10
    d = work / "chaos"
    _fresh(d)
    sets = phase_overrides(base_sets, f"chaos{opts.seed}", d, epochs)
    phase = Phase("chaos", cfg_path, sets, d, env, opts)
    t0 = time.monotonic()
    phase.execute(
        opts.kills, opts.seconds, deadline_s=opts.seconds + max(600.0, 2 * opts.seconds) + 120 * opts.whole_run_stops
    )
    wall = time.monotonic() - t0
    ledgers, cut = read_ledgers(phase.ledger_dir())
    rec = reconcile(ledgers)
    thr = throughput(ledgers, phase.window)
    rec_times, unrecovered = recoveries(phase.kills, phase.restarter.spawns_wall(), ledgers)
    clean = _clean(phase.cfg_path, phase.sets)
    left = leftovers(phase.cfg.run)
    ckpts = _checkpoints(phase.cfg.train.checkpoint_dir, phase.cfg.topology.consumers, d / "exported")
    exits = phase.restarter.exit_codes()
    late = phase.restarter.stopped_late
    unjoined = sum(len(pids) for pids in late.values())

    by_role = Counter(k.role for k in phase.kills)
    by_signal = Counter(f"{k.role}:{k.signal}" for k in phase.kills)
    chaos_rate = thr.get("items_per_s")
    report["chaos"] = {
        "epochs": epochs,
        "wall_s": round(wall, 1),
        "cut_ledger_lines": cut,
        "kills": {
            "sent": len(phase.kills),
            "unsent": phase.unsent,
            "by_role": {r: by_role.get(r, 0) for r in ("supervisor", "target", "drafter")},
            "by_role_and_signal": dict(sorted(by_signal.items())),
        },
        "restarts": phase.restarter.restarts,
        "full_restarts_after_drain": phase.full_restarts,
        # Seats a warm standby (--standbys) took over from a dead drafter: its ledger start record names the dead pid.
        "standbys": opts.standbys,
        # What tools/journal_edits.py did to dead drafters' journals between kills (each named by the readers).
        "journal_edits": phase.journal_edits,
        "takeovers": sum(
            1
            for name, recs in ledgers.items()
            if name.startswith("drafter-")
            for r in recs
            if kind(r) == DrafterStart.KIND and "took_over" in r
        ),
        "whole_run_stops": phase.run_stops,
        "recoveries": sum(map(len, rec_times.values())),
        "not_recovered_before_the_end": unrecovered,
        "recovery_s": _p50_max([t for times in rec_times.values() for t in times]),
        "recovery_s_by_role": {role: _p50_max(times) for role, times in sorted(rec_times.items())},
        "startup": startup_phases(ledgers),
        "throughput": {
            **thr,
            "baseline_items_per_s": base_rate,
            "lost": round(1 - chaos_rate / base_rate, 3) if chaos_rate and base_rate else None,
        },
        "ledger": {k: v for k, v in rec.items() if k != "problems"},
        "exit_codes": exits,
        "failure_exits_restarted": sum(1 for codes in exits.values() for rc in codes[:-1] if rc > 0),
        "stopped_unjoined_after_a_run_ended": unjoined,
        "hung": phase.hung,
        "clean": {"rc": clean.returncode, "output": (clean.stdout + clean.stderr).strip()[-500:], "leftovers": left},
        "checkpoints": ckpts,
        "kill_log": [
            {"t": round(k.t - started, 2), "process": k.name, "signal": k.signal, "pid": k.pid} for k in phase.kills
        ],
        "logs": str(d / "logs"),
    }
    failures += phase.failures + rec["problems"]
    if clean.returncode != 0:
        failures.append(f"`dflash-ring clean` exited {clean.returncode}: {clean.stderr.strip()[-300:]}")
    if left:
        failures.append(f"left after clean: {left}")
    failures += [f"{name}: {v['error']}" for name, v in ckpts.items() if "error" in v]
    bad_exits = {
        n: codes
        for n, codes in exits.items()
        if codes and not (codes[-1] == 0 or (phase.restarter.last_stopped_late(n) and codes[-1] == -signal.SIGTERM))
    }
    if bad_exits and not phase.hung:
        failures.append(f"last exit non-zero: {bad_exits}")
    report["failures"] = failures
    report["passed"] = not failures
    report["seconds_total"] = round(time.time() - started, 1)
    return report


def _fresh(d: Path) -> None:
    import shutil

    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
