"""`dflash-ring bench checkpoint`: what a checkpoint costs the training step, written in the step against
written in the background (train.async_checkpoints), measured in one run.

The drafter (the Qwen3-8B shape of `bench drafter` on a GPU, `--tiny` or no GPU: a small one) trains
through the drafter process's own Trainer and checkpoint policy (consumer/training/checkpoint_policy.py `Checkpoints`),
one host-to-device batch copy per step as the prefetcher does. In order:

1. steps without a checkpoint: the baseline step time;
2. a checkpoint written in the step: all of its time is on the critical path;
3. the background snapshot's host buffer allocated (and page-locked on a GPU): once per process, reported
   alone; then the snapshot copy synchronized at its end, what the step would pay if it waited for the copy
   instead of holding only the next optimizer step until it has passed;
4. a background checkpoint: the time `save` takes in the step, then training steps until the write is
   durable. Their excess over the baseline (the copy the next optimizer step waits for, the writer's
   CPU, memory and PCIe traffic) is added to the critical path;
5. steps after the write: the baseline again, to show drift; then the background checkpoint is loaded and
   checked against the state cloned just before it was taken (`background_checkpoint_matches_its_step`: on
   a GPU this is the check of the side-stream copy and of the optimizer step held until it has passed).

Each checkpoint's critical path is reported as a fraction of `--every` baseline steps (2% is the goal).
The checkpoints go to a fresh directory under `--dir` (removed at the end); its filesystem is reported:
a tmpfs there measures memory, not a disk. Each measurement also goes to stderr as soon as it is made
(bench/progress.py), so a run cut off by a time limit keeps it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import safetensors
import torch

from dflash_ring.bench.drafter import bench_target
from dflash_ring.bench.progress import progress
from dflash_ring.common.arguments import at_least_one, output_directory
from dflash_ring.common.config.drafter import DrafterConfig
from dflash_ring.common.config.train import TrainConfig
from dflash_ring.common.lifecycle.trained_journal import Journal
from dflash_ring.consumer.training.checkpoint import Checkpoint, CheckpointStore, optimizer_to_flat
from dflash_ring.consumer.training.checkpoint_policy import Checkpoints
from dflash_ring.consumer.modeling.model import FrozenTargetHead, cu_seqlens_from_lengths
from dflash_ring.consumer.families.build import build_drafter
from dflash_ring.consumer.training.trainer import DeviceBatch, Trainer


def run_checkpoint_bench(tiny: bool = False, every: int = 100, steps: int = 10, directory: str | None = None) -> dict:
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    big = cuda and not tiny
    target = bench_target("qwen3-8b", tiny=not big)
    seqs, seq_len, anchors = (4, 3072, 512) if big else (2, 256, 32)
    h, vocab = target["hidden_size"], target["vocab_size"]
    drafter = DrafterConfig(num_hidden_layers=5, block_size=16, num_anchors=anchors, mask_token_id=vocab - 1)
    torch.manual_seed(0)
    with torch.device(dev):  # initialised where it trains, as the drafter process does
        model = build_drafter(drafter, target)
    dtype = torch.bfloat16 if cuda else torch.float32
    head = FrozenTargetHead(
        torch.randn(vocab, h, dtype=dtype, device=dev) * 0.02, torch.randn(vocab, h, dtype=dtype, device=dev) * 0.02
    )
    trainer = Trainer(model, head, drafter, TrainConfig(total_steps=100_000), dev)
    n_ctx = len(model.target_layer_ids)
    tokens = seqs * seq_len
    features = torch.randn(tokens, n_ctx * h, dtype=dtype)
    features = features.pin_memory() if cuda else features
    ids = torch.randint(0, vocab - 1, (tokens,))
    mask = torch.arange(tokens) % seq_len >= seq_len // 4  # a prompt quarter in every sample
    cu = cu_seqlens_from_lengths([seq_len] * seqs)

    def step() -> float:
        t0 = time.perf_counter()
        batch = DeviceBatch(
            features.to(dev, non_blocking=True),
            ids.to(dev),
            mask.to(dev),
            cu.to(dev),
            meta={"producer": 0, "epoch": 0, "position": trainer.step},
        )
        trainer.train_step(batch, 100_000)  # returns the loss as a float: the step has finished on the device
        return time.perf_counter() - t0

    def state() -> dict:
        return {
            "consumed": {"0": [0, trainer.step]},
            "items": trainer.step,
            "drafter": asdict(drafter),
            "target_config": target,
        }

    root = Path(tempfile.mkdtemp(prefix="bench-checkpoint-", dir=directory))
    try:
        warmup_s = sum(step() for _ in range(4 if big else 2))  # the first steps compile; the moments appear
        progress("checkpoint", "warmup", {"warmup_s": round(warmup_s, 1)})
        before = [step() for _ in range(steps)]
        progress("checkpoint", "before", {"step_s": round(statistics.fmean(before), 4)})

        in_step = Checkpoints(
            CheckpointStore(root / "in-step"),
            every,
            1,
            state,
            trainer,
            _journal(root, "in-step"),
            None,
            background=False,
        )
        t0 = time.perf_counter()
        in_step.save()
        sync_s = time.perf_counter() - t0
        nbytes = _bytes(root / "in-step")
        progress(
            "checkpoint",
            "in_step",
            {
                "checkpoint_bytes": nbytes,
                "critical_path_s": round(sync_s, 3),
                "write_gb_per_s": round(nbytes / sync_s / 1e9, 2),
            },
        )
        shutil.rmtree(root / "in-step")  # one checkpoint on the disk at a time

        background = Checkpoints(
            CheckpointStore(root / "background"), every, 1, state, trainer, _journal(root, "background"), None
        )
        snapshot = background.snapshot
        first_s = _synchronized_snapshot(snapshot, trainer)  # allocates and page-locks the buffer
        synchronized_s = _synchronized_snapshot(snapshot, trainer)
        progress(
            "checkpoint",
            "snapshot",
            {
                "host_buffer_bytes": snapshot.nbytes,
                "first_snapshot_s": round(first_s, 3),
                "snapshot_synchronized_s": round(synchronized_s, 3),
            },
        )
        expected = _state_tensors(trainer.state({}))  # on the device: checked against what was written
        started, t0 = time.time(), time.perf_counter()
        background.save()
        snapshot_s = time.perf_counter() - t0
        during = []
        while background.writer.busy:
            during.append(step())
        background.wait()
        # Until `latest` moved (its mtime; the loop above sees the end only at a step boundary).
        write_s = (root / "background" / "latest").stat().st_mtime - started
        # The same state either way; only the metadata's `snapshot_t` (a float whose printed digits vary) may differ.
        assert abs(_bytes(root / "background") - nbytes) < 64, (_bytes(root / "background"), nbytes)
        progress(
            "checkpoint",
            "background",
            {
                "snapshot_s": round(snapshot_s, 4),
                "write_s": round(write_s, 2),
                "write_gb_per_s": round(nbytes / write_s / 1e9, 2),
                "steps_during_write": len(during),
            },
        )
        after = [step() for _ in range(steps)]
        progress("checkpoint", "after", {"step_s": round(statistics.fmean(after), 4)})
        written = _state_tensors(CheckpointStore(root / "background").load_latest(fall_back=False))
        same = written.keys() == expected.keys() and all(torch.equal(written[k], v.cpu()) for k, v in expected.items())
    finally:
        shutil.rmtree(root, ignore_errors=True)

    base = statistics.fmean(before + after)
    interval = every * base
    interference = sum(during) - len(during) * base
    async_s = snapshot_s + interference
    return {
        "benchmark": "checkpoint",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(dev) if cuda else platform.processor() or "cpu",
        "torch": torch.__version__,
        "safetensors": safetensors.__version__,
        "shape": {
            "hidden": h,
            "draft_layers": drafter.num_hidden_layers,
            "seqs": seqs,
            "seq_len": seq_len,
            "anchors_per_seq": anchors,
            "vocab": vocab,
            "parameters": sum(p.numel() for p in model.parameters()),
        },
        "directory": str(root.parent),
        "filesystem": _filesystem(root.parent),
        # The background checkpoint holds the state of its step, though training went on during the copy and write.
        "background_checkpoint_matches_its_step": same,
        "checkpoint_bytes": nbytes,
        "host_buffer_bytes": snapshot.nbytes,
        "every_steps": every,
        "warmup_s": round(warmup_s, 1),
        "step_s": {
            "baseline": round(base, 4),
            "before": round(statistics.fmean(before), 4),
            "after": round(statistics.fmean(after), 4),
            "stdev": round(statistics.stdev(before + after), 4) if len(before + after) > 1 else 0.0,
            "during_background_write": round(statistics.fmean(during), 4) if during else None,
        },
        "in_step": {
            "critical_path_s": round(sync_s, 3),
            "write_gb_per_s": round(nbytes / sync_s / 1e9, 2),
            "fraction_of_interval": round(sync_s / interval, 5),
        },
        "background": {
            "first_snapshot_s": round(first_s, 3),  # once per process: the host buffer is allocated and pinned
            "snapshot_synchronized_s": round(synchronized_s, 3),
            "snapshot_s": round(snapshot_s, 4),
            "write_s": round(write_s, 2),
            "write_gb_per_s": round(nbytes / write_s / 1e9, 2),
            "steps_during_write": len(during),
            "interference_s": round(interference, 3),
            "critical_path_s": round(async_s, 3),
            "fraction_of_interval": round(async_s / interval, 5),
        },
        "background_vs_in_step_critical_path": round(async_s / sync_s, 4),
    }


def _journal(root: Path, name: str) -> Journal:
    """The trained-items journal a Checkpoints rotates, beside (not in) the store whose bytes are counted."""
    return Journal(root / f"journal-{name}", ring=0, after_step=0)


def _synchronized_snapshot(snapshot, trainer: Trainer) -> float:
    """A snapshot taken and waited for (nothing written): its copy's full time on the host."""
    t0 = time.perf_counter()
    snapshot.take(trainer.state({}))
    if snapshot.copied is not None:
        snapshot.copied.synchronize()
    return time.perf_counter() - t0


