"""Metrics and systemd readiness of real processes: /metrics scraped over HTTP, sd_notify over a real socket."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import signal
import socket
import subprocess
import urllib.request
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from dflash_ring.cli import main as cli_main
from dflash_ring.common.config.load import load_config
from dflash_ring.common.config.schema import ConfigError
from dflash_ring.common.gpu_metrics import GpuCollector, device_uuid
from dflash_ring.common.metrics import run_ports
from dflash_ring.common.ring import Ring
from support import build_target, pipeline_config, wait_exit, wait_for, write_chat_rows

SUPERVISOR_NAMES = [
    "dflash_ring_capacity_slots",
    "dflash_ring_slots",
    "dflash_ring_depth_items",
    "dflash_ring_items_produced_total",
    "dflash_ring_items_consumed_total",
    "dflash_ring_items_redelivered_total",
    "dflash_ring_items_reclaimed_total",
    "dflash_ring_producers_done",
    "dflash_ring_producers_expected",
    "dflash_ring_process_starts_total",
    "dflash_ring_consumers_live",
    "dflash_ring_producers_live",
    "dflash_ring_startup_seconds",
]
TARGET_NAMES = [
    "dflash_ring_producer_blocked_seconds_total",
    "dflash_ring_d2h_copy_seconds",
    "dflash_ring_target_tokens_total",
    "dflash_ring_target_items_total",
    "dflash_ring_bad_rows_skipped_total",
    "dflash_ring_target_step_seconds",
    "dflash_ring_target_packing_info",
    "dflash_ring_target_conformance_error",
    "dflash_ring_startup_seconds",
]
DRAFTER_NAMES = [
    "dflash_ring_consumer_wait_seconds_total",
    "dflash_ring_h2d_copy_seconds",
    "dflash_ring_drafter_tokens_total",
    "dflash_ring_drafter_steps_total",
    "dflash_ring_drafter_step_seconds",
    "dflash_ring_drafter_loss",
    "dflash_ring_drafter_accuracy",
    "dflash_ring_drafter_acceptance_length",
    "dflash_ring_drafter_learning_rate",
    "dflash_ring_drafter_grad_norm",
    "dflash_ring_startup_seconds",
]
HISTOGRAMS = {
    "dflash_ring_d2h_copy_seconds",
    "dflash_ring_target_step_seconds",
    "dflash_ring_h2d_copy_seconds",
    "dflash_ring_drafter_step_seconds",
}


class Scrape:
    """One /metrics page, parsed by prometheus_client's own parser."""

    def __init__(self, port: int):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.samples = {}
        for f in self.families.values():
            for s in f.samples:
                self.samples.setdefault(s.name, []).append(s)

    def has(self, name: str) -> bool:
        if name in HISTOGRAMS:
            return self.families.get(name) is not None and self.families[name].type == "histogram"
        return name in self.samples

    def value(self, name: str, **labels: str) -> float:
        found = [s.value for s in self.samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())]
        assert len(found) == 1, (name, labels, self.samples.get(name))
        return found[0]


def try_scrape(port: int) -> Scrape | None:
    try:
        return Scrape(port)
    except OSError:
        return None


def listening_addresses(port: int) -> set[str]:
    """Local IPv4 addresses with a listening TCP socket on port, from /proc/net/tcp."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, p = local.split(":")
        if state == "0A" and int(p, 16) == port:
            found.add(socket.inet_ntoa(bytes.fromhex(addr)[::-1]))
    return found


@pytest.fixture
def one_thread(monkeypatch):
    """Four CPU processes on two cores: one BLAS thread each."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.fixture
def notify_socket(monkeypatch):
    """A real AF_UNIX datagram socket in the abstract namespace, named in NOTIFY_SOCKET for child processes."""
    name = f"dflash-ring-test-notify-{os.getpid()}-{id(monkeypatch)}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(120)
    monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
    yield sock
    sock.close()


