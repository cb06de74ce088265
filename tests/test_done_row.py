"""Issue 46, goal 2 (ownership that a plausible write cannot fake), a producer's DONE: the supervisor ended a run after
20 of 76 batches when a same-user write set a live producer's row to DONE, because it counted the status word alone.
A finished producer's DONE now states the end of its plan in the row (its cursor at (epochs, 0): ProcessTable.
mark_done), and the supervisor counts only DONE rows that say so; the others are named once and the run waits."""

from __future__ import annotations

import logging
import os

from dflash_ring.common.config.load import load_config
from dflash_ring.common.layout import Role, RowStatus
from dflash_ring.common.lifecycle.startup import Startup
from dflash_ring.common.ring import Ring
from dflash_ring.common.ring_spec import ring_spec
from dflash_ring.supervisor.supervisor import Supervisor


def test_a_done_row_short_of_its_plans_end_is_not_counted_and_is_named_once(tmp_path, caplog):
    cfg = load_config(
        None,
        [
            f"run.name=done{os.getpid()}",
            f"run.run_dir={tmp_path}",
            "ring.slots=2",
            "ring.slot_bytes=8192",
            "ring.slot_header_bytes=4096",
            "topology.producers=2",
            "topology.consumers=1",
            "data.epochs=3",
        ],
    )
    Ring.unlink(cfg.run.name)
    try:
        with Ring.create(ring_spec(cfg)) as ring:
            supervisor = Supervisor(cfg, Startup("supervisor"))
            for i in (0, 1):
                ring.take_row(ring.row_of(Role.PRODUCER, i), Role.PRODUCER, i)
            first, second = (ring.producer(ring.row_of(Role.PRODUCER, i)) for i in (0, 1))
            first.publish(first.try_acquire(), cursor=(1, 4))  # mid-shard: epoch 1 of 3
            ring.set_row_status(first.row, RowStatus.DONE)  # the stray write
            ring.set_row_status(second.row, RowStatus.DONE)  # and one into a row that never published
            with caplog.at_level(logging.ERROR):
                assert supervisor.producers_done(ring) == 0
                assert supervisor.producers_done(ring) == 0
            named = [r.getMessage() for r in caplog.records if "says DONE" in r.getMessage()]
            assert named == [
                "producer 0's row says DONE but its cursor is epoch 1 position 4, short of its plan's end (epoch 3): "
                "not counted as done; the run waits for that shard",
                "producer 1's row says DONE but its cursor is absent, short of its plan's end (epoch 3): not counted "
                "as done; the run waits for that shard",
            ]
            first.done((3, 0))  # what a producer that finished its shard writes
            second.done((3, 0))  # one that resumed at the end and published nothing here
            assert supervisor.producers_done(ring) == 2
            assert ring.settled_resume(second.row) == ((3, 0), 0)  # its resume point: the end, never rolled back
    finally:
        Ring.unlink(cfg.run.name)
