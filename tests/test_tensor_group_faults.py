"""A tensor-parallel target group under faults, in a real run: the supervisor, a 2-rank gloo group of the tiny target
(the leader is the producer, rank 1 its own process) and a drafter, the ledger on. A rank SIGKILLed mid-run takes
its leader down; a leader SIGKILLed takes its rank with it; the group is started again as one (what systemd's
Restart= does with the group's one unit) and every planned batch trains exactly once. A rank SIGSTOPped is named by
its leader within seconds (a group led from this process: seconds, not a run)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from pathlib import Path

import pytest
import torch

from support import build_target, cyclic_rows, packed_batch, pipeline_config, wait_exit, wait_for

from dflash_ring.common.config.target import TargetConfig
from dflash_ring.common.lifecycle.ledger import read_ledger
from dflash_ring.producer.process import prepare, run_target
from dflash_ring.producer.target import TargetModel
from dflash_ring.producer.tensor_group import TensorGroup
from dflash_ring.tools.chaos import group_ranks
from dflash_ring.tools.reconcile import read_ledgers, reconcile


def alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.processes
def test_a_group_member_killed_mid_run_restarts_the_group_and_the_ledger_is_exact(run):
    """One run, two faults in turn: its rank SIGKILLed, the group started again, then its leader SIGKILLed, the group
    started again, and the run to its end. (Two runs of a fault each before: one pays the supervisor's and the
    drafter's start-ups once, and the drafter lives through both.)"""
    target = build_target(run.tmp / "target", "qwen3", layers=4)
    data = cyclic_rows(run.tmp / "chat.jsonl", 96)
    ledger = run.tmp / "ledger"
    pipeline_config(
        run,
        target,
        data,
        {
            "run": {"ledger_dir": str(ledger)},
            "data": {"epochs": 3},
            "target": {"tensor_parallel": 2},
            "train": {"checkpoint_every_steps": 4},
        },
        consumers=1,
        slots=6,
    )
    sup, leader, drafter = run.supervisor(), run.role("target", 0), run.role("drafter", 0)
    for killed in ("rank", "leader"):
        published = lambda: sum(
            r["ev"] == "pub" and r["pid"] == leader.pid  # noqa: E731
            for r in read_ledger(ledger / "target-0.jsonl").records
        )
        wait_for(
            lambda: (ledger / "target-0.jsonl").exists() and published() >= 3,
            timeout=300,
            what=f"the group publishing before its {killed} is killed",
        )
        ranks = group_ranks(leader.pid)
        assert len(ranks) == 1, ranks  # the group's rank 1, started by its leader
        if killed == "rank":
            os.kill(ranks[0], signal.SIGKILL)
            assert wait_exit(leader, 60) == 1  # the leader goes down with its rank
            assert "tensor-parallel rank 1" in (err := leader.stderr.read()) and "SIGKILL" in err, err[-2000:]
        else:
            leader.send_signal(signal.SIGKILL)
            assert wait_exit(leader, 60) == -signal.SIGKILL
            wait_for(lambda: not alive(ranks[0]), timeout=60, what="the rank dying with its leader")
        assert drafter.poll() is None and sup.poll() is None
        leader = run.role("target", 0)  # the group started again as one
    for p in (leader, drafter, sup):
        assert wait_exit(p, 600) == 0, p.stderr.read()[-3000:]
    rec = reconcile(read_ledgers(ledger)[0])
    assert rec["problems"] == [], rec["problems"]
    assert rec["lost_in_flight"] == 0 and rec["trained_twice"] == 0
    assert rec["trained_exactly_once"] == rec["planned_batches"] > 0, rec
    assert run.leftovers() == []


@pytest.mark.processes
def test_a_stopped_rank_is_named_by_its_leader_within_seconds_and_the_forward_ends_as_before(tmp_path, caplog):
    """A rank SIGSTOPped blocked its leader's next forward in silence until the group's 30-minute timeout (issue 46):
    now the leader's beat watch names it (rank, pid, the forward it waits in) within seconds, and again when it
    answers after SIGCONT; the forward then ends with the features it gave before the stall, and the rank stops
    cleanly with the group. The group as tests/test_tensor_group.py starts one: this process its leader."""
    path = build_target(tmp_path / "qwen3", "qwen3")
    cfg = TargetConfig(path=str(path), num_draft_layers=2, tensor_parallel=2, ship_final_hidden=False)
    batch = prepare(packed_batch([37, 8, 120]), packed=False, pad_id=0, pin=False)
    said = lambda: " | ".join(r.getMessage() for r in caplog.records)  # noqa: E731
    with (
        caplog.at_level(logging.WARNING, logger="dflash_ring.producer.tensor_group"),
        TensorGroup.held(cfg, torch.device("cpu"), contextlib.nullcontext) as group,
    ):
        target = TargetModel.load(cfg, torch.device("cpu"), packed=False, group=group)
        before = run_target(target, batch).features
        (rank,) = group.ranks
        named = f"tensor-parallel rank 1 (pid {rank.pid}) has not answered for"

        def resume_once_named() -> None:
            try:
                wait_for(lambda: named in said(), timeout=30, what="the leader naming its stopped rank")
            finally:  # named or not, the forward must end: the test fails below, not in 30 minutes
                os.kill(rank.pid, signal.SIGCONT)

        os.kill(rank.pid, signal.SIGSTOP)
        resumer = threading.Thread(target=resume_once_named)
        resumer.start()
        after = run_target(target, batch).features  # blocked in the forward's collectives until SIGCONT
        resumer.join()
        assert named in said() and "the leader has waited on it in a forward for" in said(), said()
        wait_for(lambda: f"rank 1 (pid {rank.pid}) answers again after" in said(), timeout=30, what="answers again")
    assert torch.equal(before, after)
    assert rank.returncode == 0  # told to stop, it left the group and exited cleanly
