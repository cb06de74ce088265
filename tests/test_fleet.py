"""tools/fleet.py: the one command line per role, the one /metrics scraper and a process's own READY=1, each
against the real thing (the CLI's own parser, a real HTTP metrics server, a real child process's sd_notify)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from dflash_ring.cli import _parser
from dflash_ring.common.config.schema import MetricsConfig
from dflash_ring.common.metrics import SUPERVISOR
from dflash_ring.tools.fleet import Readiness, role_command, scrape, wait_for
from support import free_port_base


@pytest.mark.parametrize(
    "name, want",
    [
        ("supervisor", {"command": "supervisor", "reclaim_stale": False}),
        ("target-3", {"command": "target", "index": 3, "device": "cuda:1"}),
        ("drafter-0", {"command": "drafter", "index": 0, "standby": None, "device": "cuda:1"}),
        ("standby-2", {"command": "drafter", "index": None, "standby": "all", "device": "cuda:1"}),
    ],
)
def test_a_role_command_line_is_one_the_cli_accepts(name, want):
    cmd = role_command(
        name, "/etc/run.toml", ["train.lr=0.1", "ring.slots=8"], device=None if name == "supervisor" else "cuda:1"
    )
    assert cmd[:3] == [sys.executable, "-m", "dflash_ring"]
    args = _parser().parse_args(cmd[3:])
    assert {k: getattr(args, k) for k in want} == want
    assert (args.config, args.set) == ("/etc/run.toml", ["train.lr=0.1", "ring.slots=8"])
    assert _parser().parse_args(role_command("supervisor", "c.toml", reclaim_stale=True)[3:]).reclaim_stale


@pytest.mark.parametrize("name", ["target", "drafter-x", "producer-0", "regenerate"])
def test_no_role_command_for_a_name_that_is_no_role_process(name):
    with pytest.raises(ValueError, match="no role process is named"):
        role_command(name, "c.toml")


def test_the_scraper_folds_labels_into_names_and_is_none_while_nothing_serves():
    registry = CollectorRegistry()
    Gauge("dflash_ring_depth_items", "depth", registry=registry).set(3)
    phases = Gauge("dflash_ring_startup_seconds", "phases", ["phase"], registry=registry)
    phases.labels("model").set(1.5)
    Counter("dflash_ring_items", "items", ["role", "index"], registry=registry).labels("drafter", "0").inc(7)
    metrics = replace(MetricsConfig(), port_base=free_port_base(1))
    assert scrape(metrics, SUPERVISOR) is None  # nothing serves yet
    server, thread = start_http_server(metrics.port_base, addr="127.0.0.1", registry=registry)
    try:
        sample = scrape(metrics, SUPERVISOR)
        assert sample["dflash_ring_depth_items"] == 3.0
        assert sample["dflash_ring_startup_seconds{phase=model}"] == 1.5
        assert sample["dflash_ring_items_total{index=0,role=drafter}"] == 7.0
    finally:
        server.shutdown()
        thread.join()
    assert scrape(metrics, SUPERVISOR) is None  # gone again


@pytest.mark.processes
def test_readiness_is_the_process_own_ready_notification():
    readiness = Readiness()
    try:
        assert not readiness.ready()
        code = (
            "import sys; from dflash_ring.common.lifecycle import sd_notify; sd_notify.notify('WATCHDOG=1'); "
            "sys.exit(0 if sd_notify.ready('built, waiting') else 1)"
        )
        child = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, **readiness.env()})
        wait_for(readiness.ready, 120, "the child's READY=1", poll_s=0.05)
        assert child.wait(60) == 0 and readiness.statuses == ["built, waiting"]  # the watchdog ping is no READY
    finally:
        readiness.close()


@pytest.mark.processes
def test_a_wait_ends_with_the_process_that_exited_meanwhile():
    done = subprocess.Popen([sys.executable, "-c", "raise SystemExit(5)"])
    done.wait()
    with pytest.raises(RuntimeError, match="drafter-0 exited with 5 while waiting for 3 steps"):
        wait_for(lambda: False, 60, "3 steps", {"drafter-0": done})
