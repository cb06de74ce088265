"""Where a producer starts again, and the batches it publishes from there.

Its resume point comes from the ring's process table while the ring holds one (checked against this producer's data
plan, `ShardBatcher.plan_key`, exactly as the cursor file's is), else from its cursor file in target.state_dir. The
batches: its replay list's pending entries first (what a removed ring still held, or what dead drafters' sealed
journals ask for again, producer/live_replay.py), then the plan from the cursor, each carrying what it commits.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace

from dflash_ring.common.lifecycle.resume_state import CursorFile, ResumeState
from dflash_ring.common.ring import ProducerPort

from .batching import Batch, Cursor, ShardBatcher
from .live_replay import LiveReplay


class PlanMismatchError(RuntimeError):
    """The ring row's resume point counts batches of another data plan: resuming there would skip or redo data."""


class ResumePointError(RuntimeError):
    """A resume point (the ring's, or the cursor file's) that this producer's plan does not have: started there, a
    huge epoch would lose the rest of the shard in silence, a huge position was a traceback at every start."""


def check_resume_point(start: ResumeState, batches: Sequence[int], source: str) -> None:
    """Refuse (ResumePointError, one line naming `source`) a resume point outside the plan: `batches`, this shard's
    batch count in each epoch of data.epochs. The end of the shard (epoch data.epochs, position 0) is one."""
    epochs, e, q = len(batches), start.epoch, start.position
    if 0 <= e < epochs and 0 <= q <= batches[e] or (e, q) == (epochs, 0):
        return
    has = f"{batches[e]} batches in epoch {e}" if 0 <= e < epochs else f"data.epochs = {epochs}"
    raise ResumePointError(
        f"the {source} resumes this producer at epoch {e} position {q}, which its plan does not have ({has}; the "
        f"shard ends at epoch {epochs} position 0): it is damaged, or of a run with more epochs. Restore it (or "
        f"data.epochs), or delete the cursor file to start the shard again from the beginning (epoch 0)"
    )


def resume_point(port: ProducerPort, cursor_file: CursorFile) -> tuple[ResumeState, str]:
    """Where to start; the ring's cursor is checked against our plan exactly as the cursor file's is.

    The replay list always comes from the file (only a ring's removal changes it); how much of it is
    published comes from the ring while it holds our resume point.
    """
    saved = cursor_file.load()
    if (committed := port.committed_cursor()) is not None:
        theirs = port.cursor_plan()
        if theirs != cursor_file.plan:
            run = port.run
            what = cursor_file.description_of(theirs) or "its settings are not on this host"
            raise PlanMismatchError(
                f"the ring of run {run!r} holds this producer's resume point (epoch {committed[0]}, position "
                f"{committed[1]}) of data plan {theirs or '<unrecorded>'} ({what}), but this producer's data "
                f"plan is {cursor_file.plan} ({cursor_file.description}): finish the old run, or end it with "
                f"`dflash-ring stop {run}` (or `dflash-ring clean {run}` if its processes are dead) before "
                f"starting one with other data or batching, or restore the old data and data.* settings"
            )
        replay, taken = (saved.replay, saved.taken) if saved is not None else ((), ())
        return ResumeState(*committed, replay, min(port.committed_replayed(), len(replay)), taken), "ring"
    port.set_cursor_plan(cursor_file.plan)  # before our first publish: the cursors to come are of our plan
    if saved is not None:
        return saved, f"cursor file {cursor_file.path}"
    return ResumeState(), "start"


def resumed_batches(batcher: ShardBatcher, start: ResumeState, replay: LiveReplay) -> Iterator[Batch]:
    """The replay list's pending entries, then the plan from the cursor; each carries what it commits. Entries
    that join the list meanwhile (a dead drafter's sealed journal) go out before the next plan batch."""
    cursor, j = Cursor(start.epoch, start.position), start.replayed
    plan = batcher.batches(cursor)
    while True:
        replay.poll()
        for epoch, position in replay.entries_from(j):
            j += 1
            yield replace(batcher.batch_at(epoch, position), cursor=cursor, replayed=j, is_replay=True)
        if (batch := next(plan, None)) is None:
            return
        cursor = batch.cursor
        yield replace(batch, replayed=j)


def replays_after_the_end(batcher: ShardBatcher, replay: LiveReplay, replayed: int, epochs: int) -> Iterator[Batch]:
    """A finished shard's producer stays for the replays that dead drafters' journals still bring, until shutdown:
    the entries from `replayed` on (the cursor stays at the end)."""
    for j, (epoch, position) in enumerate(replay.entries_from(replayed), start=replayed):
        yield replace(batcher.batch_at(epoch, position), cursor=Cursor(epochs, 0), replayed=j + 1, is_replay=True)
