"""What one ring slot holds: a msgpack header, then raw tensor bytes at aligned offsets.

    [ "DFS1" | header length u32 | msgpack header ... ][ tensor 0 ][ tensor 1 ] ...
    ^ slot start                                       ^ slot_header_bytes

The header names each tensor (dtype, shape, byte offset) and carries the item's
metadata. A reader trusts nothing in it: every offset, shape and length is
checked against the slot bounds before a view is made, so a corrupted slot
raises SlotFormatError instead of reading out of bounds. No pickle: msgpack
with size limits, and a fixed set of dtypes.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgpack

if TYPE_CHECKING:  # torch is imported where tensors are made, so `status`, `stop` and `clean` never load it
    import torch

PAYLOAD_MAGIC = b"DFS1"
_PREFIX = struct.Struct("<4sI")
ALIGN = 256  # tensor offsets: enough for any dtype and for vectorized copies
MAX_TENSORS = 64
MAX_NDIM = 8
MAX_NAME = 128

# dtypes that may travel, by name, with their sizes in bytes.
ITEMSIZE: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}


def torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str | None:
    """The travelling name of a torch dtype, or None if it may not travel."""
    name = str(dtype).removeprefix("torch.")
    return name if name in ITEMSIZE else None


class SlotFormatError(ValueError):
    """A slot's header or layout cannot be trusted."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # from the slot start

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


@dataclass
class SlotHeader:
    tensors: list[TensorSpec] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)


class SlotLayout:
    """Places tensors one after another behind the header area, as a producer asks for them."""

    def __init__(self, slot_bytes: int, header_bytes: int):
        self.slot_bytes = slot_bytes
        self.header_bytes = header_bytes
        self.specs: list[TensorSpec] = []
        self._next = header_bytes

    def add(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> TensorSpec:
        if (travelling := dtype_name(dtype)) is None:
            raise ValueError(f"tensor {name!r}: dtype {dtype} cannot travel through the ring")
        if any(s.name == name for s in self.specs):
            raise ValueError(f"tensor {name!r} added twice to one slot")
        if len(self.specs) >= MAX_TENSORS:
            raise ValueError(f"a slot holds at most {MAX_TENSORS} tensors")
        spec = TensorSpec(name, travelling, tuple(int(s) for s in shape), self._next)
        end = spec.offset + spec.nbytes
        if end > self.slot_bytes:
            raise ValueError(
                f"tensor {name!r} {list(shape)} {dtype} needs {end} bytes of a {self.slot_bytes}-byte slot: "
                f"raise ring.slot_bytes or lower the batch's token budget"
            )
        self.specs.append(spec)
        self._next = _round_up(end, ALIGN)
        return spec


def encode_header(header: SlotHeader, header_bytes: int) -> bytes:
    body = msgpack.packb(
        {
            "tensors": [[t.name, t.dtype, list(t.shape), t.offset] for t in header.tensors],
            "meta": header.meta,
        },
        use_bin_type=True,
    )
    out = _PREFIX.pack(PAYLOAD_MAGIC, len(body)) + body
    if len(out) > header_bytes:
        raise ValueError(
            f"slot header is {len(out)} bytes, more than ring.slot_header_bytes = {header_bytes}: "
            f"carry less metadata or raise that setting"
        )
    return out


def decode_header(buf: memoryview | bytes, slot_bytes: int, header_bytes: int) -> SlotHeader:
    """Parse and bounds-check a slot header read from shared memory."""
    if len(buf) < _PREFIX.size:
        raise SlotFormatError("slot is too small for a header")
    magic, body_len = _PREFIX.unpack_from(buf, 0)
    if magic != PAYLOAD_MAGIC:
        raise SlotFormatError(f"slot header magic is {magic!r}, expected {PAYLOAD_MAGIC!r}")
    if body_len > header_bytes - _PREFIX.size or _PREFIX.size + body_len > len(buf):
        raise SlotFormatError(
            f"slot header claims {body_len} bytes, the header area holds {header_bytes - _PREFIX.size}"
        )
    raw = bytes(buf[_PREFIX.size : _PREFIX.size + body_len])
    try:
        doc = msgpack.unpackb(
            raw,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=header_bytes,
            max_bin_len=header_bytes,
            max_array_len=1 << 16,
            max_map_len=1 << 12,
            max_ext_len=0,
        )
    except Exception as e:  # msgpack raises a zoo of types on garbage
        raise SlotFormatError(f"slot header is not valid msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(doc, dict) or set(doc) != {"tensors", "meta"}:
        raise SlotFormatError("slot header must be a map with exactly 'tensors' and 'meta'")
    if not isinstance(doc["meta"], dict):
        raise SlotFormatError("slot header 'meta' must be a map")
    entries = doc["tensors"]
    if not isinstance(entries, list) or len(entries) > MAX_TENSORS:
        raise SlotFormatError(f"slot header 'tensors' must be a list of at most {MAX_TENSORS}")
    specs = [_check_entry(e, slot_bytes, header_bytes) for e in entries]
    _check_disjoint(specs)
    return SlotHeader(specs, doc["meta"])


def _check_entry(entry: Any, slot_bytes: int, header_bytes: int) -> TensorSpec:
    if not (isinstance(entry, list) and len(entry) == 4):
        raise SlotFormatError(f"tensor entry {entry!r:.80} is not [name, dtype, shape, offset]")
    name, dtype, shape, offset = entry
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
        raise SlotFormatError(f"tensor name {name!r:.80} is not a short string")
    if not isinstance(dtype, str) or dtype not in ITEMSIZE:  # a list or map here is unhashable
        raise SlotFormatError(f"tensor {name!r} has unknown dtype {dtype!r:.40}")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_NDIM
        or not all(type(s) is int and 0 <= s < 1 << 40 for s in shape)
    ):
        raise SlotFormatError(f"tensor {name!r} has an invalid shape {shape!r:.80}")
    if type(offset) is not int or offset % ALIGN or offset < header_bytes:
        raise SlotFormatError(f"tensor {name!r} has an invalid offset {offset!r:.40}")
    spec = TensorSpec(name, dtype, tuple(shape), offset)
    if offset + spec.nbytes > slot_bytes:
        raise SlotFormatError(
            f"tensor {name!r} {shape} {dtype} at offset {offset} runs past the {slot_bytes}-byte slot"
        )
    return spec


def _check_disjoint(specs: list[TensorSpec]) -> None:
    end = 0
    names = set()
    for s in sorted(specs, key=lambda s: s.offset):
        if s.name in names:
            raise SlotFormatError(f"tensor {s.name!r} appears twice in one slot")
        names.add(s.name)
        if s.offset < end:
            raise SlotFormatError(f"tensor {s.name!r} overlaps the tensor before it")
        end = s.offset + s.nbytes


def view(slot: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """A zero-copy tensor over the slot's bytes (slot is a uint8 tensor over the slot area)."""
    import torch

    dtype = torch_dtype(spec.dtype)
    if spec.nbytes == 0:
        return torch.empty(spec.shape, dtype=dtype)
    return slot[spec.offset : spec.offset + spec.nbytes].view(dtype).view(spec.shape)


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to
