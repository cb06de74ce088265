"""`dflash-ring bench loader`: can one CPU core feed a target GPU?

Times the producer's data path from materialized token arrays to everything
but the features in the slot format (plan the epoch, cut token-budget
batches, build the forward's inputs, write ids, mask, boundaries and sample
ids into a ring slot), on one thread, and compares its tokens/s with the
target forward rate measured on the H200 (docs/benchmarks.md). The goal is
at least 10x, so the loader never starves the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from dflash_ring.common.arguments import at_least_one
from dflash_ring.common.ring import Ring, RingSpec
from dflash_ring.common.slot_contract import HOST_TENSORS, item_tensors
from dflash_ring.producer.batching import ShardBatcher
from dflash_ring.producer.pretokenized import TokenizedData
from dflash_ring.producer.process import prepare

H200_TARGET_TOKENS_PER_S = 33563.2  # Qwen3-8B-shaped forward, docs/bench-target-h200.json


def run_loader_bench(
    samples: int = 200_000,
    max_tokens: int = 32768,
    max_length: int = 3072,
    target_tokens_per_s: float = H200_TARGET_TOKENS_PER_S,
) -> dict:
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(600), 0.8, samples), 16, max_length).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    data = TokenizedData(
        tokens=rng.integers(0, 151936, offsets[-1]).astype(np.int32),
        loss_mask=np.ones(offsets[-1], np.uint8),
        offsets=offsets,
        row_ids=np.arange(samples, dtype=np.int64),
        num_rows=samples,
        bad_rows=(),
        directory=Path("."),
        from_cache=False,
    )
    spec = RingSpec.of(
        f"bench-loader-{os.getpid()}", producers=1, consumers=1, slots=1, slot_bytes=2097152, slot_header_bytes=65536
    )
    Ring.unlink(spec.run)
    with Ring.create(spec) as ring:
        port = ring.producer(1)
        t0 = time.perf_counter()
        batcher = ShardBatcher(data, rank=0, world_size=1, max_tokens_per_batch=max_tokens, epochs=1)
        tokens = batches = 0
        for batch in batcher.batches():
            prepare(batch, packed=True, pad_id=0, pin=False)
            w = port.try_acquire()
            for name, dtype, shape in item_tensors(batch.num_tokens, len(batch.lengths), 0, None, torch.float32):
                if name in HOST_TENSORS:
                    w.tensor(name, dtype, shape).copy_(torch.from_numpy(getattr(batch, name)))
            port.abort(w)
            tokens += batch.num_tokens
            batches += 1
        seconds = time.perf_counter() - t0
        del w
    Ring.unlink(spec.run)
    rate = tokens / seconds
    return {
        "benchmark": "loader",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "threads": 1,
        "samples": samples,
        "batches": batches,
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "loader_tokens_per_s": round(rate),
        "target_tokens_per_s": target_tokens_per_s,
        "ratio_loader_over_target": round(rate / target_tokens_per_s, 1),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`dflash-ring bench loader`'s own options (cli.py registers every bench by name, and hands it the rest)."""
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--samples", type=at_least_one, default=200_000)


def main(args: argparse.Namespace) -> int:
    print(json.dumps(run_loader_bench(args.samples), indent=2))
    return 0
