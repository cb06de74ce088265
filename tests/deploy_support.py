"""Shared by test_deploy.py and test_prometheus_live.py: where deploy/ is, and the external tools it needs.

promtool and prometheus come from the distribution (`apt-get install prometheus`); `make test` and
.ci/run install them when run as root. Missing in CI (env CI set) is a failure, elsewhere a skip.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
UNITS = DEPLOY / "systemd"
PROMETHEUS = DEPLOY / "prometheus"
RULES = PROMETHEUS / "rules" / "dflash-ring.rules.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "dflash-ring.json"
DATASOURCE_UID = "dflash-ring-prom"
INSTALLED_BIN = "/usr/local/bin/dflash-ring"
# Grafana's range variable; the tests give it a value Prometheus can evaluate.
RATE_INTERVAL = "$__rate_interval"


def require(tool: str, install: str) -> str:
    """The tool's path; fail under CI (env CI set), skip elsewhere, naming the install command."""
    path = shutil.which(tool)
    if path:
        return path
    if os.environ.get("CI"):
        pytest.fail(
            f"{tool} is not installed but CI is set: the deploy checks must run in CI. "
            f"Install it with `{install}` (.ci/run and `make test` do so as root)"
        )
    pytest.skip(f"{tool} not found: {install}")


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_panels(dash: dict) -> list[dict]:
    """Every panel, rows' nested panels included; rows themselves have no queries."""
    out = []
    for p in dash["panels"]:
        if p.get("type") == "row":
            out += p.get("panels", [])
        else:
            out.append(p)
    return out


def panel_exprs(dash: dict, rate_interval: str = "1m") -> list[tuple[str, str]]:
    """(panel title, PromQL) for every panel target, with Grafana's $__rate_interval filled in."""
    return [
        (p["title"], t["expr"].replace(RATE_INTERVAL, rate_interval))
        for p in dashboard_panels(dash)
        for t in p.get("targets", [])
    ]


def is_gpu_expr(expr: str) -> bool:
    return "dflash_ring_gpu_" in expr


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\bdflash_ring_[a-z0-9_]+", expr))
