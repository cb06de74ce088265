"""Checkpoints off the training step: copy the state to host memory, write it on a thread.

An 8B-shaped drafter's checkpoint (fp32 weights and two AdamW moments) is ~14 GB; written in the step it
stalls training for the whole write, fsync and checksum. Here the step pays only for `HostSnapshot.take`:
the weights, moments and trainer tensors copied into host buffers allocated once (page-locked when the
model is on a GPU, so the copies run at PCIe speed on a side stream and overlap the next forward and
backward; the next optimizer step waits on the device for the copy, not the host). `BackgroundWriter` then
runs the one writer, `CheckpointStore.save`, on that copy: same files, same fsyncs, manifest, rename and
`latest`, so a SIGKILL mid-write leaves the previous checkpoint in place exactly as before.

The writer thread runs alongside training because what it spends its time in releases the GIL:
safetensors >= 0.8 writes from the tensors' memory without it (0.7 and earlier copy every tensor into a
Python bytes object holding it, which would stall the training thread), hashlib's sha256 releases it for
buffers over 2 KiB, and so do file reads, writes and fsync.

The host buffers cost as much memory as the checkpoint (14 GB per drafter at the 8B shape, page-locked).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dflash_ring.common.pinning import HostRegistration
from dflash_ring.consumer.training.checkpoint import (
    Checkpoint,
    CheckpointError,
    CheckpointStore,
    NonFiniteCheckpoint,
    optimizer_from_flat,
    optimizer_to_flat,
)

log = logging.getLogger(__name__)

ALIGN = 64  # every tensor's bytes start on a cache line of the one host buffer


class HostSnapshot:
    """Host copies of a checkpoint's tensors, in one buffer reused from checkpoint to checkpoint.

    `take` returns a Checkpoint whose tensors are views of the buffer and whose JSON parts (optimizer
    settings, consumed items, high-water marks) are frozen copies: all of it as of this moment, however the
    trainer moves on. On a GPU the copies are queued on a side stream after everything already queued, and
    `copied` is the event that marks their end: whoever writes the buffer waits for it, and the trainer's
    next optimizer step must too (`Trainer.hold_updates`). On the CPU the copies are done when `take` returns.
    The buffer is reused: take the next snapshot only once the previous one is written.
    """

    def __init__(self) -> None:
        self.copied: torch.cuda.Event | None = None
        self._layout: list[tuple[str, str, torch.dtype, tuple[int, ...]]] = []
        self._views: list[torch.Tensor] = []
        self._buffer: torch.Tensor | None = None
        self._pinned: HostRegistration | None = None
        self._stream: torch.cuda.Stream | None = None

    def take(self, ckpt: Checkpoint) -> Checkpoint:
        opt_tensors, opt_rest = optimizer_to_flat(ckpt.optimizer)
        groups = {"model": ckpt.model, "optimizer": opt_tensors, "tensors": ckpt.tensors}
        sources = [(g, k, v.detach()) for g, tensors in groups.items() for k, v in tensors.items()]
        layout = [(g, k, v.dtype, tuple(v.shape)) for g, k, v in sources]
        device = next((v.device for _, _, v in sources if v.is_cuda), None)
        if layout != self._layout:  # the first time, or the optimizer's state appeared since
            self._allocate(layout, pin=device is not None)
        if device is None:
            for dst, (_, _, src) in zip(self._views, sources):
                dst.copy_(src)
            self.copied = None
        else:
            if self._stream is None or self._stream.device != device:
                self._stream = torch.cuda.Stream(device)
            self._stream.wait_stream(torch.cuda.current_stream(device))  # after the step that made this state
            with torch.cuda.stream(self._stream):
                for dst, (_, _, src) in zip(self._views, sources):
                    dst.copy_(src, non_blocking=True)
            self.copied = torch.cuda.Event()
            self.copied.record(self._stream)
        host: dict[str, dict[str, torch.Tensor]] = {g: {} for g in groups}
        for (g, k, _), view in zip(sources, self._views):
            host[g][k] = view
        return Checkpoint(
            ckpt.step,
            host["model"],
            optimizer_from_flat(host["optimizer"], _frozen(opt_rest)),
            host["tensors"],
            _frozen(ckpt.info),
        )

    @property
    def nbytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()

    def _allocate(self, layout: list[tuple[str, str, torch.dtype, tuple[int, ...]]], pin: bool) -> None:
        self.close()
        offsets, total = [], 0
        for _, _, dtype, shape in layout:
            offsets.append(total)
            total += -(-math.prod(shape) * dtype.itemsize // ALIGN) * ALIGN
        t0 = time.perf_counter()
        self._buffer = torch.empty(total, dtype=torch.uint8)
        self._pinned = HostRegistration(self._buffer) if pin else None
        self._views = [
            self._buffer[o : o + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
            for o, (_, _, dtype, shape) in zip(offsets, layout)
        ]
        self._layout = layout
        log.info(
            "checkpoint snapshot buffer: %.2f GB in host memory%s, %.1f s",
            total / 1e9,
            " (page-locked)" if self._pinned is not None and self._pinned.pinned else "",
            time.perf_counter() - t0,
        )

    def close(self) -> None:
        if self._pinned is not None:
            self._pinned.close()
        self._buffer, self._pinned, self._views, self._layout = None, None, [], []


def _frozen(value: dict[str, Any]) -> dict[str, Any]:
    """A deep copy through JSON: what the trainer changes later is not in it, and what JSON cannot hold fails
    here, in the step, not in the writer."""
    return json.loads(json.dumps(value))


class BackgroundWriter:
    """`CheckpointStore.save` on a thread of its own, one write at a time.

    A write's error is kept and raised on the training thread (`check` after every step, `wait`), so a
    checkpoint that could not be written stops the drafter as a failed save in the step did, instead of
    vanishing with the thread. The thread is not a daemon: a process leaving by an exception still
    finishes the write in flight before it exits.
    """

    def __init__(self, store: CheckpointStore, keep: int):
        self.store, self.keep = store, keep
        self.step: int | None = None  # the checkpoint being written, or last written
        self._thread: threading.Thread | None = None
        self._error: Exception | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, ckpt: Checkpoint, copied: torch.cuda.Event | None, durable: Callable[[Path], None]) -> None:
        """Write `ckpt` (a HostSnapshot's, once `copied` has passed), then call `durable` with its directory."""
        self.wait()
        self.step = ckpt.step
        self._thread = threading.Thread(
            target=self._write, args=(ckpt, copied, durable), name=f"checkpoint-{ckpt.step}"
        )
        self._thread.start()

    def _write(self, ckpt: Checkpoint, copied: torch.cuda.Event | None, durable: Callable[[Path], None]) -> None:
        try:
            if copied is not None:
                copied.synchronize()
            self.store.save(ckpt, keep=self.keep, on_latest=durable)
        except Exception as e:  # raised on the training thread by check() or wait()
            self._error = e

    def check(self) -> None:
        """Raise the error of a write that failed."""
        if self._error is None:
            return
        e, self._error = self._error, None
        if isinstance(e, NonFiniteCheckpoint):  # not the disk's doing: its own line, and the drafter ends as diverged
            raise e
        raise CheckpointError(
            f"writing checkpoint step-{self.step:08d} under {self.store.root} failed "
            f"({type(e).__name__}: {e}): fix the cause (free space, permissions) and restart the "
            "drafter; it resumes from its last complete checkpoint"
        ) from e

    def wait(self) -> None:
        """Until the write in flight is durable (raises its error)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.check()
