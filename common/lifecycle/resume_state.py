"""A producer's resume point on disk: where its plan goes on, and the batches a stopped run left untrained.

While the ring lives it holds each producer's resume point, committed with every publish; this file
holds it for when the ring is gone (a producer restarted into a new ring starts here). Whoever removes
a ring (the supervisor at the end of a run, `clean`, the reclaim of a stale run) first writes the items
still in it into their producer's replay list (supervisor/unfinished.py), so a run stopped at any moment
and started again produces them again before going on: nothing published is lost with the ring.

The file carries the crc32 of its content (`sum`, over the other fields in a canonical form): a digit changed on
disk (an epoch, a position, the replayed count, an entry of the replay list, a taken segment's name) is damage,
refused by name, never a resume point that skips or repeats batches. One checksum for the whole record, not one per
entry: the file is replaced whole at every commit, and its fields only mean something together (`replayed` counts
entries of `replay`; `taken` says which journal segments are in it), so no part of a damaged one can be trusted
alone. A file without `sum` was written by an earlier version: it is read as before (a producer restarted mid-run
onto this version resumes) and carries a sum from its next commit on. Either way its counts are held to their
ranges here, and to the producer's plan by producer/resume.py's check_resume_point.
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

from dflash_ring.common.bounded_read import RECORD_BYTES, read_text

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResumeState:
    """Where a producer starts: the entries of `replay` from `replayed` on, then its plan from (epoch, position)."""

    epoch: int = 0
    position: int = 0
    # (epoch, position) of batches published into a ring that was removed before they were trained.
    replay: tuple[tuple[int, int], ...] = ()
    replayed: int = 0  # how many entries of `replay` are published again
    # The sealed drafter journal segments (common/lifecycle/trained_journal.py) whose entries for this producer are in
    # `replay`: each is taken once, by name.
    taken: tuple[str, ...] = ()

    @property
    def pending_replay(self) -> tuple[tuple[int, int], ...]:
        return self.replay[self.replayed :]


def cursor_path(state_dir: str | os.PathLike, run: str, index: int) -> Path:
    return Path(state_dir).expanduser() / run / f"producer-{index}.json"


class CursorFileError(RuntimeError):
    """A cursor file that exists but cannot be read: starting over at epoch 0 would redo (or with a ring's replay
    list, lose) data, so it is refused; the message names the file and what to do."""


class CursorFile:
    """The resume point on disk, tagged with the data plan it belongs to (a changed plan ignores it)."""

    def __init__(self, path: Path, plan: str, description: str = ""):
        self.path = path
        self.plan = plan
        self.description = description  # for people: which data and settings `plan` stands for

    def load(self) -> ResumeState | None:
        saved = self.read()
        if saved is None:
            return None
        plan, _, state = saved
        if plan != self.plan:
            log.warning("ignoring cursor file %s: it belongs to another data set or batching plan", self.path)
            return None
        return state

    def read(self) -> tuple[str, str, ResumeState] | None:
        """(plan, plan description, state) whatever the plan; None when absent, CursorFileError when damaged."""
        try:
            saved = json.loads(read_text(self.path, RECORD_BYTES, CursorFileError, "cursor file"))
            if "sum" in saved and saved.pop("sum") != _checksum(saved):
                raise CursorFileError(
                    f"cursor file {self.path} does not match its checksum (a digit or a byte changed since it was "
                    "written): restore it, or delete it to start this producer's shard again from the beginning "
                    "(epoch 0)"
                )
            state = ResumeState(
                int(saved["epoch"]),
                int(saved["position"]),
                tuple((int(e), int(p)) for e, p in saved.get("replay", [])),
                int(saved.get("replayed", 0)),
                tuple(str(k) for k in saved.get("taken", [])),
            )
            if min(state.epoch, state.position) < 0 or not 0 <= state.replayed <= len(state.replay):
                raise CursorFileError(
                    f"cursor file {self.path} holds epoch {state.epoch}, position {state.position} and replayed "
                    f"{state.replayed} of a replay list of {len(state.replay)} entries, which no producer writes: "
                    "restore it, or delete it to start this producer's shard again from the beginning (epoch 0)"
                )
            return str(saved.get("plan", "")), str(saved.get("plan_description", "")), state
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError, OverflowError) as e:
            raise CursorFileError(
                f"cursor file {self.path} cannot be read ({type(e).__name__}: {e}): restore it, or delete "
                "it to start this producer's shard again from the beginning (epoch 0)"
            ) from None

    def save(self, state: ResumeState, *, durable: bool = False) -> None:
        """Replace the file atomically; `durable` also fsyncs it (the one copy left once the ring is gone)."""
        fields = {
            "epoch": state.epoch,
            "position": state.position,
            "plan": self.plan,
            "plan_description": self.description,
            "replay": [list(x) for x in state.replay],
            "replayed": state.replayed,
            "taken": list(state.taken),
        }
        body = json.dumps(fields | {"sum": _checksum(fields)})
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(body)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, self.path)
        if durable:
            dfd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)

    def description_of(self, plan: str) -> str:
        """What the file says `plan` was (it names the previous plan until this producer first publishes)."""
        saved = self.read()
        return saved[1] if saved is not None and saved[0] == plan else ""


def _checksum(fields: dict) -> str:
    """The crc32 of a cursor record's fields (all but `sum`), in the one canonical form both sides compute."""
    return f"{zlib.crc32(json.dumps(fields, sort_keys=True, separators=(',', ':')).encode()):08x}"
