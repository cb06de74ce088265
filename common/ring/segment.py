"""A run's shared-memory segment: its names (the one place they are spelled), its creation, mapping and removal.

A segment is the mapping and nothing of the protocol: the header's identity (checked against the run's spec on
attach), numpy views of the process table and slot descriptors, the compare-and-swap words, the two wake-up
semaphores. `Ring` (common/ring/__init__.py) composes it with the table, the slots and their repair. It takes a
`RingSpec`, never the application's Config: the ring stands below config (tests/test_layering.py).
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np
import posix_ipc

from dflash_ring.common.atomic_words import atomic_words
from dflash_ring.common.crash_points import crash_point
from dflash_ring.common.layout import (
    DESC_BYTES,
    DESC_DTYPE,
    FINGERPRINT_BLOB_OFFSET,
    HEADER_BYTES,
    ROW_DTYPE,
    Counter,
    Geometry,
    Identity,
    RingHeaderError,
    is_initialized,
    publish_magic,
    read_identity,
    write_identity,
)
from dflash_ring.common.ownership import ForeignObjectError, check_private_fd, check_semaphore, semaphore_path
from dflash_ring.common.run_name import check_run_name
from dflash_ring.common.slot_format import SlotHeader, decode_header

if TYPE_CHECKING:  # torch is imported where tensors are made: `status`, `stop` and `clean` never load it
    import torch

SHM_DIR = Path("/dev/shm")
PREFIX = "/dflash-ring."
log = logging.getLogger(__name__)


# ---- names ------------------------------------------------------------------------------------


def segment_name(run: str) -> str:
    return f"{PREFIX}{check_run_name(run, 'the ring name')}"


def replica_segment_name(run: str) -> str:
    """Where the drafter replicas of a run average their parameters (consumer/training/replicas.py)."""
    return f"{segment_name(run)}.replicas"


def semaphore_names(run: str) -> tuple[str, str]:
    return f"{segment_name(run)}.ready", f"{segment_name(run)}.free"


def segment_files(run: str) -> list[Path]:
    """The run's segments as files (the ring's and its replicas'), for who maps them (common/ring_users.py)."""
    return [SHM_DIR / segment_name(run)[1:], SHM_DIR / replica_segment_name(run)[1:]]


def check_kinds(run: str) -> None:
    """Whatever /dev/shm holds under the run's segment and semaphore names is a regular file, else ForeignObjectError
    naming it: posix_ipc's answer for a directory there was a bare ValueError ('Invalid parameter(s)'), a traceback
    from status, stop, clean and every role. Not ours to remove: the user removes it or picks another run.name."""
    for path in [*segment_files(run), *(semaphore_path(s) for s in semaphore_names(run))]:
        try:
            mode = path.lstat().st_mode
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else "a symlink" if stat.S_ISLNK(mode) else "not a regular file"
            raise ForeignObjectError(
                f"{path} is {kind}, not a shared-memory object of a ring: something else holds the name of run "
                f"{run!r}; remove it by hand if it is yours, or choose another run.name"
            )


def leftover_files(run: str) -> list[Path]:
    """Whatever /dev/shm holds under the run's names: its segments, its semaphores, anything else named after it."""
    base = segment_name(run)[1:]
    return [
        SHM_DIR / n
        for n in sorted(os.listdir(SHM_DIR))
        if n == base or n.startswith(f"{base}.") or n.startswith(f"sem.{base}.")
    ]


def fingerprint_digest(fields: Mapping[str, Any]) -> bytes:
    """The header's digest of what every process of a run must agree on."""
    text = "\n".join(f"{k}={fields[k]!r}" for k in sorted(fields))
    return hashlib.sha256(text.encode()).digest()


# ---- errors -----------------------------------------------------------------------------------


class RingNotFound(FileNotFoundError):
    pass


