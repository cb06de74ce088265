"""One "host leader" for the replica-group tests: a tiny model trained on random data, averaged every K steps.

Writes <out>/<host>.step (its step counter, after every step) and, after every
cross-host average, <out>/<host>/<gen>-<round>.safetensors (its parameters then),
so a test can compare two hosts' weights at the same group round.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from dflash_ring.common.config.schema import ConfigError, GroupConfig
from dflash_ring.consumer.training.replica_group import ReplicaGroup


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("host")
    ap.add_argument("--rendezvous", required=True)
    ap.add_argument("--secret", required=True)  # group.secret_file
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=10**9)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=4)  # stands for the drafter fields compared at rendezvous
    ap.add_argument("--step-sleep", type=float, default=0.02)
    ap.add_argument("--nan-at", type=int, default=0)  # this step's parameters turn NaN just before the average
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format=f"{args.host} %(levelname)s %(message)s")
    torch.manual_seed(sum(args.host.encode()))  # every host starts from different weights
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    locks = args.out / f"{args.host}.locks"
    locks.mkdir(parents=True, exist_ok=True)
    group = ReplicaGroup(
        GroupConfig(rendezvous=args.rendezvous, hosts=2, settle_s=2.0, timeout_s=20.0, secret_file=args.secret),
        args.host,
        0,
        model,
        locks,
        {"drafter.block_size": args.block_size},
        fresh=True,
    )
    dumps = args.out / args.host
    dumps.mkdir(exist_ok=True)

    def dump() -> None:
        if group.size > 1:
            save_file(
                {k: v.detach().clone() for k, v in model.state_dict().items()},
                str(dumps / f"{group.gen}-{group.round}.safetensors"),
            )

    try:
        group.start()
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr, flush=True)
        return 2
    dump()
    target = torch.nn.Linear(8, 8)
    for step in range(1, args.steps + 1):
        x = torch.randn(64, 8)
        loss = (model(x) - target(x).detach()).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        tmp = args.out / f"{args.host}.step.tmp"
        tmp.write_text(f"{step} {float(loss):.5f}\n")
        os.replace(tmp, args.out / f"{args.host}.step")
        if step == args.nan_at:
            with torch.no_grad():
                model[0].weight[0, 0] = float("nan")
            print(f"injected NaN at step {step}", file=sys.stderr, flush=True)
        if step % args.every == 0 and group.sync(step):
            dump()
        if (args.out / "stop").exists():
            break
        time.sleep(args.step_sleep)
    group.close()
    print(f"done at step {step}, {group.averages} averages", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
