"""A target sharded by transformers' tensor parallelism over a real 2-rank gloo group on the CPU (the leader in this
process, rank 1 a real process): its features against the unsharded target's, the probe on the group, the refusals
of target.tensor_parallel in one line."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch

from dflash_ring.cli import main
from dflash_ring.common.config.target import TargetConfig, TargetConfigError
from dflash_ring.producer.conformance import choose_packing
from dflash_ring.producer.process import prepare, run_target
from dflash_ring.producer.target import ShardedTarget, TargetModel
from dflash_ring.producer.tensor_group import TensorGroup, check_group, tensor_parallel_refusal
from support import assert_same_features, build_target, packed_batch, reference_features, write_config

LENGTHS = [37, 8, 120, 64, 9, 200, 12]
CPU = torch.device("cpu")


def sequences(batch) -> list[torch.Tensor]:
    cu = batch.cu_seqlens
    return [torch.from_numpy(batch.input_ids[a:b]) for a, b in zip(cu[:-1], cu[1:])]


def split(t: torch.Tensor, batch) -> list[torch.Tensor]:
    cu = batch.cu_seqlens
    return [t[a:b] for a, b in zip(cu[:-1], cu[1:])]


@pytest.mark.processes
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_two_rank_gloo_group_gives_the_unsharded_features(tmp_path, arch):
    """Rank 1 runs in its own process; every linear of the plan is a DTensor shard of half the rows or columns, so a
    forward that skipped a rank's all-reduce or read only its own shard would be off by O(1), not by rounding. The
    bound is the packed-vs-alone one (FEATURE_TOLERANCE, 1e-4 relative RMS): row-wise all-reduce sums the two halves
    of each product in another order than one GEMM does (measured ~2e-7 on this target)."""
    path = build_target(tmp_path / arch, arch)
    cfg = TargetConfig(path=str(path), num_draft_layers=2, tensor_parallel=2, ship_final_hidden=False)
    with TensorGroup.held(cfg, CPU, contextlib.nullcontext) as group:
        target = TargetModel.load(cfg, CPU, packed=False, group=group)
        assert isinstance(target, ShardedTarget)
        q = target.decoder.layers[0].self_attn.q_proj.weight
        assert type(q).__name__ == "DTensor" and q.to_local().shape[0] == q.shape[0] // 2
        report = choose_packing(target, "packed")  # the probe on the group: packed against alone, every layer
        assert report.passed and target.packed
        batch = packed_batch(LENGTHS)
        packed = run_target(target, prepare(batch, packed=True, pad_id=0, pin=False)).features
        target.use_packing(False)
        padded = run_target(target, prepare(batch, packed=False, pad_id=0, pin=False)).features
        assert group.ranks[0].poll() is None  # the rank is alive and mirrored every forward
        rendezvous = group._rendezvous  # a file in a directory of this user's alone, no port
        assert rendezvous.stat().st_mode & 0o777 == 0o700 and rendezvous.stat().st_uid == os.getuid()
    assert group.ranks[0].returncode == 0  # told to stop, it left the group and exited cleanly
    assert not rendezvous.exists()  # removed with the group
    expected = reference_features(path, sequences(batch), target.layer_ids)
    assert_same_features(split(packed, batch), expected)
    assert_same_features(split(padded, batch), expected)


def test_a_family_without_a_plan_is_refused_in_one_line_naming_those_with_one(tmp_path):
    path = build_target(tmp_path / "zamba2", "zamba2")
    why = tensor_parallel_refusal(TargetConfig(path=str(path), tensor_parallel=2))
    assert why is not None and "'zamba2'" in why and "qwen3" in why and "llama" in why and "\n" not in why
    assert tensor_parallel_refusal(TargetConfig(path=str(path), tensor_parallel=1)) is None


@pytest.mark.parametrize(
    ("ranks", "says"),
    [
        (3, "does not divide the target's num_attention_heads = 4"),  # 4 heads, 2 K/V heads, MLP 128
        (4, "does not divide the target's num_key_value_heads = 2"),
    ],
)
def test_check_config_refuses_ranks_that_do_not_divide_the_target(tmp_path, capsys, ranks, says):
    path = build_target(tmp_path / "qwen3", "qwen3")
    config = write_config(
        tmp_path / "run.toml", {"target": {"path": str(path), "tensor_parallel": ranks, "mask_token_id": 1}}
    )
    assert config.target.tensor_parallel == ranks
    capsys.readouterr()  # the model's save progress
    assert main(["check-config", "--config", str(tmp_path / "run.toml")]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1


def test_more_ranks_than_cpu_cores_is_refused(tmp_path, monkeypatch):
    path = build_target(tmp_path / "qwen3", "qwen3")
    monkeypatch.setattr("os.cpu_count", lambda: 1)
    with pytest.raises(TargetConfigError, match="more ranks than this host's 1 CPU cores"):
        check_group(TargetConfig(path=str(path), tensor_parallel=2), CPU)


@pytest.mark.processes
def test_bench_target_tensor_parallel_runs_the_group_end_to_end(tmp_path):
    """`dflash-ring bench target --tiny --tensor-parallel 2`, the command the two-GPU run will be: a real gloo group
    loads, passes the probe, forwards and writes into a ring, and the JSON carries the ratios against one rank of the
    same run (speeds are not asserted: two ranks on two shared cores)."""
    out = subprocess.run(
        [sys.executable, "-m", "dflash_ring", "bench", "target", "--tiny", "--tensor-parallel", "2"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["benchmark"] == "target_tensor_parallel" and report["tensor_parallel"] == 2
    assert report["backend"] == "gloo" and report["probe"]["passed"]
    assert report["host"]["device"] == "cpu" and report["batches"]["tokens"] > 0
    assert report["ring_tokens_per_s"] > 0 and report["ratio_group_over_one_rank"] > 0
