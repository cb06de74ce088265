"""The ring's atomic words (common/atomic_words.py) are atomic across processes on one shared mapping."""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os

import posix_ipc
import pytest

from dflash_ring.common.atomic_words import atomic_words

ROUNDS = 20_000
WORKERS = 2


def _hammer(name: str, start) -> None:
    """Each round: one fetch-add on word 0, and one increment of word 1 by a compare-and-swap loop."""
    shm = posix_ipc.SharedMemory(name)
    mm = mmap.mmap(shm.fd, shm.size)
    shm.close_fd()
    added, swapped = atomic_words(mm, [0, 64])
    start.wait()
    for _ in range(ROUNDS):
        added.fetch_add(1)
        while True:
            seen = swapped.load()
            if swapped.cmpxchg_strong(expected=seen, desired=seen + 1):
                break


@pytest.mark.processes
def test_concurrent_increments_from_processes_are_never_lost():
    # A plain read-modify-write on the shared page loses increments when two processes race;
    # every one of these must land.
    name = f"/dflash-ring-test-atomic-{os.getpid()}"
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=4096)
    try:
        mm = mmap.mmap(shm.fd, shm.size)
        shm.close_fd()
        added, swapped = atomic_words(mm, [0, 64])
        ctx = mp.get_context("spawn")
        start = ctx.Event()
        procs = [ctx.Process(target=_hammer, args=(name, start)) for _ in range(WORKERS)]
        for p in procs:
            p.start()
        start.set()
        for p in procs:
            p.join(timeout=300)
            assert p.exitcode == 0
        assert added.load() == WORKERS * ROUNDS
        assert swapped.load() == WORKERS * ROUNDS
        assert not swapped.cmpxchg_strong(expected=0, desired=7)  # a stale expectation changes nothing
        assert swapped.load() == WORKERS * ROUNDS
        swapped.store(2**64 - 1)  # the full unsigned 64-bit range: state words use the top bits
        assert swapped.fetch_add(1) == 2**64 - 1 and swapped.load() == 0
    finally:
        posix_ipc.unlink_shared_memory(name)


def test_a_mapping_with_live_words_cannot_be_unmapped_under_them():
    mm = mmap.mmap(-1, 4096)
    (word,) = atomic_words(mm, [8])
    with pytest.raises(BufferError):
        mm.close()
    word.store(5)
    assert word.load() == 5
    del word
    mm.close()


def test_misaligned_or_outside_words_are_refused():
    mm = mmap.mmap(-1, 4096)
    for offset in (4, 4092, 4096, -8):
        with pytest.raises(ValueError, match="aligned 8-byte word"):
            atomic_words(mm, [offset])
