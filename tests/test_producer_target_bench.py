"""`bench target --tiny` runs end to end on the CPU and reports what the H200 run will be judged by."""

from __future__ import annotations

import pytest
import torch

from dflash_ring.bench.target import run_target_bench


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_tiny_target_bench_reports_forward_and_ring_throughput(packed):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # CI has two cores; the bench adds a loader and a consumer thread
    try:
        report = run_target_bench(tiny=True, batches=2, max_tokens=1024, draft_layers=2, packed=packed, quiet=True)
    finally:
        torch.set_num_threads(threads)
    assert report["model"]["layer_ids"] == [1, 5] and report["model"]["layers_run"] == 6
    assert report["model"]["attention"] == ("packed_varlen" if packed else "sdpa")
    assert report["forward_tokens_per_s"] > 0 and report["ring_tokens_per_s"] > 0
    assert report["ratio_ring_over_forward"] > 0 and report["ring"]["wait_s"] >= 0
    assert report["batches"]["timed"] == 2
    assert (report["batches"]["padding_fraction"] == 0.0) == packed
    assert report["ring"]["bytes_per_token"] == 2 * 128 * 4 + 5
    assert 0 < report["mfu"]["forward"] < 1 and report["mfu"]["peak_flops"] == 989e12
