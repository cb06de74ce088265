"""`dflash-ring chaos` as CI runs it, and regression tests for what chaos runs found."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from support import build_target, load_tokenizer, wait_exit, wait_for

from dflash_ring.common.lifecycle.ledger import read_ledger
from dflash_ring.common.lifecycle.startup import DRAFTER_PHASES, SUPERVISOR_PHASES, TARGET_PHASES
from dflash_ring.tools.reconcile import reconcile


def _stderr_until(proc: subprocess.Popen, text: str, timeout: float) -> str:
    """Read the process's stderr until a line containing `text` (without waiting past its exit)."""
    seen = []

    def found() -> bool:
        line = proc.stderr.readline()
        seen.append(line)
        return text in line or (not line and proc.poll() is not None)

    wait_for(found, timeout=timeout, what=f"{text!r} on stderr")
    assert text in seen[-1], "".join(seen)[-3000:]
    return "".join(seen)


@pytest.mark.parametrize("role", ["target", "drafter"])
def test_sigterm_while_waiting_for_the_ring_ends_the_process(run, role):
    """Found by chaos: a target or drafter restarted after its run had ended waited the whole
    attach timeout for a ring that would never come, deaf to SIGTERM (systemctl stop hung)."""
    target = build_target(run.tmp / "target", "qwen3", layers=4)
    vocab = len(load_tokenizer(target))
    run.write_config(
        1,
        1,
        run={"attach_timeout_s": 600},
        target={"path": str(target), "device": "cpu", "mask_token_id": vocab},
        train={"device": "cpu", "checkpoint_dir": str(run.tmp / "ckpt")},
    )
    proc = run.role(role, 0)
    _stderr_until(proc, "waiting up to 600s for the ring", timeout=300)
    proc.send_signal(signal.SIGTERM)
    rc = wait_exit(proc, 120)  # well below the 600 s attach timeout (a deaf process would wait it out)
    assert rc in (0, -signal.SIGTERM), rc
    assert run.leftovers() == []


def _rec(ev, pid, t, **kw):
    return {"ev": ev, "pid": pid, "t": t, **kw}


def _batch(p, e, pos):
    return {"producer": p, "epoch": e, "pos": pos}


