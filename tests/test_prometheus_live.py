"""A real Prometheus scrapes a real CPU pipeline (supervisor, 1 target, 2 drafters) with our rules loaded.

Checks, through Prometheus's HTTP API:
- every dashboard panel query parses and returns at least one series. The GPU panels are the
  exception on this CPU run: their gauges exist only on GPU hosts, so here they must parse and
  return nothing;
- every alert expression of deploy/prometheus/rules is valid PromQL, and the ones that must be
  quiet on a healthy run are (DrafterStarved and ProducersBlocked depend on the relative speed of
  targets and drafters, so on a healthy run they are only parsed);
- a stopped producer (SIGSTOP: it keeps its lock, so the ring does not reap it, but answers no
  scrape) makes ProcessDown, PipelineStalled and DrafterStarved fire.

The rules Prometheus loads are a test copy of the shipped file with every `for:` set to 0s and every
range window ([5m], [10m], [30m]) shortened to [15s], so alerts fire within seconds instead of
minutes. The quiet checks evaluate the shipped expressions unchanged. All waits are bounded and
nothing asserts on speed.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

from deploy_support import PROMETHEUS, RULES, dashboard, is_gpu_expr, panel_exprs, require
from support import PIPELINE_RUN, build_target, cyclic_rows, pipeline_config, wait_exit

QUIET_WHEN_HEALTHY = {
    "ProcessDown",
    "RestartLoop",
    "SlotsReclaimed",
    "PipelineStalled",
    "NoTrainingProgress",
    "GPUIdle",
}
SPEED_DEPENDENT = {"DrafterStarved", "ProducersBlocked"}


def wait_for(cond, timeout: float, what: str):
    """support's wait_for at a pace a Prometheus API on a shared box does not mind (2 polls a second)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := cond():
            return got
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prom:
    """A prometheus server on 127.0.0.1 with its own storage, and its HTTP API."""

    def __init__(self, tmp: Path, config: dict):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config_file = tmp / "prometheus.yml"
        self.config_file.write_text(yaml.safe_dump(config))
        self.log = tmp / "prometheus.log"
        self.proc = subprocess.Popen(
            [
                require("prometheus", "apt-get install prometheus"),
                f"--config.file={self.config_file}",
                f"--storage.tsdb.path={tmp / 'prom-data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
        )

    def get(self, path: str, **params) -> dict:
        url = f"{self.url}{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:  # 400 for a query that does not parse: say why
            body = json.load(e)
            raise AssertionError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}") from None
        assert body["status"] == "success", body
        return body["data"]

    def ready(self) -> bool:
        assert self.proc.poll() is None, f"prometheus exited: {self.log.read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def query(self, expr: str) -> list[dict]:
        return self.get("/api/v1/query", query=expr)["result"]

    def active_alerts(self) -> list[dict]:
        return self.get("/api/v1/alerts")["alerts"]

    def firing(self, name: str) -> list[dict]:
        return [
            a["labels"] for a in self.active_alerts() if a["labels"]["alertname"] == name and a["state"] == "firing"
        ]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def fast_rules(path: Path) -> Path:
    """The shipped rules with `for:` 0s and range windows of 15s: the same expressions, seconds to fire."""
    text = re.sub(r"for: \d+m\b", "for: 0s", RULES.read_text())
    text = re.sub(r"\[\d+m\]", "[15s]", text)
    assert "m]" not in text and re.search(r"for: \d+m", text) is None
    path.write_text(text)
    return path


def scrape_config(run_ports: dict[str, int], rules: Path) -> dict:
    """The shipped prometheus.yml with this run's ports, a 1 s scrape and evaluation, and the test rules."""
    cfg = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    cfg["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    cfg["rule_files"] = [str(rules)]
    (job,) = cfg["scrape_configs"]
    job["scrape_interval"], job["scrape_timeout"] = "1s", "1s"
    groups = []
    for name, port in run_ports.items():
        role, _, index = name.partition("-")
        groups.append({"targets": [f"127.0.0.1:{port}"], "labels": {"role": role, "index": index or "0"}})
    job["static_configs"] = groups
    return cfg


def start(run, *args: str) -> subprocess.Popen:
    """A dflash-ring process with its log in a file (a pipe nobody reads would block a long run)."""
    log = (run.tmp / f"{'-'.join(args[:3:2])}.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflash_ring", *args[:1], "--config", str(run.config), *args[1:]],
        cwd=run.tmp,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    run.procs.append(proc)
    return proc


def logs(run) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(run.tmp.glob("*.log")))


