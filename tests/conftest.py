"""Shared fixtures: a run per test (own name, own lock dir), real processes, and cleanup."""

from __future__ import annotations

import itertools
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_ring.common.ring import Ring

WORKER = Path(__file__).with_name("ring_worker.py")
_seq = itertools.count()


class Run:
    """One test's run: its config file, ledgers, and every process it started."""

    def __init__(self, tmp: Path, name: str):
        self.tmp = tmp
        self.name = name
        self.lock_dir = tmp / "locks"
        self.config = tmp / "run.toml"
        self.procs: list[subprocess.Popen] = []
        self.metrics_base = free_port_base()

    def write_config(self, producers: int, consumers: int, slots: int = 4, slot_bytes: int = 1 << 20,
                     extra: str = "") -> Path:
        self.config.write_text(
            f'[run]\nname = "{self.name}"\nrun_dir = "{self.lock_dir}"\nattach_timeout_s = 30\n'
            f"[ring]\nslots = {slots}\nslot_bytes = {slot_bytes}\nslot_header_bytes = 4096\nwait_s = 0.1\n"
            f"[topology]\nproducers = {producers}\nconsumers = {consumers}\n"
            f"[supervisor]\nreap_interval_s = 0.1\nexit_timeout_s = 30\n{extra}"
            # Every process serves /metrics: a free base per run, so runs side by side never collide.
            + ("" if "[metrics]" in extra else f"\n[metrics]\nport_base = {self.metrics_base}\n")
        )
        return self.config

    def ledger(self, role: str, index: int) -> Path:
        return self.tmp / f"{role}-{index}.ledger"

    def spawn(self, *args: str, stdout=None) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, *args], cwd=self.tmp, stdout=stdout, stderr=subprocess.PIPE,
                                text=True)
        self.procs.append(proc)
        return proc

    def supervisor(self, *extra: str) -> subprocess.Popen:
        return self.spawn("-m", "dflash_ring", "supervisor", "--config", str(self.config), *extra)

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        out = subprocess.run([sys.executable, "-m", "dflash_ring", *args], cwd=self.tmp, capture_output=True,
                             text=True, timeout=120)
        if check and out.returncode != 0:
            raise AssertionError(f"dflash-ring {' '.join(args)} exited {out.returncode}: {out.stderr}")
        return out

    def worker(self, role: str, index: int, *extra: str) -> subprocess.Popen:
        return self.spawn(str(WORKER), role, "--config", str(self.config), "--index", str(index),
                          "--ledger", str(self.ledger(role, index)), *extra)

    def ledger_lines(self, kind: str) -> list[list[str]]:
        lines = []
        for p in sorted(self.tmp.glob("*.ledger")):
            lines += [ln.split() for ln in p.read_text().splitlines() if ln.startswith(kind + " ")]
        return lines

    def leftovers(self) -> list[str]:
        found = [n for n in os.listdir("/dev/shm") if n.startswith(f"dflash-ring.{self.name}")]
        found += [str(p) for p in self.lock_dir.glob("*")] if self.lock_dir.exists() else []
        return found


def free_port_base(span: int = 8) -> int:
    """A metrics port base whose first ports (supervisor, targets) and drafter ports are all free."""
    for _ in range(200):
        base = random.randrange(10000, 32000)  # below Linux's ephemeral range (32768-60999)
        try:
            for port in [*range(base, base + span), *range(base + 100, base + 100 + span)]:
                with socket.create_server(("127.0.0.1", port)):
                    pass
        except OSError:
            continue
        return base
    raise RuntimeError("no free metrics port base found on 127.0.0.1")


def wait_exit(proc: subprocess.Popen, timeout: float = 60.0) -> int:
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"process {proc.args} did not exit within {timeout}s")
    return rc


def wait_for(cond, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.fixture
def run(tmp_path: Path):
    r = Run(tmp_path, f"t{os.getpid()}-{next(_seq)}")
    yield r
    for proc in r.procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    Ring.unlink(r.name)