def drain(sock: socket.socket) -> list[str]:
    sock.setblocking(False)
    out = []
    try:
        while True:
            out.append(sock.recv(4096).decode())
    except BlockingIOError:
        return out
    finally:
        sock.settimeout(120)


@contextlib.contextmanager
def stderr_on_failure(procs: dict[str, subprocess.Popen]):
    """A failure shows what each process said (they are killed first, so their pipes end)."""
    try:
        yield
    except BaseException as e:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        tails = "".join(f"\n--- {name}:\n{p.stderr.read()[-2500:]}" for name, p in procs.items())
        raise AssertionError(f"{type(e).__name__}: {e}{tails}") from e


def long_run_config(run) -> None:
    """Many epochs of a small set: the run outlasts the test, which ends it with a drain."""
    target = build_target(run.tmp / "target", "qwen3", layers=4, hidden=32)
    data = write_chat_rows(run.tmp / "chat.jsonl", 64)
    pipeline_config(
        run,
        target,
        data,
        {
            "ring": {"slot_header_bytes": 4096},
            "data": {"max_tokens_per_batch": 256, "epochs": 500},
            "drafter": {"num_anchors": 8},
            "train": {"average_every_steps": 0, "checkpoint_every_steps": 100000, "log_every_steps": 100000},
        },
        slot_bytes=1 << 20,
    )


def check_supervisor_matches_status(run, sup: Scrape) -> None:
    """At a quiet moment the supervisor's scrape, Ring.status() and `dflash-ring status --json` agree."""
    with Ring.open(run.name) as ring:
        st = ring.status()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # `dflash-ring status --json`, run here: a process would only add start-up
        assert cli_main(["status", "--config", str(run.config), "--json"]) == 0
    cli = json.loads(out.getvalue())
    assert sup.value("dflash_ring_capacity_slots") == st.n_slots == 8  # pipeline_config's ring
    for state, n in st.slots_by_state.items():
        assert sup.value("dflash_ring_slots", state=state) == n == cli["slots_by_state"][state]
    assert sup.value("dflash_ring_depth_items") == st.depth == cli["depth"]
    for key in ("produced", "consumed", "redelivered", "reclaimed"):
        assert sup.value(f"dflash_ring_items_{key}_total") == st.counters[key] == cli["counters"][key], key
    assert sup.value("dflash_ring_producers_done") == st.counters["producers_done"] == 0
    assert sup.value("dflash_ring_producers_expected") == 1
    roles = {"supervisor": "supervisor", "producer": "target", "consumer": "drafter"}
    for row in st.rows:
        starts = sup.value("dflash_ring_process_starts_total", role=roles[row["role"]], index=str(row["index"]))
        assert starts == row["restarts"] + 1 == 1
    assert sup.value("dflash_ring_producers_live") == 1 and sup.value("dflash_ring_consumers_live") == 2


