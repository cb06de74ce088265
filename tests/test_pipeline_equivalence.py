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

from support import LEARNS, build_target, curves, cyclic_rows, pipeline_config, wait_exit

from dflash_ring.common.config.load import load_config
from dflash_ring.consumer.modeling.model import load_target_head
from dflash_ring.consumer.families.build import build_drafter
from dflash_ring.consumer.training.process import resolve_drafter_config, target_config_dict
from dflash_ring.consumer.training.trainer import DeviceBatch, Trainer
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
    drafter_cfg = resolve_drafter_config(cfg.drafter, cfg.target)
    torch.manual_seed(cfg.train.seed)
    model = build_drafter(drafter_cfg, target_config_dict(cfg.target.path))
    trainer = Trainer(model, load_target_head(cfg.target.path), drafter_cfg, cfg.train, torch.device("cpu"))
    losses = []
    for batch in batches:
        with torch.no_grad():
            out = run_target(target, prepare(batch, packed=True, pad_id=0, pin=False))
        device_batch = DeviceBatch(
            features=out.features.clone(),
            input_ids=torch.from_numpy(batch.input_ids).long(),
            loss_mask=torch.from_numpy(batch.loss_mask).bool(),
            cu_seqlens=torch.from_numpy(batch.cu_seqlens).long(),
        )
        if (m := trainer.train_step(device_batch, cfg.train.total_steps)) is not None:
            losses.append(m.loss)
    return losses


def test_pipeline_loss_curve_equals_in_process_reference(run):
    target = build_target(run.tmp / "target", "qwen3", layers=4)
    data = cyclic_rows(run.tmp / "chat.jsonl", 64, seed=3)
    pipeline_config(
        run,
        target,
        data,
        LEARNS,
        {
            "data": {"epochs": 3},
            "train": {"total_steps": STEPS, "seed": 7, "checkpoint_every_steps": 1000},
        },
        consumers=1,
        slots=3,
    )
    sup = run.supervisor()
    producer = run.role("target", 0)
    drafter = run.role("drafter", 0)
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
