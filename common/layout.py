"""Byte layout of the ring segment, and the checks that make a damaged header harmless.

    [ header: 8 KiB ][ process table ][ slot descriptors ][ payload 0 ][ payload 1 ] ...

Header: identity (magic, layout version, run, config fingerprint, geometry) and
64-bit counters, each on its own 64-byte line. Process table: one 256-byte row
per process (row 0 supervisor, then producers, then consumers). Slot descriptors:
64 bytes each; the first word is the slot's state word, changed only by
compare-and-swap. Payload areas are page-aligned so they can be pinned and
copied with DMA.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import numpy as np

from dflash_ring.common.run_name import is_valid as is_valid_run_name

MAGIC = b"DFLRING\x01"
LAYOUT_VERSION = 6  # 2: 192-byte rows (count intents), pending_word, run.lock_dir; 3: cursor_plan; 4: replayed;
# 5: planned_eval_items, tokens; 6: 256-byte rows with claim statements, descriptors' holder and released words
PAGE = 4096
HEADER_BYTES = 2 * PAGE
ROW_BYTES = 256
DESC_BYTES = 64
FINGERPRINT_BLOB_OFFSET = 1024
FINGERPRINT_BLOB_MAX = HEADER_BYTES - FINGERPRINT_BLOB_OFFSET

# Identity block: magic, version, n_slots, n_rows, slot_bytes, slot_header_bytes,
# payload_offset, total_bytes, created_ns, fingerprint sha256, run name, blob length.
_IDENTITY = struct.Struct("<8sIIIQQQQQ32s48sI")


# The values of Counter.STOP_REQUEST (and of the supervisor's own signals): drain, then stop now.
STOP_DRAIN = 1
STOP_NOW = 2


class Counter(enum.IntEnum):
    """Offsets of the header's atomic 64-bit words (one cache line each)."""

    NEXT_ITEM = 256  # the single sequence index producers fetch-add
    PRODUCED = 320
    CONSUMED = 384
    REDELIVERED = 448  # READING slots of dead consumers returned to READY
    RECLAIMED = 512  # WRITING slots of dead producers returned to FREE
    PRODUCERS_DONE = 576  # published by the supervisor, which owns the count
    DRAIN = 640  # 1: producers take no new work (SIGTERM or `stop`)
    SHUTDOWN = 704  # 1: everyone exits; set only by the supervisor (or `stop --now`)
    STOP_REQUEST = 768  # STOP_DRAIN or STOP_NOW: written by `dflash-ring stop`
    SUPERVISOR_ADOPTIONS = 832
    CORRUPT = 896  # READY slots dropped because their header failed validation, and slots whose state word
    # the protocol cannot produce (Ring.repair_impossible_words: their items redelivered where their header reads)


class SlotState(enum.IntEnum):
    FREE = 0
    WRITING = 1
    READY = 2
    READING = 3


class Role(enum.IntEnum):
    NONE = 0
    SUPERVISOR = 1
    PRODUCER = 2
    CONSUMER = 3


# One vocabulary, mapped here only: code, rows and lock files say producer/consumer (the ring's roles);
# what operators read (CLI, metrics, systemd units, logs, ledgers) says target/drafter (the processes).
ROLE_NAME = {Role.SUPERVISOR: "supervisor", Role.PRODUCER: "producer", Role.CONSUMER: "consumer"}
OPERATOR_NAME = {Role.SUPERVISOR: "supervisor", Role.PRODUCER: "target", Role.CONSUMER: "drafter"}


class RowStatus(enum.IntEnum):
    EMPTY = 0
    RUNNING = 1
    DONE = 2  # producer finished its shard; sticky until the row is taken again
    STOPPED = 3  # exited cleanly without finishing (drained or shut down)
    DEAD = 4  # found dead by the reaper


NO_OWNER = 0xFFFF


def pack_state(gen: int, owner: int, state: SlotState) -> int:
    """State word = generation (40 bits) | owner row (16 bits) | state (8 bits).

    The owner lives in the same word as the state so that claiming a slot and
    recording who holds it is one compare-and-swap: a process that dies right
    after its CAS still leaves a slot the reaper can attribute. The generation
    fences stale owners: every move to FREE or READY bumps it (a publish too), so only a claim keeps it, and no
    word a slot holds ever comes back: a WRITING or READING word names one claim.
    """
    return ((gen & 0xFF_FFFF_FFFF) << 24) | ((owner & 0xFFFF) << 8) | int(state)


