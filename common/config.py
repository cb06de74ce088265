"""Run configuration: one TOML file shared by every process of a run.

Every field has a default, an unknown key is an error that names it, and
`--set section.key=value` overrides a field from the command line. The fields
that two processes must agree on (ring geometry, topology, drafter settings) form the config
fingerprint stored in the ring header, so a mismatched process is refused.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from dflash_ring.common.refusal import Refusal
from dflash_ring.common.bounded_read import CONFIG_BYTES, read_text
from dflash_ring.common.range_config import DEFAULT, PositiveSeconds, Range, Seconds, range_of, refusal
from dflash_ring.common.ownership import SecretFileError, group_secret
from dflash_ring.common.run_name import RunNameError, check_run_name
from dflash_ring.common.drafter_config import DrafterConfig
from dflash_ring.common.train_config import TrainConfig
from dflash_ring.common.data_config import DataConfig
from dflash_ring.common.target_config import TargetConfig
from dflash_ring.common.regenerate_config import RegenerateConfig
from dflash_ring.common.tracking_config import TrackingConfig


class ConfigError(Refusal, ValueError):
    """A config file or override that cannot be used; the message says which key and why."""


MAX_PROCESSES = 4000  # producers + consumers of one run: each holds a row of the ring header


@dataclass
class RunConfig:
    name: str = "default"
    # Lock files live here; empty means /run/dflash-ring/<name> as root,
    # else $XDG_RUNTIME_DIR/dflash-ring/<name>, else /tmp/dflash-ring-<uid>/<name>.
    run_dir: str = ""
    # How long a producer or drafter waits for the supervisor to create the ring.
    attach_timeout_s: Seconds = 60.0
    # Empty: off. Else every process appends what it committed, consumed and trained to
    # <ledger_dir>/<role>-<index>.jsonl (common/ledger.py), e.g. for `dflash-ring chaos`.
    ledger_dir: str = ""
    # torch.compile caches (common/compile_cache.py), one directory per role and model config, so a restarted
    # process skips compiling; empty: torch's defaults under /tmp.
    compile_cache_dir: str = "~/.cache/dflash_ring/compile"


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
    """Drafter replicas on several hosts (consumer/replica_group.py); empty rendezvous: this host only."""

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
    secret_file: str = ""


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
            raise ConfigError(f"drafter.kl_weight = {self.drafter.kl_weight} and drafter.label = "
                              f"{self.drafter.label!r} read the target's distribution, but target.ship_final_hidden "
                              "= false: remove that key (it then follows the drafter) or set it to true")

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
            raise ConfigError(f"topology.producers = {t.producers} and topology.consumers = {t.consumers}: at most "
                              f"{MAX_PROCESSES} processes in all (each has a row in the ring header)")
        m = self.metrics
        if m.enabled:
            if t.producers > 99:
                raise ConfigError(f"topology.producers = {t.producers}: metrics ports of targets (port_base + 1 + i) "
                                  "would run into the drafters' (port_base + 100 + j); set metrics.enabled = false")
            if m.port_base > 65535 - 100 - t.consumers:
                raise ConfigError(f"metrics.port_base = {m.port_base}: must leave room for port_base + 100 + "
                                  f"{t.consumers - 1} below 65536 (topology.consumers = {t.consumers}); lower it "
                                  "or set metrics.enabled = false")

        g = self.group
        if g.rendezvous and not re.match(r"^tcp://([^\s/:\[\]]+|\[[0-9A-Fa-f:.]+\]):\d{1,5}$", g.rendezvous):
            raise ConfigError(f"group.rendezvous = {g.rendezvous!r}: expected tcp://host:port")
        if g.serve and not g.rendezvous:
            raise ConfigError("group.serve = true needs group.rendezvous = \"tcp://host:port\" to listen on")
        if g.rendezvous:
            try:
                group_secret(g.secret_file)  # here, so a missing or exposed secret stops the run at start
            except SecretFileError as e:
                raise ConfigError(f"group.rendezvous = {g.rendezvous!r} needs the group's secret: {e}") from None

    def fingerprint_fields(self) -> dict[str, typing.Any]:
        """What every process of a run must agree on; stored in the ring header.

        With a target set, its geometry (read from its config.json) joins in, so a drafter
        built for other features is refused by name when it attaches.
        """
        fields = {
            "run.name": self.run.name,
            # Where the run's processes hold their locks: liveness and the reaper look there, so a process
            # with another run_dir would look dead to them. Recorded here, anyone can find the run's users.
            "run.lock_dir": os.path.abspath(self.lock_dir()),
            "ring.slots": self.ring.slots,
            "ring.slot_bytes": self.ring.slot_bytes,
            "ring.slot_header_bytes": self.ring.slot_header_bytes,
            "topology.producers": self.topology.producers,
            "topology.consumers": self.topology.consumers,
        }
        # Drafter replicas average their weights: replicas of another shape or objective must not join (their
        # numeric format, drafter.precision, may differ: DrafterConfig.model_fields).
        fields |= {f"drafter.{k}": v for k, v in self.drafter.model_fields().items()}
        if self.target.path:
            try:
                fields |= self.target.geometry().fingerprint_fields()
            except ValueError as e:
                raise ConfigError(str(e)) from None
        return fields

    def tracking_dir(self) -> Path:
        """tracking.dir, or `tracking/` in the run's directory: the one that holds train.checkpoint_dir (where
        `dflash-ring run` also exports the drafter), so a run's curves sit beside its checkpoints."""
        if self.tracking.dir:
            return Path(self.tracking.dir)
        return Path(self.train.checkpoint_dir).parent / "tracking"

    def lock_dir(self) -> Path:
        if self.run.run_dir:
            return Path(self.run.run_dir)
        return default_runtime_root() / self.run.name


