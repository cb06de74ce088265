"""`dflash-ring bench drafter`: one drafter training step, timed phase by phase, with its FLOP utilization.

The drafter is built from a config (no download) for a target shape of bench/target_shapes.py and a
named recipe: by default the paper's (5 layers, B=16, 512 anchors per sequence) on a Qwen3-8B-shaped
target with 4 x 3072-token samples. Model FLOPs count what the step must compute: the drafter layers
and fc forward + backward, attention over the keys each block may see in each layer (sliding-window
layers see at most their window), and the frozen lm_head in the loss (the draft's logits, their gradient
to the hidden states, and the target's logits where the objective reads them, KL or target-argmax labels,
once per distinct position the step reads: what the loss computes, consumer/training/loss.py). DSpark adds its Markov
bias; DFlash2 its convolutions (two per layer, each with its kernel projection) and its selector objective (the
hidden projection, the K-way bilinear scores and the candidates' logits' gradient; the top-K is a selection).

Before anything is built, the step's peak memory is estimated (bench/drafter_memory.py) against the GPU's
(--gpu-memory-gib, default the visible GPU's total): samples per step and tokens per sample left unset are
chosen to fit, and ones given that do not fit are refused in one line. Each figure goes to stderr as soon
as it is measured (bench/progress.py), so a run cut off by a time limit keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from dataclasses import asdict, replace
from datetime import datetime, timezone
from pathlib import Path
from statistics import fmean
from typing import Any

import torch
from safetensors.torch import save_file

from dflash_ring.bench.drafter_memory import GiB, fit_samples
from dflash_ring.bench.progress import progress
from dflash_ring.bench.target_shapes import SHAPES, shape_config, tiny_config
from dflash_ring.common.arguments import (
    at_least_one,
    attention_geometry_argument,
    fp8_recipe_argument,
    recipe_argument,
)
from dflash_ring.common.compile_cache import use_compile_cache
from dflash_ring.common.config.drafter import DrafterConfig, target_text_config
from dflash_ring.common.config.schema import ConfigError
from dflash_ring.consumer.modeling.fp8 import check_precision, convert_to_fp8
from dflash_ring.consumer.training.loss import drafter_loss
from dflash_ring.consumer.modeling.model import Anchors, FrozenTargetHead, cu_seqlens_from_lengths, sample_anchors
from dflash_ring.consumer.families import family
from dflash_ring.consumer.families.build import build_drafter
from dflash_ring.consumer.families.eagle3.vocab import vocab_mapping
from dflash_ring.consumer.layouts.drafter_hf_config import drafter_geometry
from dflash_ring.consumer.training.objective import ObjectiveInputs, block_objective

H200_BF16_PEAK = 989e12  # dense bf16 FLOP/s (spec sheet)
DEFAULT_SAMPLES = (4, 3072)  # samples per step, tokens per sample: the paper's Qwen3-8B drafter
# Tokens per sample where the default does not fit: the 27B's is the replaced pipeline's 4096 (issue 25).
SAMPLE_TOKENS = {"qwen3.6-27b": 4096}


def bench_target(shape: str, tiny: bool) -> dict[str, Any]:
    """The target's text config: the real shape, or (tiny, or no GPU) a small member of the same family."""
    if shape not in SHAPES or shape == "tiny":
        raise ValueError(f"unknown shape {shape!r}; known: {sorted(set(SHAPES) - {'tiny'})}")
    family = SHAPES[shape][0]
    config = tiny_config(family, vocab_size=512, hidden_size=128, num_hidden_layers=8) if tiny else shape_config(shape)
    return target_text_config(config)


def visible_keys(anchors: Anchors, block: int, window: int | None) -> float:
    """Mean keys a block-token query attends to in a layer (context before its anchor, within the window for
    sliding layers, plus its own block: all of it, or the causal part in a sliding layer)."""
    before = (anchors.positions - anchors.seq_bounds()[0]).float()[:, None]
    if window is None:
        return float(before.mean()) + block
    k = torch.arange(block, device=before.device).float()[None, :]
    return float((torch.minimum(before, (window - 1 - k).clamp_min(0)) + k + 1).mean())