class HalfCreatedRingError(RingHeaderError):
    """The run's segment exists but has no magic yet: its supervisor is creating it, or died doing so.

    A RingHeaderError, so whoever judges a damaged ring stale (`supervisor --reclaim-stale`, `clean`)
    judges this one the same way: reclaimable once no process of the run is alive. It never held an
    item (nobody attaches before the magic), so removing it loses nothing."""

    def __init__(self, run: str):
        super().__init__(
            f"segment {segment_name(run)} has no ring header: a supervisor died while creating it (e.g. killed while "
            f"prefaulting a large ring), or is creating it right now. If no process of run {run!r} is alive, "
            f"`dflash-ring supervisor --reclaim-stale` or `dflash-ring clean {run}` removes it"
        )


class ConfigMismatchError(RuntimeError):
    """This process's config differs from the one the ring was created with."""


# ---- the spec ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class RingSpec:
    """What a ring is made from: its run, its geometry, what every process must agree on, and how it waits.

    `fields` are stored in the header; the ring reads back `topology.producers`, `topology.consumers` (which rows
    are whose) and `run.lock_dir` (where the run's processes hold their locks). common/ring_spec.py makes one from
    a run's config; the ring bench makes its own."""

    run: str
    geometry: Geometry
    fields: Mapping[str, Any]
    wait_s: float = 0.2  # longest sleep on a wake-up hint before a waiter looks again
    pin: bool = True  # page-lock the mapping for CUDA when asked to (common/pinning.py)
    attach_timeout_s: float = 0.0  # how long `Ring.attach` waits for the supervisor's segment
    fingerprint: bytes = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "fingerprint", fingerprint_digest(self.fields))

    @classmethod
    def of(
        cls,
        run: str,
        *,
        producers: int,
        consumers: int,
        slots: int,
        slot_bytes: int,
        slot_header_bytes: int,
        lock_dir: str | os.PathLike | None = None,
        agreed: Mapping[str, Any] | None = None,
        **how: Any,
    ) -> RingSpec:
        """A spec from the few numbers a ring has. `lock_dir`: where the run's processes hold their locks (none for
        a ring whose users hold none, as in the ring bench); `agreed`: further fields every process must agree on."""
        own = {
            "run.name": run,
            "ring.slots": slots,
            "ring.slot_bytes": slot_bytes,
            "ring.slot_header_bytes": slot_header_bytes,
            "topology.producers": producers,
            "topology.consumers": consumers,
        }
        if lock_dir is not None:
            own["run.lock_dir"] = os.path.abspath(lock_dir)
        geometry = Geometry(
            n_slots=slots, n_rows=1 + producers + consumers, slot_bytes=slot_bytes, slot_header_bytes=slot_header_bytes
        )
        return cls(run, geometry, {**(agreed or {}), **own}, **how)


# ---- the segment ------------------------------------------------------------------------------