def test_ledger_reconciliation_counts_each_batch_trained_once_through_redelivery_and_replay(tmp_path):
    producer = [_rec("start", 10, 0, plan=[4], resume=[0, 0])]
    producer += [_rec("pub", 10, 1 + k, item=k, epoch=0, pos=k) for k in range(4)]
    # Pid 20 trains item 0 and is killed before releasing it: redelivered to pid 30 (deliveries 2), which
    # trains it again; the first train is undone (its slot was never released, its update died with it).
    d0 = [
        _rec("start", 20, 1, step=0),
        _rec("got", 20, 2, item=0, deliveries=1, **_batch(0, 0, 0)),
        _rec("train", 20, 2.5, step=1, item=0, deliveries=1, **_batch(0, 0, 0)),
    ]
    d1 = [
        _rec("start", 30, 1, step=0),
        _rec("got", 30, 4, item=0, deliveries=2, **_batch(0, 0, 0)),
        _rec("train", 30, 5, step=1, item=0, deliveries=2, **_batch(0, 0, 0)),
        _rec("got", 30, 6, item=1, deliveries=1, **_batch(0, 0, 1)),
        _rec("train", 30, 7, step=2, item=1, deliveries=1, **_batch(0, 0, 1)),
        _rec("got", 30, 7.5, item=2, deliveries=1, **_batch(0, 0, 2)),
        _rec("train", 30, 7.6, step=3, item=2, deliveries=1, **_batch(0, 0, 2)),
        _rec("exit", 30, 8, step=3),
    ]
    # Batch 3 was READY when the whole run stopped: the next run's producer replays it (another ring, item 0).
    # The new drafter may claim it before the producer's `pub` line is written: the start record announces it.
    replay = [
        _rec("start", 11, 20, plan=[4], resume=[1, 0], replay=[[0, 3]]),
        _rec("pub", 11, 22.5, item=0, epoch=0, pos=3, replay=True),
    ]
    d2 = [
        _rec("start", 40, 20, step=3),
        _rec("got", 40, 22, item=0, deliveries=1, **_batch(0, 0, 3)),
        _rec("train", 40, 23, step=4, item=0, deliveries=1, **_batch(0, 0, 3)),
        _rec("exit", 40, 24, step=4),
    ]
    ledgers = {"target-0": producer + replay, "drafter-0": d0, "drafter-1": d1, "drafter-2": d2}
    rec = reconcile(ledgers)
    assert rec["problems"] == [] and rec["missing"] == 0 and rec["lost_in_flight"] == 0
    assert rec["trained_exactly_once"] == rec["planned_batches"] == 4
    assert rec["trains_undone_by_redelivery_or_replay"] == 1 and rec["replayed_batches"] == 1
    assert rec["redelivered_items"] == 1 and rec["seen_twice_explained_by_redelivery_or_replay"] == 1
    # Ledger files come in any order (here the redelivered drafter's before the killed one's): time decides.
    swapped = reconcile({"target-0": producer + replay, "drafter-0": d1, "drafter-1": d0, "drafter-2": d2})
    assert swapped["problems"] == [] and swapped["seen_twice_explained_by_redelivery_or_replay"] == 1
    # A train of a batch later replayed is undone too: its drafter was killed before the release, and the ring was
    # removed (holding the slot) before anyone redelivered it.
    held = [
        _rec("start", 50, 11, step=3),
        _rec("got", 50, 12, item=3, deliveries=1, **_batch(0, 0, 3)),
        _rec("train", 50, 13, step=4, item=3, deliveries=1, **_batch(0, 0, 3)),
    ]
    again = reconcile(dict(ledgers, **{"drafter-3": held}))
    assert again["problems"] == [] and again["trains_undone_by_redelivery_or_replay"] == 2
    # Not so for a drafter that released it and exited cleanly: its update is in its state, a replay trains it twice.
    kept = held + [_rec("exit", 50, 14, step=4)]
    assert reconcile(dict(ledgers, **{"drafter-3": kept}))["trained_twice"] == 1
    # The same batch trained by two drafters that both released it: trained twice, and taken twice unexplained.
    d1_twice = d1[:-1] + [
        _rec("got", 30, 9, item=5, deliveries=1, **_batch(0, 0, 2)),
        _rec("train", 30, 10, step=4, item=5, deliveries=1, **_batch(0, 0, 2)),
        _rec("exit", 30, 11, step=4),
    ]
    bad = reconcile(dict(ledgers, **{"drafter-1": d1_twice}))
    assert bad["trained_twice"] == 1 and bad["seen_twice_unexplained"] == 1 and bad["problems"]
    # Taken and never trained by anyone: lost in flight, a problem (there is no allowance any more).
    lost = reconcile(dict(ledgers, **{"drafter-2": d2[:2]}))
    assert lost["lost_in_flight"] == 1 and any("never trained" in p for p in lost["problems"])
    # A batch nobody took is missing, whatever else happened.
    gone = reconcile({"target-0": producer, "drafter-1": d1})
    assert gone["missing"] == 1 and gone["missing_examples"] == [(0, 0, 3)]


