"""`dflash-ring bench drafter`: one drafter training step, timed phase by phase, with its FLOP utilization.

The drafter is built from a config (no download): by default Qwen3-8B-shaped
(5 layers, hidden 4096, B=16, 512 anchors per sequence, 4 x 3072-token
samples). Model FLOPs count what the step must compute: the drafter layers
and fc forward + backward, attention over the keys each block may see, and the
frozen lm_head in the loss (forward, plus the gradient to the hidden states).
"""

from __future__ import annotations

import platform
import time
from dataclasses import asdict
from datetime import datetime, timezone
from typing import Any

import torch

from dflash_ring.common.compile_cache import use_compile_cache
from dflash_ring.common.drafter_config import DrafterConfig
from dflash_ring.consumer.loss import dflash_loss
from dflash_ring.consumer.model import FrozenTargetHead, build_drafter, cu_seqlens_from_lengths, sample_anchors

QWEN3_8B = dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                intermediate_size=12288, vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
                max_position_embeddings=40960)
TINY = dict(QWEN3_8B, hidden_size=128, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, intermediate_size=256, vocab_size=512)
H200_BF16_PEAK = 989e12  # dense bf16 FLOP/s (spec sheet)


def step_flops(cfg: dict[str, Any], n_layers: int, n_ctx_layers: int, tokens: int, blocks: int, block: int,
               visible_keys: float) -> float:
    h, hd = cfg["hidden_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    block_tokens = blocks * block
    per_layer_block = 2 * block_tokens * (h * q + 2 * h * kv + q * h + 3 * h * cfg["intermediate_size"])
    per_layer_ctx = 2 * tokens * (2 * h * kv)
    attention = 2 * 2 * block_tokens * visible_keys * q
    fc = 2 * tokens * n_ctx_layers * h * h
    trainable_fwd = n_layers * (per_layer_block + per_layer_ctx + attention) + fc
    head = 2 * blocks * (block - 1) * h * cfg["vocab_size"]
    return 3 * trainable_fwd + 2 * head


def _grad_check(model, head, drafter, ctx, ids, mask, anchors, cuda: bool) -> float:
    """Max over parameters of |g_flex - g_sdpa| / |g_sdpa| for one step: the fused path must train the same model."""
    grads = {}
    for attention in ("sdpa", "flex"):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            hidden = model(ctx, ids, anchors, head, attention=attention)
            dflash_loss(hidden, anchors, ids, mask, head, drafter).loss.backward()
        grads[attention] = [p.grad.float().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return max(float((f - s_).norm() / s_.norm().clamp_min(1e-30)) for f, s_ in zip(grads["flex"], grads["sdpa"]))


def _top_kernels(prof, n: int = 15) -> list[list]:
    rows = sorted(prof.key_averages(), key=lambda e: e.self_device_time_total, reverse=True)[:n]
    return [[e.key[:90], round(e.self_device_time_total / 1e3 / 2, 2), e.count // 2] for e in rows]  # ms, calls per step


def run_drafter_bench(tiny: bool = False, steps: int = 5, seqs: int = 4, seq_len: int = 3072,
                      anchors: int = 512, anchors_per_group: int = 64, attention: str = "auto",
                      loss_chunk: int = 1024, check: bool = True, profile: bool = False, compile: bool = True,
                      compile_cache: str = "", peak_flops: float = H200_BF16_PEAK) -> dict:
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    attention = attention if attention != "auto" else ("flex" if cuda else "sdpa")
    target = TINY if tiny or not cuda else QWEN3_8B
    if not cuda:
        seqs, seq_len, anchors, steps = 2, 256, 32, 2
    drafter = DrafterConfig(num_hidden_layers=5, block_size=16, num_anchors=anchors,
                            mask_token_id=target["vocab_size"] - 1, loss_chunk_tokens=loss_chunk)
    model = build_drafter(drafter, target).to(dev)
    n_ctx = len(model.target_layer_ids)
    h, vocab = target["hidden_size"], target["vocab_size"]
    head = FrozenTargetHead(torch.randn(vocab, h, dtype=torch.bfloat16, device=dev) * 0.02,
                            torch.randn(vocab, h, dtype=torch.bfloat16, device=dev) * 0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, fused=cuda)
    tokens = seqs * seq_len
    host = torch.randn(tokens, n_ctx * h, dtype=torch.bfloat16).pin_memory() if cuda else torch.randn(tokens, n_ctx * h)
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
    cache = use_compile_cache(compile_cache, "bench-drafter", {"drafter": asdict(drafter), "target": target,
                                                               "attention": attention}) if compile else None
    grad_err = None
    if check and cuda:  # flex has no CPU backward
        ctx, ids, mask = host.to(dev), ids_host.to(dev), mask_host.to(dev)
        grad_err = _grad_check(model, head, drafter, ctx, ids, mask, sample_anchors(mask, cu, anchors, gen), cuda)
    if compile:
        model.compile_layers()

    def step() -> tuple[float, ...]:
        t0 = sync()
        ctx = host.to(dev, non_blocking=True)
        ids, mask = ids_host.to(dev, non_blocking=True), mask_host.to(dev, non_blocking=True)
        t1 = sync()
        a = sample_anchors(mask, cu, anchors, gen)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
            hidden = model(ctx, ids, a, head, attention=attention, anchors_per_group=anchors_per_group)
            out = dflash_loss(hidden, a, ids, mask, head, drafter)
        t2 = sync()
        out.loss.backward()
        t3 = sync()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t4 = sync()
        step.anchors = a
        return t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0

    compile_s = sum(step()[-1] for _ in range(4))  # warm-up; the first steps compile (flex, layers, loss)
    phases = {"h2d_s": [], "forward_s": [], "backward_s": [], "optimizer_s": [], "step_s": []}
    for _ in range(steps):
        for k, v in zip(phases, step()):
            phases[k].append(v)
    a = step.anchors
    blocks = a.num_blocks
    visible = float((a.positions - a.seq_bounds()[0]).float().mean()) + drafter.block_size
    top = None
    if profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step(), step()
        top = _top_kernels(prof)
    mean = {k: sum(v) / len(v) for k, v in phases.items()}
    flops = step_flops(target, drafter.num_hidden_layers, n_ctx, tokens, blocks, drafter.block_size, visible)
    report = {
        "benchmark": "drafter",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(dev) if cuda else platform.processor() or "cpu",
        "torch": torch.__version__,
        "shape": {"hidden": h, "draft_layers": drafter.num_hidden_layers, "target_layers_fed": n_ctx,
                  "block_size": drafter.block_size, "anchors_per_seq": anchors, "seqs": seqs, "seq_len": seq_len,
                  "blocks_per_step": blocks, "vocab": vocab},
        "attention": attention,
        "anchors_per_group": anchors_per_group if attention == "sdpa" else None,
        "loss_chunk_tokens": loss_chunk,
        "compiled_layers": compile,
        "warmup_s": round(compile_s, 1),
        "compile_cache": None if cache is None else str(cache),
        "flex_vs_sdpa_grad_rel_err": None if grad_err is None else round(grad_err, 5),
        "step_split_s": {k: round(v, 4) for k, v in mean.items()},
        "sync_s": 0.0,  # one replica: no collective in the step
        "tokens_per_s": round(tokens / mean["step_s"], 1),
        "model_tflop_per_step": round(flops / 1e12, 2),
        "achieved_tflop_per_s": round(flops / mean["step_s"] / 1e12, 1),
        "peak_tflop_per_s": round(peak_flops / 1e12, 1),
        "mfu": round(flops / mean["step_s"] / peak_flops, 4),
        "peak_memory_gib": round(torch.cuda.max_memory_allocated(dev) / 2**30, 1) if cuda else None,
    }
    if top is not None:
        report["top_kernels_ms_per_step"] = top
    return report