class Segment:
    """One process's mapping of a run's segment, with views of what the protocol reads and writes."""

    def __init__(self, run: str, shm: posix_ipc.SharedMemory, identity: Identity, fields: dict[str, Any]):
        self.run, self.name = run, segment_name(run)
        self.identity = identity
        self.geometry: Geometry = identity.geometry
        self.fields = fields
        self._mm = mmap.mmap(shm.fd, shm.size)
        shm.close_fd()
        self.mv = memoryview(self._mm)
        geo = self.geometry
        self.rows = np.frombuffer(self._mm, dtype=ROW_DTYPE, count=geo.n_rows, offset=geo.table_offset)
        self.desc = np.frombuffer(self._mm, dtype=DESC_DTYPE, count=geo.n_slots, offset=geo.desc_offset)
        # The columns every claim writes (Slots._claim, Slots.release), as views made once: a field of `rows[row]`
        # costs a record object per write (~1 us a claim against ~0.15 us).
        self.claim_word, self.claim_slot = self.rows["claim_word"], self.rows["claim_slot"]
        self.holder, self.released = self.desc["holder"], self.desc["released"]
        self.counters = dict(zip(Counter, atomic_words(self._mm, list(Counter))))
        self.states = atomic_words(self._mm, [geo.desc_offset + i * DESC_BYTES for i in range(geo.n_slots)])
        self._bytes = None  # a uint8 tensor over the mapping, made on first use (operator commands never need torch)
        self._areas: list[torch.Tensor | None] = [None] * geo.n_slots  # each slot's bytes, made on first use
        self.pin = None  # a HostRegistration (common/pinning.py) when the mapping is page-locked
        ready, free = semaphore_names(run)
        self.sem_ready = posix_ipc.Semaphore(ready)
        self.sem_free = posix_ipc.Semaphore(free)

    def check(self, spec: RingSpec) -> None:
        """Refuse a spec whose fields differ from the ones the segment was created with, naming each."""
        if spec.fingerprint == self.identity.fingerprint:
            return
        mine, theirs = spec.fields, self.fields
        diffs = [
            f"{k}: ring has {theirs.get(k, '<unset>')!r}, this process has {mine.get(k, '<unset>')!r}"
            for k in sorted(set(mine) | set(theirs))
            if mine.get(k) != theirs.get(k)
        ] or ["(fields equal but digest differs: the header is damaged)"]
        raise ConfigMismatchError(
            f"config of this process does not match ring {self.name}: "
            + "; ".join(diffs)
            + ". Start every process of a run with the same config file."
        )

    # ---- header words -----------------------------------------------------------------------

    @property
    def draining(self) -> bool:
        return self.counters[Counter.DRAIN].load() != 0

    @property
    def shutting_down(self) -> bool:
        return self.counters[Counter.SHUTDOWN].load() != 0

    def hint(self, sem: posix_ipc.Semaphore) -> None:
        # Bounded, so hints never pile up beyond one per process.
        if sem.value < self.geometry.n_rows:
            sem.release()

    def broadcast(self) -> None:
        """Wake every waiter, e.g. after shutdown was set: each looks at the flags again."""
        for sem in (self.sem_ready, self.sem_free):
            for _ in range(self.geometry.n_rows):
                sem.release()

    # ---- slot bytes -------------------------------------------------------------------------

    def tensor(self) -> torch.Tensor:
        if self._bytes is None:
            import torch

            self._bytes = torch.frombuffer(self._mm, dtype=torch.uint8)
        return self._bytes

    def slot_area(self, slot: int) -> torch.Tensor:
        area = self._areas[slot]
        if area is None:
            off = self.geometry.slot_offset(slot)
            area = self._areas[slot] = self.tensor()[off : off + self.geometry.slot_bytes]
        return area

    def header(self, slot: int) -> SlotHeader:
        geo = self.geometry
        return decode_header(
            self.mv[geo.slot_offset(slot) :][: geo.slot_header_bytes], geo.slot_bytes, geo.slot_header_bytes
        )

    def clear_header(self, slot: int) -> None:
        """A claimed slot keeps no header until its publish writes one: the header left by the slot's previous
        item would let a corrupted word pass an unpublished slot off as that old, already trained item."""
        off = self.geometry.slot_offset(slot)
        self.mv[off : off + 4] = b"\0\0\0\0"

    def close(self) -> None:
        """Drop this process's mapping. Tensor views handed out must be gone first."""
        if self._mm.closed:
            return
        if self.pin is not None:
            self.pin.close()
        del (
            self.rows,
            self.desc,
            self.claim_word,
            self.claim_slot,
            self.holder,
            self.released,
            self._bytes,
            self._areas,
            self.counters,
            self.states,
        )
        self.mv.release()
        self.sem_ready.close()
        self.sem_free.close()
        try:
            self._mm.close()
        except BufferError:
            pass  # a caller still holds a slot view; the mapping goes when that view does


# ---- create, open, remove ---------------------------------------------------------------------


def create(spec: RingSpec) -> Segment:
    """Create the run's segment and semaphores exclusively (mode 0600). Supervisor only."""
    run, geo = spec.run, spec.geometry
    check_kinds(run)
    _check_shm_space(geo.total_bytes, run)
    blob = msgpack.packb(dict(spec.fields), use_bin_type=True)
    for sem in semaphore_names(run):
        posix_ipc.Semaphore(sem, posix_ipc.O_CREX, mode=0o600, initial_value=0).close()
    shm = posix_ipc.SharedMemory(segment_name(run), posix_ipc.O_CREX, mode=0o600, size=geo.total_bytes)
    with mmap.mmap(shm.fd, geo.total_bytes) as mm:
        _prefault(mm)
        crash_point("ring.prefaulted")  # the segment exists with no magic: what a supervisor killed here leaves
        buf = memoryview(mm)
        write_identity(buf, geo, time.time_ns(), spec.fingerprint, run, blob)
        publish_magic(buf)
        buf.release()
    shm2 = posix_ipc.SharedMemory(segment_name(run))
    shm.close_fd()
    return _map(run, shm2)