def drafter_target_settings(drafter: DrafterConfig, target: TargetConfig) -> tuple[int, list[int]]:
    """The drafter's mask token and feature layers, resolved against the target (its config.json's geometry),
    as every drafter process validates them before building anything: a refusal is a ConfigError (one line at
    the command's boundary), never a bare ValueError from deeper down."""
    geometry = target.geometry()  # a target it cannot read: its own TargetConfigError
    mask = drafter.mask_token_id if drafter.mask_token_id is not None else target.mask_token_id
    if mask is None:
        raise ConfigError("target.mask_token_id is unset: a drafter needs the target's <|MASK|> embedding row; set "
                          "it in [target] to the target's first unused row (151669 for Qwen3)")
    if not 0 <= mask < geometry.vocab_size:
        raise ConfigError(f"drafter.mask_token_id = {mask} is not a row of the {geometry.vocab_size}-row target "
                          "embedding: set a row of it (or remove drafter.mask_token_id to use target.mask_token_id)")
    # One source of truth for the features: the layers the producers capture.
    layer_ids = list(geometry.layer_ids)
    if drafter.target_layer_ids and list(drafter.target_layer_ids) != layer_ids:
        raise ConfigError(f"drafter.target_layer_ids {drafter.target_layer_ids} differs from the layers the "
                          f"producers capture {layer_ids}: set target.layer_ids instead")
    return mask, layer_ids


def default_runtime_root() -> Path:
    if os.geteuid() == 0:
        return Path("/run/dflash-ring")
    if xdg := os.environ.get("XDG_RUNTIME_DIR"):
        return Path(xdg) / "dflash-ring"
    return Path(f"/tmp/dflash-ring-{os.getuid()}")


