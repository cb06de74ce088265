"""`bench target --tiny` runs end to end on the CPU and reports what the H200 run will be judged by."""

from __future__ import annotations

import json
import re

import pytest
import torch

import numpy as np

from dflash_ring.bench.target import active_parameters, attention_pairs, run_target_bench
from dflash_ring.bench.target_shapes import SHAPES
from dflash_ring.producer.target import TargetModel
from dflash_ring.common.config.target import TargetConfig

PROGRESS = re.compile(r"^(\w+) (\w+): (\{.*\})$")  # bench/progress.py's lines


def test_shapes_a_bench_offers_are_the_benchs():
    """Each bench's --shape choices, from its own parser (add_arguments): every shape, less tiny where a bench has
    its --tiny instead."""
    import argparse
    import importlib

    for bench, offered in {
        "target": set(SHAPES),
        "topology": set(SHAPES),
        "regenerate": set(SHAPES),
        "drafter": set(SHAPES) - {"tiny"},
        "precision": set(SHAPES) - {"tiny"},
    }.items():
        parser = argparse.ArgumentParser()
        importlib.import_module(f"dflash_ring.bench.{bench}").add_arguments(parser)
        (shape,) = [a for a in parser._actions if a.dest == "shape"]
        assert set(shape.choices) == offered, bench


def test_moe_flops_count_only_the_routed_experts_a_token_uses(tmp_path):
    from support import build_target as save_target

    target = TargetModel.load(
        TargetConfig(path=str(save_target(tmp_path / "moe", "qwen3_moe")), num_draft_layers=2),
        torch.device("cpu"),
        packed=True,
    )
    layer = target.decoder.layers[0]
    experts = sum(p.numel() for n, p in layer.named_parameters() if ".experts." in f".{n}")
    total = sum(p.numel() for p in layer.parameters())
    assert 0 < experts < total
    assert active_parameters(target, 1) == pytest.approx(total - experts + experts * 2 / 4)  # top-2 of 4


def test_attention_pairs_respect_the_window():
    assert attention_pairs(np.array([4]), None) == 10 and attention_pairs(np.array([4]), 2) == 1 + 2 + 2 + 2


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_tiny_target_bench_reports_forward_and_ring_throughput(packed, capsys):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # CI has two cores; the bench adds a loader and a consumer thread
    try:
        report = run_target_bench(shape="tiny", batches=2, max_tokens=1024, draft_layers=2, packed=packed)
    finally:
        torch.set_num_threads(threads)
    assert report["model"]["layer_ids"] == [1, 5] and report["model"]["layers_run"] == 6
    assert report["model"]["attention"] == ("packed_varlen" if packed else "sdpa")
    assert report["probe"]["passed"] and report["probe"]["max_error"] < 1e-4
    layouts = report["layouts"]
    assert layouts["packed_tokens_per_s"] > 0 and layouts["padded_tokens_per_s"] > 0
    assert report["forward_tokens_per_s"] > 0 and report["ring_tokens_per_s"] > 0
    assert report["ratio_ring_over_forward"] > 0 and report["ring"]["wait_s"] >= 0
    assert report["batches"]["timed"] == 2
    assert (report["batches"]["padding_fraction"] == 0.0) == packed
    assert report["ring"]["bytes_per_token"] == 2 * 128 * 4 + 5
    assert 0 < report["mfu"]["forward"] < 1 and report["mfu"]["peak_flops"] == 989e12
    # Each figure went to stderr as it was measured (what a run cut off by a time limit keeps), as the report has it.
    lines = [PROGRESS.match(line) for line in capsys.readouterr().err.splitlines()]
    figures = [(m[2], json.loads(m[3])) for m in lines if m and m[1] == "target"]
    assert [part for part, _ in figures] == ["build", "probe", "forward", "ring", "forward"]
    (_, build), (_, probe), (_, forward), (_, ring), (_, other) = figures
    assert build["build_s"] == report["model"]["build_s"] and probe["passed"] == report["probe"]["passed"]
    assert (forward["packed"], forward["tokens_per_s"]) == (packed, report["forward_tokens_per_s"])
    assert ring["tokens_per_s"] == report["ring_tokens_per_s"]
    assert ring["ratio_ring_over_forward"] == report["ratio_ring_over_forward"]
    assert other["tokens_per_s"] == report["layouts"]["padded_tokens_per_s" if packed else "packed_tokens_per_s"]


def test_regenerate_bench_runs_both_paths_on_the_same_prompts(capsys):
    """`dflash-ring bench regenerate --shape tiny` in-process: every reply runs to max_new_tokens on both paths."""
    from dflash_ring.bench.regenerate import run_regenerate_bench

    rep = run_regenerate_bench(
        shape="tiny", device="cpu", prompts=8, max_new_tokens=4, batch_size=4, median_words=20, max_words=60
    )
    assert rep["engine"]["finish_length"] == 8
    assert rep["engine"]["generated_tokens"] == rep["baseline_model_generate"]["generated_tokens"] == 32
    assert rep["ratio_engine_over_baseline"] > 0
    lines = [PROGRESS.match(line) for line in capsys.readouterr().err.splitlines()]
    figures = {m[2]: json.loads(m[3]) for m in lines if m and m[1] == "regenerate"}  # each path as it was timed
    assert figures == {k: rep[k] for k in ("engine", "baseline_model_generate")}


def test_regenerate_bench_silences_the_head_rows_it_must():
    """Ids the tokenizer lacks and the end tokens can never be generated (their head rows are zero)."""
    from dflash_ring.bench.regenerate import build_model, silence

    model = build_model("tiny", torch.device("cpu"), torch.float32)
    silence(model, 300, [5, 7])
    head = model.get_output_embeddings().weight.detach()
    assert not head[[5, 7]].any() and not head[300:].any() and head[6].any()


def test_family_probe_survey_reports_each_family_as_a_target_process_judges_it(capsys):
    from dflash_ring.bench import family_probe

    assert family_probe.main(["cpu", "qwen3,glm_moe_dsa"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["qwen3"]["packed"] and out["qwen3"]["passed"] and out["qwen3"]["max_error"] <= 1e-4
    assert out["glm_moe_dsa"]["packed"] is False  # refused packing by its sparse-attention indexer: padded
    assert all(max(out[f]["head_errors"]) <= 1e-5 for f in out), out  # the drafter's head probe, verified
