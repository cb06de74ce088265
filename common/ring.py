"""The shared-memory slot ring: the one channel between target producers and drafter trainers.

Slot life cycle, each arrow one compare-and-swap on the slot's state word:

    FREE --producer claims--> WRITING --publish--> READY --consumer claims--> READING --release--> FREE
               (abort / producer died: back to FREE)      (consumer died: back to READY, redelivered)

Ownership lives only in the state words; the two POSIX semaphores are wake-up
hints with timeouts, so a process dying anywhere leaves nothing held that a
compare-and-swap by the reaper cannot undo. Producers number items with one
fetch-add on the header's sequence index; consumers take the READY slot with
the lowest item number, so the ring is FIFO and any number of producers feeds
any number of consumers through the same pool of slots.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np
import posix_ipc

from dflash_ring.common.atomic_words import atomic_words
from dflash_ring.common.config import Config, fingerprint_digest
from dflash_ring.common.crash_points import crash_point
from dflash_ring.common.layout import (
    DESC_BYTES,
    DESC_DTYPE,
    FINGERPRINT_BLOB_OFFSET,
    HEADER_BYTES,
    NO_OWNER,
    ROW_DTYPE,
    Counter,
    Geometry,
    Identity,
    RingHeaderError,
    Role,
    RowStatus,
    SlotState,
    is_initialized,
    pack_state,
    publish_magic,
    read_identity,
    write_identity,
)
from dflash_ring.common.ownership import ForeignObjectError, check_private_fd, check_semaphore, semaphore_path
from dflash_ring.common.run_name import check_run_name
from dflash_ring.common.slot_format import SlotFormatError, SlotHeader, SlotLayout, decode_header, encode_header, view

if TYPE_CHECKING:  # torch is imported where tensors are made: `status`, `stop` and `clean` never load it
    import torch

SHM_DIR = "/dev/shm"
SHM_DIR_PATH = Path(SHM_DIR)
log = logging.getLogger(__name__)
_READY = int(SlotState.READY)  # numpy compares a plain int ~2 µs faster than an IntEnum member


def segment_name(run: str) -> str:
    return f"/dflash-ring.{check_run_name(run, 'the ring name')}"


def replica_segment_name(run: str) -> str:
    """Where the drafter replicas of a run average their parameters (consumer/replicas.py)."""
    return f"/dflash-ring.{check_run_name(run, 'the ring name')}.replicas"


def semaphore_names(run: str) -> tuple[str, str]:
    check_run_name(run, "the ring name")
    return f"/dflash-ring.{run}.ready", f"/dflash-ring.{run}.free"


class RingNotFound(FileNotFoundError):
    pass


class HalfCreatedRingError(RingHeaderError):
    """The run's segment exists but has no magic yet: its supervisor is creating it, or died doing so.

    A RingHeaderError, so whoever judges a damaged ring stale (`supervisor --reclaim-stale`, `clean`)
    judges this one the same way: reclaimable once no process of the run is alive. It never held an
    item (nobody attaches before the magic), so removing it loses nothing."""

    def __init__(self, name: str):
        run = name.removeprefix("/dflash-ring.")
        super().__init__(
            f"segment {name} has no ring header: a supervisor died while creating it (e.g. killed while "
            f"prefaulting a large ring), or is creating it right now. If no process of run {run!r} is alive, "
            f"`dflash-ring supervisor --reclaim-stale` or `dflash-ring clean {run}` removes it")


class ConfigMismatchError(RuntimeError):
    """This process's config differs from the one the ring was created with."""


class SlotLostError(RuntimeError):
    """A slot this process held was taken back (it was presumed dead): its work is void."""


