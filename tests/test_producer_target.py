"""The target forward in-process: exact features, truncation, no logits, layer selection and its fingerprint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from dflash_ring.common.config.load import load_config
from dflash_ring.common.config.schema import ConfigError
from dflash_ring.producer.batching import Batch
from dflash_ring.common.lifecycle.resume_state import CursorFile, ResumeState
from dflash_ring.producer.process import prepare, run_target
from dflash_ring.producer.target import TargetModel
from dflash_ring.common.config.target import TargetConfig, TargetConfigError
from dflash_ring.common.ring_spec import run_fingerprint_fields
from dflash_ring.common.target_geometry import target_geometry
from support import assert_same_features, build_target, packed_batch, reference_features, reference_final_hidden

LENGTHS = [37, 8, 120, 64, 9, 200, 12]  # real samples are never shorter: the chat template alone is longer


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("targets")
    return {arch: build_target(root / arch, arch) for arch in ("qwen3", "llama")}


def sequences(batch: Batch) -> list[torch.Tensor]:
    cu = batch.cu_seqlens
    return [torch.from_numpy(batch.input_ids[a:b]) for a, b in zip(cu[:-1], cu[1:])]


def split(t: torch.Tensor, batch: Batch) -> list[torch.Tensor]:
    cu = batch.cu_seqlens
    return [t[a:b] for a, b in zip(cu[:-1], cu[1:])]


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_packed_features_equal_each_sequence_alone(targets, arch):
    target = TargetModel.load(
        TargetConfig(path=str(targets[arch]), num_draft_layers=2), torch.device("cpu"), packed=True
    )
    assert target.layer_ids == [1, 3] and target.dtype == torch.float32
    batch = packed_batch(LENGTHS)
    out = run_target(target, prepare(batch, packed=True, pad_id=0, pin=False))
    assert out.features.shape == (batch.num_tokens, 2 * 64) and out.final_hidden is None
    expected = reference_features(targets[arch], sequences(batch), target.layer_ids)
    assert_same_features(split(out.features, batch), expected)  # a leak would change every later sequence


def test_sliding_window_attention_stays_exact_when_packed(tmp_path):
    """Mistral-style sliding windows shorter than the sequences: the packed path must apply them too."""
    path = build_target(tmp_path / "mistral", "mistral", sliding_window=16)
    target = TargetModel.load(TargetConfig(path=str(path), num_draft_layers=2), torch.device("cpu"), packed=True)
    batch = packed_batch(LENGTHS)
    out = run_target(target, prepare(batch, packed=True, pad_id=0, pin=False))
    expected = reference_features(path, sequences(batch), target.layer_ids)
    assert_same_features(split(out.features, batch), expected)


def test_padded_batches_match_to_rounding_and_keep_only_real_tokens(targets):
    cfg = TargetConfig(path=str(targets["qwen3"]), num_draft_layers=2)
    target = TargetModel.load(cfg, torch.device("cpu"), packed=False)
    batch = packed_batch(LENGTHS)
    out = run_target(target, prepare(batch, packed=False, pad_id=0, pin=False))
    assert out.features.shape[0] == batch.num_tokens
    expected = reference_features(targets["qwen3"], sequences(batch), target.layer_ids)
    for got, want in zip(split(out.features, batch), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.processes)])  # cc runs
def test_compiled_layers_keep_features_truncation_and_one_graph_for_any_pack(targets, backend):
    """target.compile: the capture hooks stay outside the compiled forward (features and the early stop work
    as in eager) and batches with other token and sequence counts reuse the compiled graphs: the spans travel
    outside the layer's inputs, where a Python list would be guarded element by element."""
    from torch._dynamo.utils import counters

    if backend == "inductor" and shutil.which("cc") is None:
        pytest.skip("Inductor on the CPU needs a C compiler")
    torch._dynamo.reset()
    cfg = TargetConfig(path=str(targets["qwen3"]), layer_ids=[3, 1])
    eager = TargetModel.load(cfg, torch.device("cpu"), packed=True)
    compiled = TargetModel.load(cfg, torch.device("cpu"), packed=True)
    assert compiled.compile_layers(backend) == [0, 1, 2, 3]  # layers 4 and 5 never run
    calls: dict[str, int] = {}
    for name, module in compiled.decoder.named_children():
        for i, sub in enumerate(module) if name == "layers" else [(None, module)]:
            key = name if i is None else f"layers.{i}"
            sub.register_forward_pre_hook(lambda m, a, key=key: calls.__setitem__(key, calls.get(key, 0) + 1))
    packs = [LENGTHS, [5, 300, 17], [64] * 9, [33]]
    for i, lengths in enumerate(packs):
        batch = packed_batch(lengths)
        want = run_target(eager, prepare(batch, packed=True, pad_id=0, pin=False)).features
        got = run_target(compiled, prepare(batch, packed=True, pad_id=0, pin=False)).features
        if backend == "aot_eager":
            assert torch.equal(got, want)
        else:  # fused float32 kernels round differently
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        if i == 1:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs  # no recompiles after the first two packs
    assert {k: v for k, v in calls.items() if k.startswith("layers.")} == {f"layers.{i}": len(packs) for i in range(4)}
    assert "norm" not in calls


