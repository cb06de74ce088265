"""deploy/: systemd units, Prometheus config and rules, Grafana provisioning and dashboard.

The external checkers do the judging: `systemd-analyze verify` for the units, `promtool check
config|rules` and `promtool test rules` for Prometheus. PromQL in the dashboard is parsed by promtool
too (as recording rules). Metric names in the rules and the dashboard are checked against what the
real metric classes and the real ring collector export.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from deploy_support import (
    DASHBOARD,
    DATASOURCE_UID,
    DEPLOY,
    INSTALLED_BIN,
    PROMETHEUS,
    RULES,
    UNITS,
    dashboard,
    dashboard_panels,
    metric_names,
    panel_exprs,
    require,
)

SERVICES = [
    "dflash-ring-supervisor.service",
    "dflash-ring-target@.service",
    "dflash-ring-drafter@.service",
    "dflash-ring-drafter-standby@.service",
    "dflash-ring-target-group@.service",
]
CONFIG = "/etc/dflash-ring/run.toml"
ENV_FILE = "/etc/dflash-ring/env"


def read_unit(name: str) -> dict[str, dict[str, list[str]]]:
    """section -> key -> every value, in order (systemd keys repeat: Environment=, ExecStop=)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for line in (UNITS / name).read_text().splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key, []).append(value)
    return sections


def one(unit: dict, section: str, key: str) -> str:
    values = unit[section].get(key, [])
    assert len(values) == 1, f"[{section}] {key}= should be set once, got {values}"
    return values[0]


def installed_binary() -> str:
    """A real dflash-ring entry point to stand in for /usr/local/bin/dflash-ring (verify checks it exists)."""
    candidate = Path(sys.executable).with_name("dflash-ring")
    assert candidate.exists(), f"{candidate} missing: install the package (`make setup`)"
    return str(candidate)


# ---- systemd -----------------------------------------------------------------------------------


