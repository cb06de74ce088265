"""SIGTERM is honoured within a bound in every phase of a producer, and in a drafter's waits (issue 23 item 4).

Once a producer has attached to its ring, SIGTERM only sets its stop flag, which the publish loop reads; the
phases before that loop (tokenizing the data, loading the model, the probe, building the plan) never read it,
so a producer told to stop while tokenizing used to tokenize to the end, load its model and only then stop.
Those phases now unwind at the signal: here, a producer stopped while tokenizing leaves no finished cache.
"""

from __future__ import annotations

import signal

import pytest

from dflash_ring.common.ring import Ring
from dflash_ring.common.ring_spec import ring_spec
from support import build_target, load_tokenizer, wait_exit, wait_for, write_chat_rows

ROWS = 40_000  # tokenizing them takes long enough (seconds even on a fast box) to be stopped in the middle


@pytest.mark.processes
def test_a_producer_stopped_while_tokenizing_stops_there(run, tmp_path):
    target = build_target(tmp_path / "model", "qwen3", layers=4)
    data = write_chat_rows(tmp_path / "big.jsonl", ROWS)
    cfg = run.write_config(
        1,
        1,
        slots=2,
        data={"path": str(data), "cache_dir": str(tmp_path / "cache"), "max_length": 256, "max_tokens_per_batch": 512},
        target={"path": str(target), "state_dir": str(tmp_path / "state"), "device": "cpu"},
        metrics={"enabled": False},
    )
    Ring.create(ring_spec(cfg)).close()
    proc = run.role("target", 0)
    log = tmp_path / "proc-0.stderr"
    wait_for(lambda: "tokenizing" in log.read_text(), timeout=120, what="the producer to start tokenizing")
    proc.send_signal(signal.SIGTERM)
    rc = wait_exit(proc, timeout=120)  # a hang guard, not a speed bound
    err = log.read_text()
    assert rc == 0 and "Traceback" not in err, err[-3000:]
    assert "stopped by SIGTERM while starting" in err, err[-3000:]
    assert not list((tmp_path / "cache").glob("tokenized-*/meta.json")), "it tokenized to the end after SIGTERM"
    assert "target " + str(target) not in err, "it went on to load the model"


@pytest.mark.processes
def test_a_drafter_stopped_while_waiting_for_its_first_item_exits_zero_and_leaves_its_row(run, tmp_path):
    """The drafter's other waiting phase: joined (row taken), no item ever published. SIGTERM ends it with exit 0
    (systemctl stop counts nothing else as clean), its row given back, the ring left to its supervisor."""
    target = build_target(tmp_path / "model", "qwen3", layers=4)
    cfg = run.write_config(
        1,
        1,
        slots=2,
        target={"path": str(target), "device": "cpu", "mask_token_id": len(load_tokenizer(target))},
        train={"device": "cpu", "checkpoint_dir": str(tmp_path / "ckpt")},
        metrics={"enabled": False},
    )
    with Ring.create(ring_spec(cfg)) as ring:
        proc = run.role("drafter", 0)
        log = tmp_path / "proc-0.stderr"
        wait_for(lambda: "drafter 0 on cpu" in log.read_text(), timeout=300, what="the drafter to join")
        assert [r["status"] for r in ring.status().rows if r["role"] == "consumer"] == ["running"]
        proc.send_signal(signal.SIGTERM)
        rc = wait_exit(proc, timeout=120)  # a hang guard, not a speed bound
        err = log.read_text()
        assert rc == 0 and "Traceback" not in err, err[-3000:]
        assert [r["status"] for r in ring.status().rows if r["role"] == "consumer"] == ["stopped"]
