"""`dflash-ring bench attention`: the drafter's flex attention alone, forward and backward, each way it can be called.

The drafter's attention (consumer/modeling/model.py: `_flex_attention`) is one block-sparse flex_attention call per
layer over every block of the step, on the layout `flex_layout` builds for the sampled anchors. Issue 45 asks two
questions of it
at head dim 256 (the Qwen3.6-27B width: 24 query heads, 4 key/value heads): does repeating K/V to the query heads beat
`enable_gqa=True` forward + backward (ModelOpt's DFlash flex attention repeats them, its note saying the GQA backward
is much slower), and does compiling flex with `dynamic=False` beat `dynamic=True`? This bench answers both on the
step's own layout: the same queries, keys, values and block masks through each variant, each compiled afresh
(Dynamo reset between variants), timed with CUDA events (median of --iters after --warmup), its output and
gradients compared with the baseline's (today's call: `enable_gqa`, dynamic).

Variants: `gqa-dynamic` (baseline: the call before issue 45), `gqa-static`, `gqa-dynamic-divisible` (dynamic, with
IS_DIVISIBLE in the kernel options: the lengths are whole tiles, which a dynamic compile cannot prove; what
consumer/modeling/model.py calls now), `repeat-dynamic`, `repeat-static` (K/V repeated to the query heads inside the
timed region, so the copy and the sum of their gradients over the group are counted), and `repeat-static-default-tiles`
(Inductor's own tile sizes instead of FLEX_KERNEL_OPTIONS, which were tuned for GQA).

FLOPs per layer as `bench drafter` counts them: forward 4 x rows x visible keys x heads x head dim, forward +
backward 3 x that (`tflop_per_s`); the kernels' own work (the backward recomputes the scores: 3.5 x) is
`kernel_tflop_per_s`. `step_ms` sums the recipe's layers (e.g. ddtree: 4 sliding + 1 full).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import datetime, timezone
from statistics import median
from typing import Any

import torch

from dflash_ring.bench.drafter import _drafter_config, bench_target, visible_keys
from dflash_ring.bench.progress import progress
from dflash_ring.bench.target_shapes import SHAPES
from dflash_ring.common.arguments import at_least_one, attention_geometry_argument, recipe_argument
from dflash_ring.consumer.families.build import build_drafter
from dflash_ring.consumer.modeling.model import (
    FLEX_KERNEL_OPTIONS,
    cu_seqlens_from_lengths,
    flex_layout,
    sample_anchors,
)

VARIANTS = {  # name: (K/V repeated to the query heads, compiled dynamic, the tuned tile sizes, IS_DIVISIBLE given)
    "gqa-dynamic": (False, True, True, False),
    "gqa-static": (False, False, True, False),
    "gqa-dynamic-divisible": (False, True, True, True),
    "repeat-dynamic": (True, True, True, False),
    "repeat-static": (True, False, True, False),
    "repeat-static-default-tiles": (True, False, False, False),
}
BASELINE = "gqa-dynamic"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def run_attention_bench(
    shape: str = "qwen3.6-27b",
    recipe: str = "ddtree",
    seqs: int = 1,
    seq_len: int = 4096,
    drafter_attention: tuple[int, int, int] | None = None,
    variants: list[str] | None = None,
    warmup: int = 3,
    iters: int = 10,
    device: str = "cuda",
) -> dict[str, Any]:
    """device: "cuda" (the figures); "cpu" only to smoke-test the code (compiled flex on the CPU, slow)."""
    from torch.nn.attention.flex_attention import flex_attention

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    target = bench_target(shape, False)
    drafter = _drafter_config(target, recipe, None, 1024, drafter_attention)
    with torch.device("meta"):  # only its geometry and layer windows: nothing allocated
        model = build_drafter(drafter, target)
    attn = model.layers[0].self_attn
    heads, groups, head_dim = attn.num_heads, attn.num_kv_groups, attn.head_dim
    kv_heads = heads // groups
    layer_windows = [layer.self_attn.sliding_window for layer in model.layers]
    tokens, block = seqs * seq_len, model.block_size
    gen = torch.Generator(device=dev).manual_seed(0)
    mask = torch.ones(tokens, dtype=torch.bool)
    mask[torch.arange(tokens) % seq_len < seq_len // 4] = False  # the prompt quarter, as bench drafter
    anchors = sample_anchors(mask.to(dev), cu_seqlens_from_lengths([seq_len] * seqs).to(dev), drafter.num_anchors, gen)
    layout = flex_layout(anchors, tokens, block, set(layer_windows), model.sliding_causal)
    rows = anchors.num_blocks * block
    q_len = layout.masks[layer_windows[0]].seq_lengths[0]
    kv_len = layout.context_len + q_len
    torch.manual_seed(0)
    q0 = torch.randn(1, heads, q_len, head_dim, device=dev, dtype=torch.bfloat16)
    k0 = torch.randn(1, kv_heads, kv_len, head_dim, device=dev, dtype=torch.bfloat16)
    v0 = torch.randn(1, kv_heads, kv_len, head_dim, device=dev, dtype=torch.bfloat16)
    grad_out = torch.randn(1, heads, q_len, head_dim, device=dev, dtype=torch.bfloat16)
    fwd_flop = {w: 4 * rows * visible_keys(anchors, block, w) * heads * head_dim for w in set(layer_windows)}
    report: dict[str, Any] = {
        "benchmark": "attention",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(dev) if cuda else platform.processor() or "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "target_shape": shape,
        "recipe": recipe,
        "tokens": tokens,
        "blocks": anchors.num_blocks,
        "block_size": block,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "layers": [("full" if w is None else f"window {w}") for w in layer_windows],
        "query_rows": q_len,
        "key_rows": kv_len,
        "tuned_tiles": FLEX_KERNEL_OPTIONS.get(head_dim),
        "baseline": BASELINE,
        "variants": {},
    }
    reference: dict[int | None, list[torch.Tensor]] = {}
    for name in variants or list(VARIANTS):
        repeat, dynamic, tuned, divisible = VARIANTS[name]
        torch._dynamo.reset()
        compiled = torch.compile(flex_attention, dynamic=dynamic)
        options = dict(FLEX_KERNEL_OPTIONS.get(head_dim, {})) if tuned else {}
        if divisible:  # what consumer/modeling/model.py passes now (flex_kernel_options): the lengths are whole tiles
            options["IS_DIVISIBLE"] = True
        options = options or None

        def attend(q, k, v, block_mask):
            if repeat:  # query head h reads kv head h // groups, as _expand_kv and HF's repeat_kv
                k, v = (x.repeat_interleave(groups, dim=1) for x in (k, v))
                return compiled(q, k, v, block_mask=block_mask, kernel_options=options)
            return compiled(q, k, v, block_mask=block_mask, enable_gqa=True, kernel_options=options)

        figures: dict[str, Any] = {}
        try:
            for window in sorted(set(layer_windows), key=lambda w: (w is None, w or 0)):
                block_mask = layout.masks[window]
                q, k, v = (x.clone().requires_grad_() for x in (q0, k0, v0))

                def fwd():
                    with torch.no_grad():
                        return attend(q, k, v, block_mask)

                def fwd_bwd():
                    out = attend(q, k, v, block_mask)
                    q.grad = k.grad = v.grad = None
                    out.backward(grad_out)
                    return out

                def timed(fn) -> float:
                    times = []
                    for i in range(warmup + iters):
                        if cuda:
                            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                            start.record()
                            fn()
                            end.record()
                            torch.cuda.synchronize()
                            elapsed = start.elapsed_time(end)
                        else:
                            t0 = time.perf_counter()
                            fn()
                            elapsed = (time.perf_counter() - t0) * 1e3
                        if i >= warmup:
                            times.append(elapsed)
                    return median(times)

                out = fwd_bwd()  # compiles; its values for the comparison
                values = [out.detach(), q.grad, k.grad, v.grad]
                if name == BASELINE:
                    reference[window] = values
                fwd_ms, step_ms = timed(fwd), timed(fwd_bwd)
                flop = fwd_flop[window]
                key = "full" if window is None else f"window_{window}"
                figures[key] = {
                    "forward_ms": round(fwd_ms, 3),
                    "backward_ms": round(step_ms - fwd_ms, 3),
                    "forward_backward_ms": round(step_ms, 3),
                    "forward_tflop_per_s": round(flop / fwd_ms / 1e9, 1),
                    "tflop_per_s": round(3 * flop / step_ms / 1e9, 1),
                    "kernel_tflop_per_s": round(3.5 * flop / step_ms / 1e9, 1),
                    "rel_err_vs_baseline": None
                    if window not in reference or name == BASELINE
                    else {
                        part: round(_rel(a, b), 6)
                        for part, a, b in zip(("out", "dq", "dk", "dv"), values, reference[window])
                    },
                }
                progress("attention", f"{name} {key}", figures[key])
                del out, values, q, k, v
            per_layer = {None if k == "full" else int(k.split("_")[1]): f for k, f in figures.items()}
            figures["step_ms"] = round(sum(per_layer[w]["forward_backward_ms"] for w in layer_windows), 2)
            figures["step_tflop_per_s"] = round(
                3 * sum(fwd_flop[w] for w in layer_windows) / figures["step_ms"] / 1e9, 1
            )
        except Exception as error:  # noqa: BLE001 - a variant that does not compile or fit is a figure too
            figures["error"] = f"{type(error).__name__}: {str(error)[:300]}"
            progress("attention", f"{name} error", {"error": figures["error"]})
        report["variants"][name] = figures
        if cuda:
            torch.cuda.empty_cache()
    base = report["variants"].get(BASELINE, {}).get("step_ms")
    for figures in report["variants"].values():
        if base and "step_ms" in figures:
            figures["speedup_vs_baseline"] = round(base / figures["step_ms"], 3)
    report["model_tflop_per_step"] = round(3 * sum(fwd_flop[w] for w in layer_windows) / 1e12, 2)
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`dflash-ring bench attention`'s own options."""
    parser.add_argument("--shape", default="qwen3.6-27b", choices=sorted(set(SHAPES) - {"tiny"}), help="target shape")
    recipe_argument(parser, default="ddtree")
    attention_geometry_argument(parser)
    parser.add_argument("--seqs", type=at_least_one, default=1, help="samples per step")
    parser.add_argument("--seq-len", type=at_least_one, default=4096, help="tokens per sample")
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated, of: {', '.join(VARIANTS)} (the baseline, {BASELINE}, first for the comparison)",
    )
    parser.add_argument("--warmup", type=at_least_one, default=3, help="untimed calls per variant and layer kind")
    parser.add_argument("--iters", type=at_least_one, default=10, help="timed calls (the median is reported)")


def main(args: argparse.Namespace) -> int:
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"bench attention: unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    if not torch.cuda.is_available():
        raise SystemExit("bench attention: needs a CUDA GPU (its figures are of the GPU kernels)")
    report = run_attention_bench(
        args.shape, args.recipe, args.seqs, args.seq_len, args.drafter_attention, names, args.warmup, args.iters
    )
    print(json.dumps(report, indent=2))
    return 0
