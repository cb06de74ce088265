"""What the producers still owe before a run may end: batches dead drafters trained after their checkpoints.

Every producer done and an empty ring is not yet the end: a drafter that died meanwhile lost the updates of the
batches it trained after its last checkpoint, and its sealed journal (common/lifecycle/trained_journal.py) asks for them
again. A finished producer stays to publish them (producer/process.py `serve_replays`); the supervisor waits
while any is owed: in a sealed segment the producer has not taken yet, or taken into its replay list and not
yet published.
"""

from __future__ import annotations

from dflash_ring.common.layout import Role
from dflash_ring.common.lifecycle.resume_state import CursorFile, CursorFileError, cursor_path
from dflash_ring.common.ring import Ring
from dflash_ring.common.lifecycle.trained_journal import owed_to


def owed(state_dir: str, run_name: str, checkpoint_dir: str, ring: Ring) -> dict[int, int]:
    """Producer index -> batches it still owes (only producers that owe some). `state_dir`: target.state_dir, where
    the producers' cursor files are; `checkpoint_dir`: train.checkpoint_dir, where the drafters' journals are."""
    out = {}
    for row, r in enumerate(ring.rows()):
        if r["role"] != Role.PRODUCER:
            continue
        index = int(r["index"])
        try:
            saved = CursorFile(cursor_path(state_dir, run_name, index), "").read()
        except CursorFileError:
            saved = None  # its producer refuses to start on it, with the reason
        state = saved[2] if saved is not None else None
        taken = state.taken if state is not None else ()
        n = sum(len(entries) for _, entries in owed_to(index, checkpoint_dir, taken))
        if state is not None:
            published = ring.committed_replayed(row) if ring.committed_cursor(row) is not None else state.replayed
            n += max(0, len(state.replay) - published)
        if n:
            out[index] = n
    return out
