"""`bench ring`'s iceoryx2 peer moves every item between real processes and reports times."""

from __future__ import annotations

import pytest

from dflash_ring.bench.ring import TINY_BYTES, measure


@pytest.mark.processes
def test_iceoryx2_peer_delivers_every_item_of_two_pairs():
    # Each consumer returns only after receiving all of its publisher's items, so a lost or
    # dropped sample (a publisher that sends before it sees its subscriber, or exits before its
    # subscriber took its last samples) hangs the measurement.
    wall_s, cpu_s = measure("iceoryx2", pairs=2, items=500, nbytes=TINY_BYTES)
    assert wall_s > 0 and cpu_s > 0
