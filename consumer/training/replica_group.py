"""Drafter replicas on several hosts: one leader per host averages parameters with the other hosts' leaders.

Two levels. Within a host, replicas average through shared memory every K steps
(`replicas.py`: no barrier, the fast path). Across hosts, right after that, the
host's leader (its lowest live drafter index) averages with the other hosts'
leaders through a gloo process group; the host's other replicas pick the group
mean up from the leader's shared-memory copy at their next local average.

Rendezvous: a `TCPStore` at `group.rendezvous`, served by the supervisor of the
one host with `group.serve = true` (it lives as long as that supervisor). The
store holds a generation number; each generation is one fixed set of leaders
with its own `ProcessGroupGloo` (under the prefix `g<gen>/pg/`):

- Forming generation g: a leader takes a rank with `add("g<g>/count", 1)`.
  Rank 0 closes the generation (writes `g<g>/size`) once `group.hosts` leaders are
  there, or once none has arrived for `group.settle_s`. A leader that arrives
  after the close asks the members to re-form (`add("joins", 1)`) and waits for
  the generation to change; if no member of g heartbeats any more (a background
  thread adds to `g<g>/hb` every second), it moves the generation on itself.
- Every K steps a member first all-reduces a control flag ("the generation or
  the joins counter changed since I joined", read from the store), then the
  parameters (sum / size). If the flag is set anywhere, every member re-forms at
  the next generation after this average, so all members decide alike.
- A dead peer makes the collective fail at once (its sockets close); a hung or
  unreachable one fails it after `group.timeout_s`. The survivors then move the
  generation on (`compare_set`) and re-form without it: no wait is unbounded.
  A lost store (its supervisor gone) only pauses cross-host averaging: the host
  keeps training and retries the store every few seconds.
- Healing: right after each generation forms, members average with weight 1 for
  live weights and 0 for a "fresh" leader (a restarted host whose drafters had no
  live local peer to catch up from, checkpoint-resumed or not), so a rejoining host
  takes the live hosts' mean before its first step; if every member is fresh (a
  whole-cluster start) they take the plain mean.
- Config: at rendezvous each leader compares the fields that must agree (drafter
  settings, target geometry, optimizer settings, K, parameter shapes) with the
  first registered set, as JSON in the store, and refuses to train on a mismatch,
  naming the fields.

Security (README "Security"): the store listens on the configured address only
(`common/lifecycle/rendezvous.py` binds the socket itself), and every value this module or gloo
writes to it is signed with the group secret (`group.secret_file`): HMAC-SHA256
over the full key (which holds the generation) and the value (`SignedStore`).
Reads verify and ignore unsigned or wrongly signed values, so a client without the
secret cannot take a rank (a rank counts only with a signed host record), cannot
squat the fingerprint (an unsigned one is replaced) and cannot hand gloo a peer
address. The counters (`gen`, `joins`, `g<g>/count`) are plain integers the
server adds to; someone who reaches the port can bump them, which only makes the
group re-form or pause (hosts train alone), never changes weights. A member whose
parameters are not finite is left out of that average (weight 0; it takes the
others' mean), and a non-finite mean is never applied.

Only tensors cross the wire (no pickle). Parameters are staged one at a time into
one pinned host buffer and reduced there with gloo, so a GPU drafter's extra device
memory is nil and no nccl group is needed. Caveats, as within a host: AdamW moments
are not averaged (each replica keeps its own; a rejoining host keeps its own or
fresh moments and takes only the parameters), and the slowest host sets the pace of
each average (a collective), bounded by `group.timeout_s`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed import AllreduceOptions, ProcessGroupGloo, ReduceOp, Store, TCPStore

from dflash_ring.common.config.schema import ConfigError, GroupConfig
from dflash_ring.common.config.drafter import DrafterConfig
from dflash_ring.common.config.target import TargetConfig
from dflash_ring.common.target_geometry import target_geometry
from dflash_ring.common.config.train import TrainConfig
from dflash_ring.common.layout import Role
from dflash_ring.common.lifecycle.liveness import is_alive, lock_path
from dflash_ring.common.ownership import group_secret
from dflash_ring.common.lifecycle.rendezvous import parse_rendezvous

log = logging.getLogger(__name__)

BUCKET = 16 << 20  # floats per all-reduce call (64 MiB)
HEARTBEAT_S = 1.0
RETRY_S = 10.0  # between attempts to reach a lost store


class SignedStore(Store):
    """A view of the store in which every value carries HMAC-SHA256(secret, key, value).

    Why: TCPStore has no authentication, so anyone who reaches its port can write any
    key. Values without a valid MAC are treated as absent. The MAC covers the full key
    (prefix included: `g<gen>/...`), so a value cannot be replayed under another key or
    generation. Given to gloo too, so the peer addresses it exchanges are verified.
    Counters (`add`) stay plain integers: the server computes them.
    """

    MAC = 32

    def __init__(self, inner: Store, secret: bytes, prefix: str = "", timeout_s: float = 30.0):
        super().__init__()
        self.inner, self.secret, self.prefix, self.timeout_s = inner, secret, prefix, timeout_s

    def sub(self, prefix: str, timeout_s: float | None = None) -> SignedStore:
        return SignedStore(
            self.inner, self.secret, self.prefix + prefix, self.timeout_s if timeout_s is None else timeout_s
        )

    def _mac(self, full: str, value: bytes) -> bytes:
        msg = b"dflash-ring/group/v1\0" + full.encode() + b"\0" + value
        return hmac.new(self.secret, msg, hashlib.sha256).digest()

    def _seal(self, full: str, value: bytes | str) -> bytes:
        value = value.encode() if isinstance(value, str) else bytes(value)
        return self._mac(full, value) + value

    def _open(self, full: str, raw: bytes) -> bytes | None:
        mac, value = raw[: self.MAC], raw[self.MAC :]
        return value if len(raw) >= self.MAC and hmac.compare_digest(mac, self._mac(full, value)) else None

    def read(self, key: str) -> bytes | None:
        """The verified value at key now; None if absent or not signed with our secret."""
        full = self.prefix + key
        if not self.inner.check([full]):
            return None
        return self._open(full, self.inner.get(full))

    # ---- the Store interface (what gloo calls: set, get, wait) ----

    def set(self, key: str, value: bytes | str) -> None:
        full = self.prefix + key
        self.inner.set(full, self._seal(full, value))

    def get(self, key: str, timeout_s: float | None = None) -> bytes:
        """Waits for a validly signed value: a forged one may yet be replaced by the real one."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        while True:
            value = self.read(key)
            if value is not None:
                return value
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"replica group store: no validly signed value at {self.prefix + key} "
                    "(missing, or written by someone without the group secret)"
                )
            time.sleep(0.02)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        for key in keys:
            self.get(key, None if timeout is None else timeout.total_seconds())

    def check(self, keys: list[str]) -> bool:
        return all(self.read(k) is not None for k in keys)

    def add(self, key: str, value: int) -> int:
        return int(self.inner.add(self.prefix + key, value))

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:  # plain: only the `gen` counter uses it
        return self.inner.compare_set(self.prefix + key, expected, desired)

    def claim(self, key: str, value: str) -> bytes:
        """The first validly signed value at key, ours if there is none; an unsigned squatter's value is replaced."""
        full, expected = self.prefix + key, b""
        mine = self._seal(full, value)
        for _ in range(100):
            cur = self.inner.compare_set(full, expected, mine)
            if cur == mine:
                return value.encode()
            if (theirs := self._open(full, cur)) is not None:
                return theirs
            log.warning(
                "replacing a value at %s not signed with this host's group secret (written by someone "
                "without it, or group.secret_file differs between hosts)",
                full,
            )
            expected = cur
        raise _Unavailable(f"store key {full} keeps being overwritten with unsigned values")


