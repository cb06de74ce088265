"""Start-up of role processes: the phase clock (common/lifecycle/startup.py) and what each role imports before its work.

A role restarted after a kill works again only once its imports are done, so the modules a role never
needs at start (torch in the supervisor, transformers' model code in the drafter, datasets in a target
whose data is tokenized already) must stay out of its import graph. The phases of real processes are
checked by the chaos test (tests/test_chaos.py) and served on /metrics (tests/test_metrics.py).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry

from dflash_ring.common.lifecycle.ledger import Ledger, read_ledger
from dflash_ring.common.lifecycle.startup import Startup, process_age_s


def test_phases_run_from_exec_each_once_and_finish_writes_one_record(tmp_path):
    startup = Startup("drafter 0")
    startup.mark("imports")
    startup.mark("config")
    startup.mark("imports")  # already marked: ignored
    registry = CollectorRegistry()
    startup.export(registry)
    ledger = Ledger(tmp_path / "drafter-0.jsonl")
    startup.finish("first_step", ledger)
    startup.finish("again", ledger)
    startup.mark("late")
    assert list(startup.phases) == ["imports", "config", "first_step"]
    assert startup.phases["imports"] >= startup.exec_age_s > 0  # the clock started at exec, not at Startup()
    assert all(s >= 0 for s in startup.phases.values())
    assert 0 < process_age_s()
    records = read_ledger(ledger.path).records
    assert [r["ev"] for r in records] == ["startup"]
    assert records[0]["phases"] == startup.phases and records[0]["total"] == startup.total_s
    served = {s.labels["phase"]: s.value for family in registry.collect() for s in family.samples}
    assert served == startup.phases


@pytest.mark.processes
@pytest.mark.parametrize(
    "module,absent",
    [
        ("dflash_ring.supervisor.supervisor", ["torch", "transformers"]),
        (
            "dflash_ring.consumer.training.process",
            ["transformers.modeling_utils", "transformers.models.qwen3.modeling_qwen3", "datasets", "torch._dynamo"],
        ),
        ("dflash_ring.producer.process", ["datasets", "pyarrow", "pandas"]),
    ],
)
def test_a_role_imports_only_what_its_start_needs(module, absent):
    code = (
        f"import json, sys, dflash_ring.cli, {module}; print(json.dumps([m for m in {absent!r} if m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout) == []
