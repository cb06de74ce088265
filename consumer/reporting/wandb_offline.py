"""W&B's offline run files read back: what a SIGKILLed drafter's W&B run kept.

wandb's core buffers a run's records and writes them to `run-<id>.wandb` every ~15 s and at finish, so a
drafter killed between two writes leaves its last steps out of its W&B run (seen here: a run killed after
1 s of logging left the 7-byte header alone). The record file has them, so the restarted drafter sends W&B the
steps it lacks; this module says which those are. wandb 0.31 has no Python reader for these files (only its Go
core reads them), so this reads the format: a LevelDB-style log (32 KiB blocks; chunks with a 7-byte header
of crc32c, length and type full/first/middle/last) after a 7-byte ":W&B" header, each record one of wandb's
own `wandb_internal_pb2.Record` protobuf messages.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

BLOCK, HEADER, CHUNK_HEADER = 32768, 7, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def run_file_records(path: Path) -> list[Any]:
    """Every whole record of one run file (a chunk torn by a kill ends the list)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B run file")
    out, pos, pending = [], HEADER, b""
    while pos + CHUNK_HEADER <= len(data):
        if BLOCK - pos % BLOCK < CHUNK_HEADER:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + CHUNK_HEADER])
        if kind == 0:  # zeros to the block's end
            pos += BLOCK - pos % BLOCK
            continue
        chunk, pos = data[pos + CHUNK_HEADER : pos + CHUNK_HEADER + length], pos + CHUNK_HEADER + length
        if len(chunk) < length:
            break
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
    return out


def offline_runs(wandb_dir: Path, run_id: str = "*") -> list[tuple[Any | None, list[dict[str, Any]]]]:
    """Each offline run directory of `run_id` under `wandb_dir`, oldest first: its run record (None if the file
    kept none) and its history rows (key -> value, `_step` among them)."""
    runs = []
    for f in sorted(wandb_dir.glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")):
        records = run_file_records(f)
        run = next((r.run for r in records if r.WhichOneof("record_type") == "run"), None)
        rows = [
            {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
            for r in records
            if r.WhichOneof("record_type") == "history"
        ]
        runs.append((run, rows))
    return runs


def last_step(wandb_dir: Path, run_id: str) -> int:
    """The newest step any offline file of this run kept (0: none)."""
    return max((int(row.get("_step", 0)) for _, rows in offline_runs(wandb_dir, run_id) for row in rows), default=0)
