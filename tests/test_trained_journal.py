"""The drafter's journal of what it trained since its checkpoint (common/lifecycle/trained_journal.py), on real files.

What a crash must not lose and must not double: a dead drafter's segments after the checkpoint its successor
resumes from are sealed, without the items the ring still holds (the ring redelivers those); a second seal
changes nothing; covered segments go once a checkpoint is durable; each producer is owed only its own entries,
once per segment it has not taken.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from dflash_ring.common.lifecycle.trained_journal import (
    Journal,
    journal_dir,
    lost_segments,
    owed_to,
    read_entries,
    seal,
    seal_drafter,
    segments,
    successor_step,
)
from dflash_ring.consumer.training.checkpoint import Checkpoint, CheckpointStore


def _meta(p: int, e: int, q: int) -> dict[str, int]:
    return {"producer": p, "epoch": e, "position": q}


def _dead_drafter_journal(root, ring: int) -> None:
    """A real other process writes a journal across two checkpoints' states (steps 0 and 4) and exits."""
    code = f"""
from pathlib import Path
from dflash_ring.common.lifecycle.trained_journal import Journal
j = Journal(Path({str(journal_dir(root, 0))!r}), ring={ring}, after_step=0)
for q in range(3):
    j.append({{"producer": q % 2, "epoch": 0, "position": q}}, item=q)
j.rotate(4)
for q in range(3, 6):
    j.append({{"producer": q % 2, "epoch": 0, "position": q}}, item=q)
j.close()
"""
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.processes
def test_a_dead_drafters_journal_is_sealed_after_its_checkpoint_without_what_the_ring_holds(tmp_path):
    _dead_drafter_journal(tmp_path, ring=7)
    d = journal_dir(tmp_path, 0)
    assert sorted(s.after_step for s in segments(d, "open")) == [0, 4]
    # Its successor resumes from step 4: the step-0 segment is covered; item 5 is still READING in ring 7.
    assert seal(d, 4, ring=7, in_ring={5}) == 2
    (lost,) = lost_segments(tmp_path)
    assert lost.after_step == 4 and lost.key.startswith("drafter-0/lost-00000004-")
    assert [(k, [e.position for e in es]) for k, es in owed_to(1, tmp_path, taken=())] == [(lost.key, [3])]
    assert [[e.position for e in es] for _, es in owed_to(0, tmp_path, taken=())] == [[4]]
    assert owed_to(1, tmp_path, taken=[lost.key]) == []  # taken once, never again
    # Sealing again (the reaper and the successor both try) changes nothing: the first seal wins.
    assert seal(d, 4, ring=7, in_ring=set()) == 0 and len(lost_segments(tmp_path)) == 1
    assert [s.after_step for s in segments(d, "open")] == [0]  # covered, left for a fallback resume


@pytest.mark.processes
def test_items_of_another_ring_are_never_left_out(tmp_path):
    """Item numbers restart with each ring: an entry of ring 7 is not the ring-8 item that has its number."""
    _dead_drafter_journal(tmp_path, ring=7)
    assert seal(journal_dir(tmp_path, 0), 0, ring=8, in_ring={0, 1, 2, 3, 4, 5}) == 6


def test_the_writer_retires_only_what_every_kept_checkpoint_covers(tmp_path):
    d = journal_dir(tmp_path, 0)
    j = Journal(d, ring=1, after_step=0)
    j.append(_meta(0, 0, 0), item=0)
    j.rotate(2)
    j.append(_meta(0, 0, 1), item=1)
    j.rotate(4)
    j.append(_meta(0, 0, 2), item=2)
    j.covered(oldest_kept=2)  # checkpoints 2 and 4 kept: a resume from 2 needs what came after 2
    assert sorted(s.after_step for s in segments(d)) == [2, 4]
    # A live writer's own segments are never sealed by itself.
    assert seal(d, 0, ring=1, in_ring=set(), mine=os.getpid()) == 0
    j.close()


def _checkpoint(store: CheckpointStore, step: int) -> None:
    model = torch.nn.Linear(2, 2)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    store.save(Checkpoint(step, state, torch.optim.AdamW(model.parameters()).state_dict(), {}), keep=5)


@pytest.mark.processes
def test_a_dead_drafters_journal_is_sealed_against_the_checkpoint_its_successor_loads(tmp_path):
    """The journal is sealed against the step the store resumes from, by the store's own rule, in every state a kill
    inside `save` leaves. A drafter killed between renaming its first checkpoint (step 3) into place and writing
    `latest` left no pointer: its successor loads step 3, so what the journal holds up to step 3 is in the model
    and must not be produced again (sealed against the pointer, step 0, it was: trained twice)."""
    root = tmp_path / "drafter-0"
    store = CheckpointStore(root)

    def agree() -> int:
        ckpt = store.load_latest()
        assert successor_step(tmp_path, 0) == (ckpt.step if ckpt else 0)
        return successor_step(tmp_path, 0)

    assert agree() == 0  # no checkpoint: from the start
    _checkpoint(store, 3)
    (root / "latest").unlink()  # killed at crash point "checkpoint.renamed" of the first checkpoint
    assert agree() == 3
    _dead_drafter_journal(tmp_path, ring=7)  # segments after steps 0 (batches 0-2) and 4 (batches 3-5)
    assert seal_drafter(tmp_path, 0, ring=7, in_ring=()) == 3  # only what came after step 3
    assert [e.position for e in read_entries(lost_segments(tmp_path)[0].path)] == [3, 4, 5]
    _checkpoint(store, 6)
    (root / "latest").write_text("step-00000003\n")  # killed at "checkpoint.renamed" of the second: the pointer's
    assert agree() == 3
    (root / "latest").write_bytes(b"step-0000\xff")  # a damaged pointer orders nothing: the newest complete one
    assert agree() == 6
    for p in root.glob("step-*"):
        shutil.rmtree(p)
    (root / "latest").write_text("step-00000012\n")  # a pointer to no checkpoint: from the start
    assert agree() == 0
