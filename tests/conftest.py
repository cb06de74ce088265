"""Fixtures and hooks: a run per test (own name, own lock dir), real processes, and cleanup.

The helpers themselves (Run, wait_for, configs, tiny targets) live in support.py.

Tests that start processes carry the `processes` marker (pyproject.toml), so `pytest -m "not processes"`
is the quick in-process subset. A test using the `run` fixture is marked here; any other test that
starts a process marks itself, and an unmarked test that starts one fails, naming the marker.
"""

from __future__ import annotations

import itertools
import multiprocessing.process
import os
import signal
import subprocess
from pathlib import Path

import pytest

from dflash_ring.common.ring import Ring
from support import Run

_seq = itertools.count()

PROCESS_FIXTURES = {"run"}  # fixtures whose tests start processes


def pytest_collection_modifyitems(config, items):
    for item in items:
        if PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.processes)
    if hasattr(config, "workerinput"):  # a pytest-xdist worker (`make test`)
        _longest_modules_first(items)


# A process test costs about this many in-process tests (its processes each import torch and transformers).
PROCESS_TEST_WEIGHT = 20


def _longest_modules_first(items: list[pytest.Item]) -> None:
    """`make test` runs pytest-xdist with --dist loadscope --no-loadscope-reorder: a module is one unit of work (its
    module fixtures built once, its tests in their order on one worker), and the units go out in the order of the
    collection. That order is set here: modules by an estimate of their time, longest first (a process test weighs
    PROCESS_TEST_WEIGHT in-process ones), so that no long module starts last while the other workers idle. Every
    worker collects in this same order (xdist checks that)."""
    weight: dict[str, int] = {}
    for item in items:
        module = item.nodeid.split("::")[0]
        weight[module] = weight.get(module, 0) + (PROCESS_TEST_WEIGHT if item.get_closest_marker("processes") else 1)
    items.sort(key=lambda item: -weight[item.nodeid.split("::")[0]])  # stable: a module's tests keep their order


@pytest.fixture(autouse=True)
def _processes_are_marked(request, monkeypatch):
    """An unmarked test that starts a process fails: the quick subset must stay in-process."""
    if request.node.get_closest_marker("processes") is not None:
        yield
        return
    started: list[str] = []
    popen_init = subprocess.Popen.__init__
    process_start = multiprocessing.process.BaseProcess.start

    def note_popen(self, args, *a, **kw):
        started.append(repr(args))
        popen_init(self, args, *a, **kw)

    def note_start(self):
        started.append(repr(self))
        process_start(self)

    monkeypatch.setattr(subprocess.Popen, "__init__", note_popen)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", note_start)
    yield
    if started:
        pytest.fail(
            f"{request.node.nodeid} starts processes ({started[0][:200]}) but is not marked "
            "@pytest.mark.processes: mark it, so `pytest -m 'not processes'` stays quick",
            pytrace=False,
        )


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    """Keep each phase's report on the test item, so the `run` fixture knows at teardown whether the test failed."""
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


@pytest.fixture
def run(request, tmp_path: Path):
    r = Run(tmp_path, f"t{os.getpid()}-{next(_seq)}")
    yield r
    failed = getattr(request.node, "report_call", None) is not None and request.node.report_call.failed
    for proc in r.procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        if proc.stderr is not None:
            if failed:  # every process's last words, the supervisor's too: a CI failure must be readable as it is
                proc.stderr.seek(0)
                print(
                    f"--- exit {proc.returncode}: {' '.join(map(str, proc.args))[-200:]}\n{proc.stderr.read()[-2000:]}"
                )
            proc.stderr.close()
    Ring.unlink(r.name)
