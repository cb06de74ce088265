"""Every target family, tiny and random, through the real loader: packed and padded features equal the
model's own forward of each sequence alone, and the conformance probe guards what nobody tested."""

from __future__ import annotations

import json
import os
import logging
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from dflash_ring.bench.target_shapes import FAMILIES, PADDED_ONLY, SPARSE_INDEXER
from dflash_ring.producer import packing
from dflash_ring.producer.batching import Batch
from dflash_ring.producer.conformance import choose_packing, layer_kinds, probe
from dflash_ring.producer.probe_cache import cached_probe
from dflash_ring.producer.process import prepare, run_target
from dflash_ring.producer.target import TargetModel
from dflash_ring.common.config.target import TargetConfig, TargetConfigError
from support import (
    FEATURE_TOLERANCE,
    HYBRID_MAMBA,
    LINEAR_RECURRENT,
    assert_same_features,
    build_target,
    packed_batch,
    reference_features,
    write_config,
)

# Every family's target is built once for the module (the `targets` fixture): the quick subset leaves it out.
pytestmark = pytest.mark.slow

LENGTHS = [37, 8, 120, 64, 9, 200, 12]  # 120 and 200 run past the tiny families' 16-token windows
PACKED_FAMILIES = [f for f in FAMILIES if f not in PADDED_ONLY]
LAYOUTS = [
    pytest.param(f, packed, id=f"{f}-{'packed' if packed else 'padded'}")
    for f in FAMILIES
    for packed in (True, False)
    if not (packed and f in PADDED_ONLY)
]


SINKS = ("gpt_oss", "mimo_v2_flash")  # attention sinks (MiMo-V2-Flash: in its sliding layers)


def loud_sinks(model: torch.nn.Module) -> None:
    """Sinks start near 0; large ones make a dropped sink change features by far more than rounding."""
    for name, p in model.named_parameters():
        if name.endswith("sinks"):
            p.uniform_(-1.0, 4.0)


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {f: build_target(root / f, f, init=loud_sinks if f in SINKS else None) for f in FAMILIES}


def per_sequence(t: torch.Tensor, batch: Batch) -> list[torch.Tensor]:
    cu = batch.cu_seqlens
    return [t[a:b] for a, b in zip(cu[:-1], cu[1:])]


def load(path: Path, packed: bool, **keys) -> TargetModel:
    return TargetModel.load(
        TargetConfig(path=str(path), num_draft_layers=3, **keys), torch.device("cpu"), packed=packed
    )


@pytest.fixture(scope="module")
def expected(targets) -> dict[str, list[torch.Tensor]]:
    batch = packed_batch(LENGTHS)
    ids = [torch.from_numpy(s) for s in per_sequence(batch.input_ids, batch)]
    return {f: reference_features(path, ids, load(path, False).layer_ids) for f, path in targets.items()}


@pytest.mark.parametrize("family,packed", LAYOUTS)
def test_features_equal_the_models_own_forward_of_each_sequence(targets, expected, family, packed):
    target = load(targets[family], packed)
    batch = packed_batch(LENGTHS)
    out = run_target(target, prepare(batch, packed=packed, pad_id=0, pin=False))
    assert out.features.shape == (batch.num_tokens, 3 * 64)
    assert_same_features(per_sequence(out.features, batch), expected[family])


@pytest.mark.parametrize("family", PACKED_FAMILIES)
def test_the_probe_passes_every_supported_family_and_auto_packs(targets, family):
    target = load(targets[family], True)
    report = choose_packing(target, "auto")
    assert report is not None and report.passed and target.packed, report.summary()
    assert max(report.lengths) > 16  # past the tiny windows
    assert len(report.layers) == target.deepest + 1 and report.max_error <= FEATURE_TOLERANCE


@pytest.mark.parametrize("family", sorted(SPARSE_INDEXER))
def test_sparse_attention_is_refused_packing_by_name_and_runs_padded(targets, family, caplog):
    """GLM-5's and DeepSeek-V3.2's DSA indexer picks keys over the whole row (producer/packing.py): the probe refuses
    packing with that reason, "packed" is refused at start, "auto" falls back to padded batches (exact: the features
    test above)."""
    target = load(targets[family], False)
    with pytest.raises(TargetConfigError, match="packed.*refused.*sparse-attention indexer"):
        choose_packing(target, "packed")
    with caplog.at_level(logging.WARNING):
        report = choose_packing(target, "auto")
    assert not report.passed and "indexer" in report.error and not target.packed
    assert "padded" in caplog.text


def test_minimax_lightning_attention_is_caught_by_the_probe_and_runs_padded(targets, caplog):
    """MiniMax-01's lightning attention carries a decaying linear-attention state over the row and has no Conv1d
    for packing.recurrent_mixers to find: handed a pack it leaks from one sequence into the next, which the probe
    measures at its first (linear-attention) layer. "packed" is refused, "auto" runs padded (exact: features test)."""
    target = load(targets["minimax"], False)
    with pytest.raises(TargetConfigError, match=r"packed.*refused.*layer 0 \(linear_attention\)"):
        choose_packing(target, "packed")
    with caplog.at_level(logging.WARNING):
        report = choose_packing(target, "auto")
    assert report.error is None and report.first_bad.layer == 0 and report.max_error > 1e-2, report.summary()
    assert not target.packed and "padded" in caplog.text