def test_every_process_serves_its_metrics_and_the_supervisor_matches_status(run, one_thread, notify_socket):
    long_run_config(run)
    cfg = load_config(run.config)
    ports = run_ports(cfg.metrics, cfg.topology)
    assert cfg.metrics.bind == "127.0.0.1"
    sup = run.supervisor()
    target = run.role("target", 0)
    drafters = [run.role("drafter", j) for j in range(2)]
    procs = {"supervisor": sup, "target-0": target, "drafter-0": drafters[0], "drafter-1": drafters[1]}
    with stderr_on_failure(procs):
        # READY=1 from each role, once its model is loaded and the ring attached.
        ready = []
        while len(ready) < 4:
            msg = notify_socket.recv(4096).decode()
            ready += [msg] if msg.startswith("READY=1") else []
        assert sorted(m.split("STATUS=")[1].split(":")[0].split()[0] for m in ready) == [
            "drafter",
            "drafter",
            "ring",
            "target",
        ]

        scrapes = {
            name: wait_for(lambda p=port: try_scrape(p), what=f"{name} /metrics") for name, port in ports.items()
        }
        for name, port in ports.items():
            assert listening_addresses(port) == {"127.0.0.1"}, name  # loopback only by default
            role, _, index = name.partition("-")
            s = scrapes[name]
            info = s.samples["dflash_ring_process_info"]
            assert [(i.labels, i.value) for i in info] == [
                ({"role": role, "index": index or "0", "run": run.name, "UUID": ""}, 1.0)
            ]
            assert not [n for n in s.families if n.startswith("dflash_ring_gpu_")], name  # no GPU here: nothing
        for names, who in (
            (SUPERVISOR_NAMES, ["supervisor"]),
            (TARGET_NAMES, ["target-0"]),
            (DRAFTER_NAMES, ["drafter-0", "drafter-1"]),
        ):
            for w in who:
                missing = [n for n in names if not scrapes[w].has(n)]
                assert not missing, (w, missing)
        assert not scrapes["supervisor"].has("dflash_ring_target_items_total")

        # Quiet moment 1: drafters stopped, the target blocked on a full ring.
        wait_for(
            lambda: Scrape(ports["supervisor"]).value("dflash_ring_items_consumed_total") >= 2,
            timeout=120,
            what="drafters consuming",
        )
        for d in drafters:
            d.send_signal(signal.SIGSTOP)

        def target_caught_up() -> Scrape | None:
            s, t = Scrape(ports["supervisor"]), Scrape(ports["target-0"])
            full = s.value("dflash_ring_slots", state="free") == s.value("dflash_ring_slots", state="writing") == 0
            produced = s.value("dflash_ring_items_produced_total")
            return s if full and t.value("dflash_ring_target_items_total") == produced else None

        wait_for(target_caught_up, timeout=120, what="the target to fill the ring and block")
        sup_scrape, t = Scrape(ports["supervisor"]), Scrape(ports["target-0"])
        check_supervisor_matches_status(run, sup_scrape)
        assert sup_scrape.value("dflash_ring_depth_items") >= 2  # at most one slot per stopped drafter is READING
        assert t.value("dflash_ring_target_items_total") == sup_scrape.value("dflash_ring_items_produced_total")
        assert t.value("dflash_ring_target_tokens_total") > t.value("dflash_ring_target_items_total") > 0
        assert t.value("dflash_ring_target_step_seconds_count") == t.value("dflash_ring_target_items_total")
        assert t.value("dflash_ring_d2h_copy_seconds_count") == t.value("dflash_ring_target_items_total")
        assert t.value("dflash_ring_bad_rows_skipped_total") == 0
        assert t.value("dflash_ring_target_packing_info", mode="packed", model_type="qwen3") == 1
        assert 0 <= t.value("dflash_ring_target_conformance_error") < 1e-4  # the start-up probe passed

        # Quiet moment 2: the target stopped, the drafters have taken every ready item.
        target.send_signal(signal.SIGSTOP)
        for d in drafters:
            d.send_signal(signal.SIGCONT)

        def drafters_caught_up() -> bool:
            s = Scrape(ports["supervisor"])
            d = [Scrape(ports[f"drafter-{j}"]) for j in range(2)]
            empty = s.value("dflash_ring_depth_items") == 0 and s.value("dflash_ring_slots", state="reading") == 0
            taken = sum(x.value("dflash_ring_drafter_items_total") for x in d)
            trained = any(x.value("dflash_ring_drafter_steps_total") > 0 for x in d)
            return empty and taken == s.value("dflash_ring_items_consumed_total") and trained

        wait_for(drafters_caught_up, timeout=120, what="the drafters to empty the ring")
        check_supervisor_matches_status(run, Scrape(ports["supervisor"]))
        # The ring is quiet, the drafters' prefetchers too; a drafter may still be training its last item.
        d = [Scrape(ports[f"drafter-{j}"]) for j in range(2)]
        for x in d:
            assert x.value("dflash_ring_h2d_copy_seconds_count") == x.value("dflash_ring_drafter_items_total")
            assert x.value("dflash_ring_consumer_wait_seconds_total") >= 0
        trained = [x for x in d if x.value("dflash_ring_drafter_steps_total") > 0]
        assert trained
        for x in trained:
            assert x.value("dflash_ring_drafter_tokens_total") > 0 and x.value("dflash_ring_drafter_loss") > 0
            assert 0 <= x.value("dflash_ring_drafter_accuracy") <= 1
            assert x.value("dflash_ring_drafter_acceptance_length") >= 1
            assert x.value("dflash_ring_drafter_learning_rate") > 0 and x.value("dflash_ring_drafter_grad_norm") > 0
            assert x.value("dflash_ring_drafter_step_seconds_count") >= 1

        # Drain: everyone exits 0 and the supervisor says STOPPING=1 on the way.
        target.send_signal(signal.SIGCONT)
        sup.send_signal(signal.SIGTERM)  # what `dflash-ring stop` and systemctl stop do: drain
        for name, p in procs.items():
            rc, err = wait_exit(p, 120), p.stderr.read()
            assert rc == 0, (name, err[-3000:])
            assert "NVML" not in err and "nvml" not in err, name
        assert "STOPPING=1" in drain(notify_socket)
        assert run.leftovers() == []


