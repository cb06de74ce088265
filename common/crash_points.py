"""Deterministic crash points, for tests only: die exactly where a SIGKILL would hurt most.

`DFLASH_RING_CRASH_AT=name[@n]` in a process's environment makes it SIGKILL itself the n-th
time (default: the first) it passes `crash_point(name)`. Unset, a crash point is one string
comparison. Names: "stated" (a slot CASed to WRITING or READING by a claim its row states, the slot's descriptor
not yet naming its holder), "claimed" (a slot CASed to WRITING, its item not numbered yet),
"published" and "released" (the slot's CAS done, its counts not yet updated), "trained" (a drafter's
step on an item returned, its slot not yet released), "ring.prefaulted" (the supervisor's new segment
prefaulted, its header not written: a segment with no magic); `regenerate`'s "regenerate.shard_written" (a shard's
temporary file synced, not yet renamed) and "regenerate.shard_renamed" (the shard file in place, its record
not yet written); "checkpoint.written" (a drafter checkpoint's files synced in its temporary directory, in the
background writer's thread when checkpoints are asynchronous; no manifest yet, not renamed), "checkpoint.renamed"
(renamed into place, `latest` not moved) and "checkpoint.latest" (`latest` moved, the journal and the ledger not
told).
"""

from __future__ import annotations

import os
import signal

_NAME, _, _NTH = os.environ.get("DFLASH_RING_CRASH_AT", "").partition("@")
_TARGET = int(_NTH or 1) if _NAME else 0
_passed = 0


def crash_point(name: str) -> None:
    global _passed
    if name != _NAME:
        return
    _passed += 1
    if _passed == _TARGET:
        os.kill(os.getpid(), signal.SIGKILL)