def step_flops(
    cfg: dict[str, Any],
    drafter: DrafterConfig,
    n_ctx_layers: int,
    tokens: int,
    anchors: Anchors,
    supervised: int,
    teacher_positions: int,
) -> float:
    from dflash_ring.consumer.layouts.drafter_hf_config import drafter_attention

    # the drafter's own attention geometry where it sets one (--drafter-attention), else the target's
    attn = drafter_attention(drafter, cfg)
    h, hd = cfg["hidden_size"], attn["head_dim"]
    q, kv = attn["num_attention_heads"] * hd, attn["num_key_value_heads"] * hd
    block = drafter.block_size
    block_tokens = anchors.num_blocks * block
    per_layer_block = 2 * block_tokens * (h * q + 2 * h * kv + q * h + 3 * h * drafter_mlp(cfg, drafter))
    per_layer_ctx = 2 * tokens * (2 * h * kv)
    attention = sum(
        2
        * 2
        * block_tokens
        * visible_keys(anchors, block, drafter.sliding_window if kind == "sliding_attention" else None)
        * q
        for kind in drafter.layer_types
    )
    fc = 2 * tokens * n_ctx_layers * h * h
    trainable_fwd = drafter.num_hidden_layers * (per_layer_block + per_layer_ctx) + attention + fc
    # DFlash2: the two convolutions of each layer (attention's and MLP's) on the block rows only (the context feeds
    # the keys and values alone): per sublayer its kernel projection [h] x [h, 2 k G] and the input and output
    # convolutions, k multiply-adds per channel each
    trainable_fwd += drafter.num_hidden_layers * block_tokens * dflash2_conv_flops(cfg, drafter)
    head = 2 * h * cfg["vocab_size"]  # per row of a [rows, H] x [H, vocab] product
    # DSpark: the Markov bias [rows, r] x [r, vocab], and its gradients to the features and to markov_w2
    markov = 3 * 2 * drafter.markov_rank * cfg["vocab_size"]  # markov_rank 0: no Markov head (every other family)
    # the draft's logits and their gradient per supervised row; the teacher's once per distinct position
    return (
        3 * trainable_fwd
        + head * (2 * supervised + teacher_positions)
        + markov * supervised
        + selector_flops(cfg, drafter) * supervised
    )


def dflash2_conv_flops(cfg: dict[str, Any], drafter: DrafterConfig) -> int:
    """Forward FLOPs of one DFlash2 layer's convolutions per block token (0 without convolutions: conv_kernel_size 0,
    every other family): for each of its two sublayers the kernel projection (2 h x 2 k G, G = h / group) and two
    convolutions of k taps (2 k h each)."""
    if not drafter.conv_kernel_size:
        return 0
    h, k = cfg["hidden_size"], drafter.conv_kernel_size
    groups = h // drafter.conv_group_size
    return 2 * (2 * h * 2 * k * groups + 2 * 2 * k * h)


def selector_flops(cfg: dict[str, Any], drafter: DrafterConfig) -> int:
    """FLOPs of DFlash2's selector objective per supervised row, forward and backward: the
    hidden projection [h] x [h, r], the predecessor product (r), the K-way bilinear scores (2 K r), each x 3, and the
    candidates' logits' gradient to the hidden state through the head's K rows (2 K h; their forward is the head's
    logits, counted). The unary top-K is a selection over the vocabulary, no arithmetic: not counted. 0 without a
    selector (selector_rank 0: every other family)."""
    if not drafter.selector_rank:
        return 0
    h, r, top_k = cfg["hidden_size"], drafter.selector_rank, drafter.selector_top_k
    return 3 * (2 * h * r + r + 2 * top_k * r) + 2 * top_k * h


def drafter_mlp(cfg: dict[str, Any], drafter: DrafterConfig) -> int:
    return drafter_geometry(drafter, cfg)["intermediate_size"]