def fingerprint_fields(
    drafter: DrafterConfig, target: TargetConfig, train: TrainConfig, group: GroupConfig, model: nn.Module
) -> dict[str, Any]:
    """What every host of a group must agree on, by config field name."""
    fields: dict[str, Any] = {f"drafter.{k}": v for k, v in drafter.model_fields().items()}  # not precision
    if target.path:
        fields |= target_geometry(target).fingerprint_fields()
    for k in (
        "average_every_steps",
        "lr",
        "weight_decay",
        "betas",
        "warmup_ratio",
        "min_lr_ratio",
        "grad_clip",
        "grad_accum",
    ):
        fields[f"train.{k}"] = getattr(train, k)
    fields["group.hosts"] = group.hosts
    fields["model.parameter_shapes"] = [list(p.shape) for p in model.parameters()]
    return json.loads(json.dumps(fields, default=str))


class _Unavailable(Exception):
    """No group now (store unreachable, no generation formed in time): train alone, retry later."""


class ReplicaGroup:
    def __init__(
        self,
        group: GroupConfig,
        host: str,
        index: int,
        model: nn.Module,
        lock_dir: Path,
        fields: dict[str, Any],
        fresh: bool,
    ):
        self.cfg, self.host, self.index, self.lock_dir = group, host, index, lock_dir
        self.fields = json.loads(json.dumps(fields, default=str))
        self.fresh = fresh  # no live weights yet: take the live hosts' mean when a generation forms
        self.params = list(model.parameters())
        n = sum(p.numel() for p in self.params)
        self._flat = torch.empty(n, dtype=torch.float32, pin_memory=self.params[0].is_cuda)
        self.secret = group_secret(group.secret_file)
        self.store: SignedStore | None = None
        self.hosts: list[str] = []
        self.pg: ProcessGroupGloo | None = None
        self.gen, self.rank, self.size, self.round = -1, 0, 0, 0
        self.averages = 0  # cross-host averages taken part in (size > 1)
        self._joins_seen = 0
        self._retry_at = 0.0
        self._connects = 0
        self._beat: tuple[threading.Thread, threading.Event] | None = None

    @classmethod
    def named(
        cls,
        group: GroupConfig,
        run_name: str,
        index: int,
        model: nn.Module,
        lock_dir: Path,
        fields: dict[str, Any],
        fresh: bool,
    ) -> ReplicaGroup:
        """This host's member, named group.host_name or <hostname>/<run.name>."""
        host = group.host_name or f"{socket.gethostname()}/{run_name}"
        return cls(group, host, index, model, lock_dir, fields, fresh)

    # ---- public ------------------------------------------------------------------

    def is_leader(self) -> bool:
        """The lowest live drafter index of this host meets the other hosts."""
        return not any(is_alive(lock_path(self.lock_dir, Role.CONSUMER, j)) for j in range(self.index))

    def start(self) -> None:
        """Before the first step: a leader joins, and takes the live weights if it has none."""
        if self.is_leader():
            self._join()

    def sync(self, step: int) -> bool:
        """Every K steps, after the host-local average; True if the parameters changed (re-publish them)."""
        if not self.is_leader():
            if self.store is not None:
                log.info("a lower-index drafter leads this host again: leaving the group")
                self.close()
            return False
        if self.gen < 0:
            return self._join()
        try:
            changed = int(self.store.add("gen", 0)) != self.gen or int(self.store.add("joins", 0)) != self._joins_seen
        except RuntimeError as e:
            self._lost_store(e)
            return False
        averaged = False
        if self.size > 1:
            try:
                votes = self._vote(changed, self._stage(), live=True)
                changed = bool(votes[0] > 0)
                self._reduce(votes)
                self.round += 1
                self.averages += 1
                averaged = True
            except RuntimeError as e:
                log.warning(
                    "group generation %d lost a host at step %d (%s): re-forming", self.gen, step, _first_line(e)
                )
                changed = True
        if changed:
            old = self.gen
            self._teardown()
            try:
                self.store.compare_set("gen", str(old), str(old + 1))
            except RuntimeError as e:
                self._lost_store(e)
                return averaged
            averaged = self._join() or averaged
        return averaged

    def close(self) -> None:
        """Leave: peers in a collective with us see our sockets close and re-form at once."""
        self._teardown()
        self.store = None
        self.gen = -1

    # ---- rendezvous ----------------------------------------------------------------

    def _join(self) -> bool:
        """Connect, check the config, form or join a generation, heal; False if no group now."""
        if time.monotonic() < self._retry_at:
            return False
        try:
            if self.store is None:
                host, port = parse_rendezvous(self.cfg.rendezvous)
                first, self._connects = self._connects == 0, self._connects + 1
                raw = TCPStore(
                    host,
                    port,
                    is_master=False,
                    wait_for_workers=False,
                    timeout=timedelta(seconds=min(self.cfg.timeout_s, 30.0 if first else 5.0)),
                )
                self.store = SignedStore(raw, self.secret, timeout_s=self.cfg.settle_s + 10.0)
                self._check_fingerprint()
            self._form()
            self._heal()
            return self.size > 1
        except _Unavailable as e:
            log.warning("no replica group now (%s): training alone, retrying in %.0fs", e, RETRY_S)
            self._teardown()
            self._retry_at = time.monotonic() + RETRY_S
        except RuntimeError as e:
            self._lost_store(e)
        return False

    def _check_fingerprint(self) -> None:
        mine = json.dumps(self.fields, sort_keys=True)
        first = self.store.claim("fingerprint", mine).decode()  # an unsigned (squatted) one does not count
        if first == mine:
            self.store.claim("fingerprint_host", self.host)
            return
        theirs = json.loads(first)
        by = (self.store.read("fingerprint_host") or b"?").decode()
        diff = [
            f"{k} = {self.fields.get(k, '<unset>')!r} here, {theirs.get(k, '<unset>')!r} on {by}"
            for k in sorted(set(self.fields) | set(theirs))
            if self.fields.get(k) != theirs.get(k)
        ]
        self.close()
        raise ConfigError(
            f"host {self.host} cannot join the drafter replica group at {self.cfg.rendezvous}: "
            f"its config differs from the group's: {'; '.join(diff)}. Every host must use the "
            f"same settings (restart the rendezvous host's supervisor to start a new group)"
        )

    def _form(self) -> None:
        store, deadline = self.store, time.monotonic() + self.cfg.timeout_s
        while True:
            if time.monotonic() > deadline:
                raise _Unavailable(f"no generation formed within {self.cfg.timeout_s:.0f}s")
            g = int(store.add("gen", 0))
            if store.read(f"g{g}/size") is not None:  # closed (signed by a member): ask them to re-form with us
                self._await_members(g, deadline)
                continue
            joins = int(store.add("joins", 0))  # before taking a rank: any later join is seen at a sync
            rank = int(store.add(f"g{g}/count", 1)) - 1
            size = self._close(g) if rank == 0 else self._await_size(g)
            if size is None or rank >= size:
                store.compare_set("gen", str(g), str(g + 1))
                continue
            store.set(f"g{g}/host{rank}", self.host)
            try:  # a rank counts only with a signed host record: one taken without the secret sinks g
                hosts = [store.get(f"g{g}/host{r}").decode() for r in range(size)]
                pg = (
                    ProcessGroupGloo(
                        store.sub(f"g{g}/pg/", self.cfg.timeout_s), rank, size, timedelta(seconds=self.cfg.timeout_s)
                    )
                    if size > 1
                    else None
                )
            except RuntimeError as e:
                log.warning("generation %d did not connect (%s): next one", g, _first_line(e))
                store.compare_set("gen", str(g), str(g + 1))
                continue
            self.gen, self.rank, self.size, self.pg, self.round, self._joins_seen = g, rank, size, pg, 0, joins
            self.hosts = hosts
            log.info("replica group generation %d: rank %d of %d (%s)", g, rank, size, ", ".join(hosts))
            self._start_heartbeat(g)
            return

    def _close(self, g: int) -> int:
        last, since = 1, time.monotonic()
        while True:
            count = int(self.store.add(f"g{g}/count", 0))
            if count != last:
                last, since = count, time.monotonic()
            if (self.cfg.hosts and count >= self.cfg.hosts) or time.monotonic() - since >= self.cfg.settle_s:
                self.store.set(f"g{g}/size", str(count))
                return count
            time.sleep(0.05)

    def _await_size(self, g: int) -> int | None:
        """The size rank 0 closed g with; None if it never does (rank 0 died while forming)."""
        last, since = -1, time.monotonic()
        while (size := self.store.read(f"g{g}/size")) is None:
            count = int(self.store.add(f"g{g}/count", 0))
            if count != last:
                last, since = count, time.monotonic()
            if time.monotonic() - since > self.cfg.settle_s + 10.0:
                return None
            time.sleep(0.05)
        return int(size)

    def _await_members(self, g: int, deadline: float) -> None:
        """g is closed: wait for its members to re-form at their next average, or move on if none is alive."""
        store = self.store
        store.add("joins", 1)
        size = int(store.read(f"g{g}/size") or 0)

        def beats() -> list[int]:  # signed per-rank counters: replaying an old value never looks like a beat
            return [int(store.read(f"g{g}/hb{r}") or -1) for r in range(size)]

        seen, since = beats(), time.monotonic()
        log.info("generation %d is running: waiting for its members to re-form with this host", g)
        while int(store.add("gen", 0)) == g:
            now = time.monotonic()
            latest = beats()
            if any(b > s for b, s in zip(latest, seen)):
                seen, since = [max(b, s) for b, s in zip(latest, seen)], now
            if now - since > 3 * HEARTBEAT_S + 1.0 or now > deadline:
                log.info("generation %d has no live member: starting the next", g)
                store.compare_set("gen", str(g), str(g + 1))
                return
            time.sleep(0.1)

    def _start_heartbeat(self, g: int) -> None:
        host, port = parse_rendezvous(self.cfg.rendezvous)
        stop, rank = threading.Event(), self.rank

        def beat() -> None:
            try:
                raw = TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=10))
                store, n = SignedStore(raw, self.secret), 0
                while not stop.wait(HEARTBEAT_S):
                    n += 1
                    store.set(f"g{g}/hb{rank}", str(n))
            except RuntimeError:
                pass  # the main thread finds out at its next store call

        thread = threading.Thread(target=beat, name=f"group-heartbeat-{g}", daemon=True)
        thread.start()
        self._beat = (thread, stop)

    # ---- averaging -------------------------------------------------------------------

    def _heal(self) -> None:
        """Right after forming: the mean over members with live weights (all members if none has)."""
        if self.size > 1:
            votes = self._vote(False, self._stage(), live=not self.fresh)
            mine = self._reduce(votes)
            self.averages += 1
            if self.fresh and mine == 0 and votes[1 + self.rank] > 0:
                live = int((votes[1 + self.size :] > 0).sum())
                log.info(
                    "caught up with the live hosts' weights (generation %d, %d live of %d)", self.gen, live, self.size
                )
        self.fresh = False

    @torch.no_grad()
    def _stage(self) -> bool:
        """Copy the parameters into the host buffer; True if every value is finite."""
        flat, offset = self._flat, 0
        for p in self.params:  # one parameter at a time: no extra device memory
            flat[offset : offset + p.numel()].view_as(p).copy_(p.detach(), non_blocking=True)
            offset += p.numel()
        if self.params[0].is_cuda:
            torch.cuda.current_stream(self.params[0].device).synchronize()
        return _finite(flat)

    def _vote(self, changed: bool, finite: bool, live: bool) -> torch.Tensor:
        """One small all-reduce (max): [changed anywhere, finite per rank..., live weights per rank...]."""
        votes = torch.zeros(1 + 2 * self.size)
        votes[0] = float(changed)
        votes[1 + self.rank] = float(finite)
        votes[1 + self.size + self.rank] = float(live)
        self.pg.allreduce([votes], _opts(ReduceOp.MAX)).wait()
        return votes

    @torch.no_grad()
    def _reduce(self, votes: torch.Tensor) -> float:
        """Average the staged buffer with weight 1 for finite, live members; returns this member's weight.

        Why: one NaN or inf would poison every host's weights for good. A member with non-finite
        parameters contributes zeros and takes the others' mean; every member decides from the same
        votes, so all stay in step. A mean that is itself not finite (overflow) is not applied.
        """
        finite, live = votes[1 : 1 + self.size] > 0, votes[1 + self.size :] > 0
        weights = (finite & live) if bool((finite & live).any()) else finite
        for r in torch.nonzero(~finite).flatten().tolist():
            name = self.hosts[r] if r < len(self.hosts) else "?"
            log.warning(
                "generation %d: %s (rank %d) has non-finite parameters: left out of this average%s",
                self.gen,
                name,
                r,
                " (this host: taking the others' mean)" if r == self.rank else "",
            )
        total = float(weights.sum())
        if total == 0:
            log.warning("generation %d: no member has finite parameters: nothing averaged", self.gen)
            return 0.0
        mine = float(weights[self.rank])
        flat = self._flat
        if mine == 0:
            flat.zero_()  # not mul_(0): NaN * 0 is NaN
        for chunk in flat.split(BUCKET):
            self.pg.allreduce([chunk], _opts(ReduceOp.SUM)).wait()
        flat.div_(total)
        if not _finite(flat):
            log.warning("generation %d: the mean is not finite (overflow): not applied", self.gen)
            return mine
        offset = 0
        for p in self.params:
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        return mine

    # ---- failure ---------------------------------------------------------------------

    def _teardown(self) -> None:
        if self._beat is not None:
            thread, stop = self._beat
            stop.set()
            thread.join(timeout=2 * HEARTBEAT_S)
            self._beat = None
        self.pg = None  # the destructor closes its sockets: a peer blocked on us fails at once
        self.gen, self.size = -1, 0

    def _lost_store(self, e: BaseException) -> None:
        log.warning(
            "replica group store %s unreachable (%s): training alone, retrying in %.0fs",
            self.cfg.rendezvous,
            _first_line(e),
            RETRY_S,
        )
        self._teardown()
        self.store = None
        self._retry_at = time.monotonic() + RETRY_S


def _finite(flat: torch.Tensor) -> bool:
    return all(bool(torch.isfinite(chunk).all()) for chunk in flat.split(BUCKET))


def _opts(op: ReduceOp) -> AllreduceOptions:
    o = AllreduceOptions()
    o.reduceOp = op
    return o


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
