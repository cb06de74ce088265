"""iceoryx2's zero-copy publish/subscribe as a peer in `bench ring` (optional extra `bench`).

Publish/subscribe hands every sample to every subscriber, so P->P is P services side by side,
each one publisher and one subscriber (the ring instead feeds any consumer from one pool of slots).
Lossless and bounded like the other peers: no safe overflow, and a publisher whose subscriber's
buffer is full retries until delivered (iceoryx2's RetryUntilDelivered). That holds only while
the subscriber is connected: from its first look at the service after the publisher exists, until
the publisher goes (see the workers). Depth: 4 samples in flight in all, as the ring has 4 slots
and the queues hold 4 items. A subscriber with nothing to receive blocks on an event service the
publisher notifies after each send, as ring consumers block on a semaphore.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import iceoryx2 as iox2

NOTE = (
    "iceoryx2 publish/subscribe (Slice[uint8], loaned sample written in place, sent; the subscriber "
    "copies it out): one service per producer/consumer pair, 4 samples in flight in all"
)
DEPTH = 4
WAIT = iox2.Duration.from_millis(50)


@dataclass(frozen=True)
class PairSpec:
    """What a worker process needs to open its pair's services: their names, and the prefix and root of the
    iceoryx2 instance they live in (the parent's `Services`)."""

    name: str
    nbytes: int
    buffer: int
    prefix: str
    root: str


def _node(prefix: str, root: str) -> iox2.Node:
    """A node of the bench's own iceoryx2 instance: its /dev/shm objects named `prefix...` (iceoryx2's default,
    `iox2_`, leaves a world-writable `iox2_*_global_mgmt` object behind for every user of the host) and its node and
    service files under `root`, both removed by `Services.close`."""
    iox2.set_log_level(iox2.LogLevel.Error)
    config = iox2.config.default()
    config.global_cfg.prefix = iox2.FileName.new(prefix)
    config.global_cfg.root_path = iox2.Path.new(root.rstrip("/") + "/")
    return iox2.NodeBuilder.new().config(config).create(iox2.ServiceType.Ipc)


def _pubsub(node: iox2.Node, spec: PairSpec):
    return (
        node.service_builder(iox2.ServiceName.new(spec.name))
        .publish_subscribe(iox2.Slice[ctypes.c_uint8])
        .enable_safe_overflow(False)
        .subscriber_max_buffer_size(spec.buffer)
        .subscriber_max_borrowed_samples(1)  # what a subscriber holds at once: its sample as it copies it out
        .history_size(0)
        .max_publishers(1)
        .max_subscribers(1)
    )


def _event(node: iox2.Node, spec: PairSpec):
    return node.service_builder(iox2.ServiceName.new(spec.name + ".sent")).event()


class Services:
    """Created by the parent before the workers start, so that workers only open them."""

    def __init__(self, prefix: str, pairs: int, nbytes: int):
        # An iceoryx2 instance of this bench alone: nothing of it is shared with another user of iceoryx2 on the
        # host, so all of it can go at close.
        self.prefix = f"iox2_dflash_{os.getpid()}_{time.monotonic_ns()}_"
        self.root = tempfile.mkdtemp(prefix="dflash-ring-iox2-")
        self._node = _node(self.prefix, self.root)
        self._specs = [
            PairSpec(f"{prefix}/{i}", nbytes, max(1, DEPTH // pairs), self.prefix, self.root) for i in range(pairs)
        ]
        self._held = [(_pubsub(self._node, s).create(), _event(self._node, s).create()) for s in self._specs]

    def spec(self, index: int) -> PairSpec:
        return self._specs[index]

    def close(self) -> None:
        """Drop the services, then remove what the instance left: its /dev/shm objects (the global management
        object iceoryx2 keeps past every process) and its root directory. Call once the workers have exited."""
        self._held.clear()
        del self._node
        for leftover in Path("/dev/shm").glob(f"{self.prefix}*"):
            leftover.unlink(missing_ok=True)
        shutil.rmtree(self.root, ignore_errors=True)


def producer(spec: PairSpec, items: int, ready, start, cpu, finish) -> None:
    src = np.full(spec.nbytes, 1, dtype=np.uint8)
    node = _node(spec.prefix, spec.root)
    publisher = (
        _pubsub(node, spec)
        .open()
        .publisher_builder()
        .initial_max_slice_len(spec.nbytes)
        .max_loaned_samples(1)  # one sample written at a time: a smaller data segment at 256 MB
        .backpressure_strategy(iox2.BackpressureStrategy.RetryUntilDelivered)
        .create()
    )
    notifier = _event(node, spec).open().notifier_builder().create()
    ready.put(spec.name)
    start.wait()
    publisher.update_connections()  # its subscriber exists now (it was ready): no sample may go to nobody
    c0 = time.process_time()
    for _ in range(items):
        sample = publisher.loan_slice_uninit(spec.nbytes)
        np.copyto(np.frombuffer(sample.payload().as_memory_view(), dtype=np.uint8), src)
        sample.assume_init().send()
        notifier.notify()
    cpu.put(time.process_time() - c0)
    finish.wait()  # samples a subscriber has not yet taken go with their publisher (its data segment)


def consumer(spec: PairSpec, items: int, ready, start, done, cpu) -> None:
    dst = np.empty(spec.nbytes, dtype=np.uint8)
    node = _node(spec.prefix, spec.root)
    subscriber = _pubsub(node, spec).open().subscriber_builder().create()
    listener = _event(node, spec).open().listener_builder().create()
    # Connect to the publisher (started first) before it sends: a publisher whose subscriber has not
    # connected yet drops what does not fit its buffer, RetryUntilDelivered or not.
    subscriber.has_samples()
    ready.put(spec.name)
    start.wait()
    c0 = time.process_time()
    received = 0
    while received < items:
        sample = subscriber.receive()
        if sample is None:
            listener.timed_wait(WAIT)
            continue
        np.copyto(dst, np.frombuffer(sample.payload().as_memory_view(), dtype=np.uint8))
        sample.delete()  # hands the sample back to the publisher now, not at garbage collection
        received += 1
    last = time.monotonic()
    cpu.put(time.process_time() - c0)
    done.put(last)
