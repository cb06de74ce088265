"""The restarter of `dflash-ring chaos`: what systemd's Restart=on-failure does for each unit, in-process.

Each process of a run (supervisor, target-i, drafter-j, standby-k) is started with the same command every
time (tools/fleet.py: `dflash-ring <role> --config F --set ...`) and its output appended to logs/<name>.log.
A process that exits after being signalled, or with a non-zero code, is started again after a
random delay, until the run is over; as in the units, the supervisor's exit 3 (a clean end after it fenced a
straggler, SuccessExitStatus=3) is a success, and a drafter's or standby's EXIT_DIVERGED (its training went bad,
RestartPreventExitStatus=4) is final: started again it would resume into the same divergence.
"""

from __future__ import annotations

import random
import signal
import subprocess
import time
from collections import defaultdict
from pathlib import Path

from dflash_ring.common.lifecycle.diverged import EXIT_DIVERGED
from dflash_ring.supervisor.supervisor import EXIT_FENCED
from dflash_ring.tools.fleet import role_command, spawn


class Restarter:
    def __init__(
        self,
        cfg_path: Path,
        sets: list[str],
        log_dir: Path,
        env: dict[str, str],
        rng: random.Random,
        delay_s: tuple[float, float],
    ):
        self.cfg_path, self.sets, self.log_dir, self.env = cfg_path, sets, log_dir, env
        self.rng, self.delay_s = rng, delay_s
        self.procs: dict[str, subprocess.Popen] = {}
        self.pending: dict[str, float] = {}  # name -> monotonic time of its restart
        self.signalled: set[str] = set()  # signalled by us and not yet exited
        self.exits: dict[str, list[int]] = defaultdict(list)
        self.spawns: list[tuple[float, str, int]] = []  # (wall time, name, pid)
        self.restarts = 0
        self.over = False  # the run has ended: nothing is started again
        self.stopped_late: dict[str, set[int]] = defaultdict(set)  # pids started too late to join, then stopped
        log_dir.mkdir(parents=True, exist_ok=True)

    def start(self, name: str) -> int:
        proc = spawn(role_command(name, self.cfg_path, self.sets), self.log_dir / f"{name}.log", self.env, name)
        self.procs[name] = proc
        self.pending.pop(name, None)
        self.spawns.append((time.time(), name, proc.pid))
        return proc.pid

    def poll(self, restart: bool) -> dict[str, int]:
        """Reap exits (scheduling restarts when `restart`), start the restarts that are due; return the exits."""
        now = time.monotonic()
        exited = {}
        for name, proc in self.procs.items():
            if proc.returncode is not None or (rc := proc.poll()) is None:
                continue
            exited[name] = rc
            self.exits[name].append(rc)
            failed = rc != 0 and not (name == "supervisor" and rc == EXIT_FENCED)
            final = rc == EXIT_DIVERGED and name.startswith(("drafter-", "standby-"))  # RestartPreventExitStatus=
            if restart and (name in self.signalled or failed) and not final:
                self.pending[name] = now + self.rng.uniform(*self.delay_s)
            self.signalled.discard(name)
        for name, at in list(self.pending.items()):
            if not restart:
                del self.pending[name]
            elif at <= now:
                self.start(name)
                self.restarts += 1
        return exited

    def alive(self) -> list[str]:
        """Processes not yet seen exiting by `poll` (which is what records an exit)."""
        return [n for n, p in self.procs.items() if p.returncode is None]

    def pick(self, role: str, rng: random.Random) -> str | None:
        """A running process of `role` (else of any role) that is not already on its way out."""
        candidates = [n for n in self.alive() if n not in self.signalled]
        # A standby is a drafter too: waiting, or holding the seat of one it took over.
        mine = [n for n in candidates if n.split("-")[0] == role or (role == "drafter" and n.startswith("standby-"))]
        pool = mine or candidates
        return rng.choice(sorted(pool)) if pool else None

    def signal(self, name: str, sig: signal.Signals) -> int:
        proc = self.procs[name]
        self.signalled.add(name)
        proc.send_signal(sig)
        return proc.pid

    def wait_all_exit(self, timeout_s: float) -> bool:
        """Wait for every process to exit, restarting nothing; False if some are still alive after timeout_s."""
        deadline = time.monotonic() + timeout_s
        while self.alive():
            if time.monotonic() > deadline:
                return False
            self.poll(restart=False)
            time.sleep(0.1)
        self.poll(restart=False)
        return True

    def stop_unjoined(self, joined_pids: set[int]) -> list[str]:
        """SIGTERM what was started again but never joined a run that has now ended (as `systemctl stop`
        would): such a process waits for a ring that will not come, holding nothing. Joined processes
        (`joined_pids`: they wrote their ledger's start record) must leave by themselves."""
        stopped = []
        for name in self.alive():
            if self.procs[name].pid not in joined_pids:
                self.procs[name].send_signal(signal.SIGTERM)
                self.stopped_late[name].add(self.procs[name].pid)
                stopped.append(name)
        return stopped

    def clear_pending(self) -> None:
        self.pending.clear()
        self.signalled.clear()

    def kill_all(self) -> None:
        for name in self.alive():
            self.procs[name].send_signal(signal.SIGKILL)
            self.exits[name].append(self.procs[name].wait())
        self.pending.clear()

    def last_stopped_late(self, name: str) -> bool:
        """Whether the latest process of `name` was one stopped for having started too late to join."""
        return name in self.procs and self.procs[name].pid in self.stopped_late.get(name, set())

    def exit_codes(self) -> dict[str, list[int]]:
        return {name: list(codes) for name, codes in sorted(self.exits.items())}

    def spawns_wall(self) -> list[tuple[float, str, int]]:
        return list(self.spawns)
