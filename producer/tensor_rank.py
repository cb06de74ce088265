"""One non-leader rank of a tensor-parallel target group (producer/tensor_group.py), started by its leader only.

It joins the group through the leader's store, loads its shard of the target, and mirrors the leader's forwards
until told to stop. It holds nothing of the run (no ring row, data or files), so its death needs no undoing: its
leader goes down with it and the group restarts as one. It beats (a file it touches every second) so its leader
can name it if it stops answering. Exits 0 on the leader's stop; dies with the leader.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from dflash_ring.common.target_geometry import target_geometry

from .target import TargetModel, load_sharded
from .tensor_group import JOIN_TIMEOUT, backend_for, die_with_leader, rank_target_config, serve_rank, start_beating


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dflash_ring.producer.tensor_rank", description=__doc__)
    p.add_argument("--store-file", required=True, help="the leader's rendezvous file (a FileStore)")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--device", required=True)
    p.add_argument("--leader", type=int, required=True, help="the leader's pid: this rank dies with it")
    p.add_argument("--target", required=True, help="the leader's target settings, as JSON")
    p.add_argument("--beat-file", required=True, help="touched every second: the leader names a rank that stops")
    args = p.parse_args(argv)
    die_with_leader(args.leader)
    start_beating(Path(args.beat_file))
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"%(asctime)s target-rank-{args.rank}[%(process)d] %(levelname)s %(name)s: %(message)s",
    )
    # systemd's stop (SIGTERM to the unit's every process) and a terminal's Ctrl-C reach the ranks too: the leader
    # finishes its batch, which needs them, then says stop; a leader's death kills them (PR_SET_PDEATHSIG).
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    cfg = rank_target_config(args.target)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.FileStore(args.store_file, cfg.tensor_parallel)
    store.set_timeout(JOIN_TIMEOUT)
    dist.init_process_group(
        backend_for(device), store=store, rank=args.rank, world_size=cfg.tensor_parallel, timeout=JOIN_TIMEOUT
    )
    model = load_sharded(cfg, device)
    target = TargetModel(
        model, list(target_geometry(cfg).layer_ids), final_hidden=bool(cfg.ship_final_hidden), packed=False
    )
    del model
    serve_rank(target, device)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
