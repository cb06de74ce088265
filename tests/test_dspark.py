"""DSpark: the recipe, the heads, the labels, the loss against a full-logits reference written from DeepSpec's
formulas, and a training step of a real drafter on a tiny target."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash_ring.common.config.drafter import DrafterConfig
from dflash_ring.consumer.families.dspark.dspark_heads import ConfidenceHead, MarkovHead
from dflash_ring.consumer.training.loss import DSparkHeads, block_labels, dflash_loss
from dflash_ring.consumer.modeling.model import (
    FrozenTargetHead,
    cu_seqlens_from_lengths,
    load_target_head,
    sample_anchors,
)
from dflash_ring.consumer.families.dspark.model import DSparkDraftModel
from dflash_ring.consumer.families.build import build_drafter
from dflash_ring.consumer.families.dspark.model import dspark_prev_ids
from dflash_ring.consumer.objectives.confidence import calibration
from dflash_ring.consumer.objectives.total_variation import analytic_acceptance, l1_grad, l1_of

from support import anchors_from_local, save_tiny_qwen3


def test_the_dspark_recipe_is_deepspecs_qwen3_8b_config():
    d = DrafterConfig(recipe="dspark", mask_token_id=5)
    assert (d.arch, d.num_hidden_layers, d.block_size, d.num_anchors) == ("dspark", 5, 7, 512)
    assert (d.markov_rank, d.markov_head, d.loss_gamma) == (256, "vanilla", 4.0)
    assert (d.ce_weight, d.tv_weight, d.confidence_weight, d.kl_weight, d.cap_weight) == (0.1, 0.9, 1.0, 0.0, 0.0)
    assert d.drafts_per_block == 7 and d.sample_from_anchor and d.needs_target_logits
    assert DrafterConfig(recipe="dspark", markov_head="rnn").markov_head == "rnn"


@pytest.mark.parametrize("key", [{"markov_rank": 8}, {"markov_head": "gated"}, {"confidence_weight": 1.0}])
def test_dspark_only_keys_on_a_dflash_drafter_are_refused(key):
    with pytest.raises(ValueError, match="DSpark-only.*arch = 'dflash'"):
        DrafterConfig(**key)
    with pytest.raises(ValueError, match="DSpark-only"):
        DrafterConfig(recipe="paper", **key)


def test_dspark_refuses_sliding_layers_and_dpace_with_a_confidence_head():
    with pytest.raises(ValueError, match="full_attention layers only"):
        DrafterConfig(arch="dspark", block_size=7, loss_gamma=4.0, layer_types=["sliding_attention"], sliding_window=64)
    with pytest.raises(ValueError, match="confidence_weight > 0 needs loss = 'ce'"):
        DrafterConfig(recipe="dspark", loss="dpace")


def test_a_dflash_configs_fingerprint_fields_are_what_they_were_before_dspark():
    assert not {"arch", "ce_weight", "tv_weight", "confidence_weight", "markov_rank", "markov_head"} & set(
        DrafterConfig(recipe="ddtree").model_fields()
    )
    assert DrafterConfig(recipe="dspark").model_fields()["arch"] == "dspark"


def test_slot_k_is_labelled_with_token_anchor_plus_k_plus_1_and_the_mask_is_a_prefix():
    lengths = [10, 8]
    input_ids = torch.arange(100, 118)
    loss_mask = torch.ones(18, dtype=torch.bool)
    loss_mask[4] = False
    anchors = anchors_from_local(lengths, [[2, 7], [0]])
    labels = block_labels(anchors, input_ids, loss_mask, 4, sample_from_anchor=True)
    assert labels.tokens.tolist() == [[103, 0, 0, 0], [108, 109, 0, 0], [111, 112, 113, 114]]
    assert labels.valid.tolist() == [
        [True, False, False, False],  # 104 is masked: every later slot is masked too (DeepSpec's eval mask)
        [True, True, False, False],  # 110 belongs to the next sequence
        [True, True, True, True],
    ]


def test_markov_features_equal_their_formulas():
    torch.manual_seed(0)
    hidden, prev = torch.randn(3, 4, 6), torch.randint(0, 11, (3, 4))
    for kind in ("vanilla", "gated", "rnn"):
        head = MarkovHead(11, 5, 6, kind)
        emb = head.prev_embedding(prev)
        e = head.features(hidden, emb)
        if kind == "vanilla":
            expected = head.markov_w1.weight[prev]
        elif kind == "gated":
            expected = torch.sigmoid(head.gate_proj(torch.cat([hidden, emb], -1))) * emb
        else:
            state, out = torch.zeros(3, 5), []
            for k in range(4):
                z = head.joint_proj(torch.cat([state, emb[:, k], hidden[:, k]], -1))
                g, c, o = z[:, :5], z[:, 5:10], z[:, 10:]
                state = torch.sigmoid(g) * state + (1 - torch.sigmoid(g)) * torch.tanh(c)
                out.append(torch.tanh(o))
            expected = torch.stack(out, 1)
        torch.testing.assert_close(e, expected)
        torch.testing.assert_close(head.bias(e), e @ head.markov_w2.weight.T)
    conf = ConfidenceHead(6, 5)
    emb = torch.randn(3, 4, 5)
    torch.testing.assert_close(
        conf(hidden, emb), (torch.cat([hidden, emb], -1) @ conf.proj.weight.T + conf.proj.bias).squeeze(-1)
    )


def test_l1_gradient_equals_autograd():
    torch.manual_seed(0)
    logits, p = torch.randn(4, 9, requires_grad=True), torch.softmax(torch.randn(4, 9), -1)
    (auto,) = torch.autograd.grad(l1_of(torch.softmax(logits, -1), p).sum(), logits)
    torch.testing.assert_close(l1_grad(torch.softmax(logits, -1).detach(), p), auto)
    q = torch.softmax(logits, -1).detach()
    torch.testing.assert_close(analytic_acceptance(l1_of(q, p)), torch.minimum(q, p).sum(-1))


def dspark_reference(hidden, markov, w2, conf, anchors, input_ids, loss_mask, head, target_hidden, cfg):
    """DeepSpec's loss.py on full [N, B, V] logits, differentiated by autograd:
    w_k = exp(-k / gamma) eval_mask, each term normalised by sum w, loss = 0.1 CE + 0.9 L1 + 1.0 BCE(conf, alpha*)."""
    block = hidden.shape[1]
    positions = anchors.positions[:, None] + torch.arange(block) + 1  # slot k drafts anchor + k + 1
    ends = anchors.seq_bounds()[1][:, None]
    inside = positions < ends
    safe = torch.where(inside, positions, 0)
    mask = (inside & loss_mask.bool()[safe]).long().cumprod(1).float()
    w = torch.exp(-torch.arange(block, dtype=torch.float32) / cfg.loss_gamma) * mask
    logits = head.logits(hidden) + markov @ w2.T
    log_q = F.log_softmax(logits.float(), -1)
    ce = -log_q.gather(-1, torch.where(inside, input_ids[safe], 0)[..., None]).squeeze(-1)
    p = F.softmax(head.logits(target_hidden[(positions - 1).clamp(max=len(input_ids) - 1)]).float(), -1)
    l1 = (log_q.exp() - p).abs().sum(-1)
    alpha = (1 - 0.5 * l1).clamp(0, 1).detach()
    bce = F.binary_cross_entropy_with_logits(conf, alpha, reduction="none")
    s = w.sum()
    return (
        cfg.ce_weight * (w * ce).sum() + cfg.tv_weight * (w * l1).sum() + cfg.confidence_weight * (w * bce).sum()
    ) / s


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_dspark_loss_and_gradients_equal_the_full_logits_reference(kind):
    torch.manual_seed(2)
    vocab, hidden_size, rank, block = 30, 8, 4, 5
    head = FrozenTargetHead(torch.randn(vocab, hidden_size), torch.randn(vocab, hidden_size))
    lengths = [13, 9]
    input_ids = torch.randint(0, vocab, (22,))
    loss_mask = torch.rand(22) > 0.15
    anchors = sample_anchors(torch.ones(22, dtype=torch.bool), cu_seqlens_from_lengths(lengths), 6, torch.Generator())
    hidden = torch.randn(anchors.num_blocks, block, hidden_size, requires_grad=True)
    target_hidden = torch.randn(22, hidden_size)
    markov_head, conf_head = MarkovHead(vocab, rank, hidden_size, kind), ConfidenceHead(hidden_size, rank)
    torch.nn.init.normal_(markov_head.markov_w2.weight)
    torch.nn.init.normal_(markov_head.markov_w1.weight)
    prev = dspark_prev_ids(input_ids, anchors, block)
    params = [hidden, *markov_head.parameters(), *conf_head.parameters()]

    def heads():
        emb = markov_head.prev_embedding(prev)
        return markov_head.features(hidden, emb), conf_head(hidden, emb)

    cfg = DrafterConfig(recipe="dspark", block_size=block, markov_rank=rank, markov_head=kind)
    e, c = heads()
    reference = dspark_reference(
        hidden, e, markov_head.markov_w2.weight, c, anchors, input_ids, loss_mask, head, target_hidden, cfg
    )
    expected = torch.autograd.grad(reference, params)
    for chunk in (1, 7, 10_000):
        chunked = DrafterConfig(
            recipe="dspark", block_size=block, markov_rank=rank, markov_head=kind, loss_chunk_tokens=chunk
        )
        e, c = heads()
        out = dflash_loss(
            hidden,
            anchors,
            input_ids,
            loss_mask,
            head,
            chunked,
            target_hidden,
            dspark=DSparkHeads(e, markov_head.markov_w2.weight, c),
        )
        torch.testing.assert_close(out.loss.detach(), reference.detach())
        for got, want in zip(torch.autograd.grad(out.loss, params), expected):
            torch.testing.assert_close(got, want)
        torch.testing.assert_close(out.block_loss_sum.sum() / out.block_weight_sum.sum(), reference.detach())


def test_dspark_figures_equal_hand_computed_values():
    # One block of B = 3, vocab 2, identity head: the draft's distribution is (q, 1 - q) per slot, the target's
    # (p, 1 - p); alpha* = min(q, p) + min(1 - q, 1 - p) = 1 - |q - p|.
    q, p = torch.tensor([0.9, 0.6, 0.4]), torch.tensor([0.8, 0.2, 0.5])
    hidden = torch.stack([q.log(), (1 - q).log()], -1)[None]
    head = FrozenTargetHead(torch.eye(2), torch.eye(2))
    target_hidden = torch.stack([p.log(), (1 - p).log()], -1)  # positions 0..2: the teachers of slots 0..2
    target_hidden = torch.cat([target_hidden, torch.zeros(1, 2)])
    input_ids, loss_mask = torch.zeros(4, dtype=torch.long), torch.ones(4, dtype=torch.bool)
    anchors = anchors_from_local([4], [[0]])
    conf = torch.tensor([[2.0, 0.0, -1.0]])
    cfg = DrafterConfig(recipe="dspark", block_size=3, markov_rank=1)
    out = dflash_loss(
        hidden,
        anchors,
        input_ids,
        loss_mask,
        head,
        cfg,
        target_hidden,
        dspark=DSparkHeads(torch.zeros(1, 3, 1), torch.zeros(2, 1), conf),
    )
    alpha = 1 - (q - p).abs()
    torch.testing.assert_close(out.alpha_per_position, alpha)
    torch.testing.assert_close(out.tau_probabilistic, 1 + alpha.cumprod(0).sum())
    sig = torch.sigmoid(conf[0])
    calib = out.calibration
    torch.testing.assert_close(calib.abs_error, (sig - alpha).abs().sum()[None])
    torch.testing.assert_close(calib.bias, (sig - alpha).sum()[None])
    torch.testing.assert_close(calib.cumprod_bias, (sig.cumprod(0) - alpha.cumprod(0)).sum()[None])
    w = torch.exp(-torch.arange(3.0) / 4)
    torch.testing.assert_close(out.tv, (w * 2 * (q - p).abs()).sum() / w.sum())
    torch.testing.assert_close(
        calibration(sig[None], alpha[None], torch.tensor([[True, True, False]])).abs_error,
        (sig - alpha).abs()[:2].sum()[None],
    )
    # teacher-forced: the label is token 0 everywhere; slots 0 and 1 put it first, slot 2 does not -> 2 + 1
    torch.testing.assert_close(out.accept_len, torch.tensor(3.0))
    assert int(out.valid_per_position.sum()) == 3


def test_a_dspark_drafter_trains_on_a_tiny_target(tmp_path):
    from dflash_ring.common.config.train import TrainConfig
    from dflash_ring.consumer.training.trainer import DeviceBatch, Trainer

    save_tiny_qwen3(tmp_path)
    target_config = (tmp_path / "config.json").read_text()
    import json

    config = json.loads(target_config)
    drafter = DrafterConfig(
        recipe="dspark", num_hidden_layers=1, markov_rank=8, num_anchors=8, mask_token_id=config["vocab_size"] - 1
    )
    model = build_drafter(drafter, config)
    assert isinstance(model, DSparkDraftModel)
    names = set(model.state_dict())
    assert {
        "markov_head.markov_w1.weight",
        "markov_head.markov_w2.weight",
        "confidence_head.proj.weight",
        "confidence_head.proj.bias",
    } <= names
    head = load_target_head(tmp_path)
    trainer = Trainer(model, head, drafter, TrainConfig(lr=3e-3, warmup_ratio=0.0), torch.device("cpu"))
    torch.manual_seed(0)
    n_layers, hidden = len(model.target_layer_ids), config["hidden_size"]
    length = 40
    ids = torch.arange(length) % 7 + 3  # a counting rule the drafter can learn
    batch = DeviceBatch(
        features=torch.randn(length, n_layers * hidden),
        input_ids=ids,
        loss_mask=torch.ones(length, dtype=torch.bool),
        cu_seqlens=torch.tensor([0, length]),
        final_hidden=torch.randn(length, hidden),
    )
    first = last = None
    for _ in range(25):
        m = trainer.train_step(batch, total_steps=25)
        first = first or m
        last = m
    assert len([k for k in last.figures if k.startswith("accept_rate/pos_")]) == 7
    assert "confidence/abs_error" in last.figures
    assert last.loss < first.loss


def test_dspark_figures_reach_the_record_per_source_and_prometheus():
    from prometheus_client import CollectorRegistry

    from dflash_ring.common.metrics import DrafterMetrics
    from dflash_ring.consumer.reporting.source_metrics import by_source
    from dflash_ring.consumer.reporting.step_record import WindowStats, step_scalars
    from dflash_ring.consumer.families import family
    from dflash_ring.consumer.training.trainer import StepMetrics

    torch.manual_seed(3)
    vocab, hidden_size, rank, block = 20, 6, 3, 4
    head = FrozenTargetHead(torch.randn(vocab, hidden_size), torch.randn(vocab, hidden_size))
    lengths = [12, 10]
    input_ids = torch.randint(0, vocab, (22,))
    loss_mask = torch.ones(22, dtype=torch.bool)
    anchors = sample_anchors(loss_mask, cu_seqlens_from_lengths(lengths), 4, torch.Generator())
    hidden, target_hidden = torch.randn(anchors.num_blocks, block, hidden_size), torch.randn(22, hidden_size)
    cfg = DrafterConfig(recipe="dspark", block_size=block, markov_rank=rank)
    heads = DSparkHeads(
        torch.randn(anchors.num_blocks, block, rank), torch.randn(vocab, rank), torch.randn(anchors.num_blocks, block)
    )
    out = dflash_loss(hidden, anchors, input_ids, loss_mask, head, cfg, target_hidden, dspark=heads)
    # Two sources (one per sequence) add up to the batch; each source's figures are its blocks' own.
    stats = by_source(out, anchors, torch.tensor([0, 1]), loss_mask, ["code", "chat"])
    n0 = int(anchors.cu_anchors[1])
    torch.testing.assert_close(
        stats["code"].tau_probabilistic, float(out.block_tau_probabilistic[:n0].mean()), rtol=1e-6, atol=1e-6
    )
    total_tau = sum(s.tau_prob_sum for s in stats.values()) / anchors.num_blocks
    torch.testing.assert_close(total_tau, float(out.tau_probabilistic), rtol=1e-6, atol=1e-6)
    drafts = sum(s.confidence_drafts for s in stats.values())
    figures = family("dspark").figures(out)
    torch.testing.assert_close(
        sum(s.confidence_sums[0] for s in stats.values()) / drafts,
        figures["confidence/abs_error"],
        rtol=1e-6,
        atol=1e-6,
    )
    m = StepMetrics(
        step=1,
        loss=float(out.loss),
        ce=float(out.ce),
        kl=0.0,
        cap=0.0,
        accuracy_per_position=[0.5] * 4,
        accept_len=1.0,
        accept_len_prob=1.0,
        lr=1e-3,
        grad_norm=1.0,
        tokens=22,
        step_s=0.1,
        by_source=stats,
        figures=figures,
    )
    record = step_scalars(m, WindowStats(1.0, 22, 0.0, 1, 22, 0, stats))
    assert record["tau_probabilistic"] == figures["tau_probabilistic"]
    rate = (out.alpha_per_position / out.valid_per_position.clamp_min(1)).tolist()
    assert [record[f"accept_rate/pos_{k}"] for k in range(1, 5)] == [round(r, 4) for r in rate]
    assert {
        "confidence_loss",
        "confidence/abs_error",
        "confidence/bias",
        "confidence/cumprod_bias",
        "source/code/tau_probabilistic",
        "source/chat/confidence_cumprod_bias",
    } <= set(record)
    registry = CollectorRegistry()
    DrafterMetrics(registry).publish(1, 0.1, record)
    assert registry.get_sample_value("dflash_ring_drafter_tau_probabilistic") == figures["tau_probabilistic"]
    assert (
        registry.get_sample_value("dflash_ring_drafter_position_accept_rate", {"position": "1"})
        == figures["accept_rate/pos_1"]
    )