@pytest.mark.processes
@pytest.mark.parametrize(
    "unit",
    [
        "dflash-ring-supervisor.service",
        "dflash-ring.target",
        "dflash-ring-target@0.service",
        "dflash-ring-drafter@6.service",
        "dflash-ring-target-group@2.service",
        "dflash-ring-drafter-standby@7.service",
    ],
)
def test_units_pass_systemd_analyze_verify(tmp_path, unit):
    tool = require("systemd-analyze", "apt-get install systemd")
    for f in UNITS.iterdir():
        text = f.read_text()
        if f.suffix in (".service", ".target"):
            # verify insists that ExecStart's binary exists; the units name the documented install path.
            text = text.replace(INSTALLED_BIN, installed_binary())
        (tmp_path / f.name).write_text(text)
    out = subprocess.run([tool, "verify", f"./{unit}"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    # verify exits 0 on unknown keys and bad values (it only warns), so any output is a failure too.
    assert out.returncode == 0 and not (out.stdout + out.stderr).strip(), out.stdout + out.stderr


def test_services_are_notify_watchdogged_restartable_and_part_of_the_target():
    for name in SERVICES:
        u = read_unit(name)
        s = u["Service"]
        assert one(u, "Service", "Type") == "notify" and one(u, "Service", "NotifyAccess") == "main", name
        assert one(u, "Service", "WatchdogSec") and one(u, "Service", "TimeoutStopSec"), name
        assert one(u, "Service", "Restart") == "on-failure" and one(u, "Service", "KillSignal") == "SIGTERM", name
        assert one(u, "Unit", "StartLimitIntervalSec") and int(one(u, "Unit", "StartLimitBurst")) > 1, name
        assert one(u, "Unit", "PartOf") == "dflash-ring.target", name
        assert one(u, "Install", "WantedBy") == "dflash-ring.target", name
        assert one(u, "Service", "User") == "dflash" and one(u, "Service", "EnvironmentFile") == ENV_FILE, name
        assert "XDG_RUNTIME_DIR=/run" in s["Environment"], name  # lock files in /run/dflash-ring/<run>
        assert one(u, "Service", "RuntimeDirectory") == "dflash-ring", name
        assert one(u, "Service", "RuntimeDirectoryPreserve") == "yes", name  # one unit stopping keeps the locks
        if name == "dflash-ring-supervisor.service":  # an end after fencing a straggler is no failure to restart
            from dflash_ring.supervisor.supervisor import EXIT_FENCED

            assert one(u, "Service", "SuccessExitStatus") == str(EXIT_FENCED), name
        else:
            assert one(u, "Unit", "After") == "dflash-ring-supervisor.service", name
            assert one(u, "Unit", "Wants") == "dflash-ring-supervisor.service", name
            assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in s["Environment"], name
            if name != "dflash-ring-target-group@.service":  # a group's ExecStart sets its N GPUs
                assert "CUDA_VISIBLE_DEVICES=%i" in s["Environment"], name
    drafter = read_unit("dflash-ring-drafter@.service")
    # A drafter checkpoints on SIGTERM: minutes, not systemd's default 90 s.
    assert one(drafter, "Service", "TimeoutStopSec").endswith("min")
    target = read_unit("dflash-ring.target")
    assert "dflash-ring-supervisor.service" in one(target, "Unit", "Wants")


@pytest.mark.processes
def test_sysusers_snippet_creates_a_system_user(tmp_path):
    tool = require("systemd-sysusers", "apt-get install systemd")
    (tmp_path / "etc").mkdir()
    out = subprocess.run(
        [tool, f"--root={tmp_path}", str(UNITS / "dflash-ring.sysusers.conf")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    (entry,) = [ln.split(":") for ln in (tmp_path / "etc" / "passwd").read_text().splitlines()]
    # A system uid: systemd-logind's RemoveIPC= leaves system users' shared memory alone.
    assert entry[0] == "dflash" and int(entry[2]) < 1000 and entry[5] == "/var/lib/dflash-ring", entry


def systemd_command(line: str, instance: str) -> list[str]:
    """An Exec line as systemd hands it to exec: %i filled in, $$ unescaped, quotes removed."""
    line = line.lstrip("-")
    return [w.replace("$$", "$") for w in shlex.split(line.replace("%i", instance))]


def env_file() -> dict[str, str]:
    out = {}
    for line in (UNITS / "env").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def run_exec(unit: str, key: str, instance: str, extra_env: dict[str, str]) -> tuple[list[str] | None, dict]:
    """Run the unit's Exec line through its real shell wrapper, with dflash-ring replaced by an argv printer."""
    u = read_unit(unit)
    (line,) = u["Service"][key]
    argv = systemd_command(line, instance)
    printer = f"{shlex.quote(sys.executable)} -c " + shlex.quote(
        "import json, os, sys; print(json.dumps([sys.argv[1:], dict(os.environ)]))"
    )
    argv = [a.replace(INSTALLED_BIN, printer) for a in argv]
    env = {"PATH": "/usr/bin:/bin"} | env_file() | extra_env
    for assignment in u["Service"].get("Environment", []):
        k, _, v = assignment.replace("%i", instance).partition("=")
        env.setdefault(k, v)  # EnvironmentFile= wins over Environment=, as in systemd
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    if not out.stdout.strip():
        return None, {}
    args, seen_env = json.loads(out.stdout)
    return args, seen_env


@pytest.mark.processes
@pytest.mark.parametrize(
    "unit,instance,first_gpu,index",
    [
        ("dflash-ring-target@.service", "3", None, 3),
        ("dflash-ring-drafter@.service", "5", None, 0),  # the env file's DFLASH_DRAFTER_FIRST_GPU=5
        ("dflash-ring-drafter@.service", "7", None, 2),
        ("dflash-ring-drafter@.service", "6", "2", 4),
    ],
)
def test_instance_is_the_gpu_and_the_role_index_comes_from_the_env_file(unit, instance, first_gpu, index):
    from dflash_ring.cli import _parser

    extra = {}
    if first_gpu is not None:
        extra = {"DFLASH_DRAFTER_FIRST_GPU": first_gpu}
    args, env = run_exec(unit, "ExecStart", instance, extra)
    parsed = _parser().parse_args(args)  # the real CLI accepts what the unit passes
    assert parsed.command == unit.split("-")[2].split("@")[0]
    assert (parsed.index, parsed.device, parsed.config) == (index, "cuda:0", CONFIG)
    assert env["CUDA_VISIBLE_DEVICES"] == instance and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


@pytest.mark.processes
@pytest.mark.parametrize(
    "instance, ranks, index, gpus", [("0", "2", 0, "0,1"), ("2", "2", 1, "2,3"), ("4", "4", 1, "4,5,6,7")]
)
def test_a_target_group_unit_sees_its_n_gpus_and_is_producer_first_gpu_over_n(instance, ranks, index, gpus):
    from dflash_ring.cli import _parser

    args, env = run_exec(
        "dflash-ring-target-group@.service", "ExecStart", instance, {"DFLASH_TARGET_TENSOR_PARALLEL": ranks}
    )
    parsed = _parser().parse_args(args)
    assert (parsed.command, parsed.index, parsed.device, parsed.config) == ("target", index, "cuda:0", CONFIG)
    assert env["CUDA_VISIBLE_DEVICES"] == gpus and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


@pytest.mark.processes
@pytest.mark.parametrize("standby_for, indices", [(None, [0, 1, 2]), ("0,2", [0, 2])])
def test_the_standby_unit_stands_by_for_every_drafter_or_those_the_env_file_names(standby_for, indices):
    from dflash_ring.cli import _parser, _standby_indices
    from dflash_ring.common.config.load import load_config

    extra = {} if standby_for is None else {"DFLASH_STANDBY_FOR": standby_for}
    args, env = run_exec("dflash-ring-drafter-standby@.service", "ExecStart", "7", extra)
    parsed = _parser().parse_args(args)  # the real CLI accepts what the unit passes
    assert (parsed.command, parsed.index, parsed.device, parsed.config) == ("drafter", None, "cuda:0", CONFIG)
    assert _standby_indices(load_config(None, ["topology.consumers=3"]), parsed.standby) == indices
    assert env["CUDA_VISIBLE_DEVICES"] == "7"


@pytest.mark.processes
def test_supervisor_execstop_ends_the_run_only_when_systemd_stops_a_live_supervisor():
    from dflash_ring.cli import _parser

    one(read_unit("dflash-ring-supervisor.service"), "Service", "ExecStop")
    # A supervisor that died on its own ($MAINPID unset): nothing, so the restarted one adopts the ring.
    args, _ = run_exec("dflash-ring-supervisor.service", "ExecStop", "", {})
    assert args is None
    args, _ = run_exec("dflash-ring-supervisor.service", "ExecStop", "", {"MAINPID": "4242"})
    parsed = _parser().parse_args(args)
    assert (parsed.command, parsed.now, parsed.config) == ("stop", True, CONFIG)
    start = _parser().parse_args(
        shlex.split(one(read_unit("dflash-ring-supervisor.service"), "Service", "ExecStart"))[1:]
    )
    assert (start.command, start.config) == ("supervisor", CONFIG)


# ---- Prometheus --------------------------------------------------------------------------------


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    tool = require("promtool", "apt-get install prometheus")
    return subprocess.run([tool, *args], capture_output=True, text=True, timeout=120, cwd=cwd)


@pytest.mark.processes
def test_promtool_check_config():
    out = promtool("check", "config", str(PROMETHEUS / "prometheus.yml"))
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.processes
def test_promtool_check_rules():
    out = promtool("check", "rules", str(RULES))
    assert out.returncode == 0 and "SUCCESS: 8 rules found" in out.stdout, out.stdout + out.stderr


@pytest.mark.processes
def test_promtool_test_rules():
    out = promtool("test", "rules", str(RULES.with_suffix(".test.yml")))
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr


def test_every_alert_has_severity_runbook_and_a_promtool_case():
    rules = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    names = {r["alert"] for r in rules}
    assert names == {
        "ProcessDown",
        "DrafterStarved",
        "ProducersBlocked",
        "PipelineStalled",
        "GPUIdle",
        "RestartLoop",
        "SlotsReclaimed",
        "NoTrainingProgress",
    }
    for r in rules:
        assert r["labels"]["severity"] in ("warning", "critical"), r["alert"]
        assert "for" in r and r["annotations"]["summary"], r["alert"]
        assert "Runbook" in r["annotations"]["description"], r["alert"]
    cases = yaml.safe_load(RULES.with_suffix(".test.yml").read_text())["tests"]
    firing = {c["alertname"] for t in cases for c in t["alert_rule_test"] if c["exp_alerts"]}
    quiet = {c["alertname"] for t in cases for c in t["alert_rule_test"] if not c["exp_alerts"]}
    assert firing == names and quiet, (firing, quiet)


def test_scrape_config_follows_the_port_scheme():
    cfg = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    (job,) = cfg["scrape_configs"]
    assert job["job_name"] == "dflash-ring" and job["honor_labels"] is True
    ports = {}
    for group in job["static_configs"]:
        (target,) = group["targets"]
        ports[(group["labels"]["role"], int(group["labels"]["index"]))] = int(target.rsplit(":", 1)[1])
    base = ports[("supervisor", 0)]
    for (role, index), port in ports.items():
        assert port == base + {"supervisor": 0, "target": 1 + index, "drafter": 100 + index}[role], (role, index)
    assert cfg["rule_files"] == ["rules/dflash-ring.rules.yml"]


# ---- Grafana -----------------------------------------------------------------------------------


@pytest.mark.processes
def test_dashboard_panels_use_the_provisioned_datasource_and_parse(tmp_path):
    ds = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "dflash-ring.yml").read_text())
    assert [d["uid"] for d in ds["datasources"]] == [DATASOURCE_UID]
    assert ds["datasources"][0]["type"] == "prometheus"
    prov = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "dashboards" / "dflash-ring.yml").read_text())
    assert prov["providers"][0]["type"] == "file" and prov["providers"][0]["options"]["path"]

    dash = dashboard()
    panels = dashboard_panels(dash)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    assert len(panels) >= 10
    for p in panels:
        assert p["datasource"] == {"type": "prometheus", "uid": DATASOURCE_UID}, p["title"]
        assert p["targets"], f"panel {p['title']!r} has no query"
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == DATASOURCE_UID, p["title"]
            assert t["expr"].strip(), p["title"]
    # promtool parses PromQL as it checks rules: every panel query as a recording rule.
    exprs = panel_exprs(dash)
    group = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [{"record": f"dashboard:query_{i}", "expr": e} for i, (_, e) in enumerate(exprs)],
            }
        ]
    }
    (tmp_path / "dashboard.rules.yml").write_text(yaml.safe_dump(group))
    out = promtool("check", "rules", str(tmp_path / "dashboard.rules.yml"))
    assert out.returncode == 0, out.stdout + out.stderr