def test_updates_a_killed_drafter_loses_must_be_produced_again():
    """A checkpoint written in the background becomes durable (its `ckpt` record) after later batches trained: they
    are not in it and die with a kill. Unless they are produced again (its sealed journal: an `intake` record) and
    trained by someone, they are in no surviving state: `trained_then_lost_with_crash`, a failure."""
    producer = [_rec("start", 10, 0, plan=[8], resume=[0, 0])]
    producer += [_rec("pub", 10, 1 + k, item=k, epoch=0, pos=k) for k in range(8)]
    drafter = [_rec("start", 20, 1, step=0)]
    for k in range(8):  # trains batch k at t = 10 + k (and releases it), then is killed: no exit record
        drafter += [
            _rec("got", 20, 9.5 + k, item=k, deliveries=1, **_batch(0, 0, k)),
            _rec("train", 20, 10 + k, step=k + 1, item=k, deliveries=1, **_batch(0, 0, k)),
        ]
    drafter.append(_rec("ckpt", 20, 14.5, step=2, items=2, snapshot_t=11.2))  # step 2's state, durable 3 steps on
    ledgers = {"target-0": producer, "drafter-0": sorted(drafter, key=lambda r: r["t"])}
    rec = reconcile(ledgers)
    assert rec["trained_then_lost_with_crash"] == 6 and rec["trained_exactly_once"] == 2  # batches 2..7 lost
    assert any("never produced again" in p for p in rec["problems"])
    # The journal brings them back: the producer takes them in at t = 20, another drafter trains them.
    intake = [_rec("intake", 10, 20, segments=["drafter-0/lost-x"], replay=[[0, k] for k in range(2, 8)])]
    intake += [_rec("pub", 10, 21 + k, item=8 + k, epoch=0, pos=k, replay=True) for k in range(2, 8)]
    again = [_rec("start", 30, 19, step=2)]
    for k in range(2, 8):
        again += [
            _rec("got", 30, 29 + k, item=8 + k, deliveries=1, **_batch(0, 0, k)),
            _rec("train", 30, 30 + k, step=k + 1, item=8 + k, deliveries=1, **_batch(0, 0, k)),
        ]
    again.append(_rec("exit", 30, 40, step=8))
    healed = reconcile(dict(ledgers, **{"target-0": producer + intake, "drafter-1": again}))
    assert healed["problems"] == [] and healed["trained_then_lost_with_crash"] == 0
    assert healed["trained_then_replayed_after_crash"] == 6 and healed["trained_exactly_once"] == 8


def test_what_survives_a_killed_drafter_is_the_state_its_successor_resumed_from():
    """A killed drafter's `ckpt` records may be behind its checkpoints: killed once `latest` moved and before the
    record, its successor resumes from a state the ledger never called durable. The successor's `start` record
    says when that state was taken (`snapshot_t`), and that decides what was lost; its absence (an older version)
    leaves the `ckpt` records to decide."""
    producer = [_rec("start", 10, 0, plan=[4], resume=[0, 0])]
    producer += [_rec("pub", 10, 1 + k, item=k, epoch=0, pos=k) for k in range(4)]
    killed = [_rec("start", 20, 1, step=0, snapshot_t=0.0)]
    for k in range(3):  # batches 0-2 trained; step 3's state taken at t = 12.5, `latest` moved, then the kill
        killed += [
            _rec("got", 20, 9.5 + k, item=k, deliveries=1, **_batch(0, 0, k)),
            _rec("train", 20, 10 + k, step=k + 1, item=k, deliveries=1, **_batch(0, 0, k)),
        ]
    successor = [_rec("start", 30, 20, step=3, snapshot_t=12.5)]
    successor += [
        _rec("got", 30, 21, item=3, deliveries=1, **_batch(0, 0, 3)),
        _rec("train", 30, 22, step=4, item=3, deliveries=1, **_batch(0, 0, 3)),
        _rec("exit", 30, 23, step=4),
    ]
    ledgers = {"target-0": producer, "drafter-0": killed + successor}
    rec = reconcile(ledgers)
    assert rec["problems"] == [] and rec["trained_exactly_once"] == 4 and rec["trained_then_lost_with_crash"] == 0
    # Without the successor's word, the `ckpt` records (none) decide: the three batches look lost.
    unknown = [{k: v for k, v in successor[0].items() if k != "snapshot_t"}]
    blind = reconcile({"target-0": producer, "drafter-0": killed + unknown + successor[1:]})
    assert blind["trained_then_lost_with_crash"] == 3 and blind["problems"]
    # The reverse: a `ckpt` record, but the successor started from an older state (that checkpoint refused at
    # load): the batches after it are lost, whatever the record said.
    durable = [_rec("ckpt", 20, 12.8, step=3, items=3, snapshot_t=12.5)]
    fell_back = [dict(successor[0], step=1, snapshot_t=10.2)] + successor[1:]
    older = reconcile({"target-0": producer, "drafter-0": killed + durable + fell_back})
    assert older["trained_then_lost_with_crash"] == 2 and any("never produced again" in p for p in older["problems"])


