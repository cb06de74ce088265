"""The ring's spec from a run's config: the few numbers the ring is made of, and what every process of the run
must agree on (run_fingerprint_fields). Here, so that the ring package (common/ring/) imports no config."""

from __future__ import annotations

from typing import Any

from dflash_ring.common.config.schema import Config, ConfigError
from dflash_ring.common.ring import RingSpec
from dflash_ring.common.target_geometry import target_geometry


def ring_spec(cfg: Config) -> RingSpec:
    return RingSpec.of(
        cfg.run.name,
        producers=cfg.topology.producers,
        consumers=cfg.topology.consumers,
        slots=cfg.ring.slots,
        slot_bytes=cfg.ring.slot_bytes,
        slot_header_bytes=cfg.ring.slot_header_bytes,
        lock_dir=cfg.run.lock_dir(),
        agreed=run_fingerprint_fields(cfg),
        wait_s=cfg.ring.wait_s,
        pin=cfg.ring.pin,
        attach_timeout_s=cfg.run.attach_timeout_s,
    )


def run_fingerprint_fields(cfg: Config) -> dict[str, Any]:
    """What every process of the run must agree on (Config.fingerprint_fields), with the geometry of the target
    that target.path names read from its config.json; a target it cannot read is a ConfigError naming why."""
    geometry = None
    if cfg.target.path:
        try:
            geometry = target_geometry(cfg.target)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return cfg.fingerprint_fields(geometry)
