"""The whole-pack Gated DeltaNet forward (producer/varlen_gated_deltanet.py) and its fallback, on the CPU.

flash-linear-attention's kernels are Triton and need a GPU (there the conformance probe judges them on every
target, docs/benchmarks.md). What can be wrong on any machine is ours: the forward around the kernels (the
projections, the split, the gate, the head grouping, the gated norm) and the choice of path. So the varlen
forward runs here with reference kernels that honour cu_seqlens by slicing (a depthwise causal convolution and
transformers' own PyTorch delta rule per sequence), and must equal each sequence through the model's own forward.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dflash_ring.common.config.target import TargetConfig
from dflash_ring.producer.process import prepare, run_target
from dflash_ring.producer.target import TargetModel
from dflash_ring.producer.varlen_gated_deltanet import FlaKernels, layout_mismatch
from support import assert_same_features, build_target, packed_batch, reference_features

LENGTHS = [37, 8, 120, 3, 64]  # 3 is shorter than the convolution window


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory) -> Path:
    # More value heads than key heads: the grouping must map value head h to key head h // 2.
    return build_target(
        tmp_path_factory.mktemp("qwen3_5") / "t", "qwen3_5", layers=4, linear_num_key_heads=2, linear_num_value_heads=4
    )


def reference_kernels(calls: list[str]) -> FlaKernels:
    """The two kernels' contracts on the CPU: each sequence of the pack from a zero window and a zero state."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    def spans(cu_seqlens_cpu: torch.Tensor) -> list[tuple[int, int]]:
        cu = cu_seqlens_cpu.tolist()
        return list(zip(cu[:-1], cu[1:]))

    def causal_conv1d(x, *, weight, bias, activation, cu_seqlens, cu_seqlens_cpu):
        calls.append("conv")
        outs = []
        for a, b in spans(cu_seqlens_cpu):
            seq = x[:, a:b].transpose(1, 2)
            y = F.conv1d(seq, weight.unsqueeze(1), bias, padding=weight.shape[-1] - 1, groups=seq.shape[1])
            outs.append((y[..., : b - a] if activation is None else F.silu(y[..., : b - a])).transpose(1, 2))
        return torch.cat(outs, dim=1), None

    def chunk_gated_delta_rule(
        q, k, v, *, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_cpu
    ):
        calls.append("rule")
        assert initial_state is None and not output_final_state and q.shape[2] == v.shape[2]
        outs = [
            modeling_qwen3_5.torch_chunk_gated_delta_rule(
                q[:, a:b],
                k[:, a:b],
                v[:, a:b],
                g=g[:, a:b],
                beta=beta[:, a:b],
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            )[0]
            for a, b in spans(cu_seqlens_cpu)
        ]
        return torch.cat(outs, dim=1), None

    return FlaKernels(causal_conv1d, chunk_gated_delta_rule, None, device_type="cpu")


def load(path: Path) -> TargetModel:
    return TargetModel.load(TargetConfig(path=str(path), num_draft_layers=2), torch.device("cpu"), packed=True)


def features(target: TargetModel, lengths: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    batch = packed_batch(lengths)
    out = run_target(target, prepare(batch, packed=True, pad_id=0, pin=False)).features
    cu = batch.cu_seqlens
    return [out[a:b] for a, b in zip(cu[:-1], cu[1:])], [
        torch.from_numpy(batch.input_ids[a:b]) for a, b in zip(cu[:-1], cu[1:])
    ]


def test_the_varlen_forward_equals_each_sequence_through_the_models_own(qwen3_5, monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(FlaKernels, "load", classmethod(lambda cls: reference_kernels(calls)))
    target = load(qwen3_5)
    assert target.recurrent_path == "varlen", target.recurrent_description()
    got, ids = features(target, LENGTHS)
    assert_same_features(got, reference_features(qwen3_5, ids, target.layer_ids))
    # One call of each kernel per Gated DeltaNet layer run, for the whole pack (not one per sequence).
    layers_run = [i for i in target.recurrent_layers if i <= target.deepest]
    assert calls == ["conv", "rule"] * len(layers_run) and layers_run


def test_the_per_sequence_path_is_the_fallback_and_the_same(qwen3_5, monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(FlaKernels, "load", classmethod(lambda cls: reference_kernels(calls)))
    target = load(qwen3_5)
    target.use_varlen_mixers(False)  # the bench's same-run baseline
    assert target.recurrent_path == "per-sequence" and "switched off" in target.recurrent_description()
    got, ids = features(target, LENGTHS)
    assert_same_features(got, reference_features(qwen3_5, ids, target.layer_ids))
    assert calls == []


def test_without_flash_linear_attention_each_sequence_runs_alone(qwen3_5):
    """This machine has no flash-linear-attention (nor a GPU): the log names why the varlen path is off."""
    if FlaKernels.load().missing is None:
        pytest.skip("flash-linear-attention is installed here")
    target = load(qwen3_5)
    assert target.recurrent_path == "per-sequence"
    assert "flash-linear-attention not usable" in target.recurrent_description()
    got, ids = features(target, LENGTHS[:3])
    assert_same_features(got, reference_features(qwen3_5, ids, target.layer_ids))


def test_only_the_qwen3_5_layout_is_taken(qwen3_5, tmp_path):
    """Qwen3-Next's Gated DeltaNet fuses its projections (in_proj_qkvz, in_proj_ba) in another order: the varlen
    forward would compute something else, so it keeps the per-sequence path, and says why."""
    from transformers import AutoModelForCausalLM

    own = AutoModelForCausalLM.from_pretrained(qwen3_5).model.layers[0].linear_attn
    assert layout_mismatch(own) is None
    nxt = AutoModelForCausalLM.from_pretrained(build_target(tmp_path / "next", "qwen3_next", layers=4))
    why = layout_mismatch(nxt.model.layers[0].linear_attn)
    assert why is not None and "in_proj_qkv" in why
