"""A producer or consumer process with opaque payloads, for the ring's multi-process tests.

Each producer item carries a tensor whose every element encodes (producer, k),
so a consumer can tell a corrupted or misdelivered payload; both sides append
one line per item to a ledger file, which the tests reconcile.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from dflash_ring.common.config.load import load_config
from dflash_ring.common.layout import Role
from dflash_ring.common.lifecycle.membership import Membership
from dflash_ring.common.ring import Ring
from dflash_ring.common.ring_spec import ring_spec


def value_of(producer: int, k: int) -> float:
    return float(producer * 100_000 + k)


def produce(args: argparse.Namespace, ring: Ring, me: Membership, ledger) -> None:
    start, port = 0, ring.producer(me.row)
    if args.ring_cursor and (cursor := port.committed_cursor()) is not None:
        start = cursor[1]  # exact resume from the cursor committed with the last publish
    elif args.resume and Path(args.ledger).exists():
        # A restarted producer continues after the last item it published.
        lines = [ln.split() for ln in Path(args.ledger).read_text().splitlines() if ln.startswith("P ")]
        start = 1 + max((int(f[2]) for f in lines), default=-1)
    for k in range(start, args.items):
        w = port.acquire()
        if w is None:
            return  # drain or shutdown: stop taking work
        n = args.floats
        w.tensor("data", torch.float32, (n,)).fill_(value_of(args.index, k))
        w.tensor("ids", torch.int64, (2,)).copy_(torch.tensor([args.index, k]))
        w.meta = {"producer": args.index, "k": k, "epoch": 0, "position": k}  # identity: (epoch 0, position k)
        if args.hold_s and k == args.hold_at:
            Path(args.marker).write_text(str(w.item))
            time.sleep(args.hold_s)  # the test kills us here, mid-write
        port.publish(w, cursor=(0, k + 1) if args.ring_cursor else None)
        ledger.write(f"P {args.index} {k} {w.item}\n")
        ledger.flush()
        if args.delay_s:
            time.sleep(args.delay_s)
    while args.wait_file and not Path(args.wait_file).exists():
        time.sleep(0.05)  # the test looks at the live run first
    port.done((args.epochs, 0))


def consume(args: argparse.Namespace, ring: Ring, me: Membership, ledger) -> None:
    seen, port = 0, ring.consumer(me.row)
    while True:
        r = port.claim()
        if r is None:
            return  # shutdown: the only reason a consumer stops
        producer, k = (int(x) for x in r.tensors["ids"])
        data = r.tensors["data"]
        ok = r.meta == {"producer": producer, "k": k, "epoch": 0, "position": k} and bool(
            (data == value_of(producer, k)).all()
        )
        if args.hold_s and seen == args.hold_at:
            Path(args.marker).write_text(str(r.item))
            time.sleep(args.hold_s)  # the test kills us here, holding the slot
        deadline = time.monotonic() + args.work_s
        while time.monotonic() < deadline:  # working, and saying so, as a drafter's loop does
            me.heartbeat()
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
        item, deliveries = r.item, r.deliveries
        del data
        port.release(r)
        ledger.write(f"C {args.index} {producer} {k} {item} {deliveries} {'ok' if ok else 'BAD'}\n")
        ledger.flush()
        seen += 1


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["producer", "consumer"])
    p.add_argument("--config", required=True)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--ledger", required=True)
    p.add_argument("--items", type=int, default=10)
    p.add_argument("--floats", type=int, default=1024)
    p.add_argument("--delay-s", type=float, default=0.0)
    p.add_argument("--work-s", type=float, default=0.0)
    p.add_argument("--hold-at", type=int, default=-1)
    p.add_argument("--hold-s", type=float, default=0.0)
    p.add_argument("--marker", default="")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--ring-cursor", action="store_true", help="publish with a cursor; resume from the ring's")
    p.add_argument("--wait-file", default="", help="producer: before marking DONE, wait for this file")
    args = p.parse_args()
    cfg = load_config(args.config)
    role = Role.PRODUCER if args.role == "producer" else Role.CONSUMER
    with Ring.attach(ring_spec(cfg)) as ring:
        me = Membership.join(ring, cfg.run, role, args.index, journal_dir=cfg.train.checkpoint_dir)
        with open(args.ledger, "a") as ledger:
            args.epochs = cfg.data.epochs  # a producer's DONE states the end of its plan: (epochs, 0)
            (produce if role == Role.PRODUCER else consume)(args, ring, me, ledger)
        me.leave()
    return 0


if __name__ == "__main__":
    sys.exit(main())