def count_calls(target: TargetModel) -> tuple[dict[str, int], list[int]]:
    calls: dict[str, int] = {}
    widths: list[int] = []
    for name, module in target.decoder.named_modules():
        if name.count(".") <= 1 and name:  # layers.N, norm, embed_tokens, rotary_emb
            module.register_forward_pre_hook(lambda m, a, name=name: calls.__setitem__(name, calls.get(name, 0) + 1))
        if isinstance(module, torch.nn.Linear):
            module.register_forward_hook(lambda m, a, out: widths.append(out.shape[-1]))
    return calls, widths


def test_forward_stops_after_the_deepest_captured_layer_and_never_computes_logits(targets):
    cfg = TargetConfig(path=str(targets["llama"]), layer_ids=[2, 0])
    target = TargetModel.load(cfg, torch.device("cpu"), packed=True)
    vocab = target.config.vocab_size
    calls, widths = count_calls(target)
    batch = packed_batch(LENGTHS)
    out = run_target(target, prepare(batch, packed=True, pad_id=0, pin=False))
    assert {k: v for k, v in calls.items() if k.startswith("layers.")} == {"layers.0": 1, "layers.1": 1, "layers.2": 1}
    assert "norm" not in calls  # nor layers 3..5
    assert widths and vocab not in widths
    assert not hasattr(target, "lm_head") and not any(
        isinstance(m, torch.nn.Linear) and m.out_features == vocab for m in target.decoder.modules()
    )
    # Features come in layer_ids order, not depth order.
    expected = reference_features(targets["llama"], sequences(batch), [2, 0])
    assert_same_features(split(out.features, batch), expected)


def test_shipping_the_final_hidden_runs_every_layer_and_matches_last_hidden_state(targets):
    cfg = TargetConfig(path=str(targets["qwen3"]), num_draft_layers=2, ship_final_hidden=True)
    target = TargetModel.load(cfg, torch.device("cpu"), packed=True)
    calls, widths = count_calls(target)
    batch = packed_batch(LENGTHS)
    out = run_target(target, prepare(batch, packed=True, pad_id=0, pin=False))
    assert calls["norm"] == 1 and all(calls[f"layers.{i}"] == 1 for i in range(6))
    assert target.config.vocab_size not in widths
    expected = reference_final_hidden(targets["qwen3"], sequences(batch))
    assert_same_features(split(out.final_hidden, batch), expected)


def test_layer_ids_follow_the_dflash_rule_and_are_range_checked(targets, tmp_path):
    path = str(targets["qwen3"])
    assert target_geometry(TargetConfig(path=path)).layer_ids == (3,)  # one draft layer: L // 2
    assert target_geometry(TargetConfig(path=path, num_draft_layers=2)).layer_ids == (1, 3)
    assert TargetConfig().resolved_layer_ids(36) == [18]
    assert TargetConfig(num_draft_layers=5).resolved_layer_ids(36) == [1, 9, 17, 25, 33]
    with pytest.raises(TargetConfigError, match="0..4"):
        target_geometry(TargetConfig(path=path, layer_ids=[5]))  # layer L-1: HF's hidden_states[L] is normed
    with pytest.raises(TargetConfigError, match="mask_token_id"):
        target_geometry(TargetConfig(path=path, mask_token_id=10**6))
    with pytest.raises(TargetConfigError, match="distinct"):
        TargetConfig(layer_ids=[1, 1])


def test_target_geometry_joins_the_config_fingerprint(targets, tmp_path):
    cfg = load_config(
        None,
        [
            f'target.path="{targets["qwen3"]}"',
            "target.num_draft_layers=2",
            "target.mask_token_id=405",
            "target.ship_final_hidden=true",
        ],
    )
    fields = run_fingerprint_fields(cfg)
    assert {k: v for k, v in fields.items() if k.startswith("target.")} == {
        "target.hidden_size": 64,
        "target.num_hidden_layers": 6,
        "target.vocab_size": fields["target.vocab_size"],
        "target.layer_ids": [1, 3],
        "target.mask_token_id": 405,
        "target.ship_final_hidden": True,
    }
    assert "target.hidden_size" not in run_fingerprint_fields(load_config(None, []))
    with pytest.raises(ConfigError, match="config.json"):
        run_fingerprint_fields(load_config(None, [f'target.path="{tmp_path}"']))
    with pytest.raises(ConfigError, match="float32"):
        load_config(None, ['target.dtype="float16"'])


