"""The ring neither reorders nor corrupts data: a 1 target + 1 drafter pipeline trains exactly like a plain loop.

The reference loop runs in this process over the same batches (the producer's own batcher and
target forward) with the same seed and the same Trainer. Tolerance: 2e-4 absolute per step on the
loss, which the drafter logs with 4 decimals (rounding alone is 5e-5); the test also shows that
swapping two batches moves the curve by more than that, so a reordering ring could not pass.
"""

from __future__ import annotations

import json

import torch
from transformers import AutoTokenizer

from conftest import wait_exit
from target_fixtures import build_target, load_tokenizer
from test_pipeline import curves, cyclic_rows

from dflash_ring.common.config import load_config
from dflash_ring.consumer.model import build_drafter, load_target_head
from dflash_ring.consumer.process import resolve_drafter_config, target_config_dict
from dflash_ring.consumer.trainer import DeviceBatch, Trainer
from dflash_ring.producer.batching import ShardBatcher
from dflash_ring.producer.pretokenized import load_tokenized
from dflash_ring.producer.process import prepare, run_target
from dflash_ring.producer.target import TargetModel

TOLERANCE = 2e-4
STEPS = 24


def reference_losses(config_path, order: list[int] | None = None) -> list[float]:
    cfg = load_config(config_path)
    tokenizer = AutoTokenizer.from_pretrained(cfg.target.path, local_files_only=True)
    data = load_tokenized(cfg.data, tokenizer)
    target = TargetModel.load(cfg.target, torch.device("cpu"), packed=cfg.target.packing != "padded")
    batches = list(ShardBatcher.from_config(data, cfg.data, rank=0, world_size=1).batches())
    if order is not None:
        batches = [batches[i] for i in order]
    drafter_cfg = resolve_drafter_config(cfg)
    torch.manual_seed(cfg.train.seed)
    model = build_drafter(drafter_cfg, target_config_dict(cfg.target.path))
    trainer = Trainer(model, load_target_head(cfg.target.path), drafter_cfg, cfg.train, torch.device("cpu"))
    losses = []
    for batch in batches:
        with torch.no_grad():
            out = run_target(target, prepare(batch, packed=True, pad_id=0, pin=False))
        device_batch = DeviceBatch(
            features=out.features.clone(), input_ids=torch.from_numpy(batch.input_ids).long(),
            loss_mask=torch.from_numpy(batch.loss_mask).bool(), cu_seqlens=torch.from_numpy(batch.cu_seqlens).long(),
        )
        if (m := trainer.train_step(device_batch, cfg.train.total_steps)) is not None:
            losses.append(m.loss)
    return losses


def test_pipeline_loss_curve_equals_in_process_reference(run):
    target = build_target(run.tmp / "target", "qwen3", layers=4)
    data = cyclic_rows(run.tmp / "chat.jsonl", 64, seed=3)
    vocab = len(load_tokenizer(target))
    run.write_config(1, 1, slots=3, slot_bytes=4 << 20, extra=f"""
[data]
path = "{data}"
max_length = 128
max_tokens_per_batch = 512
epochs = 3
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
total_steps = {STEPS}
seed = 7
checkpoint_dir = "{run.tmp / 'ckpt'}"
checkpoint_every_steps = 1000
log_every_steps = 1
""")
    run.config.write_text(run.config.read_text().replace("slot_header_bytes = 4096", "slot_header_bytes = 65536"))
    sup = run.supervisor()
    producer = run.spawn("-m", "dflash_ring", "target", "--config", str(run.config), "--index", "0")
    drafter = run.spawn("-m", "dflash_ring", "drafter", "--config", str(run.config), "--index", "0")
    for p in (producer, drafter, sup):
        assert wait_exit(p, 300) == 0, p.stderr.read()[-3000:]
    piped, _ = curves(drafter.stderr.read())

    reference = reference_losses(run.config)
    assert len(piped) == len(reference) >= 12, (len(piped), len(reference))
    worst = max(abs(a - b) for a, b in zip(piped, reference))
    assert worst <= TOLERANCE, json.dumps({"pipeline": piped, "reference": reference})

    # The check has teeth: the same loop with two early batches swapped leaves the tolerance.
    swapped = reference_losses(run.config, order=[0, 2, 1, *range(3, len(reference))])
    assert max(abs(a - b) for a, b in zip(piped, swapped)) > 10 * TOLERANCE
    assert run.leftovers() == []