def test_prometheus_scrapes_the_pipeline_evaluates_the_dashboard_and_fires_on_a_stopped_producer(run):
    from dflash_ring.common.metrics import run_ports

    require("prometheus", "apt-get install prometheus")
    target = build_target(run.tmp / "target", "qwen3", layers=4)
    data = cyclic_rows(run.tmp / "chat.jsonl", 96)
    # Long enough that the producer cannot finish its shard during the test; few log lines and checkpoints.
    cfg = pipeline_config(
        run,
        target,
        data,
        PIPELINE_RUN,
        {
            "data": {"epochs": 10000},
            "train": {"checkpoint_every_steps": 100000, "log_every_steps": 10},
        },
    )
    ports = run_ports(cfg.metrics, cfg.topology)
    assert set(ports) == {"supervisor", "target-0", "drafter-0", "drafter-1"}

    sup = start(run, "supervisor")
    producer = start(run, "target", "--index", "0")
    drafters = [start(run, "drafter", "--index", str(j)) for j in (0, 1)]
    prom = Prom(run.tmp, scrape_config(ports, fast_rules(run.tmp / "rules.yml")))
    try:
        wait_for(prom.ready, timeout=60, what="prometheus to be ready")

        def all_up() -> bool:
            for p in (sup, producer, *drafters):
                assert p.poll() is None, f"{p.args} exited {p.returncode}:\n{logs(run)}"
            targets = prom.get("/api/v1/targets")["activeTargets"]
            return len(targets) == 4 and all(t["health"] == "up" for t in targets)

        wait_for(all_up, timeout=300, what="every process to be scraped")
        # Both drafters have trained and the ring has moved items, as seen by Prometheus itself.
        wait_for(
            lambda: (
                all_up()
                and len(prom.query("increase(dflash_ring_drafter_steps_total[10m]) > 0")) == 2
                and prom.query("increase(dflash_ring_items_consumed_total[10m]) > 0")
            ),
            timeout=400,
            what="both drafters to step and the ring to move items",
        )
        wait_for(
            lambda: len(prom.query("count_over_time(dflash_ring_drafter_loss[1m]) > 5")) == 2,
            timeout=60,
            what="a few scrapes of the drafters",
        )
        # Per-source series, with a `source` label: one source here, the data file's name, on both drafters (a few
        # scrapes of each, so that the per-source rates have two samples).
        wait_for(
            lambda: (
                len(prom.query('count_over_time(dflash_ring_drafter_source_tokens_total{split="train"}[1m]) > 2')) == 2
            ),
            timeout=300,
            what="per-source series of both drafters",
        )
        by_source = prom.query('dflash_ring_drafter_source_loss{split="train"}')
        assert len(by_source) == 2 and {r["metric"]["source"] for r in by_source} == {"chat"}, by_source

        # Every panel query parses; all but the GPU panels return series on this CPU run.
        empty, gpu = [], []
        for title, expr in panel_exprs(dashboard()):
            result = prom.query(expr)
            if is_gpu_expr(expr):
                gpu.append(title)
                assert result == [], f"GPU panel {title!r} has series on a CPU run: {result}"
            elif not result:
                empty.append(f"{title}: {expr}")
        assert not empty, "dashboard queries without series:\n" + "\n".join(empty)
        assert len(gpu) == 3

        # Every alert expression is valid PromQL; the ones that must be quiet on a healthy run are.
        shipped = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
        assert {r["alert"] for r in shipped} == QUIET_WHEN_HEALTHY | SPEED_DEPENDENT
        for rule in shipped:
            result = prom.query(rule["expr"])
            if rule["alert"] in QUIET_WHEN_HEALTHY:
                assert result == [], f"{rule['alert']} is not quiet on a healthy run: {result}\n{logs(run)}"

        # Prometheus loaded the (fast) rules and evaluates them without error.
        def evaluated() -> list[dict]:
            rules = [r for g in prom.get("/api/v1/rules")["groups"] for r in g["rules"]]
            return rules if len(rules) == 8 and all(r["health"] == "ok" for r in rules) else []

        rules = wait_for(evaluated, timeout=60, what="prometheus to evaluate every rule")
        assert {r["name"] for r in rules} == QUIET_WHEN_HEALTHY | SPEED_DEPENDENT
        for name in ("ProcessDown", "RestartLoop", "SlotsReclaimed"):
            assert not [a for a in prom.active_alerts() if a["labels"]["alertname"] == name], name

        # Stop the producer: no scrape answers (ProcessDown), nothing more is consumed while the run is
        # not done (PipelineStalled), and the drafters only wait (DrafterStarved).
        producer.send_signal(signal.SIGSTOP)
        try:
            down = wait_for(lambda: prom.firing("ProcessDown"), timeout=120, what="ProcessDown to fire")
            assert [(a["role"], a["index"]) for a in down] == [("target", "0")], down
            stalled = wait_for(lambda: prom.firing("PipelineStalled"), timeout=180, what="PipelineStalled to fire")
            assert stalled[0]["role"] == "supervisor" and stalled[0]["severity"] == "critical"
            starved = wait_for(
                lambda: len(prom.firing("DrafterStarved")) == 2 and prom.firing("DrafterStarved"),
                timeout=120,
                what="DrafterStarved to fire for both drafters",
            )
            assert sorted(a["index"] for a in starved) == ["0", "1"]
            assert not prom.firing("SlotsReclaimed") and not prom.firing("RestartLoop")
        finally:
            producer.send_signal(signal.SIGCONT)

        # The run still ends cleanly: stop at once, every drafter checkpoints, everyone exits 0.
        run.cli("stop", "--config", str(run.config), "--now", "--timeout", "240")
        for p in (producer, *drafters, sup):
            assert wait_exit(p, 240) == 0, logs(run)
    finally:
        prom.stop()
    assert run.leftovers() == []