def test_lfm2_short_convolutions_leak_across_a_pack_unless_run_per_sequence(targets, monkeypatch):
    """LFM2's short conv handed the whole pack reads the previous sequence's last tokens: the probe names a conv
    layer. Run per sequence (packing.RECURRENT_MIXERS), the family passes (the probe test above)."""
    monkeypatch.setattr("dflash_ring.producer.packing.RECURRENT_MIXERS", ("linear_attn",))
    report = probe(load(targets["lfm2"], True))
    assert not report.passed and report.first_bad.kind == "conv", report.summary()


@pytest.mark.parametrize("family", SINKS)
def test_sinks_matter_in_this_fixture(targets, expected, family):
    """Without its sinks the packed path would be off by far more than the tolerance: the test above can fail."""
    target = load(targets[family], True)
    for layer in target.decoder.layers:
        if layer.self_attn.sinks is not None:  # MiMo-V2-Flash: its sliding layers only
            layer.self_attn.sinks.data.fill_(-1e4)  # a sink of -inf: the softmax of plain attention
    batch = packed_batch(LENGTHS)
    out = run_target(target, prepare(batch, packed=True, pad_id=0, pin=False))
    with pytest.raises(AssertionError, match="differ"):
        assert_same_features(per_sequence(out.features, batch), expected[family], tolerance=1e-2)


def leaky_attention(module, query, key, value, attention_mask, *, scaling=None, **kwargs):
    """The classic packing bug: causal attention over the whole row, across sequence boundaries."""
    groups = query.shape[1] // key.shape[1]
    key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


@pytest.fixture
def broken_packing(monkeypatch):
    AttentionInterface.register("leaky_test", leaky_attention)
    monkeypatch.setattr("dflash_ring.producer.target.packed_implementation", lambda reference: "leaky_test")


def test_the_probe_catches_a_broken_packed_path_and_names_the_first_layer(targets, broken_packing, caplog):
    target = load(targets["qwen3"], True)
    with pytest.raises(TargetConfigError, match=r"packed.*refused.*layer 0 \(full_attention\)"):
        choose_packing(target, "packed")
    with caplog.at_level(logging.WARNING):
        report = choose_packing(target, "auto")
    assert not report.passed and report.first_bad.layer == 0 and report.max_error > 1e-2
    assert not target.packed and "qwen3" in caplog.text and "layer 0" in caplog.text and "padded" in caplog.text
    # Falling back is exact: padded features of the same model equal the reference.
    batch = packed_batch(LENGTHS)
    out = run_target(target, prepare(batch, packed=False, pad_id=0, pin=False))
    ids = [torch.from_numpy(s) for s in per_sequence(batch.input_ids, batch)]
    assert_same_features(per_sequence(out.features, batch), reference_features(targets["qwen3"], ids, target.layer_ids))


@pytest.mark.parametrize("family", ["qwen3_5", *LINEAR_RECURRENT])
def test_recurrent_layers_leak_without_per_sequence_state(targets, family, monkeypatch):
    """Gated DeltaNet (Qwen3.5, OLMo-hybrid) or Kimi Delta Attention (Kimi-Linear, Bailing) handed the whole pack:
    transformers either refuses (no flash-linear-attention) or runs state across sequences; either way the probe
    says so, naming a linear-attention layer or the error."""
    monkeypatch.setattr("dflash_ring.producer.target.recurrent_mixers", lambda layers: {})
    target = load(targets[family], True)
    report = probe(target)
    assert not report.passed
    assert report.error is not None or report.first_bad.kind == "linear_attention", report.summary()


@pytest.mark.parametrize("family", HYBRID_MAMBA)  # every tiny one starts with a Mamba layer
def test_the_probe_catches_a_mamba_mixer_run_over_the_whole_pack(targets, family, monkeypatch):
    """Mixers handed the whole pack (what packing did before they were found): their convolution and scan carry
    state from one sequence into the next, and the probe names the first Mamba layer (jamba's Mamba1 leaks the
    least here, ~1e-3, still 10x the float32 tolerance)."""
    monkeypatch.setattr("dflash_ring.producer.target.recurrent_mixers", lambda layers: {})
    report = probe(load(targets[family], True))
    assert report.error is None and report.first_bad.layer == 0, report.summary()
    assert report.first_bad.kind in ("linear_attention", "hybrid") and report.max_error > 5e-4