@dataclass
class SlotWriter:
    """A slot claimed by a producer: fill the tensors it hands out, then publish."""

    slot: int
    item: int
    word: int
    layout: SlotLayout
    area: torch.Tensor
    meta: dict[str, Any] = field(default_factory=dict)

    def tensor(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A zero-copy view into the slot, to be filled in place (e.g. by a D2H copy)."""
        return view(self.area, self.layout.add(name, dtype, shape))


@dataclass
class SlotReader:
    """A slot claimed by a consumer. Its tensors are views into shared memory:
    copy what you need before `release`, after which a producer may overwrite them."""

    slot: int
    item: int
    word: int
    deliveries: int
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]


@dataclass(frozen=True)
class CorruptSlot:
    """A slot whose state word the protocol cannot produce, and what was done about it."""

    slot: int
    item: int
    word: int
    why: str  # what is impossible about the word
    outcome: str  # where its item went


_STATES = frozenset(int(s) for s in SlotState)
_HOLDER = {SlotState.WRITING: Role.PRODUCER, SlotState.READY: Role.PRODUCER, SlotState.READING: Role.CONSUMER}


def impossible_word(word: int, roles: np.ndarray) -> str | None:
    """Why the protocol cannot have produced this state word, given the process table's roles; None if it can.

    Reachable words: FREE owned by nobody (or the all-zero word of a new ring), WRITING by a producer row,
    READY by the producer row that published it or by nobody (requeued or redelivered), READING by a
    consumer row. A row's role is set before its first claim and never cleared, so roles read after the
    word judge it soundly."""
    state, owner = word & 0xFF, (word >> 8) & 0xFFFF
    if state not in _STATES:
        return f"has state {state}, which is no slot state"
    state = SlotState(state)
    if state == SlotState.FREE:
        return None if owner == NO_OWNER or word == 0 else f"is FREE with owner row {owner}, which frees nothing"
    if state == SlotState.READY and owner == NO_OWNER:
        return None
    if owner >= len(roles):
        return f"is {state.name} by row {owner}, outside the {len(roles)}-row process table"
    want, role = _HOLDER[state], int(roles[owner])
    if role == want:
        return None
    what = "a row no process has taken" if role == Role.NONE else (
        f"the {Role(role).name.lower()} row" if role in Role._value2member_map_ else f"a row of role {role}")
    return f"is {state.name} by row {owner}, {what}: only a {want.name.lower()} row holds a slot {state.name}"


def _suspects(words: np.ndarray, roles: np.ndarray) -> np.ndarray:
    """The slots whose words impossible_word may object to, in one vectorized look (every supervisor pass
    reads every word; a Python call per word would cost milliseconds on a ring of thousands of slots)."""
    state, owner = words & 0xFF, (words >> 8) & 0xFFFF
    role = roles[np.minimum(owner, len(roles) - 1)].astype(np.int64)
    held = owner < len(roles)
    fine = ((state == SlotState.FREE) & ((owner == NO_OWNER) | (words == 0))
            | (state == SlotState.READY) & ((owner == NO_OWNER) | held & (role == Role.PRODUCER))
            | (state == SlotState.WRITING) & held & (role == Role.PRODUCER)
            | (state == SlotState.READING) & held & (role == Role.CONSUMER))
    return np.flatnonzero(~fine)


@dataclass
class RingStatus:
    run: str
    created_ns: int
    n_slots: int
    slot_bytes: int
    slots_by_state: dict[str, int]
    counters: dict[str, int]
    rows: list[dict[str, Any]]

    @property
    def depth(self) -> int:
        return self.slots_by_state["ready"]


class Ring:
    """One process's mapping of the ring. Create it (supervisor) or attach to it; close it when done."""

    def __init__(self, name: str, shm: posix_ipc.SharedMemory, identity: Identity, fields: dict[str, Any]):
        self.name = name
        self.identity = identity
        self.geometry: Geometry = identity.geometry
        self.fingerprint_fields = fields
        self.wait_s = 0.2
        self._size = shm.size
        self._mm = mmap.mmap(shm.fd, shm.size)
        shm.close_fd()
        self._mv = memoryview(self._mm)
        geo = self.geometry
        self._rows = np.frombuffer(self._mm, dtype=ROW_DTYPE, count=geo.n_rows, offset=geo.table_offset)
        self._desc = np.frombuffer(self._mm, dtype=DESC_DTYPE, count=geo.n_slots, offset=geo.desc_offset)
        counters = atomic_words(self._mm, list(Counter))
        self._counters = dict(zip(Counter, counters))
        self._states = atomic_words(self._mm, [geo.desc_offset + i * DESC_BYTES for i in range(geo.n_slots)])
        self._bytes = None  # a uint8 tensor over the mapping, made on first use (operator commands never need torch)
        self._areas: list[torch.Tensor | None] = [None] * geo.n_slots  # each slot's bytes, made on first use
        self._pin = None  # a HostRegistration (common/pinning.py) when the mapping is page-locked
        ready, free = semaphore_names(identity.run_name)
        self._sem_ready = posix_ipc.Semaphore(ready)
        self._sem_free = posix_ipc.Semaphore(free)
        self.wait_seconds = 0.0  # time spent blocked on an empty or full ring

    # ---- life cycle -------------------------------------------------------

    @classmethod
    def create(cls, cfg: Config) -> Ring:
        """Create the run's segment and semaphores exclusively (mode 0600). Supervisor only."""
        run = cfg.run.name
        geo = Geometry(
            n_slots=cfg.ring.slots,
            n_rows=1 + cfg.topology.producers + cfg.topology.consumers,
            slot_bytes=cfg.ring.slot_bytes,
            slot_header_bytes=cfg.ring.slot_header_bytes,
        )
        _check_shm_space(geo.total_bytes, run)
        fields = cfg.fingerprint_fields()
        blob = msgpack.packb(fields, use_bin_type=True)
        for sem in semaphore_names(run):
            posix_ipc.Semaphore(sem, posix_ipc.O_CREX, mode=0o600, initial_value=0).close()
        shm = posix_ipc.SharedMemory(segment_name(run), posix_ipc.O_CREX, mode=0o600, size=geo.total_bytes)
        with mmap.mmap(shm.fd, geo.total_bytes) as mm:
            _prefault(mm)
            crash_point("ring.prefaulted")  # the segment exists with no magic: what a supervisor killed here leaves
            buf = memoryview(mm)
            write_identity(buf, geo, time.time_ns(), fingerprint_digest(fields), run, blob)
            publish_magic(buf)
            buf.release()
        shm2 = posix_ipc.SharedMemory(segment_name(run))
        shm.close_fd()
        ring = cls._open(segment_name(run), shm2)
        ring.wait_s = cfg.ring.wait_s
        return ring

    @classmethod
    def attach(cls, cfg: Config, timeout_s: float | None = None, pin: bool = False) -> Ring:
        """Attach to the live ring of cfg's run, waiting for the supervisor to create it."""
        timeout_s = cfg.run.attach_timeout_s if timeout_s is None else timeout_s
        ring = cls.open(cfg.run.name, timeout_s)
        try:
            ring.check_config(cfg)
            ring.wait_s = cfg.ring.wait_s
            if pin and cfg.ring.pin:
                from dflash_ring.common.pinning import HostRegistration

                ring._pin = HostRegistration(ring._tensor())
        except BaseException:
            ring.close()
            raise
        return ring

    @classmethod
    def open(cls, run: str, timeout_s: float = 0.0) -> Ring:
        """Map an existing ring without a config (status, stop, clean)."""
        name = segment_name(run)
        deadline = time.monotonic() + timeout_s
        announced = False
        while True:
            half_created = False
            try:
                shm = posix_ipc.SharedMemory(name)
                if shm.size >= 8:
                    with mmap.mmap(shm.fd, 8, prot=mmap.PROT_READ) as head:
                        ready = is_initialized(memoryview(head))
                    if ready:
                        return cls._open(name, shm)
                shm.close_fd()
                half_created = True
            except posix_ipc.ExistentialError:
                pass
            if time.monotonic() >= deadline and half_created:
                raise HalfCreatedRingError(name)  # not "does not exist": starting a supervisor is what failed
            if time.monotonic() >= deadline:
                raise RingNotFound(
                    f"no ring for run {run!r} (shared-memory segment {name} does not exist"
                    + (f" after waiting {timeout_s:.0f}s" if timeout_s else "")
                    + "): is the supervisor running? Start it with `dflash-ring supervisor --config ...`"
                )
            if not announced:
                log.info("waiting up to %.0fs for the ring of run %r (%s): is its supervisor running?",
                         timeout_s, run, name)
                announced = True
            time.sleep(0.05)

    @classmethod
    def _open(cls, name: str, shm: posix_ipc.SharedMemory) -> Ring:
        run = name.removeprefix("/dflash-ring.")
        fix = (f"If it is a stale run of yours, remove it as its owner with `dflash-ring clean {run}`; "
               f"else choose another run.name")
        try:
            check_private_fd(shm.fd, f"shared-memory segment {name}", fix)
        except ForeignObjectError:
            shm.close_fd()
            raise
        with mmap.mmap(shm.fd, min(shm.size, HEADER_BYTES), prot=mmap.PROT_READ) as head:
            buf = memoryview(head)
            try:
                identity = read_identity(buf, shm.size, name)
                blob = bytes(buf[FINGERPRINT_BLOB_OFFSET : FINGERPRINT_BLOB_OFFSET + identity.blob_len])
            finally:
                buf.release()
        try:
            fields = msgpack.unpackb(blob, raw=False)
            if not isinstance(fields, dict):
                raise ValueError("not a map")
        except Exception as e:
            shm.close_fd()
            raise RingHeaderError(
                f"segment {name} has unreadable config fields ({e}): the header is damaged. Stop every process "
                f"of this run, then remove it with `dflash-ring clean {identity.run_name}` and start again."
            ) from None
        try:
            for sem in semaphore_names(identity.run_name):  # /dev/shm is sticky: nobody can swap ours later
                check_semaphore(sem, fix)
        except ForeignObjectError:
            shm.close_fd()
            raise
        try:
            return cls(name, shm, identity, fields)
        except posix_ipc.ExistentialError:
            raise RingHeaderError(
                f"segment {name} exists but its semaphores do not: a half-removed run. "
                f"Remove it with `dflash-ring clean {identity.run_name}`"
            ) from None

    @property
    def lock_dir(self) -> Path | None:
        """The lock directory of the run's processes, as its creator recorded it (None: an older header)."""
        d = self.fingerprint_fields.get("run.lock_dir")
        return Path(d) if isinstance(d, str) and d.startswith("/") else None

    def check_config(self, cfg: Config) -> None:
        mine = cfg.fingerprint_fields()
        if fingerprint_digest(mine) == self.identity.fingerprint:
            return
        theirs = self.fingerprint_fields
        diffs = [
            f"{k}: ring has {theirs.get(k, '<unset>')!r}, this process has {mine.get(k, '<unset>')!r}"
            for k in sorted(set(mine) | set(theirs))
            if mine.get(k) != theirs.get(k)
        ] or ["(fields equal but digest differs: the header is damaged)"]
        raise ConfigMismatchError(
            f"config of this process does not match ring {self.name}: " + "; ".join(diffs)
            + ". Start every process of a run with the same config file."
        )

    def close(self) -> None:
        """Drop this process's mapping. Tensor views handed out must be gone first."""
        if self._mm.closed:
            return
        if self._pin is not None:
            self._pin.close()
        del self._rows, self._desc, self._bytes, self._areas, self._counters, self._states
        self._mv.release()
        self._sem_ready.close()
        self._sem_free.close()
        try:
            self._mm.close()
        except BufferError:
            pass  # a caller still holds a slot view; the mapping goes when that view does

    def __enter__(self) -> Ring:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def unlink(run: str) -> list[str]:
        """Remove the run's segment and semaphores (whatever exists); return what was removed.

        Another user's objects under the run's names are refused, not removed: as root this
        would delete someone else's run, and as anyone else it fails halfway.
        """
        for path in [SHM_DIR_PATH / segment_name(run)[1:], SHM_DIR_PATH / replica_segment_name(run)[1:],
                     *(semaphore_path(s) for s in semaphore_names(run))]:
            try:
                uid = path.stat().st_uid
            except FileNotFoundError:
                continue
            if uid != os.geteuid():
                raise ForeignObjectError(
                    f"{path} belongs to uid {uid}, not to this user (uid {os.geteuid()}): not removing another "
                    f"user's objects; its owner (or root, by hand) must remove it, or choose another run.name")
        removed = []
        for name, kind in [(segment_name(run), posix_ipc.unlink_shared_memory),
                           (replica_segment_name(run), posix_ipc.unlink_shared_memory)] + [
            (s, posix_ipc.unlink_semaphore) for s in semaphore_names(run)
        ]:
            try:
                kind(name)
                removed.append(name)
            except posix_ipc.ExistentialError:
                pass
        return removed

    @staticmethod
    def exists(run: str) -> bool:
        try:
            posix_ipc.SharedMemory(segment_name(run)).close_fd()
            return True
        except posix_ipc.ExistentialError:
            return False

    # ---- rows ---------------------------------------------------------------

    def row_of(self, role: Role, index: int) -> int:
        producers = int(self.fingerprint_fields["topology.producers"])
        consumers = int(self.fingerprint_fields["topology.consumers"])
        if role == Role.SUPERVISOR:
            return 0
        limit = producers if role == Role.PRODUCER else consumers
        if not 0 <= index < limit:
            raise ValueError(
                f"{role.name.lower()} index {index} is out of range: the run has "
                f"topology.{role.name.lower()}s = {limit}"
            )
        return 1 + index if role == Role.PRODUCER else 1 + producers + index

    def take_row(self, row: int, role: Role, index: int) -> None:
        r = self._rows[row]
        if r["pid"] != 0:
            r["restarts"] += 1
        r["role"], r["index"], r["pid"] = int(role), index, os.getpid()
        r["started_ns"] = r["heartbeat_ns"] = time.time_ns()
        r["status"] = RowStatus.RUNNING

    def committed_cursor(self, row: int) -> tuple[int, int] | None:
        """The (epoch, position) after the producer's last published batch, if it has one."""
        r = self._rows[row]
        if not r["has_cursor"] or r["cursor"][0] < 0:
            return None
        return int(r["cursor"][0]), int(r["cursor"][1])

    def committed_replayed(self, row: int) -> int:
        """How many entries of the producer's replay list its published batches have covered."""
        return int(self._rows[row]["replayed"])

    def settled_resume(self, row: int) -> tuple[tuple[int, int], int] | None:
        """A dead producer's resume point ((epoch, position), replayed), its unpublished claim undone: what the
        reaper would leave, without needing the row's lock file (whoever removes a dead ring calls this)."""
        r = self._rows[row].copy()
        if not r["has_cursor"]:
            return None
        cursor, replayed = r["cursor"], r["replayed"]
        if int(r["pending_word"]) in {int(w) for w in self._desc["state"]}:  # its publish CAS never happened
            cursor, replayed = r["prev_cursor"], r["prev_replayed"]
        if cursor[0] < 0:
            return None
        return (int(cursor[0]), int(cursor[1])), int(replayed)

    def cursor_plan(self, row: int) -> str:
        """The data plan the row's committed cursor belongs to ('' if none was recorded)."""
        return bytes(self._rows[row]["cursor_plan"]).decode("ascii", "replace")

    def set_cursor_plan(self, row: int, plan: str) -> None:
        """Only while the row has no committed cursor: the cursors it publishes from now on are of `plan`."""
        self._rows[row]["cursor_plan"] = plan.encode("ascii")[:24]

    def set_planned_items(self, row: int, n: int, evals: int = 0) -> None:
        """A producer's plan: `n` items over the run, `evals` of them evaluation items."""
        self._rows[row]["planned_eval_items"] = evals
        self._rows[row]["planned_items"] = n

    def planned_items(self) -> int:
        """Batches all producers that have started plan to publish over the run."""
        rows = self._rows
        return int(rows["planned_items"][rows["role"] == Role.PRODUCER].sum())

    def set_row_status(self, row: int, status: RowStatus) -> None:
        self._rows[row]["status"] = status

    def row_status(self, row: int) -> RowStatus:
        return RowStatus(int(self._rows[row]["status"]))

    def heartbeat(self, row: int) -> None:
        self._rows[row]["heartbeat_ns"] = time.time_ns()

    def rows(self) -> np.ndarray:
        return self._rows.copy()

    # ---- counters and flags -------------------------------------------------

    def produced_tokens(self) -> int:
        """Tokens every producer has published (their rows' `tokens`; see layout.ROW_DTYPE for how exact)."""
        producers = int(self.fingerprint_fields["topology.producers"])
        return int(self._rows["tokens"][1 : 1 + producers].sum())

    def counter(self, c: Counter) -> int:
        """A header counter; PRODUCED and CONSUMED are the sums of the producer and consumer rows' items."""
        producers = int(self.fingerprint_fields["topology.producers"])
        if c == Counter.PRODUCED:
            return self._items_of_rows(1, producers)
        if c == Counter.CONSUMED:
            return self._items_of_rows(1 + producers, self.geometry.n_rows - 1 - producers)
        return self._counters[c].load()

    def increment(self, c: Counter) -> int:
        return self._counters[c].fetch_add(1)

    def set_flag(self, c: Counter, value: int = 1) -> None:
        self._counters[c].store(value)

    @property
    def draining(self) -> bool:
        return self._counters[Counter.DRAIN].load() != 0

    @property
    def shutting_down(self) -> bool:
        return self._counters[Counter.SHUTDOWN].load() != 0

    def broadcast(self) -> None:
        """Wake every waiter, e.g. after shutdown was set: each looks at the flags again."""
        for sem in (self._sem_ready, self._sem_free):
            for _ in range(self.geometry.n_rows):
                sem.release()

    # ---- producer side ------------------------------------------------------

    def try_acquire(self, row: int) -> SlotWriter | None:
        """Claim a FREE slot for writing and take the next item number; None if the ring is full."""
        states = self._desc["state"].copy()
        n = len(states)
        start = random.randrange(n)
        for k in range(n):
            slot = (start + k) % n
            word = int(states[slot])
            if word & 0xFF != SlotState.FREE:
                continue
            if self._unconsumed(slot):  # a READY word rewritten to FREE: its item is not this producer's to drop
                if self._restore_unconsumed(slot, word):
                    log.error("slot %d (item %d) is corrupt: its state word %#x says FREE over a published item no "
                              "drafter claimed (the protocol cannot produce that: another process wrote the "
                              "segment); made READY again, redelivered, counted corrupt", slot,
                              int(self._desc[slot]["item"]), word)
                continue
            mine = pack_state(word >> 24, row, SlotState.WRITING)
            if self._states[slot].cmpxchg_strong(expected=word, desired=mine):
                crash_point("claimed")  # the descriptor still shows the slot's previous item here
                self._clear_header(slot)
                item = self._counters[Counter.NEXT_ITEM].fetch_add(1)
                d = self._desc[slot]
                d["item"], d["claimed_ns"], d["deliveries"] = item, time.time_ns(), 0
                geo = self.geometry
                area = self._slot_area(slot)
                return SlotWriter(slot, item, mine, SlotLayout(geo.slot_bytes, geo.slot_header_bytes), area)
        return None

    def _clear_header(self, slot: int) -> None:
        """A claimed slot keeps no header until its publish writes one: the header left by the slot's previous
        item would let a corrupted word pass an unpublished slot off as that old, already trained item."""
        off = self.geometry.slot_offset(slot)
        self._mv[off : off + 4] = b"\0\0\0\0"

    def acquire(self, row: int, timeout_s: float | None = None) -> SlotWriter | None:
        """Claim a slot, waiting while the ring is full. None on drain, shutdown or timeout."""
        return self._wait(lambda: None if self.draining else self.try_acquire(row), self._sem_free, row, timeout_s)

    def publish(self, w: SlotWriter, row: int, cursor: tuple[int, int] | None = None, replayed: int = 0,
                tokens: int = 0) -> None:
        """Make the slot READY. With a cursor, the producer's resume point moves to it in the same step.

        The resume point is (cursor, replayed): the next batch of the plan, and how many entries of the
        producer's replay list are published. It is recorded before the compare-and-swap, with the claim
        (state word, generation included) that commits it; if the producer dies before the CAS, the
        reaper rolls it back with the slot, and only for that very claim: never for a later claim of
        the same slot.
        """
        header = encode_header(SlotHeader(w.layout.specs, w.meta), self.geometry.slot_header_bytes)
        off = self.geometry.slot_offset(w.slot)
        self._mv[off : off + len(header)] = header
        if cursor is not None:
            r = self._rows[row]
            r["prev_cursor"] = r["cursor"] if r["has_cursor"] else (-1, -1)
            r["prev_replayed"] = r["replayed"]
            r["pending_word"] = w.word
            r["cursor"] = cursor
            r["replayed"] = replayed
            r["has_cursor"] = 1
        ready = pack_state(w.word >> 24, row, SlotState.READY)
        self._arm(row, w.slot, w.word)
        if not self._states[w.slot].cmpxchg_strong(expected=w.word, desired=ready):
            self._disarm(row)
            raise SlotLostError(f"slot {w.slot} (item {w.item}) was reclaimed while this process wrote it")
        crash_point("published")
        self._count(row)
        self._rows[row]["tokens"] += tokens  # only this producer writes its row
        self._hint(self._sem_ready)

    def abort(self, w: SlotWriter) -> None:
        """Give a claimed slot back unpublished (e.g. on shutdown)."""
        self._clear_header(w.slot)  # a FREE slot with a header and no delivery is an unconsumed item (_unconsumed)
        if self._states[w.slot].cmpxchg_strong(expected=w.word, desired=pack_state((w.word >> 24) + 1, NO_OWNER, SlotState.FREE)):
            self._hint(self._sem_free)

    # ---- consumer side ------------------------------------------------------

    def try_claim(self, row: int) -> SlotReader | None:
        """Claim the READY slot with the lowest item number; None if none is READY.

        A slot whose header fails validation is dropped (back to FREE, counted)
        and SlotFormatError is raised, so the caller can log it and go on.
        """
        states = self._desc["state"].copy()
        ready = np.flatnonzero((states & 0xFF) == _READY)
        if len(ready) > 1:
            ready = ready[np.argsort(self._desc["item"][ready], kind="stable")]
        for slot in ready.tolist():
            word = int(states[slot])
            mine = pack_state(word >> 24, row, SlotState.READING)
            if not self._states[slot].cmpxchg_strong(expected=word, desired=mine):
                continue
            d = self._desc[slot]
            d["claimed_ns"] = time.time_ns()
            d["deliveries"] += 1
            item, deliveries = int(d["item"]), int(d["deliveries"])
            area = self._slot_area(slot)
            try:
                header = self._header(slot)
            except SlotFormatError as e:
                self._states[slot].cmpxchg_strong(
                    expected=mine, desired=pack_state((word >> 24) + 1, NO_OWNER, SlotState.FREE))
                self._counters[Counter.CORRUPT].fetch_add(1)
                self._hint(self._sem_free)
                raise SlotFormatError(f"slot {slot} (item {item}) dropped: {e}") from None
            tensors = {s.name: view(area, s) for s in header.tensors}
            return SlotReader(slot, item, mine, deliveries, tensors, header.meta)
        return None

    def claim(self, row: int, timeout_s: float | None = None) -> SlotReader | None:
        """Claim the oldest READY item, waiting while the ring is empty. None on shutdown or timeout.

        An empty ring is never a reason to stop: only the supervisor's shutdown is. Once shutdown
        is set nothing more is claimed (a normal end has an empty ring; `stop --now` means stop),
        so what is READY then is exactly what goes untrained.
        """
        return self._wait(lambda: None if self.shutting_down else self.try_claim(row), self._sem_ready, row,
                          timeout_s)

    def release(self, r: SlotReader) -> None:
        """Hand a consumed slot back to the producers."""
        free = pack_state((r.word >> 24) + 1, NO_OWNER, SlotState.FREE)
        row = (r.word >> 8) & 0xFFFF
        self._arm(row, r.slot, r.word)
        if not self._states[r.slot].cmpxchg_strong(expected=r.word, desired=free):
            self._disarm(row)
            raise SlotLostError(f"slot {r.slot} (item {r.item}) was reclaimed while this process read it")
        crash_point("released")
        self._count(row)
        self._hint(self._sem_free)

    def requeue(self, r: SlotReader) -> None:
        """Give a claimed item back unconsumed, for another consumer to take."""
        if self._states[r.slot].cmpxchg_strong(expected=r.word, desired=pack_state((r.word >> 24) + 1, NO_OWNER, SlotState.READY)):
            self._hint(self._sem_ready)

    # ---- reaper -------------------------------------------------------------

    def reclaim_slots_of(self, row: int) -> tuple[int, int]:
        """Undo what a dead row held: WRITING -> FREE, READING -> READY. Returns (freed, redelivered).

        The caller must hold the dead row's lock, so no successor runs meanwhile.
        """
        freed = redelivered = 0
        self._settle(row)  # first: whether its last CAS happened is read from the slot words as they are
        for slot, word in enumerate(self._desc["state"].copy()):
            word = int(word)
            if (word >> 8) & 0xFFFF != row:
                continue
            state = word & 0xFF
            if state == SlotState.WRITING:
                new, c = pack_state((word >> 24) + 1, NO_OWNER, SlotState.FREE), Counter.RECLAIMED
                self._clear_header(slot)  # written but never published: no item (see _unconsumed)
            elif state == SlotState.READING:
                new, c = pack_state((word >> 24) + 1, NO_OWNER, SlotState.READY), Counter.REDELIVERED
            else:
                continue
            if self._states[slot].cmpxchg_strong(expected=word, desired=new):
                self._counters[c].fetch_add(1)
                if c == Counter.RECLAIMED:
                    r = self._rows[row]
                    if r["has_cursor"] and r["pending_word"] == word:
                        r["cursor"] = r["prev_cursor"]  # the claim that committed it was never published
                        r["replayed"] = r["prev_replayed"]
                    freed += 1
                else:
                    redelivered += 1
        if freed:
            self._hint(self._sem_free)
        if redelivered:
            self._hint(self._sem_ready)
        return freed, redelivered

    # A row's `items` is the one count of what it published (producer) or released (consumer);
    # PRODUCED and CONSUMED are their sums. Each count moves with a CAS in three steps, so that a
    # death between the CAS and the count is repaired by whoever reclaims the row (_settle):
    #   _arm: record (slot, the word the CAS expects, items + 1); the CAS; _count: items = that.

    def _arm(self, row: int, slot: int, expected: int) -> None:
        r = self._rows[row]
        r["intent_word"] = expected
        r["intent_items"] = r["items"] + 1
        r["intent_slot"] = slot + 1  # last: armed only once the rest is in place

    def _disarm(self, row: int) -> None:
        self._rows[row]["intent_slot"] = 0

    def _count(self, row: int) -> None:
        r = self._rows[row]
        r["items"] = r["intent_items"]  # an assignment, so completing it twice counts once
        r["intent_slot"] = 0

    def _settle(self, row: int) -> None:
        """For a dead row (its lock held): complete its count if its CAS happened, else drop it.

        The CAS happened iff the slot's word moved off the expected one: a WRITING or READING word
        owned by the dead row changes only by its own CAS or by this reclaim, which comes after.
        """
        r = self._rows[row]
        slot = int(r["intent_slot"]) - 1
        if slot < 0:
            return
        if 0 <= slot < self.geometry.n_slots and int(self._desc[slot]["state"]) != int(r["intent_word"]):
            r["items"] = r["intent_items"]
        r["intent_slot"] = 0

    def _items_of_rows(self, first: int, count: int) -> int:
        return int(self._rows["items"][first : first + count].sum())

    def owned_slots(self) -> set[int]:
        """Rows that hold a WRITING or READING slot right now."""
        states = self._desc["state"].copy()
        held = np.isin(states & 0xFF, (SlotState.WRITING, SlotState.READING))
        return {int(w >> 8) & 0xFFFF for w in states[held]}

    # ---- words the protocol cannot produce ----------------------------------

    def repair_impossible_words(self) -> list[CorruptSlot]:
        """Put every slot whose state word the protocol cannot produce back where the protocol goes on.

        Such a word (a state byte that is no state, an owner row outside the process table or of a role
        that never holds that state) is nobody's to undo: the reaper would wait forever for an owner that
        does not exist, and a state nobody counts lets the run end without the item. So the slot is
        counted corrupt and its item made READY again if its header reads (a claim clears the header, so
        a readable one is this item's, published), else FREE. Each change is a CAS from the impossible
        word, so a process that moved the word meanwhile wins. The supervisor calls this every pass.
        """
        words = self._desc["state"].copy()  # before the roles: a row's role, once set, never goes back
        roles = self._rows["role"].copy()
        found = []
        for slot in _suspects(words, roles).tolist():
            word = int(words[slot])
            if (why := impossible_word(word, roles)) is not None and (c := self._repair(slot, word, why)):
                found.append(c)
        # A READY word rewritten to a FREE one the protocol can reach: only the slot's contents tell (_unconsumed).
        maybe = ((words & 0xFF) == SlotState.FREE) & (words != 0) & (self._desc["deliveries"] == 0)
        for slot in np.flatnonzero(maybe).tolist():
            word = int(words[slot])
            if impossible_word(word, roles) is None and self._unconsumed(slot):
                if self._restore_unconsumed(slot, word):
                    found.append(CorruptSlot(slot, int(self._desc[slot]["item"]), word, "says FREE over a published "
                                             "item no drafter claimed", "made READY again: redelivered"))
        return found

    def _repair(self, slot: int, word: int, why: str) -> CorruptSlot | None:
        item = int(self._desc[slot]["item"])
        gen = word >> 24
        if word & 0xFF == SlotState.FREE and self._unconsumed(slot):
            new, outcome = pack_state(gen + 1, NO_OWNER, SlotState.READY), ("made READY again: a published item "
                                                                            "nobody consumed, redelivered")
        elif word & 0xFF == SlotState.FREE:
            new, outcome = pack_state(gen + 1, NO_OWNER, SlotState.FREE), "owner cleared (a free slot holds no item)"
        else:
            try:
                self._header(slot)
                new, outcome = pack_state(gen + 1, NO_OWNER, SlotState.READY), "made READY again: redelivered"
            except SlotFormatError as e:
                new, outcome = pack_state(gen + 1, NO_OWNER, SlotState.FREE), f"freed, its item dropped: {e}"
        if not self._states[slot].cmpxchg_strong(expected=word, desired=new):
            return None  # moved meanwhile: looked at again on the next pass
        self._counters[Counter.CORRUPT].fetch_add(1)
        self._hint(self._sem_ready if new & 0xFF == SlotState.READY else self._sem_free)
        return CorruptSlot(slot, item, word, why, outcome)

    def _unconsumed(self, slot: int) -> bool:
        """Whether the slot, whatever its word says, holds a published item that no consumer ever claimed.

        Every item that reaches FREE by the protocol either was never published (its claim cleared the
        header, and an abort or a reclaim of a dead writer clears what a publish may have written) or was
        claimed by a consumer first (its claim counts a delivery before any release). So a readable header
        with no delivery is a published item whose READY word was rewritten by someone outside the protocol
        (a same-user process can write the segment): the item is still owed."""
        if int(self._desc[slot]["deliveries"]) != 0:
            return False
        off = self.geometry.slot_offset(slot)
        if self._mv[off : off + 4] == b"\0\0\0\0":  # cleared by a claim (or a new ring): the common case, cheap
            return False
        try:
            self._header(slot)
        except SlotFormatError:
            return False
        return True

    def _restore_unconsumed(self, slot: int, word: int) -> bool:
        """CAS a FREE word over an unconsumed item back to READY, counted corrupt (a process that moved it
        meanwhile wins); the caller names it."""
        if not self._states[slot].cmpxchg_strong(expected=word, desired=pack_state((word >> 24) + 1, NO_OWNER,
                                                                                    SlotState.READY)):
            return False
        self._counters[Counter.CORRUPT].fetch_add(1)
        self._hint(self._sem_ready)
        return True

    # ---- observation --------------------------------------------------------

    def unfinished_items(self) -> tuple[list[dict[str, Any]], list[str]]:
        """The metadata of every item published and not yet trained (READY, or READING by a holder that may
        die, or under a state word the protocol cannot produce: see repair_impossible_words); and a line for each
        such slot whose header cannot be read. Used by whoever removes the ring, so that what it held is
        produced again (supervisor/unfinished.py)."""
        metas, damaged = [], []
        desc = self._desc.copy()
        roles = self._rows["role"].copy()
        for slot, word in enumerate(desc["state"].tolist()):
            why = impossible_word(word, roles)
            published = word & 0xFF in (SlotState.READY, SlotState.READING)
            if word & 0xFF == SlotState.FREE and self._unconsumed(slot):
                published, why = True, "says FREE over a published item no drafter claimed"
            if not published and (why is None or word & 0xFF == SlotState.FREE):
                continue  # free, or being written by a producer: nothing published to keep
            name = f"slot {slot} (item {int(desc['item'][slot])})"
            try:
                metas.append(dict(self._header(slot).meta))
            except SlotFormatError as e:
                damaged.append(f"{name}: {e}" + (f" (its state word {why})" if why else ""))
                continue
            if why is not None:  # a word nobody could have written: the item is still owed, so it is kept
                log.error("%s is corrupt: its state word %#x %s; its item is kept for the replay list", name, word, why)
        return metas, damaged

    def unfinished_item_numbers(self) -> set[int]:
        """The item numbers of every slot READY or READING: what the ring itself still delivers or replays (a dead
        drafter's journal leaves them out, common/trained_journal.py)."""
        desc = self._desc.copy()
        held = np.isin(desc["state"] & 0xFF, (SlotState.READY, SlotState.READING))
        return {int(i) for i in desc["item"][held]}

    def _header(self, slot: int) -> SlotHeader:
        geo = self.geometry
        return decode_header(self._mv[geo.slot_offset(slot):][: geo.slot_header_bytes], geo.slot_bytes,
                             geo.slot_header_bytes)

    def slot_counts(self) -> dict[str, int]:
        states = self._desc["state"] & 0xFF
        return {s.name.lower(): int(np.count_nonzero(states == s)) for s in SlotState}

    def status(self) -> RingStatus:
        now = time.time_ns()
        rows = []
        for i, r in enumerate(self._rows.copy()):
            if r["role"] == Role.NONE:
                continue
            rows.append({
                "row": i,
                "role": Role(int(r["role"])).name.lower(),
                "index": int(r["index"]),
                "pid": int(r["pid"]),
                "status": RowStatus(int(r["status"])).name.lower(),
                "heartbeat_age_s": round((now - int(r["heartbeat_ns"])) / 1e9, 3),
                "items": int(r["items"]),
                "restarts": int(r["restarts"]),
            })
        return RingStatus(
            run=self.identity.run_name,
            created_ns=self.identity.created_ns,
            n_slots=self.geometry.n_slots,
            slot_bytes=self.geometry.slot_bytes,
            slots_by_state=self.slot_counts(),
            counters={c.name.lower(): self.counter(c) for c in Counter},
            rows=rows,
        )

    # ---- internals ------------------------------------------------------------

    def _tensor(self) -> torch.Tensor:
        if self._bytes is None:
            import torch

            self._bytes = torch.frombuffer(self._mm, dtype=torch.uint8)
        return self._bytes

    def _slot_area(self, slot: int) -> torch.Tensor:
        area = self._areas[slot]
        if area is None:
            off = self.geometry.slot_offset(slot)
            area = self._areas[slot] = self._tensor()[off : off + self.geometry.slot_bytes]
        return area

    def _hint(self, sem: posix_ipc.Semaphore) -> None:
        # Bounded, so hints never pile up beyond one per process.
        if sem.value < self.geometry.n_rows:
            sem.release()

    def _wait(self, attempt, sem: posix_ipc.Semaphore, row: int, timeout_s: float | None):
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        waited_from = None
        try:
            while True:
                got = attempt()
                if got is not None or self.shutting_down:
                    return got
                if self.draining and sem is self._sem_free:
                    return None
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    return None
                waited_from = waited_from or now
                self.heartbeat(row)
                wait = self.wait_s if deadline is None else min(self.wait_s, deadline - now)
                with contextlib.suppress(posix_ipc.BusyError):
                    sem.acquire(wait)
        finally:
            if waited_from is not None:
                self.wait_seconds += time.monotonic() - waited_from


def _prefault(mm: mmap.mmap) -> None:
    """Touch every page once so tmpfs allocates now, not during the first hot-path copy."""
    if hasattr(mmap, "MADV_POPULATE_WRITE"):
        try:
            mm.madvise(mmap.MADV_POPULATE_WRITE)
            return
        except OSError:
            pass
    pages = np.frombuffer(mm, dtype=np.uint8)
    pages[:: mmap.PAGESIZE] = 0
    del pages


def _check_shm_space(nbytes: int, run: str) -> None:
    """tmpfs overcommits: a ring larger than /dev/shm's free space would SIGBUS on first touch."""
    st = os.statvfs(SHM_DIR)
    free = st.f_bavail * st.f_frsize
    if nbytes > free:
        raise MemoryError(
            f"ring for run {run!r} needs {nbytes / 2**30:.2f} GiB of shared memory but {SHM_DIR} has "
            f"{free / 2**30:.2f} GiB free: lower ring.slots or ring.slot_bytes, or enlarge {SHM_DIR}"
        )
