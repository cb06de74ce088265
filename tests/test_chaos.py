"""`dflash-ring chaos` as CI runs it, and regression tests for what chaos runs found."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from support import build_target, load_tokenizer, wait_exit, wait_for

from dflash_ring.common.ledger import read_ledger
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
    run.write_config(1, 1, run={"attach_timeout_s": 600},
                     target={"path": str(target), "device": "cpu", "mask_token_id": vocab},
                     train={"device": "cpu", "checkpoint_dir": str(run.tmp / "ckpt")})
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


def test_ledger_reconciliation_tells_redelivery_and_in_flight_losses_from_missing_batches(tmp_path):
    producer = [_rec("start", 10, 0, plan=[3], resume=[0, 0])]
    producer += [_rec("pub", 10, 1 + k, item=k, epoch=0, pos=k) for k in range(3)]
    # Drafter pid 20 takes item 0 and is killed before releasing it: redelivered to pid 30 (deliveries 2).
    # Pid 20 had also taken item 1 and released it: lost in flight. Pid 30 trains items 0 and 2.
    d0 = [_rec("start", 20, 1, step=0), _rec("got", 20, 2, item=1, deliveries=1, **_batch(0, 0, 1)),
          _rec("got", 20, 3, item=0, deliveries=1, **_batch(0, 0, 0))]
    d1 = [_rec("start", 30, 1, step=0), _rec("got", 30, 4, item=0, deliveries=2, **_batch(0, 0, 0)),
          _rec("train", 30, 5, step=1, **_batch(0, 0, 0)), _rec("got", 30, 6, item=2, deliveries=1, **_batch(0, 0, 2)),
          _rec("train", 30, 7, step=2, **_batch(0, 0, 2)), _rec("exit", 30, 8, step=2)]
    rec = reconcile({"target-0": producer, "drafter-0": d0, "drafter-1": d1}, checkpoint_every=10, grad_accum=1)
    assert rec["problems"] == [] and rec["missing"] == 0
    assert rec["redelivered_items"] == 1 and rec["seen_twice_explained_by_redelivery"] == 1
    assert rec["lost_in_flight"] == 1 and rec["trained_batches"] == 2
    # The same item taken twice by drafters that both lived, or trained twice: not explained.
    d1_twice = d1[:-1] + [_rec("got", 30, 9, item=5, deliveries=1, **_batch(0, 0, 2)),
                          _rec("train", 30, 10, step=3, **_batch(0, 0, 2)), _rec("exit", 30, 11, step=3)]
    bad = reconcile({"target-0": producer, "drafter-0": d0, "drafter-1": d1_twice}, 10, 1)
    assert bad["trained_twice"] == 1 and bad["seen_twice_unexplained"] == 1 and bad["problems"]
    # A batch nobody took is missing, whatever else happened.
    gone = reconcile({"target-0": producer, "drafter-1": d1}, 10, 1)
    assert gone["missing"] == 1 and gone["missing_examples"] == [(0, 0, 1)]


def test_ledger_reader_counts_a_line_cut_by_a_kill(tmp_path):
    path = tmp_path / "drafter-0.jsonl"
    path.write_text(json.dumps(_rec("start", 1, 0.0, step=0)) + "\n" + '{"ev":"train","pid":1,"t":1.0,"produ')
    f = read_ledger(path)
    assert len(f.records) == 1 and f.cut_lines == 1


@pytest.mark.processes
@pytest.mark.parametrize("seed", [11, 12])
def test_chaos_minute_loses_nothing(tmp_path, seed):
    """A minute of random SIGKILL/SIGTERM across targets, drafters and the supervisor (CI's chaos run)."""
    out = subprocess.run([sys.executable, "-m", "dflash_ring", "chaos", "--kills", "12", "--seconds", "60",
                          "--seed", str(seed), "--workdir", str(tmp_path / "chaos"), "--json"],
                         capture_output=True, text=True, timeout=1500)
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
    assert led["trained_batches"] + led["lost_in_flight"] == led["planned_batches"]
    assert led["lost_in_flight"] <= 2 * kills["by_role_and_signal"].get("drafter:SIGKILL", 0)
    assert c["hung"] == [] and c["clean"]["rc"] == 0 and c["clean"]["leftovers"] == []
    assert all("step" in v and "exported" in v for v in c["checkpoints"].values()), c["checkpoints"]
    assert c["recoveries"] + c["not_recovered_before_the_end"] == kills["sent"]
    assert rep["baseline"]["missing"] == 0 and rep["baseline"]["items_per_s"]
