"""Before a ring is removed, what it still holds goes back to its producers as replay lists.

Items READY in the ring (published, never claimed) and READING (claimed by a drafter that had not
finished training on them) exist nowhere else: a producer resumes after its last *published* batch.
So whoever removes a ring (the supervisor at the end, `clean`, the reclaim of a stale run) first
writes each producer's resume point with those items as its replay list (common/lifecycle/resume_state.py),
fsynced; the producer of the next run publishes them before going on. Only a host that loses
/dev/shm without any of these running (a reboot) loses them.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from dflash_ring.common.layout import Role
from dflash_ring.common.lifecycle.resume_state import CursorFile, CursorFileError, ResumeState, cursor_path
from dflash_ring.common.ring import Ring
from dflash_ring.common.lifecycle.trained_journal import owed_once, owed_to, seal_drafter

log = logging.getLogger(__name__)


@dataclass
class Unfinished:
    """What the ring held at its removal, and where it went."""

    saved: dict[int, int] = field(default_factory=dict)  # producer index -> items added to its replay list
    lost: list[str] = field(default_factory=list)  # items that could not be saved, and why

    @property
    def items(self) -> int:
        return sum(self.saved.values())


def seal_journals(ring: Ring, checkpoint_dir: str) -> int:
    """Seal every drafter's journal against its `latest` checkpoint (no drafter of the run is alive: the ring is
    being removed), leaving out the items the ring still holds (they go to the replay lists as the ring's)."""
    in_ring = ring.unfinished_item_numbers()
    root = Path(checkpoint_dir)
    indices = sorted(int(d.name.split("-")[1]) for d in root.glob("drafter-*") if d.name.split("-")[1].isdigit())
    return sum(seal_drafter(checkpoint_dir, i, ring.identity.created_ns, in_ring) for i in indices)


def save_unfinished(ring: Ring, state_dir: str, checkpoint_dir: str) -> Unfinished:
    """Write every producer's resume point, with the ring's untrained items and the batches dead drafters trained
    after their checkpoints (their sealed journals, common/lifecycle/trained_journal.py) added to its replay list.

    Call only when no process of the run is alive (the ring is being removed)."""
    out = Unfinished()
    seal_journals(ring, checkpoint_dir)
    metas, damaged = ring.unfinished_items()
    out.lost += [f"{d} (header unreadable: its batch cannot be produced again)" for d in damaged]
    held: dict[int, set[tuple[int, int]]] = defaultdict(set)
    for m in metas:
        try:
            held[int(m["producer"])].add((int(m["epoch"]), int(m["position"])))
        except (KeyError, TypeError, ValueError):
            out.lost.append(f"an item without a batch identity ({m})")
    run = ring.identity.run_name
    for row, r in enumerate(ring.rows()):
        if r["role"] != Role.PRODUCER:
            continue
        index = int(r["index"])
        items = held.pop(index, set())
        resume = ring.settled_resume(row)
        if resume is None:
            if items:
                out.lost.append(f"{len(items)} item(s) of producer {index}, which has no resume point in the ring")
            continue
        (epoch, position), replayed = resume
        f = CursorFile(cursor_path(state_dir, run, index), ring.cursor_plan(row))
        earlier: tuple[tuple[int, int], ...] = ()
        taken: tuple[str, ...] = ()
        try:
            old = f.read()
        except CursorFileError as e:  # the ring's record is what is written back; the file's replay list is gone
            out.lost.append(f"the replay list of producer {index}: {e}")
            old = None
        if old is not None:
            plan, f.description, state = old
            if plan == f.plan:
                earlier = state.replay[replayed:]  # entries not yet published again: still owed
                taken = state.taken
            elif state.pending_replay:
                out.lost.append(
                    f"{len(state.pending_replay)} replay entries of producer {index} in {f.path}: "
                    "they belong to another data plan"
                )
        owed = owed_to(index, checkpoint_dir, taken)
        from_ring = tuple(sorted(items - set(earlier)))
        # Each batch once, and none the producer has not published (owed_once names what contradicts the records).
        lost_with_drafters = tuple(owed_once(index, owed, earlier + from_ring, (epoch, position)))
        replay = earlier + from_ring + lost_with_drafters
        f.path.parent.mkdir(parents=True, exist_ok=True)
        f.save(ResumeState(epoch, position, replay, 0, taken + tuple(key for key, _ in owed)), durable=True)
        if items or lost_with_drafters:
            out.saved[index] = len(items) + len(lost_with_drafters)
    for index, items in held.items():
        out.lost.append(f"{len(items)} item(s) of producer {index}, which has no row in the ring")
    if out.items:
        log.warning(
            "the ring held %d untrained item(s) (with what dead drafters trained after their checkpoints); "
            "written to the producers' replay lists (%s): "
            "they are produced again first when the run starts again",
            out.items,
            ", ".join(f"producer {i}: {n}" for i, n in sorted(out.saved.items())),
        )
    for line in out.lost:
        log.error("lost with the ring: %s", line)
    return out
