"""Gated DeltaNet over a whole pack in one call, through flash-linear-attention's varlen kernels.

Why: a packed batch must not carry a convolution window or a recurrent state from one sequence into the
next (producer/packing.py). The portable way is one call of the module's own forward per sequence: on the
Qwen3.6-27B shape that is 48 layers x the pack's sequences of projections, a depthwise convolution and the
chunked delta rule, each launched per sequence, with transformers' PyTorch convolution (causal-conv1d is
rarely installed). flash-linear-attention's Triton `causal_conv1d` and `chunk_gated_delta_rule` take
`cu_seqlens` and start each sequence's convolution window and state from zero: exactly what running each
sequence alone computes, for the whole pack in one launch each.

This runs the module's own parameters and submodules (projections, gated norm, output projection) in the
order of transformers' Qwen3.5 forward (5.17 and 5.24 alike), with the two token mixers swapped for their
varlen kernels. It is bound only where it fits (`varlen_refusal`): flash-linear-attention
imports with both kernels, the module has the Qwen3.5 Gated DeltaNet layout (qwen3_5, qwen3_5_moe; not
Qwen3-Next's fused projections) and an activation the kernel supports; it runs only on CUDA tensors.
Everything else keeps the per-sequence path. The conformance probe (producer/conformance.py) compares the
pack against each sequence through the model's own forward before a batch is published, so this path is
judged on every target it runs for, like any packed mixer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# The Qwen3.5 Gated DeltaNet layout this forward reproduces (transformers' Qwen3_5GatedDeltaNet).
LAYOUT = (
    "in_proj_qkv",
    "in_proj_z",
    "in_proj_b",
    "in_proj_a",
    "conv1d",
    "A_log",
    "dt_bias",
    "norm",
    "out_proj",
    "key_dim",
    "value_dim",
    "head_k_dim",
    "head_v_dim",
    "num_k_heads",
    "num_v_heads",
    "activation",
)
KERNEL_ACTIVATIONS = ("silu", "swish")


@dataclass(frozen=True)
class FlaKernels:
    """flash-linear-attention's two varlen kernels, or why they are not there."""

    causal_conv1d: Callable | None
    chunk_gated_delta_rule: Callable | None
    missing: str | None
    device_type: str = "cuda"  # where they run (Triton); a pack elsewhere takes the per-sequence path

    @classmethod
    def load(cls) -> FlaKernels:
        try:
            from fla.modules.causal_conv1d import causal_conv1d
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        except Exception as e:  # not installed, or installed without a usable Triton
            return cls(None, None, f"flash-linear-attention not usable ({type(e).__name__}: {e})")
        return cls(causal_conv1d, chunk_gated_delta_rule, None)


def varlen_refusal(module: nn.Module, kernels: FlaKernels) -> str | None:
    """Why this module stays on the per-sequence path, or None when the varlen forward fits it."""
    return kernels.missing or layout_mismatch(module)


def layout_mismatch(module: nn.Module) -> str | None:
    """What keeps this module off the varlen path (a different layout or activation), or None."""
    absent = [name for name in LAYOUT if not hasattr(module, name)]
    if absent:
        return f"{type(module).__name__} lacks {', '.join(absent)} (not the Qwen3.5 Gated DeltaNet layout)"
    if module.activation not in KERNEL_ACTIVATIONS:
        return f"{type(module).__name__}: activation {module.activation!r} is not one the varlen convolution runs"
    if module.num_v_heads % module.num_k_heads:
        return f"{type(module).__name__}: {module.num_v_heads} value heads over {module.num_k_heads} key heads"
    return None


class VarlenGatedDeltaNet:
    """The whole-pack forward of one Gated DeltaNet module (module docstring)."""

    def __init__(self, module: nn.Module, kernels: FlaKernels):
        self.module = module
        self.kernels = kernels

    @torch._dynamo.disable  # Triton kernels behind autograd Functions, and a host-side cu_seqlens: run as they are
    def __call__(self, hidden: torch.Tensor, cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor) -> torch.Tensor:
        """hidden [1, tokens, hidden]; cu_seqlens [n + 1] int64 on the device and on the host."""
        m = self.module
        tokens = hidden.shape[1]
        mixed_qkv = m.in_proj_qkv(hidden)  # [1, T, conv_dim]: the kernel's layout, no transpose
        z = m.in_proj_z(hidden).reshape(1, tokens, -1, m.head_v_dim)
        beta = m.in_proj_b(hidden).sigmoid()
        a = m.in_proj_a(hidden)
        # The activation outside the kernel, on the rounded convolution, as transformers applies it: fused, the
        # output is rounded once instead of twice, which on its own moves a bf16 layer by ~1e-2 (more than the
        # probe allows for bf16 noise; measured on the H200, 2026-12-03).
        mixed_qkv, _ = self.kernels.causal_conv1d(
            mixed_qkv,
            weight=m.conv1d.weight.squeeze(1),
            bias=m.conv1d.bias,
            activation=None,
            cu_seqlens=cu_seqlens,
            cu_seqlens_cpu=cu_seqlens_cpu,
        )
        mixed_qkv = F.silu(mixed_qkv)
        query, key, value = torch.split(mixed_qkv, [m.key_dim, m.key_dim, m.value_dim], dim=-1)
        query = query.reshape(1, tokens, -1, m.head_k_dim)
        key = key.reshape(1, tokens, -1, m.head_k_dim)
        value = value.reshape(1, tokens, -1, m.head_v_dim)
        g = -m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias)
        groups = m.num_v_heads // m.num_k_heads
        if groups > 1:  # value head h reads key head h // groups, as transformers 5.17 lays them out
            query = query.repeat_interleave(groups, dim=2)
            key = key.repeat_interleave(groups, dim=2)
        out, _ = self.kernels.chunk_gated_delta_rule(
            query,
            key,
            value,
            g=g,
            beta=beta,
            initial_state=None,
            output_final_state=False,
            use_qk_l2norm_in_kernel=True,
            cu_seqlens=cu_seqlens,
            cu_seqlens_cpu=cu_seqlens_cpu,
        )
        out = m.norm(out.reshape(-1, m.head_v_dim), z.reshape(-1, m.head_v_dim)).reshape(1, tokens, -1)
        return m.out_proj(out)