@pytest.mark.parametrize("family", ["qwen3_5", *LINEAR_RECURRENT, *HYBRID_MAMBA])
def test_every_stateful_layer_and_only_those_run_per_sequence(targets, family):
    """The layers whose config type carries a state (zamba's, zamba2's and falcon_h1's "hybrid" layers hold a Mamba
    mixer beside attention) are the ones found; nemotron_h's attention and MoE blocks, also named `mixer`, and the
    MLA `self_attn` of Kimi-Linear and Bailing (their KDA mixers are `self_attn` too) stay whole (and compiled on a
    GPU)."""
    target = load(targets[family], True)
    kinds = layer_kinds(target.config, len(target.decoder.layers))
    assert sorted(packing.recurrent_mixers(target.decoder.layers)) == [
        i for i, kind in enumerate(kinds) if kind in ("linear_attention", "hybrid")
    ]


def test_a_stack_without_attention_layers_runs_packed(tmp_path):
    """With no attention layer HF's hybrid cache cannot count tokens (`get_seq_length` can only be called on
    Attention layers): the producer's forward builds no cache, and the Mamba-only model packs exactly."""
    path = build_target(tmp_path / "mamba_only", "bamba", layers=4, attn_layer_indices=[])
    report = choose_packing(load(path, True), "packed")
    assert report.passed and {c.kind for c in report.layers} == {"linear_attention"}, report.summary()


def test_padded_mode_skips_the_probe(targets):
    target = load(targets["qwen3"], True)
    assert choose_packing(target, "padded") is None and not target.packed


def test_the_packed_attention_refuses_implementations_it_cannot_mirror():
    with pytest.raises(ValueError, match="flex_attention"):
        packing.packed_implementation("flex_attention")


def check_target(config: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dflash_ring", "check-target", "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.processes
def test_check_target_reports_the_probe_as_json(targets, tmp_path):
    config = tmp_path / "run.toml"
    write_config(config, {"target": {"path": targets["qwen3_5_vl"], "num_draft_layers": 3, "packing": "packed"}})
    out = check_target(config, "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert (report["packing"], report["chosen"], report["probe"]["passed"]) == ("packed", "packed", True)
    assert [c["kind"] for c in report["probe"]["layers"]] == ["linear_attention"] * 3 + ["full_attention"]
    assert report["probe"]["model_type"].startswith("qwen3_5")
    # The drafter's head, derived from the target's own code and verified as the drafter does at its start.
    head = report["head"]
    assert set(head) == {"tied", "embed_scale", "logit_multiplier", "logit_softcap", "verified_relative_error"}
    assert all(0 <= e < 1e-3 for e in head["verified_relative_error"].values()), head
    plain = check_target(config)
    assert plain.returncode == 0 and re.search(
        r"^drafter head: tied=\w+, embed_scale=.*logits [\d.e-]+\)$", plain.stdout, re.M
    ), plain.stdout


@pytest.mark.processes
def test_check_target_of_a_directory_without_weights_is_one_clear_line(targets, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(targets["qwen3"] / "config.json", bare / "config.json")
    config = tmp_path / "run.toml"
    write_config(config, {"target": {"path": bare}})
    out = check_target(config)
    assert out.returncode == 2 and out.stdout == ""
    assert "Traceback" not in out.stderr and out.stderr.strip().splitlines()[-1].startswith(
        "dflash-ring check-target: error:"
    )


def test_an_attention_implementation_packing_cannot_mirror_falls_back_or_refuses(targets):
    target = load(targets["qwen3"], False)
    target.attn_implementation = "flex_attention"  # as if loaded with target.attn_implementation it cannot mirror
    with pytest.raises(TargetConfigError, match="flex_attention"):
        choose_packing(target, "packed")
    report = choose_packing(target, "auto")
    assert report.error is not None and "flex_attention" in report.error and not target.packed


def test_a_restart_reads_the_probe_result_saved_for_exactly_this_model_and_probes_again_otherwise(
    tmp_path, caplog, monkeypatch
):
    """producer/probe_cache.py: the second start on the same model directory reads the saved report (the probe does
    not run); a model file touched, or a damaged entry (moved aside, with a warning), makes it probe again."""
    from dflash_ring.producer import conformance

    path = build_target(tmp_path / "qwen3", "qwen3", layers=4)
    cache = (tmp_path / "state" / "probe", str(path))
    cached = cached_probe(*cache)
    runs = []
    real_probe = conformance.probe
    monkeypatch.setattr(conformance, "probe", lambda target: runs.append(1) or real_probe(target))
    first = choose_packing(load(path, True), "auto", cached)
    again = choose_packing(load(path, True), "auto", cached)
    assert len(runs) == 1 and again.to_json() == first.to_json() and first.passed
    (entry,) = cache[0].glob("*.json")
    assert entry.stat().st_mode & 0o777 == 0o600
    original = (path / "config.json").stat().st_mtime_ns
    os.utime(path / "config.json", ns=(1, 1))  # a model file touched: another key
    choose_packing(load(path, True), "auto", cached)
    assert len(runs) == 2 and len(list(cache[0].glob("*.json"))) == 2
    entry.write_text('{"model_type": "qwen3"')  # cut short
    os.utime(path / "config.json", ns=(original, original))  # the first key again
    with caplog.at_level(logging.WARNING):
        report = choose_packing(load(path, True), "auto", cached)
    assert report.passed and "probe cache" in caplog.text and entry.with_suffix(".damaged").exists()