ROW_DTYPE = np.dtype(
    {
        # planned_items: batches a producer will publish over the whole run (the trainers' LR schedule);
        # planned_eval_items: how many of them are evaluation items (held-out rows: evaluated, not trained).
        # A producer's resume point lives here, beside its row, so it survives the producer:
        # cursor is the committed (epoch, position); pending_word the state word of the WRITING claim
        # that committed it (generation included: a later claim of the same slot never matches it),
        # and prev_cursor what to roll back to if that very claim is reclaimed unpublished.
        # intent_*: a count about to change with a slot's CAS (common/ring/slots.py, Slots._commit): if the process
        # dies between the CAS and the count, whoever reclaims the row completes or drops the count.
        # intent_slot is the slot + 1 (0: no intent), so a fresh zeroed row holds none.
        # cursor_plan: the data plan (producer/batching.py ShardBatcher.plan_key) the cursor counts batches of, so a
        # producer restarted with other data or batching never resumes from a position of another plan.
        # replayed: how many entries of the producer's replay list (batches a stopped run left untrained,
        # common/lifecycle/resume_state.py) are published; it commits and rolls back with the cursor (prev_replayed).
        # tokens: tokens a producer published (the drafters' view of the producers' tokens/s). Added after the
        # publish, so a producer killed in between leaves one item's tokens out: a rate, where items is the
        # exactly-once count.
        # claim_slot, claim_word: the claim this row is making (slot + 1, 0: none, and the state word it is about to
        # CAS in), stated before the CAS and withdrawn once the slot's descriptor names the word (`holder`): with the
        # holder, what lets the supervisor tell a WRITING or READING word the row took from one written into the
        # segment by someone else (common/ring/slots.py, Slots._claim; common/ring/repair.py, repair_unstated_words).
        "names": [
            "role",
            "index",
            "pid",
            "heartbeat_ns",
            "started_ns",
            "items",
            "status",
            "restarts",
            "pending_word",
            "cursor",
            "prev_cursor",
            "has_cursor",
            "planned_items",
            "intent_slot",
            "intent_word",
            "intent_items",
            "cursor_plan",
            "replayed",
            "prev_replayed",
            "planned_eval_items",
            "tokens",
            "claim_slot",
            "claim_word",
        ],
        "formats": [
            "<u4",
            "<u4",
            "<u8",
            "<u8",
            "<u8",
            "<u8",
            "<u8",
            "<u8",
            "<u8",
            ("<i8", (2,)),
            ("<i8", (2,)),
            "<u8",
            "<u8",
            "<u8",
            "<u8",
            "<u8",
            "S24",
            "<u8",
            "<u8",
            "<u8",
            "<u8",
            "<u8",
            "<u8",
        ],
        "offsets": [0, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 104, 112, 120, 128, 136, 160, 168, 176, 184, 192, 200],
        "itemsize": ROW_BYTES,
    }
)

# holder: the state word the slot's last holder took it with (WRITING or READING), written by that holder after its
# CAS; released: the READING word of the last consumer that released it, written before its release CAS. Words never
# repeat (every transition but a claim moves the generation), so a slot whose word is its holder's is held by the
# protocol, and one whose holder was released holds a consumed item (common/ring/repair.py, repair_unstated_words).
DESC_DTYPE = np.dtype(
    {
        "names": ["state", "item", "claimed_ns", "deliveries", "holder", "released"],
        "formats": ["<u8", "<u8", "<u8", "<u8", "<u8", "<u8"],
        "offsets": [0, 8, 16, 24, 32, 40],
        "itemsize": DESC_BYTES,
    }
)


class RingHeaderError(RuntimeError):
    """The segment's header is not one this build can trust."""


