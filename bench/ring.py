"""`dflash-ring bench ring`: our ring against the usual ways of moving tensors between processes.

Every transport does the same work per item: the producer copies a source
tensor into the transport, the consumer copies it out into a private buffer.
Throughput is bytes moved per second from the first put to the last get;
per-item overhead is measured separately with 4 KiB items, as wall time and as
the CPU time of the producer and consumer processes (which a machine shared
with other work disturbs far less). Ratios compare our ring to each peer
measured in the same invocation. The peers: multiprocessing.Queue,
torch.multiprocessing's queue, and iceoryx2's zero-copy publish/subscribe
(when the optional `bench` extra is installed).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import platform
import time
from datetime import datetime, timezone
from typing import Any

import numpy as np
import torch

from dflash_ring.common.arguments import non_negative
from dflash_ring.bench.progress import progress
from dflash_ring.common.host_bounds import available_memory
from dflash_ring.common.layout import Counter, Role
from dflash_ring.common.ring import Ring, RingSpec

MB = 1_000_000
TINY_BYTES = 4096


def _ring_spec(run: str, producers: int, consumers: int, nbytes: int) -> RingSpec:
    return RingSpec.of(
        run,
        producers=producers,
        consumers=consumers,
        slots=4,
        slot_bytes=nbytes + 8192,
        slot_header_bytes=4096,
        wait_s=0.05,
    )


def _seat(ring: Ring, role: Role, index: int) -> int:
    """The row of a bench process: taken, with no lock (no reaper watches a bench ring)."""
    row = ring.row_of(role, index)
    ring.take_row(row, role, index)
    return row


def _ring_producer(spec_args, index, items, nbytes, ready, start, cpu):
    torch.set_num_threads(1)
    src = torch.full((nbytes,), index, dtype=torch.uint8)
    with Ring.attach(_ring_spec(*spec_args)) as ring:
        row = _seat(ring, Role.PRODUCER, index)
        port = ring.producer(row)
        ready.put(index)
        start.wait()
        c0 = time.process_time()
        for _ in range(items):
            w = port.acquire()
            w.tensor("x", torch.uint8, (nbytes,)).copy_(src)
            port.publish(w)
            del w
        cpu.put(time.process_time() - c0)


def _ring_consumer(spec_args, index, nbytes, ready, start, done, cpu):
    torch.set_num_threads(1)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    with Ring.attach(_ring_spec(*spec_args)) as ring:
        row = _seat(ring, Role.CONSUMER, index)
        port = ring.consumer(row)
        ready.put(index)
        start.wait()
        c0 = time.process_time()
        last = time.monotonic()
        while (r := port.claim()) is not None:
            dst.copy_(r.tensors["x"])
            port.release(r)
            del r
            last = time.monotonic()  # the last get; the shutdown that ends the loop comes later
        cpu.put(time.process_time() - c0)
        done.put(last)


def _mpq_producer(q, index, items, nbytes, ready, start, cpu, sent):
    src = np.full(nbytes, index, dtype=np.uint8)
    ready.put(index)
    start.wait()
    c0 = time.process_time()
    for _ in range(items):
        q.put(src.copy())
    q.close()
    q.join_thread()  # every item is in the pipe before the sentinels go in behind them
    cpu.put(time.process_time() - c0)
    sent.put(index)


def _mpq_consumer(q, index, nbytes, ready, start, done, cpu):
    dst = np.empty(nbytes, dtype=np.uint8)
    ready.put(index)
    start.wait()
    c0 = time.process_time()
    while (a := q.get()) is not None:
        np.copyto(dst, a)
    cpu.put(time.process_time() - c0)
    done.put(time.monotonic())


def _tmp_producer(q, index, items, nbytes, ready, start, cpu, sent, finish):
    torch.set_num_threads(1)
    src = torch.full((nbytes,), index, dtype=torch.uint8)
    ready.put(index)
    start.wait()
    c0 = time.process_time()
    for _ in range(items):
        q.put(src.clone().share_memory_())
    q.close()
    q.join_thread()
    cpu.put(time.process_time() - c0)
    sent.put(index)
    finish.wait()  # a shared tensor's sender must outlive its receivers (torch.multiprocessing docs)


def _tmp_consumer(q, index, nbytes, ready, start, done, cpu):
    torch.set_num_threads(1)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    ready.put(index)
    start.wait()
    c0 = time.process_time()
    while (t := q.get()) is not None:
        dst.copy_(t)
        del t
    cpu.put(time.process_time() - c0)
    done.put(time.monotonic())


def measure(transport: str, pairs: int, items: int, nbytes: int) -> tuple[float, float]:
    """Wall seconds to move pairs*items items of nbytes from pairs producers to pairs consumers,
    and the CPU seconds those processes spent doing it."""
    ctx = mp.get_context("spawn")
    ready, done, sent, cpu, start, finish = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Event()
    total = pairs * items
    ring = services = None
    if transport == "ring":
        spec_args = (f"bench-{os.getpid()}", pairs, pairs, nbytes)
        Ring.unlink(spec_args[0])
        ring = Ring.create(_ring_spec(*spec_args))
        prod = [
            ctx.Process(target=_ring_producer, args=(spec_args, i, items, nbytes, ready, start, cpu))
            for i in range(pairs)
        ]
        cons = [
            ctx.Process(target=_ring_consumer, args=(spec_args, i, nbytes, ready, start, done, cpu))
            for i in range(pairs)
        ]
    elif transport == "iceoryx2":
        from dflash_ring.bench import iceoryx2_peer

        services = iceoryx2_peer.Services(f"dflash-ring-bench-{os.getpid()}-{time.monotonic_ns()}", pairs, nbytes)
        prod = [
            ctx.Process(target=iceoryx2_peer.producer, args=(services.spec(i), items, ready, start, cpu, finish))
            for i in range(pairs)
        ]
        cons = [
            ctx.Process(target=iceoryx2_peer.consumer, args=(services.spec(i), items, ready, start, done, cpu))
            for i in range(pairs)
        ]
    else:
        q = (torch.multiprocessing.get_context("spawn") if transport == "torch_mp_queue" else ctx).Queue(maxsize=4)
        if transport == "torch_mp_queue":
            pf, cf, extra = _tmp_producer, _tmp_consumer, (sent, finish)
        else:
            pf, cf, extra = _mpq_producer, _mpq_consumer, (sent,)
        prod = [ctx.Process(target=pf, args=(q, i, items, nbytes, ready, start, cpu, *extra)) for i in range(pairs)]
        cons = [ctx.Process(target=cf, args=(q, i, nbytes, ready, start, done, cpu)) for i in range(pairs)]
    procs = prod + cons
    try:
        for group in (prod, cons):  # producers first: an iceoryx2 subscriber connects to its publisher
            for p in group:
                p.start()
            for _ in group:
                ready.get(timeout=120)
        t0 = time.monotonic()
        start.set()
        if ring is not None:
            while ring.counter(Counter.CONSUMED) < total:
                time.sleep(0.005)
            ring.set_flag(Counter.SHUTDOWN)
            ring.broadcast()
        elif services is None:
            for _ in prod:
                sent.get(timeout=600)
            for _ in cons:  # FIFO queue: each consumer's sentinel comes after every item
                q.put(None)
        t1 = max(done.get(timeout=600) for _ in cons)
        cpu_s = sum(cpu.get(timeout=60) for _ in procs)
        finish.set()
        for p in procs:
            p.join(timeout=60)
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"{transport}: a worker failed: exit codes {[p.exitcode for p in procs]}")
        return t1 - t0, cpu_s
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        if ring is not None:
            ring.close()
            Ring.unlink(ring.identity.run_name)
        if services is not None:
            services.close()


def _items_for(nbytes: int, requested: int) -> int:
    if requested:
        return requested
    return max(4, min(200, int(2e9 // 2 // max(nbytes, 1))))  # ~1 GB per producer, 4-200 items


def _gpu_copy_cases(nbytes: int = 256 * 2**20, repeats: int = 10) -> dict[str, Any]:
    """GPU <-> slot copy rates: a registered ring slot against the same mapping unregistered and a
    pinned torch buffer, all in this run (the ring's reason to cudaHostRegister its mapping)."""
    spec = RingSpec.of(
        f"bench-gpu-{os.getpid()}", producers=1, consumers=1, slots=1, slot_bytes=nbytes + 8192, slot_header_bytes=4096
    )
    Ring.unlink(spec.run)
    dev = torch.device("cuda")
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=dev)

    def rate(fn) -> float:
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
        return round(repeats * nbytes / (time.perf_counter() - t0) / 1e9, 2)

    out: dict[str, Any] = {"bytes": nbytes, "device": torch.cuda.get_device_name(dev)}
    with Ring.create(spec) as ring:
        w = ring.producer(1).try_acquire()
        slot = w.tensor("x", torch.uint8, (nbytes,))
        out["unregistered_h2d_gb_per_s"] = rate(lambda: gpu.copy_(slot, non_blocking=True))
        out["unregistered_d2h_gb_per_s"] = rate(lambda: slot.copy_(gpu, non_blocking=True))
        t0 = time.perf_counter()
        from dflash_ring.common.pinning import HostRegistration

        reg = HostRegistration(ring.segment.tensor())
        out["register_s"] = round(time.perf_counter() - t0, 3)
        out["registered"] = reg.pinned
        out["slot_h2d_gb_per_s"] = rate(lambda: gpu.copy_(slot, non_blocking=True))
        out["slot_d2h_gb_per_s"] = rate(lambda: slot.copy_(gpu, non_blocking=True))
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        out["pinned_buffer_h2d_gb_per_s"] = rate(lambda: gpu.copy_(pinned, non_blocking=True))
        out["ratio_slot_over_unregistered_h2d"] = round(out["slot_h2d_gb_per_s"] / out["unregistered_h2d_gb_per_s"], 2)
        out["ratio_slot_over_pinned_h2d"] = round(out["slot_h2d_gb_per_s"] / out["pinned_buffer_h2d_gb_per_s"], 2)
        del slot, w
        reg.close()
    Ring.unlink(spec.run)
    progress("ring", "gpu_copies", out)
    return out


