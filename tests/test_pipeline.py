"""The whole pipeline as real processes: supervisor, a target producer and two drafter replicas."""

from __future__ import annotations

import signal

from safetensors.torch import load_file

from support import PIPELINE_RUN, build_target, curves, cyclic_rows, pipeline_config, wait_exit, wait_for


def test_drafters_learn_from_the_ring_stay_in_step_and_survive_a_kill(run):
    target = build_target(run.tmp / "target", "qwen3", layers=4)
    data = cyclic_rows(run.tmp / "chat.jsonl", 96)
    pipeline_config(run, target, data, PIPELINE_RUN)
    sup = run.supervisor()
    producer = run.role("target", 0)
    d0, d1 = run.role("drafter", 0), run.role("drafter", 1)
    # Kill one replica once it has checkpointed; the other and the producer must go on untouched.
    wait_for(lambda: (run.tmp / "ckpt" / "drafter-1" / "latest").exists(), timeout=180, what="a drafter-1 checkpoint")
    d1.send_signal(signal.SIGKILL)
    wait_exit(d1)
    assert producer.poll() is None and d0.poll() is None
    d1_again = run.role("drafter", 1)
    for p in (producer, d0, d1_again, sup):
        assert wait_exit(p, 300) == 0, p.stderr.read()[-3000:]
    log0, log1 = d0.stderr.read(), d1_again.stderr.read()
    assert "resumed from" in log1 and "caught up with live replica" in log1
    # Loss falls on a learnable data set fed through the ring.
    # (The random target's lm_head is nearly flat, so CE falls slowly while top-1 accuracy climbs.)
    loss, acc = curves(log0)
    assert len(loss) >= 10
    assert sum(loss[-5:]) / 5 < sum(loss[:5]) / 5 - 0.05, (loss, acc)
    assert sum(acc[-5:]) / 5 > 0.3 > sum(acc[:5]) / 5, (len(acc), acc)
    # The replicas stay close: parameter averaging every 2 steps.
    w0 = load_file(sorted((run.tmp / "ckpt" / "drafter-0").glob("step-*"))[-1] / "model.safetensors")
    w1 = load_file(sorted((run.tmp / "ckpt" / "drafter-1").glob("step-*"))[-1] / "model.safetensors")
    diff = sum(float((w0[k] - w1[k]).norm() ** 2) for k in w0) ** 0.5
    norm = sum(float(w0[k].norm() ** 2) for k in w0) ** 0.5
    assert diff / norm < 0.05, diff / norm
    out = run.cli("export", str(run.tmp / "ckpt" / "drafter-0"), str(run.tmp / "exported"))
    assert "exported" in out.stdout
    assert run.leftovers() == []