def _state_tensors(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    """The weights and optimizer moments of a checkpoint, cloned."""
    moments, _ = optimizer_to_flat(ckpt.optimizer)
    return {
        **{f"model.{k}": v.detach().clone() for k, v in ckpt.model.items()},
        **{f"optimizer.{k}": v.clone() for k, v in moments.items()},
    }


def _bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def _filesystem(path: Path) -> str:
    """The type and device of the mount holding `path` (from /proc/mounts; 'unknown' elsewhere)."""
    try:
        mounts = [line.split()[:3] for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return "unknown"
    real = os.path.realpath(path)
    inside = [m for m in mounts if real == m[1] or real.startswith(m[1].rstrip("/") + "/")]
    if not inside:
        return "unknown"
    device, mount, kind = max(inside, key=lambda m: len(m[1]))
    return f"{kind} {device} on {mount}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`dflash-ring bench checkpoint`'s own options (cli.py registers every bench by name, and hands it the rest)."""
    parser.add_argument("--tiny", action="store_true", help="a small shape (CPU smoke run)")
    parser.add_argument(
        "--every",
        type=at_least_one,
        default=100,
        help="steps between checkpoints (costs are reported as a fraction of this many steps)",
    )
    parser.add_argument(
        "--steps", type=at_least_one, default=10, help="baseline steps before and after the checkpoints"
    )
    parser.add_argument(
        "--dir",
        type=output_directory,
        default=None,
        help="where to write the checkpoints (a fresh directory in it, removed "
        "after; default: the system's temporary directory)",
    )


def main(args: argparse.Namespace) -> int:
    print(json.dumps(run_checkpoint_bench(args.tiny, args.every, args.steps, args.dir), indent=2))
    return 0