def run_ring_bench(sizes_mb: list[float], items: int = 0) -> dict[str, Any]:
    """The report below; each case's figures also go to stderr as soon as they are measured (bench/progress.py)."""
    transports = ["ring", "mp_queue_numpy", "torch_mp_queue"]
    try:
        from dflash_ring.bench.iceoryx2_peer import NOTE as iceoryx2_note

        transports.append("iceoryx2")
    except ImportError:  # an optional extra: pip install '.[bench]'
        iceoryx2_note = "iceoryx2 not installed (extra `bench`): not measured"
    cases = []
    for pairs in (1, 2):
        for size in sizes_mb + [TINY_BYTES / MB]:
            nbytes = int(size * MB)
            n = _items_for(nbytes, items) if nbytes > TINY_BYTES else 500
            row: dict[str, Any] = {"topology": f"{pairs}->{pairs}", "item_bytes": nbytes, "items": pairs * n}
            for t in transports:
                secs, cpu_s = measure(t, pairs, n, nbytes)
                row[t] = {
                    "gb_per_s": round(pairs * n * nbytes / secs / 1e9, 3),
                    "us_per_item": round(secs / (pairs * n) * 1e6, 1),
                    "cpu_us_per_item": round(cpu_s / (pairs * n) * 1e6, 1),
                }
                progress("ring", "case", {"topology": row["topology"], "item_bytes": nbytes, "transport": t, **row[t]})
            row["ratio_ring_over"] = {t: round(row["ring"]["gb_per_s"] / row[t]["gb_per_s"], 2) for t in transports[1:]}
            cases.append(row)
    return {
        "benchmark": "ring",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": {
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "method": "P producers copy a source tensor in, P consumers copy it out to a private buffer; "
        "GB/s = bytes moved / wall time from first put to last get; cpu_us_per_item = CPU time of "
        "the producer and consumer processes per item; 4 KiB rows give per-item overhead",
        "iceoryx2": iceoryx2_note,
        "cases": cases,
        "gpu_copies": _gpu_copy_cases() if torch.cuda.is_available() else "no CUDA device: not measured",
    }


