"""Per-source figures and the held-out split (issue 22 items 2 and 3), in process: which rows are held out,
how the plan carries them, what the drafter computes per source and what evaluating costs the training run."""

from __future__ import annotations

import json
from collections import Counter as Tally
from dataclasses import replace

import pytest
import torch

from dflash_ring.common.config.load import load_config
from dflash_ring.common.config.schema import ConfigError
from dflash_ring.consumer.training.loss import dflash_loss
from dflash_ring.consumer.modeling.model import Anchors, load_target_head, sample_anchors
from dflash_ring.consumer.families.build import build_drafter
from dflash_ring.consumer.reporting.source_metrics import OTHER, SourceLabels, by_source
from dflash_ring.consumer.training.trainer import DeviceBatch, Trainer
from dflash_ring.common.config.drafter import DrafterConfig
from dflash_ring.common.config.train import TrainConfig
from dflash_ring.producer.batching import ShardBatcher, held_out
from dflash_ring.producer.data_stats import data_stats
from support import mixture, save_tiny_qwen3

BUDGET = 256


def batches_of(sources, world: int, epochs: int, fraction: float, seed: int = 5):
    shards = [
        ShardBatcher(
            sources,
            rank=r,
            world_size=world,
            epochs=epochs,
            seed=seed,
            max_tokens_per_batch=BUDGET,
            eval_fraction=fraction,
        )
        for r in range(world)
    ]
    return [b for shard in shards for b in shard.batches()]


def rows(batches, e: int) -> Tally:
    return Tally((int(s), int(r)) for b in batches if b.epoch == e for s, r in zip(b.source_ids, b.sample_ids))


