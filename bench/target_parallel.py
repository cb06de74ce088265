"""`dflash-ring bench target --tensor-parallel N`: a target sharded over an N-rank group, against one rank, same run.

The random-weight model of the shape is written once as safetensors (the group's ranks load through the producer's
own loading code, `from_pretrained(..., tp_plan="auto")`, so the weights must be on disk), then:

  (1) one rank: the unsharded target on the leader's device, forward tokens/s (skipped with --no-baseline, e.g. for
      a shape that does not fit one GPU);
  (2) the group (producer/tensor_group.py: NCCL on GPUs, gloo on the CPU): the conformance probe on the group,
      forward tokens/s, then the production loop into a real ring (bench/target.py's time_into_ring);

and reports the group's tokens/s per device against (1): 1.0 would be perfect scaling; below 1 is what the
all-reduces and the smaller GEMMs cost. On the CPU the ranks share the host's cores, so its figures measure the
protocol and the collectives' overhead, not a speed-up.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from dflash_ring.common.config.drafter import build_target_layer_ids
from dflash_ring.common.config.target import TargetConfig
from dflash_ring.producer.conformance import probe
from dflash_ring.producer.target import TargetModel, resolve_device, resolve_dtype
from dflash_ring.producer.tensor_group import TensorGroup

from .progress import progress
from .target_timing import host_info, synthetic_batches, time_forward, time_into_ring
from .target_shapes import SHAPES, model_class, shape_config


def save_random_target(shape: str, dtype: torch.dtype, directory: Path) -> Path:
    """The shape's random-weight causal LM (seed 0) as an HF model directory (built on the CPU, written as
    safetensors): what the group's ranks and the one-rank baseline load."""
    torch.manual_seed(0)
    model = model_class(SHAPES[shape][0])._from_config(shape_config(shape), dtype=dtype)
    model.save_pretrained(directory)
    del model
    return directory


def run_tensor_parallel_bench(
    *,
    shape: str,
    tensor_parallel: int,
    device: str | None = None,
    batches: int = 0,
    max_tokens: int = 0,
    draft_layers: int = 5,
    packed: bool = True,
    baseline: bool = True,
    workdir: str | None = None,
) -> dict[str, Any]:
    tiny = shape == "tiny"
    dev = resolve_device(device or "auto")
    dtype = resolve_dtype("auto", dev)
    text = shape_config(shape).get_text_config()
    batches = batches or (3 if tiny else 10)
    max_tokens = max_tokens or (2048 if tiny else 32768)
    max_length = min(max_tokens, 512 if tiny else 3072)
    warm_n = 1 if tiny else 2
    layer_ids = build_target_layer_ids(text.num_hidden_layers, draft_layers)
    made = synthetic_batches(
        warm_n + batches, max_tokens=max_tokens, max_length=max_length, vocab=text.vocab_size, packed=packed
    )
    warm, timed = made[:warm_n], made[warm_n:]
    tokens = sum(b.num_tokens for b in timed)
    root = Path(tempfile.mkdtemp(prefix="dflash-bench-tp-", dir=workdir))
    try:
        t0 = time.perf_counter()
        path = save_random_target(shape, dtype, root / shape)
        progress("target_tp", "saved", {"shape": shape, "save_s": round(time.perf_counter() - t0, 1)})
        cfg = TargetConfig(
            path=str(path),
            layer_ids=layer_ids,
            dtype=str(dtype).removeprefix("torch."),
            ship_final_hidden=False,
            packing="packed" if packed else "padded",
            tensor_parallel=tensor_parallel,
        )
        one = None
        if baseline:
            single = TargetModel.load(replace(cfg, tensor_parallel=1), dev, packed=packed)
            one_s = time_forward(single, warm, timed)
            one = {"tokens_per_s": round(tokens / one_s, 1)}
            progress("target_tp", "one_rank", one)
            del single
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        with TensorGroup.held(cfg, dev, contextlib.nullcontext) as group:
            t0 = time.perf_counter()
            target = TargetModel.load(cfg, dev, packed=False, group=group)
            load_s = time.perf_counter() - t0
            report = probe(target)
            target.use_packing(packed)
            progress("target_tp", "probe", {k: report.to_json()[k] for k in ("passed", "max_error", "first_bad_layer")})
            forward_s = time_forward(target, warm, timed)
            progress("target_tp", "forward", {"tokens_per_s": round(tokens / forward_s, 1)})
            ring_s, waited_s, slot_bytes = time_into_ring(target, warm, timed, max_tokens, slots=4 if tiny else 3)
            progress("target_tp", "ring", {"tokens_per_s": round(tokens / ring_s, 1)})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    group_rate = tokens / forward_s
    return {
        "benchmark": "target_tensor_parallel",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": host_info(dev),
        "method": "same process and samples: one rank unsharded (forward), then an N-rank group of the same weights "
        "sharded by transformers' tensor-parallel plan (probe, forward, into a real ring); tokens/s over "
        "the timed batches after warm-up",
        "model": {
            "shape": shape,
            "family": SHAPES[shape][0],
            "model_type": text.model_type,
            "dtype": str(dtype).removeprefix("torch."),
            "layer_ids": layer_ids,
            "layers_run": max(layer_ids) + 1,
        },
        "batches": {
            "timed": len(timed),
            "warmup": warm_n,
            "max_tokens": max_tokens,
            "packed": packed,
            "tokens": tokens,
        },
        "tensor_parallel": tensor_parallel,
        "backend": "nccl" if dev.type == "cuda" else "gloo",
        "group_load_s": round(load_s, 1),
        "probe": report.to_json(),
        "one_rank": one,
        "group_forward_tokens_per_s": round(group_rate, 1),
        "group_tokens_per_s_per_device": round(group_rate / tensor_parallel, 1),
        "ratio_per_device_over_one_rank": None
        if one is None
        else round(group_rate / tensor_parallel / one["tokens_per_s"], 3),
        "ratio_group_over_one_rank": None if one is None else round(group_rate / one["tokens_per_s"], 3),
        "ring_tokens_per_s": round(tokens / ring_s, 1),
        "ratio_ring_over_forward": round(forward_s / ring_s, 3),
        "ring": {"slot_bytes": slot_bytes, "wait_s": round(waited_s, 3)},
    }
