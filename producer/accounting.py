"""A producer's account of each batch it publishes: the ring's commit, the ledger's record, the replay list's commit.

The mirror of the drafter's `ItemAccount` (consumer/training/accounting.py), in the one order a restart relies on:
`publish` moves the slot to READY and the producer's cursor in its row together (the ring's record wins over the
file's);
then the `pub` ledger record (reconcile's evidence that the batch was published: a SIGKILL between the two leaves
a published batch without its record, which reconcile counts, never a record without its batch); then the cursor
file and the replay list follow the ring's record (producer/live_replay.py).
"""

from __future__ import annotations

from dflash_ring.common.lifecycle.ledger import Ledger
from dflash_ring.common.lifecycle.ledger_events import Published
from dflash_ring.common.ring import ProducerPort, SlotWriter

from .batching import Batch
from .live_replay import LiveReplay


class PublishAccount:
    def __init__(self, port: ProducerPort, ledger: Ledger | None = None, replay: LiveReplay | None = None):
        self.port = port
        self.ledger = ledger  # run.ledger_dir: one record per published batch
        self.replay = replay  # the replay list the batches' `replayed` counts refer to, and the cursor file

    def publish(self, writer: SlotWriter, b: Batch) -> None:
        """Batch `b`, written into `writer`'s slot (its copy landed), published and recorded."""
        self.port.publish(writer, cursor=(b.cursor.epoch, b.cursor.position), replayed=b.replayed, tokens=b.num_tokens)
        if self.ledger is not None:
            self.ledger.write(Published(writer.item, b.epoch, b.position, replay=b.is_replay, eval=b.eval))
        if self.replay is not None:
            self.replay.commit(b.cursor.epoch, b.cursor.position, b.replayed)
