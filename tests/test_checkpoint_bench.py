"""`bench checkpoint --tiny` in-process on the CPU: it runs through the drafter process's own checkpoint policy, the
background checkpoint holds its step, and each measurement went to stderr as it was made."""

from __future__ import annotations

import json
import re

import pytest

from dflash_ring.bench.checkpoint import run_checkpoint_bench

PROGRESS = re.compile(r"^(\w+) (\w+): (\{.*\})$")  # bench/progress.py's lines


@pytest.mark.processes  # the report's device name on a CPU is platform.processor(), which runs `uname -p`
def test_tiny_checkpoint_bench_measures_both_ways_and_says_so_as_it_goes(tmp_path, capsys):
    report = run_checkpoint_bench(tiny=True, every=10, steps=1, directory=str(tmp_path))
    assert report["background_checkpoint_matches_its_step"] and report["checkpoint_bytes"] > 0
    assert not list(tmp_path.iterdir())  # its checkpoints are removed
    lines = [PROGRESS.match(line) for line in capsys.readouterr().err.splitlines()]
    figures = {m[2]: json.loads(m[3]) for m in lines if m and m[1] == "checkpoint"}
    assert list(figures) == ["warmup", "before", "in_step", "snapshot", "background", "after"]
    assert figures["warmup"]["warmup_s"] == report["warmup_s"]
    assert (figures["before"]["step_s"], figures["after"]["step_s"]) == (
        report["step_s"]["before"],
        report["step_s"]["after"],
    )
    assert figures["in_step"] == {
        "checkpoint_bytes": report["checkpoint_bytes"],
        **{k: report["in_step"][k] for k in ("critical_path_s", "write_gb_per_s")},
    }
    assert figures["snapshot"]["host_buffer_bytes"] == report["host_buffer_bytes"]
    assert all(report["background"][k] == v for k, v in figures["snapshot"].items() if k != "host_buffer_bytes")
    assert figures["background"] == {k: report["background"][k] for k in figures["background"]}
