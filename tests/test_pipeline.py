"""The whole pipeline as real processes: supervisor, a target producer and two drafter replicas."""

from __future__ import annotations

import re
import signal

from safetensors.torch import load_file

from conftest import wait_exit, wait_for
from target_fixtures import WORDS, build_target, load_tokenizer

import json
import random

STEP = re.compile(r"step (\d+)/\d+ loss ([\d.]+) acc@1 ([\d.]+)")


def pipeline_config(run, target, data, extra: str = "") -> None:
    vocab = len(load_tokenizer(target))
    run.write_config(1, 2, slots=4, slot_bytes=4 << 20, extra=f"""
[data]
path = "{data}"
max_length = 128
max_tokens_per_batch = 512
epochs = 12
cache_dir = "{run.tmp / 'cache'}"
[target]
path = "{target}"
mask_token_id = {vocab}
state_dir = "{run.tmp / 'state'}"
device = "cpu"
[drafter]
num_hidden_layers = 1
block_size = 4
loss_gamma = 2.0
num_anchors = 16
[train]
lr = 3e-3
warmup_ratio = 0.1
device = "cpu"
average_every_steps = 2
checkpoint_dir = "{run.tmp / 'ckpt'}"
checkpoint_every_steps = 5
log_every_steps = 1
{extra}""")
    run.config.write_text(run.config.read_text().replace("slot_header_bytes = 4096", "slot_header_bytes = 65536"))


def cyclic_rows(path, rows: int, seed: int = 0):
    """Replies that walk a fixed word cycle: each token determines the next, so a drafter can learn them."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(rows):
            start = rng.randrange(len(WORDS))
            reply = " ".join(WORDS[(start + i) % len(WORDS)] for i in range(24))
            f.write(json.dumps({"messages": [{"role": "user", "content": f"continue from {WORDS[start]}"},
                                             {"role": "assistant", "content": reply}]}) + "\n")
    return path


def drafter(run, index: int):
    return run.spawn("-m", "dflash_ring", "drafter", "--config", str(run.config), "--index", str(index))


def curves(stderr: str) -> tuple[list[float], list[float]]:
    steps = list(STEP.finditer(stderr))
    return [float(m.group(2)) for m in steps], [float(m.group(3)) for m in steps]


def test_drafters_learn_from_the_ring_stay_in_step_and_survive_a_kill(run):
    target = build_target(run.tmp / "target", "qwen3", layers=4)
    data = cyclic_rows(run.tmp / "chat.jsonl", 96)
    pipeline_config(run, target, data)
    sup = run.supervisor()
    producer = run.spawn("-m", "dflash_ring", "target", "--config", str(run.config), "--index", "0")
    d0, d1 = drafter(run, 0), drafter(run, 1)
    # Kill one replica once it has checkpointed; the other and the producer must go on untouched.
    wait_for(lambda: (run.tmp / "ckpt" / "drafter-1" / "latest").exists(), timeout=180, what="a drafter-1 checkpoint")
    d1.send_signal(signal.SIGKILL)
    wait_exit(d1)
    assert producer.poll() is None and d0.poll() is None
    d1_again = drafter(run, 1)
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