def _grad_check(model, head, drafter, ctx, ids, mask, anchors, teacher, cuda: bool) -> float:
    """Max over parameters of |g_flex - g_sdpa| / |g_sdpa| for one step: the fused path must train the same model."""
    grads = {}
    for attention in ("sdpa", "flex"):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            hidden = model(ctx, ids, anchors, head, attention=attention)
            drafter_loss(model, hidden, anchors, ids, mask, head, drafter, teacher).loss.backward()
        grads[attention] = [p.grad.float().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return max(float((f - s_).norm() / s_.norm().clamp_min(1e-30)) for f, s_ in zip(grads["flex"], grads["sdpa"]))


def _top_kernels(prof, n: int = 15) -> list[list]:
    rows = sorted(prof.key_averages(), key=lambda e: e.self_device_time_total, reverse=True)[:n]
    return [
        [e.key[:90], round(e.self_device_time_total / 1e3 / 2, 2), e.count // 2] for e in rows
    ]  # ms, calls per step


def _drafter_config(
    target: dict[str, Any],
    recipe: str,
    anchors: int | None,
    loss_chunk: int,
    attention: tuple[int, int, int] | None = None,
    draft_vocab_size: int = 0,
) -> DrafterConfig:
    """The recipe's drafter for the shape; attention: its own (heads, key/value heads, head width), else the
    target's. draft_vocab_size: EAGLE-3's reduced vocabulary (the keys of another family refuse it), whose maps
    DRAFT_VOCAB_FILE holds once write_draft_vocab has run."""
    heads, kv_heads, head_dim = attention or (None, None, None)
    vocab = {"draft_vocab_size": draft_vocab_size, "draft_vocab": str(DRAFT_VOCAB_FILE)} if draft_vocab_size else {}
    if draft_vocab_size > target["vocab_size"]:
        raise ConfigError(
            f"--draft-vocab-size {draft_vocab_size} exceeds the target's vocabulary of {target['vocab_size']}"
        )
    try:  # the options' combination as a run's config would refuse it, in one line
        return DrafterConfig(
            recipe=recipe,
            num_anchors=anchors,
            mask_token_id=target["vocab_size"] - 1,
            loss_chunk_tokens=loss_chunk,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            **vocab,
        )
    except ValueError as e:
        raise ConfigError(f"bench drafter --recipe {recipe}: {e}") from None


DRAFT_VOCAB_FILE = Path(tempfile.gettempdir()) / f"bench-drafter-draft-vocab-{os.getpid()}.safetensors"


def write_draft_vocab(draft_vocab_size: int, vocab_size: int) -> None:
    """A reduced draft vocabulary's maps for the bench (which tokens it keeps changes no FLOP, only which head rows
    are read): the draft-vocab tool's mapping of random counts, so the kept ids scatter over the vocabulary as a
    real data set's do."""
    counts = torch.randint(0, 1000, (vocab_size,), generator=torch.Generator().manual_seed(0))
    d2t, t2d = vocab_mapping(counts, draft_vocab_size)
    save_file({"d2t": d2t, "t2d": t2d, "counts": counts}, DRAFT_VOCAB_FILE, {"vocab_size": str(vocab_size)})


def _fit_to_gpu(
    shape: str,
    tiny: bool,
    recipe: str,
    seqs: int | None,
    seq_len: int | None,
    anchors: int | None,
    loss_chunk: int,
    gpu_bytes: float,
    *,
    compiled: bool,
    check: bool,
    drafter_attention: tuple[int, int, int] | None = None,
    draft_vocab_size: int = 0,
) -> tuple[int, int]:
    """The samples the GPU step runs (the given ones, or defaults that fit); DoesNotFit, before anything is built,
    if they do not fit. The estimate is of the shape as a GPU runs it, also when asked for on a CPU."""
    target = bench_target(shape, tiny)
    seqs, seq_len, memory = fit_samples(
        target,
        _drafter_config(target, recipe, anchors, loss_chunk, drafter_attention, draft_vocab_size),
        seqs,
        seq_len,
        gpu_bytes,
        compiled=compiled,
        check=check,
        default=DEFAULT_SAMPLES,
        fallback_len=SAMPLE_TOKENS.get(shape, DEFAULT_SAMPLES[1]),
    )
    progress(
        "drafter",
        "memory",
        {
            "seqs": seqs,
            "seq_len": seq_len,
            "estimated_peak_gib": round(memory.peak / GiB, 1),
            "gradient_check_gib": None if memory.check is None else round(memory.check / GiB, 1),
            "gpu_gib": round(gpu_bytes / GiB, 1),
        },
    )
    return seqs, seq_len


def run_drafter_bench(
    tiny: bool = False,
    steps: int = 5,
    seqs: int | None = None,
    seq_len: int | None = None,
    anchors: int | None = None,
    anchors_per_group: int = 64,
    attention: str = "auto",
    loss_chunk: int = 1024,
    check: bool = True,
    profile: bool = False,
    compile: bool = True,
    compile_cache: str = "",
    peak_flops: float = H200_BF16_PEAK,
    shape: str = "qwen3-8b",
    recipe: str = "paper",
    gpu_memory_gib: float | None = None,
    precision: str = "bf16",
    fp8_recipe: str = "rowwise",
    drafter_attention: tuple[int, int, int] | None = None,
    draft_vocab_size: int = 0,
) -> dict:
    """seqs, seq_len: None to fit the GPU. gpu_memory_gib: what the step must fit in (default: the visible GPU's
    total; given without a GPU, the check runs for the GPU shape and the bench then runs its CPU smoke size).
    precision: drafter.precision (fp8: refused in one line where it cannot run)."""
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    check_precision(precision, dev)
    gpu_bytes = (
        gpu_memory_gib * GiB
        if gpu_memory_gib is not None
        else torch.cuda.get_device_properties(dev).total_memory
        if cuda
        else None
    )
    if gpu_bytes is not None:
        seqs, seq_len = _fit_to_gpu(
            shape,
            tiny,
            recipe,
            seqs,
            seq_len,
            anchors,
            loss_chunk,
            gpu_bytes,
            compiled=compile and attention in ("auto", "flex"),
            check=check,
            drafter_attention=drafter_attention,
            draft_vocab_size=draft_vocab_size,
        )
    attention = attention if attention != "auto" else ("flex" if cuda else "sdpa")
    target = bench_target(shape, tiny or not cuda)
    if not cuda:
        seqs, seq_len, anchors, steps = 2, 256, 32, 2
        draft_vocab_size = min(draft_vocab_size, target["vocab_size"])  # the CPU smoke run's small vocabulary
    drafter = replace(
        _drafter_config(target, recipe, anchors, loss_chunk, drafter_attention, draft_vocab_size),
        precision=precision,
        fp8_recipe=fp8_recipe,
    )
    anchors = drafter.num_anchors
    backbone_only = replace(drafter, confidence_weight=0.0)  # DSpark's step without its heads (heads_overhead)
    if draft_vocab_size:
        write_draft_vocab(draft_vocab_size, target["vocab_size"])
    try:
        model = build_drafter(drafter, target).to(dev)
    finally:
        DRAFT_VOCAB_FILE.unlink(missing_ok=True)
    if precision == "fp8":  # as the Trainer does: before the optimizer and the compile
        convert_to_fp8(model, fp8_recipe)
    n_ctx = len(model.target_layer_ids)
    h, vocab = target["hidden_size"], target["vocab_size"]
    head = FrozenTargetHead(
        torch.randn(vocab, h, dtype=torch.bfloat16, device=dev) * 0.02,
        torch.randn(vocab, h, dtype=torch.bfloat16, device=dev) * 0.02,
    )
    if precision == "fp8":
        head.quantize_fp8()
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, fused=cuda)
    tokens = seqs * seq_len

    def host_tensor(width: int) -> torch.Tensor:
        return torch.randn(tokens, width, dtype=torch.bfloat16).pin_memory() if cuda else torch.randn(tokens, width)

    host = host_tensor(n_ctx * h)
    final_host = host_tensor(h) if drafter.needs_target_logits else None  # the shipped final hidden state
    ids_host = torch.randint(0, vocab - 1, (tokens,))
    mask_host = torch.ones(tokens, dtype=torch.bool)
    mask_host[torch.arange(tokens) % seq_len < seq_len // 4] = False  # prompt quarter of every sample
    cu = cu_seqlens_from_lengths([seq_len] * seqs).to(dev)
    gen = torch.Generator(device=dev).manual_seed(0)

    def sync() -> float:
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    compile = compile and cuda and attention == "flex"
    cache = (
        use_compile_cache(
            compile_cache, "bench-drafter", {"drafter": asdict(drafter), "target": target, "attention": attention}
        )
        if compile
        else None
    )
    grad_err = None
    if check and cuda:  # flex has no CPU backward
        ctx, ids, mask = host.to(dev), ids_host.to(dev), mask_host.to(dev)
        teacher = None if final_host is None else final_host.to(dev)
        grad_err = _grad_check(
            model, head, drafter, ctx, ids, mask, sample_anchors(mask, cu, anchors, gen), teacher, cuda
        )
        progress("drafter", "gradient_check", {"flex_vs_sdpa_grad_rel_err": round(grad_err, 5)})
    if compile:
        model.compile_layers(include_fc=precision == "fp8")

    def step(heads: bool = True) -> tuple[float, ...]:
        t0 = sync()
        ctx = host.to(dev, non_blocking=True)
        ids, mask = ids_host.to(dev, non_blocking=True), mask_host.to(dev, non_blocking=True)
        teacher = None if final_host is None else final_host.to(dev, non_blocking=True)
        t1 = sync()
        a = sample_anchors(mask, cu, anchors, gen)
        inputs = ObjectiveInputs(ctx, ids, mask, cu, teacher, a, attention, anchors_per_group)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
            if heads:  # the family's objective, as the trainer runs it
                objective = family(drafter.arch).objective(model, inputs, head, drafter)
            else:  # a block family's backbone alone
                objective = block_objective(model, inputs, head, backbone_only, heads=False)
            out = objective.out
        t2 = sync()
        out.loss.backward()
        t3 = sync()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t4 = sync()
        step.anchors, step.supervised = objective.blocks, int(out.num_valid_tokens)
        step.teacher_positions = out.teacher_positions
        return t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0

    compile_s = sum(step()[-1] for _ in range(4))  # warm-up; the first steps compile (flex, layers, loss)
    progress("drafter", "warmup", {"warmup_s": round(compile_s, 1)})
    phases = {"h2d_s": [], "forward_s": [], "backward_s": [], "optimizer_s": [], "step_s": []}
    for i in range(steps):
        for k, v in zip(phases, step()):
            phases[k].append(v)
        progress("drafter", "step", {"step": i + 1, **{k: round(v[-1], 4) for k, v in phases.items()}})
    a = step.anchors
    heads_overhead = None
    if drafter.markov_rank:  # DSpark's heads: the same steps with the Markov bias and the confidence left out
        backbone = [step(heads=False)[-1] for _ in range(2 + steps)][2:]
        heads_overhead = round(fmean(phases["step_s"]) / fmean(backbone) - 1, 4)
        progress(
            "drafter", "dspark_heads", {"backbone_step_s": round(fmean(backbone), 4), "heads_overhead": heads_overhead}
        )
    blocks = a.num_blocks
    mean = {k: sum(v) / len(v) for k, v in phases.items()}
    geometry = drafter_geometry(drafter, target)
    own = family(drafter.arch).step_flops  # a family trained otherwise than by blocks counts its own
    flops = (
        own(
            target,
            geometry,
            drafter,
            n_ctx,
            tokens,
            a,
            step.supervised,
            step.teacher_positions,
        )
        if own
        else step_flops(target, drafter, n_ctx, tokens, a, step.supervised, step.teacher_positions)
    )
    summary = {
        "step_split_s": {k: round(v, 4) for k, v in mean.items()},
        "tokens_per_s": round(tokens / mean["step_s"], 1),
        "block_positions_per_s": round(blocks * drafter.block_size / mean["step_s"], 1),
        "teacher_positions_per_step": step.teacher_positions,
        "model_tflop_per_step": round(flops / 1e12, 2),
        "achieved_tflop_per_s": round(flops / mean["step_s"] / 1e12, 1),
        "mfu": round(flops / mean["step_s"] / peak_flops, 4),
        "peak_memory_gib": round(torch.cuda.max_memory_allocated(dev) / 2**30, 1) if cuda else None,
    }
    progress("drafter", "summary", summary)
    top = None
    if profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step(), step()
        top = _top_kernels(prof)
    report = {
        "benchmark": "drafter",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(dev) if cuda else platform.processor() or "cpu",
        "torch": torch.__version__,
        "target_shape": shape if cuda and not tiny else f"{shape} (tiny: same family, hidden {h})",
        "recipe": {
            k: v
            for k, v in asdict(drafter).items()
            if k
            in (
                "recipe",
                "arch",
                "loss",
                "kl_weight",
                "cap_weight",
                "tv_weight",
                "confidence_weight",
                "markov_rank",
                "markov_head",
                "label",
                "layer_types",
                "sliding_window",
            )
        },
        "shape": {
            "hidden": h,
            "draft_layers": drafter.num_hidden_layers,
            "target_layers_fed": n_ctx,
            "block_size": drafter.block_size,
            "anchors_per_seq": anchors,
            "seqs": seqs,
            "seq_len": seq_len,
            "blocks_per_step": blocks,
            "vocab": vocab,
            "draft_vocab": drafter.draft_vocab_size or vocab,
            # The drafter's attention (its own where --drafter-attention set it, else the target's).
            "heads": geometry["num_attention_heads"],
            "kv_heads": geometry["num_key_value_heads"],
            "head_dim": geometry["head_dim"],
        },
        "attention": attention,
        # the trainable linears' GEMMs; the frozen head's products as consumer/training/loss.py does them
        "precision": precision,
        "fp8_recipe": fp8_recipe if precision == "fp8" else None,
        "anchors_per_group": anchors_per_group if attention == "sdpa" else None,
        "loss_chunk_tokens": loss_chunk,
        "compiled_layers": compile,
        "warmup_s": round(compile_s, 1),
        "compile_cache": None if cache is None else str(cache),
        "flex_vs_sdpa_grad_rel_err": None if grad_err is None else round(grad_err, 5),
        "step_split_s": summary["step_split_s"],
        "sync_s": 0.0,  # one replica: no collective in the step
        **{
            k: summary[k]
            for k in (
                "tokens_per_s",
                "block_positions_per_s",
                "teacher_positions_per_step",
                "model_tflop_per_step",
                "achieved_tflop_per_s",
            )
        },
        "peak_tflop_per_s": round(peak_flops / 1e12, 1),
        "mfu": summary["mfu"],
        "peak_memory_gib": summary["peak_memory_gib"],
        # DSpark: step time with the Markov and confidence heads / the same steps without them, - 1
        "dspark_heads_overhead": heads_overhead,
    }
    if top is not None:
        report["top_kernels_ms_per_step"] = top
    return report


def positive(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`dflash-ring bench drafter`'s own options (cli.py registers every bench by name, and hands it the rest)."""
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="a small shape (CPU smoke run)")
    parser.add_argument("--steps", type=at_least_one, default=5)
    parser.add_argument(
        "--shape",
        default="qwen3-8b",
        choices=sorted(set(SHAPES) - {"tiny"}),
        help="target shape (bench/target_shapes.py); --tiny for the CPU smoke run",
    )
    recipe_argument(parser, default="paper")
    attention_geometry_argument(parser)
    parser.add_argument(
        "--seqs",
        type=at_least_one,
        default=None,
        help="samples per step (default: 4 x 3072 tokens where the step fits the GPU, else as many "
        "samples of the shape's length as fit; given values that do not fit are refused)",
    )
    parser.add_argument("--seq-len", type=at_least_one, default=None, help="tokens per sample (default: see --seqs)")
    parser.add_argument(
        "--gpu-memory-gib",
        type=positive,
        default=None,
        help="GPU memory the step must fit, by the estimate of bench/drafter_memory.py, checked before "
        "anything is built (default: the visible GPU's total; given without a GPU, the shape is "
        "checked as a GPU would run it, then the CPU smoke run follows)",
    )
    parser.add_argument("--anchors", type=at_least_one, default=None, help="anchors per sample (default: the recipe's)")
    parser.add_argument(
        "--anchors-per-group", type=at_least_one, default=64, help="blocks per SDPA call (--attention sdpa)"
    )
    parser.add_argument("--attention", choices=["auto", "flex", "sdpa"], default="auto")
    parser.add_argument("--loss-chunk", type=at_least_one, default=1024, help="rows of [rows, vocab] logits at once")
    parser.add_argument("--no-check", action="store_true", help="skip the flex-vs-sdpa gradient comparison (GPU)")
    parser.add_argument("--profile", action="store_true", help="add the top GPU kernels of two steps")
    parser.add_argument("--no-compile", action="store_true", help="run the decoder layers eagerly")
    parser.add_argument(
        "--precision",
        choices=["bf16", "fp8"],
        default="bf16",
        help="drafter.precision: the trainable linears in bf16 or FP8 (refused without a capable GPU)",
    )
    fp8_recipe_argument(parser)
    parser.add_argument(
        "--draft-vocab-size",
        type=at_least_one,
        default=0,
        help="EAGLE-3's reduced draft vocabulary (EAGLE and SpecForge train 32000; default: the target's)",
    )
    parser.add_argument(
        "--compile-cache",
        default="",
        help="persistent compile cache root (run.compile_cache_dir); run twice to see a warm start",
    )


def main(args: argparse.Namespace) -> int:
    print(
        json.dumps(
            run_drafter_bench(
                args.tiny,
                args.steps,
                seqs=args.seqs,
                seq_len=args.seq_len,
                anchors=args.anchors,
                shape=args.shape,
                recipe=args.recipe,
                anchors_per_group=args.anchors_per_group,
                attention=args.attention,
                loss_chunk=args.loss_chunk,
                check=not args.no_check,
                profile=args.profile,
                compile=not args.no_compile,
                compile_cache=args.compile_cache,
                gpu_memory_gib=args.gpu_memory_gib,
                precision=args.precision,
                fp8_recipe=args.fp8_recipe,
                drafter_attention=args.drafter_attention,
                draft_vocab_size=args.draft_vocab_size,
            ),
            indent=2,
        )
    )
    return 0
