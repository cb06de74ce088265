"""`bench topology`: the layout arithmetic by hand, and the tiny run end to end on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dflash_ring.bench.topology import best_layout, topology


def test_the_layout_is_the_split_that_trains_the_most():
    # T = 9,000, D = 2,700 tokens/s: 2 targets (18k) feed 6 drafters (16.2k) -> 16.2k; 1 + 7 -> 9k; 3 + 5 -> 13.5k.
    layout = best_layout(9000.0, 2700.0, 8)
    assert (layout["targets"], layout["drafters"], layout["tokens_per_s"]) == (2, 6, 16200.0)
    assert layout["bound_by"] == "drafters"
    # The other way round: fast drafters, slow targets.
    assert best_layout(1000.0, 5000.0, 8)["targets"] == 6  # 6k (vs 2 drafters: 10k); 7 + 1 -> 5k


def test_the_balanced_rate_and_the_replaced_pipeline():
    report = topology(9000.0, 2700.0)
    assert report["balanced_tokens_per_gpu_s"] == pytest.approx(1 / (1 / 9000 + 1 / 2700), abs=0.1)
    assert report["drafters_per_target"] == pytest.approx(3.33)
    assert report["replaced_pipeline_tokens_per_gpu_s"] == 2425.0
    # 5 targets + 3 drafters with these rates: the drafters bound it at 8,100 tokens/s.
    assert report["replaced_pipeline_layout_5_plus_3_tokens_per_gpu_s"] == pytest.approx(8100 / 8, abs=0.1)


@pytest.mark.processes
def test_tiny_topology_bench_runs_end_to_end():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash_ring",
            "bench",
            "topology",
            "--tiny",
            "--json",
            "--target-batches",
            "2",
            "--drafter-steps",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    top = report["topology"]
    assert top["target_tokens_per_s"] == report["target"]["forward_tokens_per_s"] > 0
    assert top["drafter_tokens_per_s"] == report["drafter"]["tokens_per_s"] > 0
    assert report["recipe"]["recipe"] == "ddtree" and top["layout_8_gpus"]["targets"] in range(1, 8)
    # Each half on stderr as it completes (what a run cut off by a time limit keeps).
    assert f'topology target: {{"tokens_per_s": {top["target_tokens_per_s"]}' in out.stderr
    assert f'topology drafter: {{"tokens_per_s": {top["drafter_tokens_per_s"]}' in out.stderr


@pytest.mark.processes
def test_an_fp8_drafter_half_that_cannot_run_is_refused_before_the_target_half():
    out = subprocess.run(
        [sys.executable, "-m", "dflash_ring", "bench", "topology", "--tiny", "--precision", "bf16,fp8"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and 'drafter.precision = "fp8" cannot run here' in lines[0], out.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "dflash_ring", "bench", "topology", "--tiny", "--precision", "fp16"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "expected bf16, fp8 or both" in bad.stderr