def test_held_out_rows_are_fixed_by_seed_and_row_evaluated_once_an_epoch_and_never_trained():
    sources = mixture(("code", 300, 3.0, False), ("chat", 200, 1.0, False), ("probe", 40, 1.0, False))
    sources[2] = replace(sources[2], eval=True)  # a held-out source: all of its rows
    everything = batches_of(sources, world=3, epochs=2, fraction=0.1)
    # The held-out rows: exactly held_out()'s, all of an eval source's; the same for one producer or three.
    want = {
        (k, int(r))
        for k, s in enumerate(sources)
        for r in s.data.row_ids[held_out(s.name, s.data.row_ids, 0.1, 5) | s.eval]
    }
    assert 25 < len(want) - 40 < 75  # about 10% of 500 rows (binomial: mean 50, sd 7), plus the probe's 40
    evaluated = [b for b in everything if b.eval]
    assert evaluated and all(
        b.eval == all((int(s), int(r)) in want for s, r in zip(b.source_ids, b.sample_ids)) for b in everything
    )  # no batch mixes held-out and training rows
    plan = ShardBatcher(sources, rank=0, world_size=1, max_tokens_per_batch=BUDGET, epochs=1, seed=5, eval_fraction=0.1)
    assert plan.counts[2] == 0 and abs(plan.counts[0] - 3 * plan.counts[1]) < 3  # the weights split training 3:1
    for e in (0, 1):
        assert rows(evaluated, e) == Tally(want)  # every held-out row once an epoch
        trained = rows([b for b in everything if not b.eval], e)
        assert not set(trained) & want  # never trained, in any epoch
        assert [sum(v for (s, _), v in trained.items() if s == k) for k in range(3)] == plan.counts
    assert rows([b for b in batches_of(sources, 1, 2, 0.1) if b.eval], 1) == Tally(want)
    assert {
        (int(s), int(r))
        for b in batches_of(sources, 3, 1, 0.1, seed=6)
        if b.eval
        for s, r in zip(b.source_ids, b.sample_ids)
    } != want  # another seed holds out other rows
    # `dflash-ring data stats` counts the same split: held-out rows apart, the epoch's rows the training ones.
    stats = data_stats(sources, 0.1, 5)
    assert [s.eval_rows for s in stats.sources] == [sum(s == k for s, _ in want) for k in range(3)]
    assert [s.epoch_rows for s in stats.sources] == plan.counts
    # Spread through the epoch, not bunched at one end: each third of a producer's epoch holds some.
    positions, n = plan.eval_positions(0), len(plan.epoch_plan(0))
    assert all(any(i * n // 3 <= p < (i + 1) * n // 3 for p in positions) for i in range(3))
    # A resume from a cursor anywhere continues the same plan (a cursor counts both kinds of batch).
    mine = list(plan.batches())
    assert [b.sample_ids.tolist() for b in plan.batches(mine[positions[0]].cursor)] == [
        b.sample_ids.tolist() for b in mine[positions[0] + 1 :]
    ]


def test_the_split_is_part_of_the_plan_and_refused_when_wrong():
    sources = mixture(("code", 60, 3.0, False), ("chat", 60, 1.0, False))

    def key(fraction, srcs=sources):
        return ShardBatcher(
            srcs, rank=0, world_size=1, max_tokens_per_batch=BUDGET, epochs=1, eval_fraction=fraction
        ).plan_key()

    assert key(0.0) == key(0.0) != key(0.05) != key(0.1)
    assert key(0.0, [sources[0], replace(sources[1], eval=True)]) != key(0.0)
    for sets, says in (
        (["data.eval_fraction=1.0"], "data.eval_fraction = 1.0: must be a finite number >= 0 and < 1"),
        (['data.sources=[{path="a.jsonl", eval=true}]'], "nothing is left to train on"),
        (['data.sources=[{path="a.jsonl"}, {path="b.jsonl", eval=true, repeat=true}]'], "drop repeat"),
        (['data.sources=[{path="a.jsonl", name="my code"}]'], "1 to 64 letters, digits"),
        (["train.eval_every_steps=0"], "eval_every_steps = 0"),
    ):
        with pytest.raises(ConfigError, match=says):
            load_config(None, sets)
    many = ", ".join(f'{{path="s{i}.jsonl"}}' for i in range(17))
    with pytest.raises(ConfigError, match="at most 16"):
        load_config(None, [f"data.sources=[{many}]"])


def tiny(tmp_path, seed=0):
    path = tmp_path / "target"
    save_tiny_qwen3(path, vocab_size=96, max_position_embeddings=256, tie_word_embeddings=False)
    drafter = DrafterConfig(num_hidden_layers=1, block_size=4, num_anchors=6, mask_token_id=95, loss_gamma=2.0)
    torch.manual_seed(seed)
    model = build_drafter(drafter, json.loads((path / "config.json").read_text()))
    return model, load_target_head(path), drafter


def two_source_batch(seed: int, eval: bool = False) -> DeviceBatch:
    g = torch.Generator().manual_seed(seed)
    lengths = [20, 12, 16, 9]
    ids = torch.randint(0, 90, (sum(lengths),), generator=g)
    return DeviceBatch(
        features=torch.randn(sum(lengths), 64, generator=g),
        input_ids=ids,
        loss_mask=torch.rand(sum(lengths), generator=g) > 0.2,
        cu_seqlens=torch.tensor([0, 20, 32, 48, 57]),
        meta={"producer": 0, "epoch": 0, "position": seed, "sources": ["code", "chat", "stray"], "eval": eval},
        source_ids=torch.tensor([1, 0, 1, 2]),
    )


def test_per_source_figures_equal_the_loss_on_each_sources_blocks_alone(tmp_path):
    model, head, cfg = tiny(tmp_path)
    b = two_source_batch(1)
    anchors = sample_anchors(b.loss_mask, b.cu_seqlens, cfg.num_anchors, torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = model(b.features, b.input_ids, anchors, head, attention="sdpa")
        out = dflash_loss(hidden, anchors, b.input_ids, b.loss_mask, head, cfg)
    labels = SourceLabels(["code", "chat"]).of(b.meta["sources"])
    assert labels == ["code", "chat", OTHER]
    got = by_source(out, anchors, b.source_ids, b.loss_mask, labels)
    assert set(got) == {"code", "chat", OTHER}
    counts = anchors.cu_anchors.diff()
    for name, k in (("code", 0), ("chat", 1), (OTHER, 2)):
        mine = b.source_ids == k
        keep = torch.repeat_interleave(mine, counts)  # the blocks of this source's sequences
        alone = Anchors(
            anchors.positions[keep], torch.nn.functional.pad((counts * mine).cumsum(0), (1, 0)), anchors.cu_seqlens
        )
        with torch.no_grad():
            direct = dflash_loss(hidden[keep], alone, b.input_ids, b.loss_mask, head, cfg)
        s = got[name]
        assert s.blocks == int(keep.sum()) == direct.num_blocks
        assert s.tokens == int(b.loss_mask[torch.repeat_interleave(mine, b.cu_seqlens.diff())].sum())
        assert s.loss == pytest.approx(float(direct.ce), rel=1e-5)
        assert s.accuracy == pytest.approx(float(direct.correct_per_position.sum() / direct.valid_per_position.sum()))
        assert s.accept_len == pytest.approx(float(direct.accept_len), rel=1e-6)
    # The sources add up to the whole item.
    assert sum(s.blocks for s in got.values()) == anchors.num_blocks
    total_loss = sum(s.loss_sum for s in got.values()) / sum(s.weight_sum for s in got.values())
    assert total_loss == pytest.approx(float(out.ce), rel=1e-5)


def test_evaluating_trains_nothing_and_leaves_the_training_stream_as_it_was(tmp_path):
    def trainer():
        model, head, cfg = tiny(tmp_path)
        return Trainer(
            model,
            head,
            cfg,
            TrainConfig(lr=1e-3, total_steps=10, grad_accum=2),
            torch.device("cpu"),
            SourceLabels(["code", "chat"]),
        )

    plain, with_eval = trainer(), trainer()
    losses = []
    for t, evaluate in ((plain, False), (with_eval, True)):
        steps = []
        for s in range(4):
            if evaluate:  # a held-out item between every micro-batch, one inside each gradient accumulation
                before = [p.detach().clone() for p in t.model.parameters()]
                grads = [None if p.grad is None else p.grad.clone() for p in t.model.parameters()]
                first = t.evaluate(two_source_batch(100 + s, eval=True))
                assert first == t.evaluate(two_source_batch(100 + s, eval=True))  # the item's own anchors
                assert all(torch.equal(a, p) for a, p in zip(before, t.model.parameters()))
                assert all(
                    (g is None and p.grad is None) or torch.equal(g, p.grad)
                    for g, p in zip(grads, t.model.parameters())
                )
                assert set(first) == {"code", "chat", OTHER} and all(x.blocks for x in first.values())
            m = t.train_step(two_source_batch(s), 10)
            steps.append(None if m is None else (m.loss, {k: v.loss_sum for k, v in m.by_source.items()}))
        losses.append(steps)
    assert losses[0] == losses[1] and losses[0][1] is not None  # bit for bit: same anchors, same updates
    assert torch.equal(plain.anchor_rng.get_state(), with_eval.anchor_rng.get_state())
    # A step's per-source sums cover both of its micro-batches.
    assert set(losses[0][1][1]) == {"code", "chat", OTHER}
