"""The ring's spec from a run's config: the few numbers the ring is made of, and what every process of the run
must agree on (Config.fingerprint_fields). Here, so that the ring package (common/ring/) imports no config."""

from __future__ import annotations

from dflash_ring.common.config.schema import Config
from dflash_ring.common.ring import RingSpec


def ring_spec(cfg: Config) -> RingSpec:
    return RingSpec.of(
        cfg.run.name,
        producers=cfg.topology.producers,
        consumers=cfg.topology.consumers,
        slots=cfg.ring.slots,
        slot_bytes=cfg.ring.slot_bytes,
        slot_header_bytes=cfg.ring.slot_header_bytes,
        lock_dir=cfg.run.lock_dir(),
        agreed=cfg.fingerprint_fields(),
        wait_s=cfg.ring.wait_s,
        pin=cfg.ring.pin,
        attach_timeout_s=cfg.run.attach_timeout_s,
    )