def load_config(path: str | os.PathLike | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Read a TOML file (or start from defaults) and apply `section.key=value` overrides."""
    raw: dict[str, typing.Any] = {}
    if path is not None:
        try:
            raw = tomllib.loads(read_text(path, CONFIG_BYTES, ConfigError, "config file"))
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    for item in overrides:
        section, key, value = _parse_override(item)
        raw.setdefault(section, {})[key] = value
    cfg = _build(Config, raw, "")
    cfg.validate()
    return cfg


def _parse_override(item: str) -> tuple[str, str, typing.Any]:
    name, sep, text = item.partition("=")
    section, dot, key = name.strip().partition(".")
    if not sep or not dot or not section or not key:
        raise ConfigError(f"--set {item!r}: expected section.key=value")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text  # a bare word is a string
    return section, key, value


def _build(cls: type, raw: typing.Any, where: str) -> typing.Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"[{where}] must be a table, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls, include_extras=True)  # with each field's declared Range
    known = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in known:
            place = f"[{where}]" if where else "the top level"
            raise ConfigError(f"unknown config key {key!r} in {place}; known keys: {', '.join(sorted(known))}")
    values = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            continue
        name = f"{where}.{f.name}" if where else f.name
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            values[f.name] = _build(hint, raw[f.name], name)
        else:
            values[f.name] = _coerce(raw[f.name], hint, name)
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"[{where}]: {e}") from None


def _coerce(value: typing.Any, hint: typing.Any, name: str, bound: Range | None = None) -> typing.Any:
    """`value` as the field's type, or a ConfigError naming `name`; a number also within its declared `bound`
    (common/range_config.py: from an Annotated hint, else the rule for every number, DEFAULT)."""
    if dataclasses.is_dataclass(hint):  # a table in a list of tables ([[data.sources]])
        return _build(hint, value, name)
    origin = typing.get_origin(hint)
    if origin is typing.Annotated:
        inner, *extras = typing.get_args(hint)
        return _coerce(value, inner, name, range_of(tuple(extras)) or bound)
    if origin is typing.Literal:
        if value not in typing.get_args(hint):
            raise ConfigError(f"{name} = {value!r}: expected one of {', '.join(map(repr, typing.get_args(hint)))}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        options = [arg for arg in args if arg is not type(None)]
        for arg in options:
            try:
                return _coerce(value, arg, name, bound)
            except ConfigError as e:
                if len(options) == 1:  # X | None: X's own message
                    raise e from None
        raise ConfigError(f"{name} = {value!r}: expected {hint}")
    if origin is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(f"{name} = {value!r}: expected a list")
        return [_coerce(v, item, f"{name}[{i}]") for i, v in enumerate(value)]
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        value = _as_float(value)
    if hint is bool and not isinstance(value, bool):
        raise ConfigError(f"{name} = {value!r}: expected true or false")
    if hint is int and isinstance(value, bool):
        raise ConfigError(f"{name} = {value!r}: expected an integer")
    if not isinstance(value, hint):
        raise ConfigError(f"{name} = {value!r}: expected {hint.__name__}, got {type(value).__name__}")
    if hint in (int, float) and (why := refusal(name, value, bound or DEFAULT)):
        raise ConfigError(why)
    return value


def _as_float(value: int) -> float:
    """An int written for a float field; one past a float's range is inf (refused as not finite, not a traceback)."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def dump_toml(cfg: Config, *, full: bool = False, header: str = "",
              comments: typing.Mapping[str, str] | None = None) -> str:
    """`cfg` as TOML that `load_config` reads back equal: the one writer of run configs.

    By default only fields that differ from the defaults, and that the section does not derive from
    its other fields, are written: a copied file then says what this run chose and keeps following the
    code's defaults for the rest (an edited num_hidden_layers is not contradicted by a stale
    layer_types). `full` writes every
    field (None, which TOML cannot spell, is every optional field's default, so it is left out).
    `header` becomes leading comment lines; `comments` maps "section" or "section.key" to a
    comment line written above it.
    """
    comments = comments or {}
    defaults = Config()
    out = [f"# {line}".rstrip() for line in header.splitlines()]
    for section in dataclasses.fields(Config):
        value = getattr(cfg, section.name)
        kept = _kept_fields(value, getattr(defaults, section.name), full)
        tables = {name: kept.pop(name) for name, v in list(kept.items()) if _is_table_list(v)}
        lines = []
        for name, v in kept.items():
            if note := comments.get(f"{section.name}.{name}"):
                lines.append(f"# {note}")
            lines.append(f"{name} = {_toml_value(v, f'{section.name}.{name}')}")
        if lines:
            if out:
                out.append("")
            if note := comments.get(section.name):
                out.append(f"# {note}")
            out += [f"[{section.name}]", *lines]
        for name, entries in tables.items():  # after the section's own keys: TOML puts them in its table
            for i, entry in enumerate(entries):
                fields = _kept_fields(entry, None, full)
                out += ["", f"[[{section.name}.{name}]]",
                        *(f"{k} = {_toml_value(v, f'{section.name}.{name}[{i}].{k}')}" for k, v in fields.items())]
    return "\n".join(out) + "\n"


def _kept_fields(value: typing.Any, default: typing.Any, full: bool) -> dict[str, typing.Any]:
    """The fields of one table that `dump_toml` writes: all (bar None) when `full`, else those that differ from
    `default` (from the type's own defaults where `default` is None) and that the table does not derive from
    its other fields (drafter.layer_types from its layers, a source's name from its path)."""
    kept = {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if getattr(value, f.name) is not None}
    if full:
        return kept
    for f in dataclasses.fields(value):
        if default is not None:
            same = getattr(default, f.name) == kept.get(f.name)
        else:
            same = f.default is not dataclasses.MISSING and f.default == kept.get(f.name)
        if same:
            kept.pop(f.name, None)
    for name in reversed(list(kept)):
        trial = {k: v for k, v in kept.items() if k != name}
        try:
            if type(value)(**trial) == value:
                kept = trial
        except (TypeError, ValueError):
            pass
    return kept


def _is_table_list(v: typing.Any) -> bool:
    return isinstance(v, list) and bool(v) and all(dataclasses.is_dataclass(x) for x in v)


def _toml_value(v: typing.Any, name: str) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return f"{v:_}" if abs(v) >= 100_000 else str(v)  # 8_388_608 reads better than 8388608
    if isinstance(v, float):
        return repr(v)  # shortest exact form; inf, -inf and nan are TOML's own spellings
    if isinstance(v, str):
        return '"' + "".join(_TOML_ESCAPES.get(c) or (f"\\u{ord(c):04x}" if ord(c) < 0x20 or c == "\x7f" else c)
                             for c in v) + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x, name) for x in v) + "]"
    raise ConfigError(f"{name} = {v!r}: a {type(v).__name__} cannot be written as TOML")


_TOML_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}