def open_segment(run: str, timeout_s: float = 0.0) -> Segment:
    """Map the run's existing segment, waiting up to `timeout_s` for its supervisor to create it."""
    name = segment_name(run)
    deadline = time.monotonic() + timeout_s
    announced = False
    while True:
        half_created = False
        check_kinds(run)  # in the loop: what appears while we wait is looked at too
        try:
            shm = posix_ipc.SharedMemory(name)
            if shm.size >= 8:
                with mmap.mmap(shm.fd, 8, prot=mmap.PROT_READ) as head:
                    ready = is_initialized(memoryview(head))
                if ready:
                    return _map(run, shm)
            shm.close_fd()
            half_created = True
        except posix_ipc.ExistentialError:
            pass
        if time.monotonic() >= deadline and half_created:
            raise HalfCreatedRingError(run)  # not "does not exist": starting a supervisor is what failed
        if time.monotonic() >= deadline:
            raise RingNotFound(
                f"no ring for run {run!r} (shared-memory segment {name} does not exist"
                + (f" after waiting {timeout_s:.0f}s" if timeout_s else "")
                + "): is the supervisor running? Start it with `dflash-ring supervisor --config ...`"
            )
        if not announced:
            log.info(
                "waiting up to %.0fs for the ring of run %r (%s): is its supervisor running?", timeout_s, run, name
            )
            announced = True
        time.sleep(0.05)


def _map(run: str, shm: posix_ipc.SharedMemory) -> Segment:
    name = segment_name(run)
    fix = (
        f"If it is a stale run of yours, remove it as its owner with `dflash-ring clean {run}`; "
        f"else choose another run.name"
    )
    try:
        check_private_fd(shm.fd, f"shared-memory segment {name}", fix)
    except ForeignObjectError:
        shm.close_fd()
        raise
    with mmap.mmap(shm.fd, min(shm.size, HEADER_BYTES), prot=mmap.PROT_READ) as head:
        buf = memoryview(head)
        try:
            identity = read_identity(buf, shm.size, name, run)
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
            f"of this run, then remove it with `dflash-ring clean {run}` and start again."
        ) from None
    try:
        for sem in semaphore_names(run):  # /dev/shm is sticky: nobody can swap ours later
            check_semaphore(sem, fix)
    except ForeignObjectError:
        shm.close_fd()
        raise
    try:
        return Segment(run, shm, identity, fields)
    except posix_ipc.ExistentialError:
        raise RingHeaderError(
            f"segment {name} exists but its semaphores do not: a half-removed run. "
            f"Remove it with `dflash-ring clean {run}`"
        ) from None


def unlink(run: str) -> list[str]:
    """Remove the run's segments and semaphores (whatever exists); return what was removed.

    Another user's objects under the run's names are refused, not removed: as root this
    would delete someone else's run, and as anyone else it fails halfway.
    """
    check_kinds(run)
    for path in [*segment_files(run), *(semaphore_path(s) for s in semaphore_names(run))]:
        try:
            uid = path.stat().st_uid
        except FileNotFoundError:
            continue
        if uid != os.geteuid():
            raise ForeignObjectError(
                f"{path} belongs to uid {uid}, not to this user (uid {os.geteuid()}): not removing another "
                f"user's objects; its owner (or root, by hand) must remove it, or choose another run.name"
            )
    removed = []
    for name, kind in [
        (segment_name(run), posix_ipc.unlink_shared_memory),
        (replica_segment_name(run), posix_ipc.unlink_shared_memory),
    ] + [(s, posix_ipc.unlink_semaphore) for s in semaphore_names(run)]:
        try:
            kind(name)
            removed.append(name)
        except posix_ipc.ExistentialError:
            pass
    return removed


def exists(run: str) -> bool:
    check_kinds(run)
    try:
        posix_ipc.SharedMemory(segment_name(run)).close_fd()
        return True
    except posix_ipc.ExistentialError:
        return False


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
