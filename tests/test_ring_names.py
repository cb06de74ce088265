"""The segment module is the one home of a run's shared-memory names, and a RingSpec is all a ring is made from."""

from __future__ import annotations

import os

import pytest

from dflash_ring.common.config.load import load_config
from dflash_ring.common.layout import Role
from dflash_ring.common.ownership import semaphore_path
from dflash_ring.common.ring import ConfigMismatchError, Ring, RingSpec, fingerprint_digest
from dflash_ring.common.ring.segment import SHM_DIR, leftover_files, segment_files, semaphore_names
from dflash_ring.common.ring_spec import ring_spec, run_fingerprint_fields


def test_a_runs_leftovers_are_its_segment_and_semaphores_and_none_of_a_longer_names():
    run, longer = f"names{os.getpid()}", f"names{os.getpid()}x"
    spec = RingSpec.of(run, producers=1, consumers=1, slots=1, slot_bytes=8192, slot_header_bytes=4096)
    Ring.unlink(run)
    Ring.unlink(longer)
    try:
        with (
            Ring.create(spec),
            Ring.create(
                RingSpec.of(longer, producers=1, consumers=1, slots=1, slot_bytes=8192, slot_header_bytes=4096)
            ),
        ):
            assert set(leftover_files(run)) == {segment_files(run)[0], *map(semaphore_path, semaphore_names(run))}
            assert all(p.parent == SHM_DIR and p.exists() for p in leftover_files(run))
        assert Ring.unlink(run) and leftover_files(run) == []
        assert leftover_files(longer) != []  # removing one run leaves the other's names
    finally:
        Ring.unlink(run)
        Ring.unlink(longer)
    assert leftover_files(longer) == []


def test_a_spec_from_a_config_agrees_with_the_configs_fingerprint_and_a_bare_spec_records_no_lock_dir():
    cfg = load_config(
        None,
        [
            f"run.name=spec{os.getpid()}",
            "ring.slots=2",
            "ring.slot_bytes=8192",
            "ring.slot_header_bytes=4096",
            "topology.producers=2",
            "topology.consumers=3",
        ],
    )
    spec = ring_spec(cfg)
    assert dict(spec.fields) == run_fingerprint_fields(cfg)
    assert spec.fingerprint == fingerprint_digest(run_fingerprint_fields(cfg))  # what the tracker header names too
    assert (spec.geometry.n_slots, spec.geometry.n_rows) == (2, 6)
    bare = RingSpec.of(cfg.run.name, producers=2, consumers=3, slots=2, slot_bytes=8192, slot_header_bytes=4096)
    Ring.unlink(cfg.run.name)
    try:
        with Ring.create(bare) as ring:
            assert ring.lock_dir is None and ring.row_of(Role.CONSUMER, 2) == 5
            with pytest.raises(ConfigMismatchError, match="run.lock_dir: ring has '<unset>'"):
                ring.check(spec)
            ring.check(bare)
    finally:
        Ring.unlink(cfg.run.name)
