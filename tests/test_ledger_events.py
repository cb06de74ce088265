"""The ledger's typed events write the lines reconcile reads, byte for byte as each role wrote its own before."""

from __future__ import annotations

import json
import os
import stat

import pytest

from dflash_ring.common.lifecycle.ledger import Ledger, read_ledger
from dflash_ring.common.lifecycle.ledger_events import (
    BatchIdentity,
    CheckpointDurable,
    DrafterStart,
    Evaluated,
    Exited,
    Got,
    Intake,
    ProducerStart,
    Published,
    ShardDone,
    StartupDone,
    SupervisorStart,
    Trained,
    encode,
    is_one_of,
    kind,
    parse,
)

BATCH = BatchIdentity.of({"producer": 1, "epoch": 0, "position": 3, "tokens": 77})

# Each event with the line the roles wrote for it (pid 7, t 1.5) when each spelled its own.
LINES = [
    (SupervisorStart(123, 0), '{"ev":"start","pid":7,"t":1.5,"ring_created_ns":123,"adoptions":0}'),
    (
        ProducerStart([4, 4], [1, 0], [[0, 3]]),
        '{"ev":"start","pid":7,"t":1.5,"plan":[4,4],"resume":[1,0],"replay":[[0,3]]}',
    ),
    (
        ProducerStart([4], [0, 0], [], [[1, 2]]),
        '{"ev":"start","pid":7,"t":1.5,"plan":[4],"resume":[0,0],"replay":[],"eval":[[1,2]]}',
    ),
    (Published(5, 0, 3), '{"ev":"pub","pid":7,"t":1.5,"item":5,"epoch":0,"pos":3}'),
    (Published(5, 0, 3, replay=True), '{"ev":"pub","pid":7,"t":1.5,"item":5,"epoch":0,"pos":3,"replay":true}'),
    (Published(5, 0, 3, eval=True), '{"ev":"pub","pid":7,"t":1.5,"item":5,"epoch":0,"pos":3,"eval":true}'),
    (
        Published(5, 0, 3, replay=True, eval=True),
        '{"ev":"pub","pid":7,"t":1.5,"item":5,"epoch":0,"pos":3,"replay":true,"eval":true}',
    ),
    (Intake(["seg-1"], [[0, 1]]), '{"ev":"intake","pid":7,"t":1.5,"segments":["seg-1"],"replay":[[0,1]]}'),
    (ShardDone(), '{"ev":"done","pid":7,"t":1.5}'),
    (DrafterStart(0), '{"ev":"start","pid":7,"t":1.5,"step":0}'),
    (DrafterStart(12, took_over=42), '{"ev":"start","pid":7,"t":1.5,"step":12,"took_over":42}'),
    (DrafterStart(12, took_over=0), '{"ev":"start","pid":7,"t":1.5,"step":12,"took_over":0}'),  # a seat never run
    (Got(9, 2, BATCH), '{"ev":"got","pid":7,"t":1.5,"item":9,"deliveries":2,"producer":1,"epoch":0,"pos":3}'),
    (
        Trained(4, 9, 2, BATCH),
        '{"ev":"train","pid":7,"t":1.5,"step":4,"item":9,"deliveries":2,"producer":1,"epoch":0,"pos":3}',
    ),
    (
        Trained(4, 9, 2, BATCH, empty=True),
        '{"ev":"train","pid":7,"t":1.5,"step":4,"item":9,"deliveries":2,"producer":1,"epoch":0,"pos":3,"empty":true}',
    ),
    (
        Evaluated(4, 9, 1, BATCH),
        '{"ev":"eval","pid":7,"t":1.5,"step":4,"item":9,"deliveries":1,"producer":1,"epoch":0,"pos":3}',
    ),
    (CheckpointDurable(4, 10, 1.25), '{"ev":"ckpt","pid":7,"t":1.5,"step":4,"items":10,"snapshot_t":1.25}'),
    (Exited(4), '{"ev":"exit","pid":7,"t":1.5,"step":4}'),
    (
        StartupDone({"imports": 0.5, "config": 0.25}, 0.75),
        '{"ev":"startup","pid":7,"t":1.5,"phases":{"imports":0.5,"config":0.25},"total":0.75}',
    ),
]


@pytest.mark.parametrize(("event", "line"), LINES, ids=[f"{type(e).__name__}-{i}" for i, (e, _) in enumerate(LINES)])
def test_each_event_is_written_as_the_line_the_roles_wrote(event, line):
    assert encode(event, 7, 1.5) == (line + "\n").encode()
    record = parse(encode(event, 7, 1.5))
    assert record == json.loads(line)
    assert kind(record) == event.KIND and is_one_of(record, type(event))


def test_a_batch_identity_of_metadata_without_its_keys_is_written_as_nulls():
    """As the drafter wrote it: a slot whose metadata lacks a key still gets its record (reconcile reports it)."""
    assert encode(Got(1, 1, BatchIdentity.of({})), 7, 1.5) == (
        b'{"ev":"got","pid":7,"t":1.5,"item":1,"deliveries":1,"producer":null,"epoch":null,"pos":null}\n'
    )


def test_a_ledger_file_reads_back_what_was_written_and_counts_a_cut_line(tmp_path):
    path = tmp_path / "drafter-0.jsonl"
    ledger = Ledger(path)
    ledger.write(DrafterStart(0))
    ledger.write(Trained(1, 3, 1, BATCH))
    ledger.close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    with open(path, "ab") as f:
        f.write(b'{"ev":"train","pid":1,"t":1.0,"produ')  # what a SIGKILL in the middle of a write(2) cannot leave,
        f.write(b"\n[1, 2]\n")  # and damage: neither is a record
    read = read_ledger(path)
    assert read.cut_lines == 2
    assert [kind(r) for r in read.records] == ["start", "train"]
    assert {r["pid"] for r in read.records} == {os.getpid()}
    assert read.records[1] == {
        "ev": "train",
        "pid": os.getpid(),
        "t": read.records[1]["t"],
        "step": 1,
        "item": 3,
        "deliveries": 1,
        "producer": 1,
        "epoch": 0,
        "pos": 3,
    }


def test_a_ledger_that_is_not_a_regular_file_never_blocks_its_reader_or_writer(tmp_path):
    """Issue 46, the kind of a file: a FIFO under a ledger's name blocked `reconcile` (and the chaos ledger check) in
    open(), and a role opening its ledger for writing waited for a reader. The reader names it in one line; the
    writer keeps it aside (the damaged-file rule) and begins a new file. A line longer than any record is a cut line,
    read past without being held whole."""
    from dflash_ring.common.lifecycle.ledger import MAX_LINE_BYTES, LedgerFileError

    fifo = tmp_path / "target-0.jsonl"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(LedgerFileError, match="ledger .*target-0.jsonl is a FIFO"):
        read_ledger(fifo)
    ledger = Ledger(fifo)
    ledger.write(DrafterStart(0))
    ledger.close()
    assert stat.S_ISREG(fifo.stat().st_mode) and [kind(r) for r in read_ledger(fifo).records] == ["start"]
    assert [p.name for p in tmp_path.iterdir() if p.name != fifo.name and stat.S_ISFIFO(p.stat().st_mode)]
    with open(fifo, "ab") as f:
        f.write(b"x" * (3 * MAX_LINE_BYTES) + b"\n")
    ledger = Ledger(fifo)
    ledger.write(DrafterStart(1))
    ledger.close()
    read = read_ledger(fifo)
    assert read.cut_lines == 1 and [kind(r) for r in read.records] == ["start", "start"]