@pytest.mark.parametrize(
    "family,keys,layers",
    [
        # Nemotron-H: the layer count is its pattern's length (config.json has no num_hidden_layers).
        ("nemotron_h", dict(hidden_size=64, vocab_size=300, layers_block_type=["mamba", "moe", "attention"] * 2), 6),
        # LongCat-Flash: num_layers decoder layers of two attention sublayers each (num_hidden_layers is 2 x that).
        ("longcat_flash", dict(hidden_size=64, vocab_size=300, num_layers=5), 5),
    ],
)
def test_geometry_of_a_config_that_names_its_layers_otherwise_is_read_through_its_config_class(
    tmp_path, family, keys, layers
):
    from transformers import AutoConfig

    AutoConfig.for_model(family, **keys).save_pretrained(tmp_path)
    assert "num_hidden_layers" not in json.loads((tmp_path / "config.json").read_text())
    geometry = target_geometry(TargetConfig(path=str(tmp_path), num_draft_layers=2))
    assert (geometry.hidden_size, geometry.num_hidden_layers, geometry.vocab_size) == (64, layers, 300)
    assert list(geometry.layer_ids) == TargetConfig(num_draft_layers=2).resolved_layer_ids(layers)


def test_cursor_file_round_trips_and_ignores_another_plan(tmp_path):
    f = CursorFile(tmp_path / "producer-0.json", plan="a")
    assert f.load() is None
    f.save(ResumeState(1, 7, ((0, 3), (1, 2)), 1), durable=True)
    assert f.load() == ResumeState(1, 7, ((0, 3), (1, 2)), 1)
    assert f.load().pending_replay == ((1, 2),)
    assert oct(f.path.stat().st_mode & 0o777) == "0o600"
    assert CursorFile(f.path, plan="b").load() is None
    f.remove()
    assert not f.path.exists()


@pytest.mark.parametrize("recorder", [object(), "default"], ids=["no-key", "default-key"])
def test_a_transformers_that_does_not_name_longcats_layer_count_is_refused_in_one_line(tmp_path, monkeypatch, recorder):
    """transformers 5.17's output recorder does not name LongCat-Flash's count: its hidden states would be
    counted by its num_hidden_layers (2 x its decoder layers), so its layer ids would name other layers."""
    from transformers import AutoConfig, LongcatFlashForCausalLM

    AutoConfig.for_model("longcat_flash", hidden_size=64, vocab_size=300, num_layers=5).save_pretrained(tmp_path)
    recorders = dict(LongcatFlashForCausalLM._can_record_outputs or {})
    if recorder == "default":
        from transformers.utils.output_capturing import OutputRecorder

        recorder = OutputRecorder(recorders["hidden_states"].target_class)
    recorders["hidden_states"] = recorder  # what 5.17 offers: no key, or the default one
    monkeypatch.setattr(LongcatFlashForCausalLM, "_can_record_outputs", recorders)
    with pytest.raises(TargetConfigError, match=r"whether num_layers \(5\) or num_hidden_layers \(10\) counts"):
        target_geometry(TargetConfig(path=str(tmp_path), num_draft_layers=2))


def test_a_config_json_writing_both_layer_counts_is_read_through_its_class(tmp_path):
    """transformers 5.17 writes LongCat-Flash's derived num_hidden_layers (2 x num_layers) into config.json."""
    from transformers import AutoConfig

    AutoConfig.for_model("longcat_flash", hidden_size=64, vocab_size=300, num_layers=5).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": 10}))
    assert target_geometry(TargetConfig(path=str(tmp_path), num_draft_layers=2)).num_hidden_layers == 5


def test_a_target_whose_own_forward_is_not_finite_is_refused_by_the_probe_not_reported_as_exact(tmp_path):
    """Python's max() and `<=` read a NaN error as none: the probe said "max error 0.00e+00" of a target with NaN
    weights and the run trained NaN to exit 0 (issue 46). Its own forward's states are checked first."""
    from dflash_ring.producer.conformance import choose_packing
    from support import save_tiny_qwen3

    def poison(model):
        model.model.layers[1].self_attn.q_proj.weight[0, 0] = float("nan")

    save_tiny_qwen3(tmp_path, init=poison, num_hidden_layers=4)
    target = TargetModel.load(TargetConfig(path=str(tmp_path), layer_ids=[1, 2]), torch.device("cpu"), packed=False)
    for mode in ("auto", "packed"):
        with pytest.raises(TargetConfigError, match=r"non-finite hidden states \(NaN or inf\) at layer 1 "):
            choose_packing(target, mode)
