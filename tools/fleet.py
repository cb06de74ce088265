"""The processes of a run as every tool and bench starts, watches and scrapes them: one home for it.

The launcher (`dflash-ring run`), the chaos restarter, chaos itself and `bench pipeline` all start the
same roles, each the way a systemd unit does: `python -m dflash_ring ROLE --config F --set ...`. Here is
the one place that builds that command line (`role_command`), starts it with its output in a log
(`spawn`), reads a process's /metrics (`scrape`) and waits for what its metrics, its ring row or its
readiness notification say (`wait_for`, `wait_for_metrics`, `Readiness`): never for a log line, which is
for people and changes with its wording.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO

from prometheus_client.parser import text_string_to_metric_families

from dflash_ring.common.config.schema import MetricsConfig
from dflash_ring.common.metrics import port_of

Sample = dict[str, float]


def cli_command(*args: str, config: str | Path | None = None, sets: Sequence[str] = ()) -> list[str]:
    """`python -m dflash_ring ARGS [--config F] [--set S ...]`: any dflash-ring command as a child process."""
    return [
        sys.executable,
        "-m",
        "dflash_ring",
        *args,
        *(["--config", str(config)] if config is not None else []),
        *[a for s in sets for a in ("--set", s)],
    ]


def role_command(
    name: str, config: str | Path, sets: Sequence[str] = (), *, device: str | None = None, reclaim_stale: bool = False
) -> list[str]:
    """The command line of process `name`: "supervisor", "target-I", "drafter-J", or "standby-K" (a warm standby
    for every drafter, `drafter --standby`); the same every time it is started, as a unit's ExecStart is."""
    role, _, index = name.partition("-")
    if role == "supervisor":
        args = ["supervisor", *(["--reclaim-stale"] if reclaim_stale else [])]
    elif role == "standby":
        args = ["drafter", "--standby"]
    elif role in ("target", "drafter") and index.isdigit():
        args = [role, "--index", index]
    else:
        raise ValueError(f"no role process is named {name!r}: supervisor, target-I, drafter-J or standby-K")
    return cli_command(*args, *(["--device", device] if device else []), config=config, sets=sets)


def spawn(
    cmd: Sequence[str], log: Path | None = None, env: Mapping[str, str] | None = None, name: str | None = None
) -> subprocess.Popen:
    """Start `cmd` with stdout and stderr appended to `log` (after a `==== HH:MM:SS start NAME` line when `name`
    is given: a log that several starts share says where each began), or piped as text lines when `log` is None."""
    env = dict(os.environ, **(env or {}))
    if log is None:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env)
    with open(log, "ab") as out:
        if name is not None:
            out.write(f"==== {time.strftime('%H:%M:%S')} start {name}\n".encode())
            out.flush()
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)


def scrape(metrics: MetricsConfig, role: str, index: int = 0, timeout_s: float = 1.0) -> Sample | None:
    """One process's /metrics as sample name -> value, labels folded into the name as `name{k=v,...}` (sorted), e.g.
    {"dflash_ring_drafter_step": 120.0, "dflash_ring_startup_seconds{phase=model}": 3.1}; None while it serves
    none (not started yet, or gone)."""
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(metrics.bind, metrics.bind)
    host = f"[{host}]" if ":" in host else host
    url = f"http://{host}:{port_of(metrics, role, index)}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            text = r.read().decode()
    except (urllib.error.URLError, OSError, ValueError):
        return None
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def wait_for(
    predicate: Callable[[], object],
    timeout_s: float,
    what: str,
    procs: Mapping[str, subprocess.Popen] = {},
    poll_s: float = 1.0,
) -> None:
    """Until `predicate()` is true; a process of `procs` that exits meanwhile, or `timeout_s`, ends the wait with
    an error that names it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for name, p in procs.items():
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited with {p.returncode} while waiting for {what}")
        if predicate():
            return
        time.sleep(poll_s)
    raise TimeoutError(f"no {what} within {timeout_s:.0f}s")


def wait_for_metrics(
    metrics: MetricsConfig,
    role: str,
    index: int,
    predicate: Callable[[Sample], object],
    timeout_s: float,
    what: str,
    procs: Mapping[str, subprocess.Popen] = {},
    poll_s: float = 1.0,
) -> Sample:
    """Until a scrape of the process satisfies `predicate`; that scrape."""
    seen: list[Sample] = []

    def met() -> bool:
        sample = scrape(metrics, role, index)
        if sample is not None and predicate(sample):
            seen.append(sample)
            return True
        return False

    wait_for(met, timeout_s, what, procs, poll_s)
    return seen[-1]


class Readiness:
    """A process's own readiness, as systemd reads it from a Type=notify unit: the datagram socket its
    NOTIFY_SOCKET names (common/lifecycle/sd_notify.py), which receives READY=1 when the process is ready (a drafter
    once it joined; a warm standby once built, attached and waiting). For a process that serves no metrics yet."""

    def __init__(self) -> None:
        # In a private directory (0700): no other user can send it a READY=1, and the path stays short (AF_UNIX
        # paths end at 107 bytes, wherever the caller's work directory is).
        self._dir = Path(tempfile.mkdtemp(prefix="dflash-ring-notify-"))
        self.path = self._dir / "socket"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._sock.bind(str(self.path))
        self._sock.setblocking(False)
        self.statuses: list[str] = []  # each STATUS= that came with a READY=1

    def env(self) -> dict[str, str]:
        return {"NOTIFY_SOCKET": str(self.path)}

    def ready(self) -> bool:
        """Whether a READY=1 has arrived (reads what is waiting, never blocks)."""
        while True:
            try:
                message = self._sock.recv(4096).decode(errors="replace")
            except BlockingIOError:
                return bool(self.statuses)
            fields = dict(line.partition("=")[::2] for line in message.splitlines())
            if fields.get("READY") == "1":
                self.statuses.append(fields.get("STATUS", ""))

    def close(self) -> None:
        self._sock.close()
        self.path.unlink(missing_ok=True)
        self._dir.rmdir()


_STDERR = threading.Lock()


def forward_lines(name: str, stream: IO[str]) -> None:
    """A piped child's lines on stderr, each prefixed with its name; a progress bar's `\\r` fragments: its last
    state only. One write per line under one lock: print() writes the text and its newline apart, and the threads
    of a run's children interleaved them (three lines on one, a clean-clone run's test_launcher failure)."""
    for line in stream:
        line = line.rstrip("\n").rsplit("\r", 1)[-1].rstrip()
        if line:
            with _STDERR:
                sys.stderr.write(f"{name:>10} | {line}\n")
                sys.stderr.flush()
