"""`dflash-ring bench target`: the target forward alone, then the same forward feeding a real ring.

One process, one random-weight model of a named shape (bench/target_shapes.py: Qwen3-8B, a
Qwen3.6-27B-like hybrid, Qwen3-30B-A3B, gpt-oss-20b, or a tiny one for a CPU smoke run), one set of
synthetic samples with a chat-like length distribution:

  (0) the conformance probe on this device: packed against per-sequence features, max error;
  (a) forward: the loader thread and the truncated forward, outputs dropped;
  (b) into the ring: the production loop (producer/process.py: loader thread, forward, D2H on a
      side stream into registered slots, publish) with a consumer thread releasing slots;
  (c) the forward of the same samples in the other layout (padded when (a) is packed).

On a GPU (a) runs twice: eager layers first (the baseline), then compiled layers (target.compile, what
the producer runs), whose features on the first timed batch are compared with the eager ones; (b) and
(c) then run compiled. b / a (compiled) is what the ring costs the producer (1.0: nothing). MFU counts model FLOPs
only: 2 x the parameters that run for a token (MoE: shared parts plus top-k of the experts), plus causal softmax
attention over each sequence (sliding layers: within the window; linear-attention layers: their
projections only), against a dense bf16 peak.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import datetime, timezone
from typing import Any

import numpy as np
import torch

from dflash_ring.common.arguments import at_least_one, non_negative, positive_number
from dflash_ring.common.config.drafter import build_target_layer_ids
from dflash_ring.producer.batching import Batch
from dflash_ring.producer.conformance import active_sliding_window, layer_kinds, probe
from dflash_ring.producer.process import run_target
from dflash_ring.producer.target import TargetModel, resolve_device, resolve_dtype

from .progress import progress
from .target_shapes import SHAPES, model_class, shape_config
from .target_timing import batch_loader, host_info, sync, synthetic_batches, time_forward, time_into_ring


def build_target(
    shape: str, device: torch.device, dtype: torch.dtype, layer_ids: list[int], *, final_hidden: bool, packed: bool
) -> TargetModel:
    """Random weights made on the device itself: no download, no host copy of 16-60 GB."""
    config = shape_config(shape)
    with torch.device(device):
        model = model_class(SHAPES[shape][0])._from_config(config, dtype=dtype)
    return TargetModel(model, layer_ids, final_hidden=final_hidden, packed=packed)


def active_parameters(target: TargetModel, run: int) -> float:
    """Parameters one token uses in the first `run` layers: routed experts count top-k / experts."""
    c = target.config
    experts = getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None)
    share = c.num_experts_per_tok / experts if experts else 1.0
    return sum(
        p.numel() * (share if ".experts." in f".{name}" else 1.0)
        for layer in list(target.decoder.layers)[:run]
        for name, p in layer.named_parameters()
    )


def attention_pairs(lengths: np.ndarray, window: int | None) -> float:
    """Query-key pairs of causal attention over sequences of these lengths, within a window if given."""
    n = lengths.astype(np.float64)
    if window is None:
        return float((n * (n + 1) / 2).sum())
    w = float(window)
    inside = np.minimum(n, w)
    return float((inside * (inside + 1) / 2 + np.maximum(n - w, 0) * w).sum())


def model_flops(target: TargetModel, batches: list[Batch]) -> float:
    """2 x active parameters per token, plus 2 x heads x (qk + v head dims) per query-key pair of each softmax layer
    (the two differ under multi-head latent attention, whose config's head_dim is only the rope part)."""
    run = len(target.decoder.layers) if target.final_hidden else target.deepest + 1
    c = target.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    widths = (getattr(c, "qk_head_dim", None) or head_dim) + (getattr(c, "v_head_dim", None) or head_dim)
    kinds = layer_kinds(c, run)
    window = active_sliding_window(c)
    tokens = sum(b.num_tokens for b in batches)
    attention = 0.0
    for kind in kinds:
        if kind in ("full_attention", "sliding_attention"):
            size = window if kind == "sliding_attention" else None
            attention += 2.0 * c.num_attention_heads * widths * sum(attention_pairs(b.lengths, size) for b in batches)
    return 2.0 * active_parameters(target, run) * tokens + attention


def _features(target: TargetModel, batch: Batch) -> torch.Tensor:
    prep = next(iter(batch_loader([batch], target, target.device)))
    out = run_target(target, prep).features.clone()
    sync(target.device)
    return out


def _fp32_features(target: TargetModel, batch: Batch) -> torch.Tensor:
    """The same batch through the same weights in float32 (eager; per-sequence attention off the bf16-only
    varlen kernel): the reference both bf16 paths are measured against. Parameters only: buffers such as
    RoPE's inv_freq are float32 already, and a round trip of the module would leave them bf16."""
    params = list(target.decoder.parameters())
    dtype = params[0].dtype
    for p in params:
        p.data = p.data.float()
    try:
        return _features(target, batch)
    finally:
        for p in params:
            p.data = p.data.to(dtype)  # bf16 -> fp32 -> bf16 is exact


def _rel_l2(got: torch.Tensor, want: torch.Tensor, layer: int | None, width: int) -> float:
    if layer is not None:
        got, want = (t[:, layer * width : (layer + 1) * width] for t in (got, want))
    want = want.float()
    return float(f"{((got.float() - want).norm() / want.norm()).item():.4g}")


def _profile(target: TargetModel, batch: Batch, n: int = 20) -> list[list]:
    """The top GPU kernels of one batch's forward: [name, ms, calls]."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        time_forward(target, [], [batch])
    rows = sorted(prof.key_averages(), key=lambda e: e.self_device_time_total, reverse=True)[:n]
    total = sum(e.self_device_time_total for e in prof.key_averages())
    return [["(all kernels)", round(total / 1e3, 2), None]] + [
        [e.key[:90], round(e.self_device_time_total / 1e3, 2), e.count] for e in rows
    ]


def run_target_bench(
    *,
    shape: str = "qwen3-8b",
    device: str | None = None,
    batches: int = 0,
    max_tokens: int = 0,
    draft_layers: int = 5,
    final_hidden: bool = False,
    packed: bool = True,
    peak_flops: float = 989e12,
    compile: bool = True,
    profile: bool = False,
) -> dict[str, Any]:
    """The report below; each figure also goes to stderr as soon as it is measured (bench/progress.py)."""
    tiny = shape == "tiny"
    dev = resolve_device(device or "auto")
    dtype = resolve_dtype("auto", dev)
    config = shape_config(shape)
    text = config.get_text_config()
    batches = batches or (3 if tiny else 10)
    max_tokens = max_tokens or (2048 if tiny else 32768)
    max_length = min(max_tokens, 512 if tiny else 3072)
    warm_n = 1 if tiny else 2
    layer_ids = build_target_layer_ids(text.num_hidden_layers, draft_layers)
    t0 = time.perf_counter()
    target = build_target(shape, dev, dtype, layer_ids, final_hidden=final_hidden, packed=packed)
    build_s = time.perf_counter() - t0
    progress("target", "build", {"shape": shape, "build_s": round(build_s, 1)})
    report = probe(target)
    progress("target", "probe", {k: report.to_json()[k] for k in ("passed", "max_error", "first_bad_layer")})

    def samples(layout_packed: bool) -> tuple[list[Batch], list[Batch]]:
        made = synthetic_batches(
            warm_n + batches, max_tokens=max_tokens, max_length=max_length, vocab=text.vocab_size, packed=layout_packed
        )
        return made[:warm_n], made[warm_n:]

    warm, timed = samples(packed)
    tokens = sum(b.num_tokens for b in timed)
    padded = sum(round(b.num_tokens / (1.0 - b.padding_fraction)) for b in timed)
    profiles: dict[str, list] = {}
    recurrent = None
    if packed and target.recurrent_path == "varlen":
        # The same-run baseline: each sequence through the recurrent mixers alone (the path before the varlen one).
        target.use_varlen_mixers(False)
        baseline_probe = probe(target)
        per_sequence_s = time_forward(target, warm + timed, timed)
        if profile:
            profiles["per_sequence_eager"] = _profile(target, timed[0])
        target.use_varlen_mixers(True)
        recurrent = {
            "path": "varlen",
            "layers": len(target.recurrent_layers),
            "per_sequence_eager_tokens_per_s": round(tokens / per_sequence_s, 1),
            "probe_per_sequence": baseline_probe.to_json(),
        }
        progress("target", "per_sequence_eager", {"tokens_per_s": recurrent["per_sequence_eager_tokens_per_s"]})
    elif target.recurrent_path is not None:
        recurrent = {
            "path": target.recurrent_path,
            "layers": len(target.recurrent_layers),
            "why": target.recurrent_description(),
        }
    # Warm with the timed batches too: Triton kernels (flash-linear-attention) compile per shape seen.
    forward_s = time_forward(target, warm + timed, timed)
    progress("target", "forward", {"packed": packed, "compiled": False, "tokens_per_s": round(tokens / forward_s, 1)})
    if recurrent is not None and recurrent["path"] == "varlen":
        recurrent["varlen_eager_tokens_per_s"] = round(tokens / forward_s, 1)
        recurrent["ratio_varlen_over_per_sequence"] = round(per_sequence_s / forward_s, 3)
    compiled = None
    if compile and dev.type == "cuda" and packed:
        eager_s, eager = forward_s, _features(target, timed[0])
        reference = _fp32_features(target, timed[0])
        t0 = time.perf_counter()
        layers = target.compile_layers()
        forward_s = time_forward(target, warm + timed, timed)
        warm_s = time.perf_counter() - t0 - forward_s
        fused = _features(target, timed[0])
        width = target.hidden_size
        compiled = {
            "layers": len(layers),
            "warmup_s": round(warm_s, 1),
            "eager_tokens_per_s": round(tokens / eager_s, 1),
            "ratio_compiled_over_eager": round(eager_s / forward_s, 3),
            "rel_l2_vs_fp32_per_layer": {
                "layer_ids": target.layer_ids,
                "eager_bf16": [_rel_l2(eager, reference, i, width) for i in range(len(target.layer_ids))],
                "compiled_bf16": [_rel_l2(fused, reference, i, width) for i in range(len(target.layer_ids))],
            },
            "rel_l2_compiled_vs_eager": _rel_l2(fused, eager, None, width),
        }
        del eager, reference, fused
        progress(
            "target",
            "forward",
            {
                "packed": packed,
                "compiled": True,
                "tokens_per_s": round(tokens / forward_s, 1),
                **{k: compiled[k] for k in ("warmup_s", "ratio_compiled_over_eager", "rel_l2_vs_fp32_per_layer")},
            },
        )
    if profile:
        profiles["compiled" if compiled else "eager"] = _profile(target, timed[0])
    ring_s, waited_s, slot_bytes = time_into_ring(target, warm, timed, max_tokens, slots=4 if tiny else 3)
    progress(
        "target",
        "ring",
        {
            "tokens_per_s": round(tokens / ring_s, 1),
            "ratio_ring_over_forward": round(forward_s / ring_s, 3),
            "wait_s": round(waited_s, 3),
        },
    )
    # The other layout, same samples (the plans differ: padding counts against the token budget).
    target.use_packing(not packed)
    other_warm, other_timed = samples(not packed)
    other_tokens = sum(b.num_tokens for b in other_timed)
    other_s = time_forward(target, other_warm + other_timed, other_timed)
    target.use_packing(packed)
    progress(
        "target",
        "forward",
        {"packed": not packed, "compiled": bool(compiled), "tokens_per_s": round(other_tokens / other_s, 1)},
    )
    flops = model_flops(target, timed)
    bytes_per_token = (
        target.feature_width * dtype.itemsize + (target.hidden_size * dtype.itemsize if final_hidden else 0) + 5
    )
    packed_rate, padded_rate = (
        (tokens / forward_s, other_tokens / other_s) if packed else (other_tokens / other_s, tokens / forward_s)
    )
    return {
        "benchmark": "target",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": host_info(dev),
        "method": "same process, model and samples: (0) conformance probe; (a) loader + truncated forward; (b) the "
        "producer loop into a real ring (side-stream D2H into registered slots) with a consumer thread "
        "releasing slots; (c) forward of the same samples in the other layout; tokens/s over the timed "
        "batches after warm-up",
        "model": {
            "shape": shape,
            "family": SHAPES[shape][0],
            "model_type": text.model_type,
            **{k: v for k, v in SHAPES[shape][1].items() if not isinstance(v, list)},
            "dtype": str(dtype).removeprefix("torch."),
            "layer_ids": layer_ids,
            "layers_run": len(target.decoder.layers) if final_hidden else target.deepest + 1,
            "final_hidden": final_hidden,
            "attention": target.config._attn_implementation,
            "build_s": round(build_s, 1),
        },
        "probe": report.to_json(),
        "batches": {
            "timed": len(timed),
            "warmup": warm_n,
            "max_tokens": max_tokens,
            "packed": packed,
            "tokens": tokens,
            "mean_sequences": round(sum(len(b.lengths) for b in timed) / len(timed), 1),
            "mean_length": round(tokens / sum(len(b.lengths) for b in timed), 1),
            "padding_fraction": round(1.0 - tokens / padded, 4),
        },
        "forward_tokens_per_s": round(tokens / forward_s, 1),
        "compiled": compiled,
        "recurrent_mixers": recurrent,
        "profile_top_kernels_ms": profiles or None,
        "ring_tokens_per_s": round(tokens / ring_s, 1),
        "ratio_ring_over_forward": round(forward_s / ring_s, 3),
        "layouts": {
            "packed_tokens_per_s": round(packed_rate, 1),
            "padded_tokens_per_s": round(padded_rate, 1),
            "ratio_packed_over_padded": round(packed_rate / padded_rate, 3),
        },
        "ring": {
            "slot_bytes": slot_bytes,
            "bytes_per_token": bytes_per_token,
            "gb_per_s": round(tokens * bytes_per_token / ring_s / 1e9, 3),
            "wait_s": round(waited_s, 3),
        },
        "mfu": {
            "peak_flops": peak_flops,
            "flops_per_token": round(flops / tokens),
            "forward": float(f"{flops / forward_s / peak_flops:.4g}"),
            "ring": float(f"{flops / ring_s / peak_flops:.4g}"),
            "eager_forward": None if compiled is None else float(f"{flops / eager_s / peak_flops:.4g}"),
            "per_sequence_eager_forward": None
            if recurrent is None or "per_sequence_eager_tokens_per_s" not in recurrent
            else float(f"{flops / per_sequence_s / peak_flops:.4g}"),
        },
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`dflash-ring bench target`'s own options (cli.py registers every bench by name, and hands it the rest)."""
    parser.add_argument("--json", action="store_true", help="print the JSON report (the default output)")
    parser.add_argument(
        "--shape",
        default="qwen3-8b",
        choices=sorted(SHAPES),
        help="random-weight target of this shape (tiny: a CPU smoke run)",
    )
    parser.add_argument("--tiny", action="store_true", help="same as --shape tiny")
    parser.add_argument("--device", help="default: cuda if available, else cpu")
    parser.add_argument(
        "--batches", type=non_negative, default=0, help="timed batches per phase (0: 10, or 3 with --tiny)"
    )
    parser.add_argument(
        "--max-tokens", type=non_negative, default=0, help="tokens per batch (0: 32768, or 2048 with --tiny)"
    )
    parser.add_argument(
        "--draft-layers", type=at_least_one, default=5, help="target layers captured, by the DFlash rule"
    )
    parser.add_argument("--final-hidden", action="store_true", help="also ship the final hidden state")
    parser.add_argument("--padded", action="store_true", help="padded batches instead of packed ones")
    parser.add_argument(
        "--peak-tflops", type=positive_number, default=989.0, help="dense bf16 peak for MFU (H200: 989)"
    )
    parser.add_argument(
        "--no-compile",
        action="store_true",
        help="eager layers only (default on a GPU: eager as the same-run baseline, then compiled layers)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="add the top GPU kernels of one batch (hybrid targets: also of the per-sequence baseline)",
    )
    parser.add_argument(
        "--tensor-parallel",
        type=at_least_one,
        default=1,
        metavar="N",
        help="shard the target over N ranks (target.tensor_parallel: NCCL on N GPUs, gloo on the CPU) "
        "and measure it against one rank of the same weights, same run",
    )
    parser.add_argument(
        "--no-baseline",
        action="store_true",
        help="with --tensor-parallel: skip the one-rank run (a shape that does not fit one device)",
    )


def main(args: argparse.Namespace) -> int:
    shape = "tiny" if args.tiny else args.shape
    if args.tensor_parallel > 1:
        from dflash_ring.bench.target_parallel import run_tensor_parallel_bench

        report = run_tensor_parallel_bench(
            shape=shape,
            device=args.device,
            tensor_parallel=args.tensor_parallel,
            batches=args.batches,
            max_tokens=args.max_tokens,
            draft_layers=args.draft_layers,
            packed=not args.padded,
            baseline=not args.no_baseline,
        )
    else:
        report = run_target_bench(
            shape=shape,
            device=args.device,
            batches=args.batches,
            max_tokens=args.max_tokens,
            draft_layers=args.draft_layers,
            final_hidden=args.final_hidden,
            packed=not args.padded,
            peak_flops=args.peak_tflops * 1e12,
            compile=not args.no_compile,
            profile=args.profile,
        )
    print(json.dumps(report, indent=2))
    return 0
