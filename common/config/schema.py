"""Run configuration: one TOML file shared by every process of a run.

Every field has a default, an unknown key is an error that names it, and
`--set section.key=value` overrides a field from the command line. The fields
that two processes must agree on (ring geometry, topology, drafter settings) form the config
fingerprint stored in the ring header, so a mismatched process is refused.
"""

from __future__ import annotations

import dataclasses
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from dflash_ring.common.config.paths import OutputDirectory, home_path, ReadPath
from dflash_ring.common.refusal import Refusal
from dflash_ring.common.config.ranges import PositiveSeconds, Range, Seconds
from dflash_ring.common.ownership import SecretFileError, group_secret
from dflash_ring.common.run_name import RunNameError, check_run_name
from dflash_ring.common.config.drafter import DrafterConfig
from dflash_ring.common.config.families import FAMILIES
from dflash_ring.common.config.train import TrainConfig
from dflash_ring.common.config.data import DataConfig
from dflash_ring.common.config.target import TargetConfig, TargetGeometry
from dflash_ring.common.config.regenerate import RegenerateConfig
from dflash_ring.common.config.tracking import TrackingConfig


class ConfigError(Refusal, ValueError):
    """A config file or override that cannot be used; the message says which key and why."""


MAX_PROCESSES = 4000  # producers + consumers of one run: each holds a row of the ring header


@dataclass
class RunConfig:
    name: str = "default"
    # Lock files live here; empty means /run/dflash-ring/<name> as root,
    # else $XDG_RUNTIME_DIR/dflash-ring/<name>, else /tmp/dflash-ring-<uid>/<name>.
    run_dir: OutputDirectory = ""
    # How long a producer or drafter waits for the supervisor to create the ring.
    attach_timeout_s: Seconds = 60.0
    # Empty: off. Else every process appends what it committed, consumed and trained to
    # <ledger_dir>/<role>-<index>.jsonl (common/lifecycle/ledger.py), e.g. for `dflash-ring chaos`.
    ledger_dir: OutputDirectory = ""
    # torch.compile caches (common/compile_cache.py), one directory per role and model config, so a restarted
    # process skips compiling; empty: torch's defaults under /tmp.
    compile_cache_dir: OutputDirectory = field(default_factory=lambda: home_path("~/.cache/dflash_ring/compile"))

    def lock_dir(self) -> Path:
        """run_dir, or the runtime root's directory named for the run: where its lock files live."""
        if self.run_dir:
            return Path(self.run_dir)
        return default_runtime_root() / self.name


@dataclass
class RingConfig:
    # Each slot has a word per state in the ring header; 4096 is far past any depth that pays (8 is the default).
    slots: Annotated[int, Range(1, 4096)] = 8
    # Below 1 TiB: a ring header naming a larger slot is refused by every reader (common/layout.py).
    slot_bytes: Annotated[int, Range(high=1 << 40, high_open=True)] = 64 * 1024 * 1024
    # Room at the start of each slot for its msgpack header: whole pages (a multiple of 4096, checked in validate).
    slot_header_bytes: Annotated[int, Range(low=4096)] = 64 * 1024
    # Longest sleep on a wake-up hint before a waiter looks at the ring again.
    wait_s: PositiveSeconds = 0.2
    # Register the mapping with CUDA (cudaHostRegister) when a GPU is present.
    pin: bool = True


@dataclass
class TopologyConfig:
    # Processes on one host, each with a row in the ring header; together at most MAX_PROCESSES (validate).
    producers: Annotated[int, Range(1, MAX_PROCESSES)] = 1
    consumers: Annotated[int, Range(1, MAX_PROCESSES)] = 2


@dataclass
class SupervisorConfig:
    reap_interval_s: PositiveSeconds = 0.5
    # After shutdown, how long to wait for every process to exit before removing the ring.
    exit_timeout_s: Seconds = 60.0
    # A running producer or drafter whose heartbeat has not moved for this long is named in the log (pid, how long),
    # again every minute while it stays silent (supervisor/silence.py).
    silent_after_s: PositiveSeconds = 30.0


@dataclass
class MetricsConfig:
    """Each process serves Prometheus /metrics on bind:port, so one scrape config covers a host.

    Ports: supervisor = port_base, target (producer) i = port_base + 1 + i,
    drafter j = port_base + 100 + j, `dflash-ring regenerate` = port_base + 200. Fixed
    offsets let the scrape config and the systemd units name every port without asking
    the run. The default bind is loopback: metrics say nothing secret, but exposure is the
    operator's choice.
    """

    enabled: bool = True
    bind: str = "127.0.0.1"
    port_base: Annotated[int, Range(1, 65535)] = 9460