def test_dashboard_covers_the_operations_questions():
    used = set().union(*(metric_names(e) for _, e in panel_exprs(dashboard())))
    for name in [
        "dflash_ring_items_produced_total",
        "dflash_ring_items_consumed_total",
        "dflash_ring_target_tokens_total",
        "dflash_ring_drafter_tokens_total",
        "dflash_ring_depth_items",
        "dflash_ring_slots",
        "dflash_ring_consumer_wait_seconds_total",
        "dflash_ring_producer_blocked_seconds_total",
        "dflash_ring_drafter_loss",
        "dflash_ring_drafter_accuracy",
        "dflash_ring_drafter_acceptance_length",
        "dflash_ring_drafter_learning_rate",
        "dflash_ring_gpu_utilization_ratio",
        "dflash_ring_drafter_probabilistic_acceptance_length",
        "dflash_ring_drafter_position_accuracy",
        "dflash_ring_process_starts_total",
        "dflash_ring_items_redelivered_total",
        "dflash_ring_drafter_source_loss",
        "dflash_ring_drafter_source_acceptance_length",
        "dflash_ring_drafter_source_tokens_total",
        "dflash_ring_target_trained_tokens_total",
    ]:
        assert name in used, f"no dashboard panel shows {name}"
    # The per-source panels keep the source apart (and train apart from eval where both are there).
    by_source = [(title, e) for title, e in panel_exprs(dashboard()) if "by source" in title]
    assert len({title for title, _ in by_source}) >= 3
    for title, e in by_source:
        assert "by (source" in e, (title, e)
        assert "split" in e or "target_trained" in e, (title, e)


