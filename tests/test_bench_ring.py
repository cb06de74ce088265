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


@pytest.mark.processes
def test_the_iceoryx2_peer_leaves_nothing_in_dev_shm():
    """iceoryx2 keeps a world-writable `iox2_*_global_mgmt` object (and its services' segments) in /dev/shm past its
    processes: the peer gives its nodes a prefix and root of their own and removes them once measured. And the ring's
    own segment is created 0600 (shared memory only its user may map)."""
    from pathlib import Path

    from dflash_ring.bench import iceoryx2_peer
    from dflash_ring.bench.ring import _ring_spec
    from dflash_ring.common.ring import Ring, segment_name

    services = iceoryx2_peer.Services("dflash-ring-test", 1, TINY_BYTES)
    made = list(Path("/dev/shm").glob(f"{services.prefix}*"))  # its nodes' own objects, the global one among them
    services.close()
    assert any(p.name.endswith("global_mgmt") for p in made)
    assert list(Path("/dev/shm").glob(f"{services.prefix}*")) == [] and not Path(services.root).exists()

    def iceoryx2_objects() -> set[Path]:  # iceoryx2's own names only: tests beside this one make rings meanwhile
        return {p for p in Path("/dev/shm").iterdir() if p.name.startswith("iox2")}

    before = iceoryx2_objects()
    measure("iceoryx2", pairs=1, items=20, nbytes=TINY_BYTES)
    assert sorted(str(p) for p in iceoryx2_objects() - before) == []
    name = "bench-mode-test"
    Ring.unlink(name)
    with Ring.create(_ring_spec(name, 1, 1, TINY_BYTES)):
        assert (Path("/dev/shm") / segment_name(name).lstrip("/")).stat().st_mode & 0o777 == 0o600
    Ring.unlink(name)