@dataclass
class GroupConfig:
    """Drafter replicas on several hosts (consumer/training/replica_group.py); empty rendezvous: this host only."""

    # "tcp://host:port" of the rendezvous store every host's drafter leader connects to.
    rendezvous: str = ""
    # This host's supervisor serves the rendezvous store (set on exactly one host).
    serve: bool = False
    # Hosts expected: a group forms as soon as this many leaders are there (0: whoever arrives within settle_s).
    hosts: int = 0
    # A forming group closes once no leader has arrived for this long.
    settle_s: PositiveSeconds = 5.0
    # Longest wait on another host (collective, rendezvous) before it is dropped from the group.
    timeout_s: PositiveSeconds = 300.0
    # This host's name in logs and errors; empty: <hostname>/<run.name>.
    host_name: str = ""
    # Shared secret (same bytes on every host, a file of ours with mode 0600): every value the group writes
    # to the store is signed with it, so a client without it can neither join nor change the group.
    # Required with a rendezvous; make one with `head -c 32 /dev/urandom > F && chmod 600 F`. Read and checked by
    # common/ownership.py `group_secret`.
    secret_file: ReadPath = ""


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    ring: RingConfig = field(default_factory=RingConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)
    data: DataConfig = field(default_factory=DataConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    group: GroupConfig = field(default_factory=GroupConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    # `dflash-ring regenerate` only: not in the fingerprint (no ring process reads it).
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)
    # Where the drafters' curves go; not in the fingerprint (processes need not agree on it).
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        """The producers ship the target's final hidden state exactly when the drafter's objective reads it,
        unless target.ship_final_hidden says otherwise (refused when the objective needs it)."""
        needed = self.drafter.needs_target_logits
        if self.target.ship_final_hidden is None:
            self.target = dataclasses.replace(self.target, ship_final_hidden=needed)
        elif needed and not self.target.ship_final_hidden:
            raise ConfigError(
                f"drafter.kl_weight = {self.drafter.kl_weight} and drafter.label = "
                f"{self.drafter.label!r} read the target's distribution, but target.ship_final_hidden "
                "= false: remove that key (it then follows the drafter) or set it to true"
            )

    def validate(self) -> None:
        try:
            check_run_name(self.run.name, "run.name")
        except RunNameError as e:
            raise ConfigError(str(e)) from None
        r = self.ring
        if r.slot_header_bytes % 4096:
            raise ConfigError(f"ring.slot_header_bytes = {r.slot_header_bytes}: must be a multiple of 4096")
        if r.slot_bytes <= r.slot_header_bytes:
            raise ConfigError(
                f"ring.slot_bytes = {r.slot_bytes} leaves no room for tensors after "
                f"ring.slot_header_bytes = {r.slot_header_bytes}"
            )
        t = self.topology
        if t.producers + t.consumers > MAX_PROCESSES:
            raise ConfigError(
                f"topology.producers = {t.producers} and topology.consumers = {t.consumers}: at most "
                f"{MAX_PROCESSES} processes in all (each has a row in the ring header)"
            )
        m = self.metrics
        if m.enabled:
            if t.producers > 99:
                raise ConfigError(
                    f"topology.producers = {t.producers}: metrics ports of targets (port_base + 1 + i) "
                    "would run into the drafters' (port_base + 100 + j); set metrics.enabled = false"
                )
            if m.port_base > 65535 - 100 - t.consumers:
                raise ConfigError(
                    f"metrics.port_base = {m.port_base}: must leave room for port_base + 100 + "
                    f"{t.consumers - 1} below 65536 (topology.consumers = {t.consumers}); lower it "
                    "or set metrics.enabled = false"
                )

        g = self.group
        if g.rendezvous and not re.match(r"^tcp://([^\s/:\[\]]+|\[[0-9A-Fa-f:.]+\]):\d{1,5}$", g.rendezvous):
            raise ConfigError(f"group.rendezvous = {g.rendezvous!r}: expected tcp://host:port")
        if g.rendezvous and not 1 <= int(g.rendezvous.rsplit(":", 1)[1]) <= 65535:
            # 0 would have the store serve on a port the kernel picks, which no other host can know
            raise ConfigError(
                f"group.rendezvous = {g.rendezvous!r}: the port must be 1..65535, the one every host dials"
            )
        if g.serve and not g.rendezvous:
            raise ConfigError('group.serve = true needs group.rendezvous = "tcp://host:port" to listen on')
        if g.rendezvous:
            try:
                group_secret(g.secret_file)  # here, so a missing or exposed secret stops the run at start
            except SecretFileError as e:
                raise ConfigError(f"group.rendezvous = {g.rendezvous!r} needs the group's secret: {e}") from None

    def fingerprint_fields(self, target: TargetGeometry | None) -> dict[str, typing.Any]:
        """What every process of a run must agree on; stored in the ring header.

        `target`: the geometry of the target that target.path names (read from its config.json by
        common/ring_spec.run_fingerprint_fields), None without one; it joins in, so a drafter built for other
        features is refused by name when it attaches.
        """
        fields = {
            "run.name": self.run.name,
            # Where the run's processes hold their locks: liveness and the reaper look there, so a process
            # with another run_dir would look dead to them. Recorded here, anyone can find the run's users.
            "run.lock_dir": os.path.abspath(self.run.lock_dir()),
            "ring.slots": self.ring.slots,
            "ring.slot_bytes": self.ring.slot_bytes,
            "ring.slot_header_bytes": self.ring.slot_header_bytes,
            "topology.producers": self.topology.producers,
            "topology.consumers": self.topology.consumers,
        }
        # Drafter replicas average their weights: replicas of another shape or objective must not join (their
        # numeric format, drafter.precision, may differ: DrafterConfig.model_fields).
        fields |= {f"drafter.{k}": v for k, v in self.drafter.model_fields().items()}
        fields |= self.train_fingerprint_fields()
        if target is not None:
            fields |= target.fingerprint_fields()
        return fields

    def train_fingerprint_fields(self) -> dict[str, typing.Any]:
        """What exactly once and training depend on (issue 46), so that a restarted drafter or a warm standby taking
        a dead one's seat with other values is refused at attach, naming both: another train.checkpoint_dir would
        resume from step 0 in its own directory and seal the dead drafter's journal against nothing (producers and
        the supervisor read the journals there too, so they must agree as well); another optimizer or schedule
        would train on with it in silence. The replica group holds its hosts to the same settings
        (consumer/training/replica_group.py fingerprint_fields). Paths are absolute, betas as the trainer resolves
        them."""
        t = self.train
        return {
            "train.checkpoint_dir": os.path.abspath(t.checkpoint_dir),
            "train.lr": t.lr,
            "train.weight_decay": t.weight_decay,
            "train.betas": list(t.betas or (0.9, 0.95)),
            "train.grad_clip": t.grad_clip,
            "train.grad_accum": t.grad_accum,
            "train.warmup_ratio": t.warmup_ratio,
            "train.min_lr_ratio": t.min_lr_ratio,
            "train.total_steps": t.total_steps,
        }

    def tracking_dir(self) -> Path:
        """tracking.dir, or `tracking/` in the run's directory: the one that holds train.checkpoint_dir (where
        `dflash-ring run` also exports the drafter), so a run's curves sit beside its checkpoints."""
        if self.tracking.dir:
            return Path(self.tracking.dir)
        return Path(self.train.checkpoint_dir).parent / "tracking"


def drafter_target_settings(drafter: DrafterConfig, geometry: TargetGeometry) -> tuple[int, list[int]]:
    """The drafter's mask token and feature layers, resolved against the target's geometry (as
    common/target_geometry.target_geometry reads it), as every drafter process validates them before building
    anything: a refusal is a ConfigError (one line at the command's boundary), never a bare ValueError from deeper
    down."""
    mask = drafter.mask_token_id if drafter.mask_token_id is not None else geometry.mask_token_id
    if mask is None:
        raise ConfigError(
            "target.mask_token_id is unset: a drafter needs the target's <|MASK|> embedding row; set "
            "it in [target] to the target's first unused row (151669 for Qwen3), or, where every row is a token, "
            "to a reserved special token the data never contains (16 for SmolLM2); `dflash-ring check-target` "
            "names the candidates"
        )
    if not 0 <= mask < geometry.vocab_size:
        raise ConfigError(
            f"drafter.mask_token_id = {mask} is not a row of the {geometry.vocab_size}-row target "
            "embedding: set a row of it (or remove drafter.mask_token_id to use target.mask_token_id)"
        )
    # One source of truth for the features: the layers the producers capture.
    layer_ids = list(geometry.layer_ids)
    if drafter.target_layer_ids and list(drafter.target_layer_ids) != layer_ids:
        raise ConfigError(
            f"drafter.target_layer_ids {drafter.target_layer_ids} differs from the layers the "
            f"producers capture {layer_ids}: set target.layer_ids instead"
        )
    try:
        FAMILIES[drafter.arch].check_target(drafter, geometry)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return mask, layer_ids


def default_runtime_root() -> Path:
    if os.geteuid() == 0:
        return Path("/run/dflash-ring")
    if xdg := os.environ.get("XDG_RUNTIME_DIR"):
        return Path(xdg) / "dflash-ring"
    return Path(f"/tmp/dflash-ring-{os.getuid()}")