# ---- names: what the rules and the dashboard ask for is what the processes export ---------------


def exported_names(tmp_path: Path) -> set[str]:
    """Sample names of the real producer and drafter metrics and of the supervisor's ring collector."""
    from dflash_ring.common.config.load import load_config
    from dflash_ring.common.layout import Role
    from dflash_ring.common.metrics import DrafterMetrics, ProducerMetrics, RingCollector
    from dflash_ring.common.ring import Ring
    from dflash_ring.common.ring_spec import ring_spec

    registry = CollectorRegistry()
    # Labelled series export samples once they have a label: one source's, through the drafter's own path.
    ProducerMetrics(registry).source_trained.labels("code").inc(1)
    drafter = DrafterMetrics(registry)
    drafter.publish_sources(
        {f"{split}source/code/{what}": 1.0 for split in ("", "eval/") for what in ("loss", "accuracy", "accept_len")}
    )
    drafter.count_source_tokens({"code": 1}, "train")
    cfg = load_config(
        None,
        [
            f"run.name=deploy-names-{tmp_path.name[-20:]}",
            f"run.run_dir={tmp_path / 'locks'}",
            "ring.slots=2",
            "ring.slot_bytes=65536",
            "ring.slot_header_bytes=4096",
        ],
    )
    (tmp_path / "locks").mkdir()
    ring = Ring.create(ring_spec(cfg))
    try:
        ring.take_row(0, Role.SUPERVISOR, 0)
        collector = RingCollector(tmp_path / "locks")
        collector.attach(ring)
        registry.register(collector)
        families = list(registry.collect())
        names = {s.name for family in families for s in family.samples}
        # A labelled gauge has no sample until its first label value (per block position): its name counts.
        names |= {family.name for family in families if family.type == "gauge"}
        collector.detach()
    finally:
        ring.close()
        Ring.unlink(cfg.run.name)
    # GPU gauges export nothing without NVML; their names are fixed in gpu_metrics.py.
    gpu_source = (Path(__file__).resolve().parent.parent / "common" / "gpu_metrics.py").read_text()
    names |= {
        n
        for n in (
            "dflash_ring_gpu_utilization_ratio",
            "dflash_ring_gpu_memory_used_bytes",
            "dflash_ring_gpu_power_watts",
        )
        if f'"{n}"' in gpu_source
    }
    return names


def test_rules_and_dashboard_ask_only_for_exported_metrics(tmp_path):
    exported = exported_names(tmp_path)
    assert "dflash_ring_items_consumed_total" in exported and "dflash_ring_drafter_step_seconds_bucket" in exported
    rules = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    wanted = {(f"alert {r['alert']}", n) for r in rules for n in metric_names(r["expr"])}
    wanted |= {(f"panel {title!r}", n) for title, e in panel_exprs(dashboard()) for n in metric_names(e)}
    missing = sorted(f"{where}: {name}" for where, name in wanted if name not in exported)
    assert not missing, "not exported by any process: " + "; ".join(missing)


def test_dashboard_json_is_what_grafana_loads():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "dflash-ring" and dash["schemaVersion"] >= 36
    assert not dash["templating"]["list"], "panel queries assume no template variables (tests fill $__rate_interval)"