@dataclass(frozen=True)
class Geometry:
    n_slots: int
    n_rows: int
    slot_bytes: int
    slot_header_bytes: int

    @property
    def slot_stride(self) -> int:
        return _round_up(self.slot_bytes, PAGE)

    @property
    def table_offset(self) -> int:
        return HEADER_BYTES

    @property
    def desc_offset(self) -> int:
        return self.table_offset + self.n_rows * ROW_BYTES

    @property
    def payload_offset(self) -> int:
        return _round_up(self.desc_offset + self.n_slots * DESC_BYTES, PAGE)

    @property
    def total_bytes(self) -> int:
        return self.payload_offset + self.n_slots * self.slot_stride

    def slot_offset(self, slot: int) -> int:
        return self.payload_offset + slot * self.slot_stride


@dataclass(frozen=True)
class Identity:
    version: int
    geometry: Geometry
    created_ns: int
    fingerprint: bytes
    run_name: str
    blob_len: int


def write_identity(
    buf: memoryview, geo: Geometry, created_ns: int, fingerprint: bytes, run_name: str, blob: bytes
) -> None:
    """Write everything but the magic; the magic goes last so a half-made header reads as 'initializing'."""
    if len(blob) > FINGERPRINT_BLOB_MAX:
        raise ValueError(f"fingerprint fields take {len(blob)} bytes, more than {FINGERPRINT_BLOB_MAX}")
    buf[FINGERPRINT_BLOB_OFFSET : FINGERPRINT_BLOB_OFFSET + len(blob)] = blob
    _IDENTITY.pack_into(
        buf,
        0,
        b"\0" * 8,
        LAYOUT_VERSION,
        geo.n_slots,
        geo.n_rows,
        geo.slot_bytes,
        geo.slot_header_bytes,
        geo.payload_offset,
        geo.total_bytes,
        created_ns,
        fingerprint,
        run_name.encode(),
        len(blob),
    )


def publish_magic(buf: memoryview) -> None:
    buf[0:8] = MAGIC


def is_initialized(buf: memoryview) -> bool:
    return bytes(buf[0:8]) != b"\0" * 8


def read_identity(buf: memoryview, segment_bytes: int, segment_name: str, run: str) -> Identity:
    """Parse and cross-check the identity block of run `run`'s segment; raise RingHeaderError on anything off."""
    fix = f"Stop every process of this run, then remove it with `dflash-ring clean {run}` and start again."
    if segment_bytes < HEADER_BYTES:
        raise RingHeaderError(f"segment {segment_name} is {segment_bytes} bytes, smaller than a ring header. {fix}")
    (
        magic,
        version,
        n_slots,
        n_rows,
        slot_bytes,
        slot_header_bytes,
        payload_offset,
        total,
        created_ns,
        fingerprint,
        run_name,
        blob_len,
    ) = _IDENTITY.unpack_from(buf, 0)
    if magic != MAGIC:
        raise RingHeaderError(f"segment {segment_name} has magic {magic!r}, not a dflash-ring header. {fix}")
    if version != LAYOUT_VERSION:
        raise RingHeaderError(
            f"segment {segment_name} has layout version {version}, this build reads version {LAYOUT_VERSION}: "
            f"run every process of a run from the same release. {fix}"
        )
    if not (
        1 <= n_slots <= 4096
        and 3 <= n_rows <= 4097
        and 0 < slot_header_bytes < slot_bytes < 1 << 40
        and blob_len <= FINGERPRINT_BLOB_MAX
    ):
        raise RingHeaderError(
            f"segment {segment_name} header has impossible geometry (slots={n_slots}, rows={n_rows}, "
            f"slot_bytes={slot_bytes}, slot_header_bytes={slot_header_bytes}). {fix}"
        )
    geo = Geometry(n_slots, n_rows, slot_bytes, slot_header_bytes)
    if payload_offset != geo.payload_offset or total != geo.total_bytes or total > segment_bytes:
        raise RingHeaderError(
            f"segment {segment_name} header is inconsistent: payload offset {payload_offset} (expected "
            f"{geo.payload_offset}), total {total} (expected {geo.total_bytes}, segment has {segment_bytes}). {fix}"
        )
    try:
        name = run_name.rstrip(b"\0").decode()
    except UnicodeDecodeError:
        name = ""
    if name != run or not is_valid_run_name(name):
        raise RingHeaderError(f"segment {segment_name} header names another run ({run_name!r:.60}). {fix}")
    return Identity(version, geo, created_ns, fingerprint, name, blob_len)


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to