# Copies of one item alive at once in the largest case (2 -> 2; one transport at a time): each producer's source
# and each consumer's destination, and the 4 items in flight (the ring's slots, or a queue's items) with the copy
# each side of a queue holds as it pickles or unpickles one.
COPIES_IN_MEMORY = 2 * 2 + 4 + 2 * 2


def item_sizes(text: str) -> list[float]:
    """--sizes-mb: comma-separated finite sizes > 0 whose largest case fits this host's free memory, checked before
    anything is created (-1 and nan were a traceback with the ring's semaphores left in /dev/shm)."""
    try:
        sizes = [float(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers of MB, got {text!r}") from None
    if bad := [s for s in sizes if not (math.isfinite(s) and s > 0)]:
        raise argparse.ArgumentTypeError(f"each size must be a finite number of MB > 0, got {bad[0]:g}")
    need = max(sizes) * MB * COPIES_IN_MEMORY
    if (have := available_memory("cpu")) is not None and need > have:
        raise argparse.ArgumentTypeError(
            f"{max(sizes):g} MB items need about {need / 2**30:.3g} GiB at once ({COPIES_IN_MEMORY} copies), "
            f"this host has {have / 2**30:.3g} GiB available"
        )
    return sizes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`dflash-ring bench ring`'s own options (cli.py registers every bench by name, and hands it the rest)."""
    parser.add_argument("--json", action="store_true", help="print the JSON report (the default output)")
    parser.add_argument("--sizes-mb", type=item_sizes, default="1,64,256", help="comma-separated item sizes in MB")
    parser.add_argument("--items", type=non_negative, default=0, help="items per case (0: scale with size)")


def main(args: argparse.Namespace) -> int:
    print(json.dumps(run_ring_bench(args.sizes_mb, args.items), indent=2))
    return 0
