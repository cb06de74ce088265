"""A target's forward timed alone and feeding a real ring, on synthetic batches: what `bench target`, its
tensor-parallel run (target_parallel.py) and `bench pipeline` measure a target with."""

from __future__ import annotations

import os
import platform
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

from dflash_ring.common.config.load import load_config
from dflash_ring.common.layout import Role
from dflash_ring.common.lifecycle.membership import Membership
from dflash_ring.common.ring import Ring
from dflash_ring.common.ring_spec import ring_spec
from dflash_ring.common.slot_contract import item_tensors
from dflash_ring.common.slot_format import ALIGN
from dflash_ring.producer.batching import Batch, ShardBatcher
from dflash_ring.producer.pretokenized import TokenizedData
from dflash_ring.producer.process import Loader, Producer, prepare, run_target
from dflash_ring.producer.target import TargetModel

HEADER_BYTES = 64 * 1024


def host_info(dev: torch.device) -> dict[str, Any]:
    """The machine a target bench ran on, for its JSON: CPU, library versions, the device's name."""
    return {
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
    }


def synthetic_batches(n: int, *, max_tokens: int, max_length: int, vocab: int, packed: bool) -> list[Batch]:
    """Log-normal lengths (median ~600 tokens for full size, a long tail cut at max_length), random ids."""
    rng = np.random.default_rng(0)
    median = min(600, max_length // 4)
    count = int(2 * n * max_tokens / median) + 16
    lengths = np.clip(rng.lognormal(np.log(median), 0.8, count), 16, max_length).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    data = TokenizedData(
        tokens=rng.integers(0, vocab, offsets[-1]).astype(np.int32),
        loss_mask=np.ones(offsets[-1], np.uint8),
        offsets=offsets,
        row_ids=np.arange(count, dtype=np.int64),
        num_rows=count,
        bad_rows=(),
        directory=Path("."),
        from_cache=False,
    )
    batcher = ShardBatcher(
        data, rank=0, world_size=1, max_tokens_per_batch=max_tokens, epochs=1, packing=packed, bucket_window=256
    )
    batches = []
    for batch in batcher.batches():
        batches.append(batch)
        if len(batches) == n:
            return batches
    raise RuntimeError(f"only {len(batches)} synthetic batches for the {n} asked")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def batch_loader(batches: list[Batch], target: TargetModel, device: torch.device) -> Loader:
    return Loader(iter(batches), lambda b: prepare(b, packed=target.packed, pad_id=0, pin=device.type == "cuda"))


def time_forward(target: TargetModel, warm: list[Batch], timed: list[Batch]) -> float:
    for prep in batch_loader(warm, target, target.device):
        run_target(target, prep)
    sync(target.device)
    t0 = time.perf_counter()
    for prep in batch_loader(timed, target, target.device):
        run_target(target, prep)
    sync(target.device)
    return time.perf_counter() - t0


def _release_all(cfg, stop: threading.Event, ready: threading.Event) -> None:
    """The consumer side: claim and release at once, so the ring is never the bottleneck by design."""
    with Ring.attach(ring_spec(cfg)) as ring:
        me = Membership.join(ring, cfg.run, Role.CONSUMER, 0, journal_dir=cfg.train.checkpoint_dir)
        port = ring.consumer(me.row)
        ready.set()
        while not stop.is_set():
            r = port.claim(timeout_s=0.2)
            if r is not None:
                port.release(r)
                del r
        me.leave()


def time_into_ring(
    target: TargetModel, warm: list[Batch], timed: list[Batch], max_tokens: int, slots: int
) -> tuple[float, float, int]:
    """(seconds for the timed batches, seconds blocked on a full ring, slot bytes)."""
    hidden = target.hidden_size if target.final_hidden else None
    specs = item_tensors(max_tokens, max_tokens, target.feature_width, hidden, target.dtype)
    slot_bytes = HEADER_BYTES + sum(-(-int(np.prod(s)) * d.itemsize // ALIGN) * ALIGN for _, d, s in specs)
    lock_dir = tempfile.mkdtemp(prefix="dflash-bench-target-")
    cfg = load_config(
        None,
        [
            f"run.name=bench-target-{os.getpid()}",
            f'run.run_dir="{lock_dir}"',
            f"ring.slots={slots}",
            f"ring.slot_bytes={slot_bytes}",
            f"ring.slot_header_bytes={HEADER_BYTES}",
            "ring.wait_s=0.05",
            "topology.producers=1",
            "topology.consumers=1",
        ],
    )
    Ring.unlink(cfg.run.name)
    owner = Ring.create(ring_spec(cfg))  # what the supervisor would do
    stop, ready = threading.Event(), threading.Event()
    consumer = threading.Thread(target=_release_all, args=(cfg, stop, ready), daemon=True)
    try:
        with Ring.attach(ring_spec(cfg), pin=target.device.type == "cuda") as ring:
            consumer.start()
            ready.wait(60)
            me = Membership.join(ring, cfg.run, Role.PRODUCER, 0, journal_dir=cfg.train.checkpoint_dir)
            producer = Producer(ring.producer(me.row), 0, target, stop=threading.Event())
            producer.run(batch_loader(warm, target, target.device))
            waited = producer.port.wait_seconds
            t0 = time.perf_counter()
            producer.run(batch_loader(timed, target, target.device))
            elapsed = time.perf_counter() - t0
            waited = producer.port.wait_seconds - waited
            me.leave()
    finally:
        stop.set()
        consumer.join(30)
        owner.close()
        Ring.unlink(cfg.run.name)
        shutil.rmtree(lock_dir, ignore_errors=True)
    return elapsed, waited, slot_bytes