def test_ledger_reader_counts_a_line_cut_by_a_kill(tmp_path):
    path = tmp_path / "drafter-0.jsonl"
    path.write_text(json.dumps(_rec("start", 1, 0.0, step=0)) + "\n" + '{"ev":"train","pid":1,"t":1.0,"produ')
    f = read_ledger(path)
    assert len(f.records) == 1 and f.cut_lines == 1


@pytest.mark.processes
def test_chaos_minute_loses_nothing(tmp_path):
    """A minute of random SIGKILL/SIGTERM across targets, drafters and the supervisor, and whole-run stops of each
    kind (stop --now, SIGTERM to all, SIGKILL to all then clean) each followed by a restart (CI's chaos run), with a
    warm standby beside the drafters (`--standbys 1`), which takes over a killed drafter's seat. One run asserts what
    two did before (seed 11 with 3 stops, seed 12 with a standby): each paid its own baseline and start-ups."""
    seed, stops, standbys = 11, 3, 1
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash_ring",
            "chaos",
            "--kills",
            "12",
            "--seconds",
            "60",
            "--seed",
            str(seed),
            "--whole-run-stops",
            str(stops),
            "--workdir",
            str(tmp_path / "chaos"),
            "--standbys",
            str(standbys),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert out.stdout, out.stderr[-5000:]
    rep = json.loads(out.stdout)
    c = rep["chaos"]
    assert rep["passed"], (rep["failures"], out.stderr[-3000:])
    assert out.returncode == 0
    kills = c["kills"]
    assert kills["sent"] >= 10 and all(kills["by_role"][r] >= 1 for r in ("supervisor", "target", "drafter")), kills
    led = c["ledger"]
    assert led["planned_batches"] > 0 and led["missing"] == 0
    assert led["trained_twice"] == 0 and led["published_twice"] == 0 and led["seen_twice_unexplained"] == 0
    assert led["lost_in_flight"] == 0 and led["held_out_trained"] == 0
    # Chaos holds 5% of the rows out: those batches are evaluated exactly once, the rest trained exactly once.
    assert led["planned_eval_batches"] > 0 and led["evaluated_exactly_once"] == led["planned_eval_batches"]
    assert led["trained_exactly_once"] + led["evaluated_exactly_once"] == led["planned_batches"]
    assert len(c["whole_run_stops"]) == stops, c["whole_run_stops"]
    assert c["hung"] == [] and c["clean"]["rc"] == 0 and c["clean"]["leftovers"] == []
    assert all("step" in v and "exported" in v for v in c["checkpoints"].values()), c["checkpoints"]
    assert c["recoveries"] + c["not_recovered_before_the_end"] == kills["sent"]
    assert c["standbys"] == standbys and (c["takeovers"] >= 1 if standbys else c["takeovers"] == 0), c["kill_log"]
    # Dead drafters' journals were edited between kills (tools/journal_edits.py); the ledger above holds regardless.
    assert c["journal_edits"], c["kill_log"]
    # Every role's start-up, phase by phase in its order, from the processes' `startup` ledger records.
    phases = {"supervisor": SUPERVISOR_PHASES, "target": TARGET_PHASES, "drafter": DRAFTER_PHASES}
    for role, names in phases.items():
        st = c["startup"][role]
        assert st["starts"] >= 1 and list(st["phases_s"]) == list(names), (role, st)
        assert st["total_s"]["p50"] > 0 and st["phases_s"]["imports"]["max"] > 0, (role, st)
    assert rep["baseline"]["missing"] == 0 and rep["baseline"]["items_per_s"]