def test_a_taken_metrics_port_is_a_clear_error_naming_the_port_and_setting(run):
    run.write_config(1, 1)
    base = run.metrics_base
    with socket.create_server(("127.0.0.1", base)):
        out = run.cli("supervisor", "--config", str(run.config), check=False)
        assert out.returncode == 2, out.stderr
        assert f"metrics port {base} on 127.0.0.1 (for supervisor) is already in use" in out.stderr
        assert "--set metrics.port_base=" in out.stderr and "Traceback" not in out.stderr
        assert not Ring.exists(run.name)  # refused before creating anything
        # `dflash-ring run` checks every port before starting a process.
        out = run.cli("run", "--config", str(run.config), "--no-eval", check=False)
        assert out.returncode == 2 and f"metrics port {base}" in out.stderr and "Traceback" not in out.stderr
    with socket.create_server(("127.0.0.1", base + 100)):
        out = run.cli("drafter", "--config", str(run.config), "--index", "0", check=False)
        assert out.returncode == 2 and f"metrics port {base + 100} on 127.0.0.1 (for drafter 0)" in out.stderr
    # The setting the message names is checked like any other.
    assert load_config(run.config, [f"metrics.port_base={base + 1}"]).metrics.port_base == base + 1
    with pytest.raises(ConfigError, match="metrics.port_base = 70000"):
        load_config(run.config, ["metrics.port_base=70000"])


def test_gpu_collector_exports_nothing_and_stays_quiet_without_a_gpu(caplog):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    caplog.set_level(logging.INFO)
    assert device_uuid(torch.device("cpu")) == ""
    for uuids in ([""], ["GPU-00000000-0000-0000-0000-000000000000"]):
        assert list(GpuCollector(uuids).collect()) == []
    assert not [r for r in caplog.records if r.levelno >= logging.INFO]


def test_supervisor_tells_systemd_ready_watchdog_and_stopping(run, notify_socket, monkeypatch):
    monkeypatch.setenv("WATCHDOG_USEC", "200000")
    run.write_config(1, 1)
    sup = run.supervisor()
    got = [notify_socket.recv(4096).decode() for _ in range(2)]
    assert got[0].startswith("READY=1\nSTATUS=ring "), got
    assert got[1] == "WATCHDOG=1"
    sup.send_signal(signal.SIGTERM)  # drain: no producer ever ran, so the run ends at once
    assert wait_exit(sup) == 0, sup.stderr.read()
    assert "STOPPING=1" in drain(notify_socket)


def test_sd_notify_reaches_a_path_socket_and_is_a_no_op_outside_systemd(tmp_path, monkeypatch):
    from dflash_ring.common.lifecycle import sd_notify

    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sd_notify.ready() is False and sd_notify.watchdog() is False
    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        assert sd_notify.ready("up") is True
        assert sock.recv(4096) == b"READY=1\nSTATUS=up"
