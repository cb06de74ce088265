"""Lock-free 64-bit atomic operations on words of a shared mapping, at about 1 µs each.

The `atomics` package does each operation in its bundled C library (patomic) but wraps it in
Python layers (buffer checks, int<->bytes conversions, result objects) that cost ~9 µs per
compare-and-swap, the larger part of the ring's per-item cost. Here the same patomic functions
are called through ctypes at the word's address: the same hardware instruction (lock cmpxchg,
lock xadd on x86-64) on the same shared page, so the ring's protocol across processes is
unchanged. No compiler is needed: the library ships in atomics' wheel. It reaches into
atomics' private `_impl.patomic`, which is why pyproject.toml keeps atomics below 1.1.

Arguments live in fresh ctypes integers per call: ctypes releases the GIL around the call, so
scratch buffers shared between a process's threads would race.
"""

from __future__ import annotations

import ctypes
import mmap

from atomics import Alignment, MemoryOrder
from atomics._impl.patomic import Patomic

_SEQ_CST = int(MemoryOrder.SEQ_CST)
_WIDTH = 8
_ALIGN = Alignment(_WIDTH).recommended


def _ops():
    ops = Patomic.ops(_WIDTH)
    fns = (ops.xchg_ops.fp_cmpxchg_strong, ops.unsigned_ops.fp_fetch_add, ops.fp_load, ops.fp_store)
    if not all(fns):
        raise RuntimeError(
            f"the atomics package's patomic library has no lock-free {_WIDTH}-byte "
            f"compare-and-swap, fetch-add, load or store on this CPU: the ring cannot run here"
        )
    return fns


_CAS, _FETCH_ADD, _LOAD, _STORE = _ops()


class AtomicWord:
    """One aligned 64-bit word of a mapping. Holding it keeps the mapping mapped (see atomic_words)."""

    __slots__ = ("_addr", "_anchor")

    def __init__(self, anchor: ctypes.Array, offset: int):
        self._anchor = anchor
        self._addr = ctypes.addressof(anchor) + offset

    def cmpxchg_strong(self, expected: int, desired: int) -> bool:
        """Store desired iff the word equals expected; True if it did."""
        e, d = ctypes.c_uint64(expected), ctypes.c_uint64(desired)
        return bool(_CAS(self._addr, ctypes.addressof(e), ctypes.addressof(d), _SEQ_CST, _SEQ_CST))

    def fetch_add(self, value: int) -> int:
        """Add value; return the word as it was before."""
        v, out = ctypes.c_uint64(value), ctypes.c_uint64()
        _FETCH_ADD(self._addr, ctypes.addressof(v), _SEQ_CST, ctypes.addressof(out))
        return out.value

    def load(self) -> int:
        out = ctypes.c_uint64()
        _LOAD(self._addr, _SEQ_CST, ctypes.addressof(out))
        return out.value

    def store(self, value: int) -> None:
        v = ctypes.c_uint64(value)
        _STORE(self._addr, ctypes.addressof(v), _SEQ_CST)


def atomic_words(mm: mmap.mmap, offsets: list[int]) -> list[AtomicWord]:
    """The words of mm at these offsets. Each holds a buffer export of mm, so mm cannot be closed
    (mmap.close raises BufferError) while any of them is alive: no word points at unmapped memory."""
    anchor = (ctypes.c_char * len(mm)).from_buffer(mm)
    base = ctypes.addressof(anchor)
    for offset in offsets:
        if (base + offset) % _ALIGN or not 0 <= offset <= len(mm) - _WIDTH:
            raise ValueError(
                f"atomic word at offset {offset} is not a {_ALIGN}-byte aligned 8-byte word "
                f"of the {len(mm)}-byte mapping"
            )
    return [AtomicWord(anchor, offset) for offset in offsets]
