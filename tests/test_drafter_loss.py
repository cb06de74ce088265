"""DFlash loss: label alignment, position weights, chunking, metrics, and learning a known rule."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dflash_ring.common.drafter_config import DrafterConfig
from dflash_ring.consumer.loss import block_labels, dflash_loss, position_weights
from dflash_ring.consumer.model import (
    FrozenTargetHead,
    build_drafter,
    cu_seqlens_from_lengths,
    load_target_head,
    sample_anchors,
)
from support import anchors_from_local, save_tiny_qwen3


def test_position_weights_decay_from_the_first_draft_position():
    w = position_weights(16, 7.0)
    assert w[0] == 0 and w[1] == 1
    expected = torch.tensor([math.exp(-(k - 1) / 7.0) for k in range(1, 16)])
    torch.testing.assert_close(w[1:], expected)
    torch.testing.assert_close(w[2:] / w[1:-1], torch.full((14,), math.exp(-1 / 7.0)))


def test_block_position_k_is_labelled_with_token_anchor_plus_k():
    lengths = [10, 8]
    input_ids = torch.arange(100, 118)  # token == 100 + packed index
    loss_mask = torch.ones(18, dtype=torch.bool)
    loss_mask[4] = False
    anchors = anchors_from_local(lengths, [[2, 7], [0]])
    labels = block_labels(anchors, input_ids, loss_mask, block_size=4)
    assert labels.tokens.tolist() == [[0, 103, 0, 105], [0, 108, 109, 0], [0, 111, 112, 113]]
    assert labels.valid.tolist() == [
        [False, True, False, True],  # position 4 has loss_mask 0
        [False, True, True, False],  # position 10 belongs to the next sequence
        [False, True, True, True],
    ]


def naive_loss(hidden, anchors, input_ids, loss_mask, head, cfg, target_hidden=None):
    """Full-logits reference for the chunked objective."""
    block = hidden.shape[1]
    labels = block_labels(anchors, input_ids, loss_mask, block)
    weights = position_weights(block, cfg.loss_gamma) * labels.valid
    log_q = F.log_softmax(head.logits(hidden).float(), dim=-1)
    ce = -log_q.gather(-1, labels.tokens[..., None]).squeeze(-1)
    per_position = ce
    if target_hidden is not None:
        teacher = anchors.positions[:, None] + torch.arange(block) - 1
        log_p = F.log_softmax(head.logits(target_hidden[teacher.clamp(0, len(input_ids) - 1)]).float(), dim=-1)
        per_position = ce + cfg.kl_weight * (log_p.exp() * (log_p - log_q)).sum(-1)
    return (per_position * weights).sum() / weights.sum()


@pytest.mark.parametrize("kl_weight", [0.0, 0.5])
def test_chunked_loss_equals_unchunked(kl_weight):
    torch.manual_seed(0)
    vocab, hidden_size, block = 50, 8, 5
    head = FrozenTargetHead(torch.randn(vocab, hidden_size), torch.randn(vocab, hidden_size))
    lengths = [13, 9]
    input_ids = torch.randint(0, vocab, (22,))
    loss_mask = torch.rand(22) > 0.2
    anchors = sample_anchors(torch.ones(22, dtype=torch.bool), cu_seqlens_from_lengths(lengths), 6, torch.Generator())
    hidden = torch.randn(anchors.num_blocks, block, hidden_size, requires_grad=True)
    target_hidden = torch.randn(22, hidden_size) if kl_weight else None

    results = []
    for chunk in (1, 7, 10_000):
        cfg = DrafterConfig(block_size=block, loss_gamma=3.0, kl_weight=kl_weight, loss_chunk_tokens=chunk)
        out = dflash_loss(hidden, anchors, input_ids, loss_mask, head, cfg, target_hidden)
        (grad,) = torch.autograd.grad(out.loss, hidden)
        results.append((out.loss.detach(), grad))
    cfg = DrafterConfig(block_size=block, loss_gamma=3.0, kl_weight=kl_weight)
    reference = naive_loss(hidden, anchors, input_ids, loss_mask, head, cfg, target_hidden)
    (reference_grad,) = torch.autograd.grad(reference, hidden)
    for loss, grad in results:
        torch.testing.assert_close(loss, reference.detach())
        torch.testing.assert_close(grad, reference_grad)


def test_metrics_count_accuracy_and_teacher_forced_acceptance():
    vocab = block = 4
    head = FrozenTargetHead(torch.eye(vocab), torch.eye(vocab))  # argmax(logits) == argmax(hidden)
    input_ids = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 0, 1])
    loss_mask = torch.ones(10, dtype=torch.bool)
    anchors = anchors_from_local([10], [[0, 4, 7]])  # labels 1,2,3 | 1,2,3 | 0,1,(past end)
    predicted = torch.tensor([[0, 1, 2, 0], [0, 3, 2, 3], [0, 0, 1, 2]])  # hits: 1,1,0 | 0,1,1 | 1,1,-
    hidden = F.one_hot(predicted, vocab).float()
    cfg = DrafterConfig(block_size=block, loss_gamma=1.0)
    out = dflash_loss(hidden, anchors, input_ids, loss_mask, head, cfg)
    assert out.correct_per_position.tolist() == [2, 3, 1]
    assert out.valid_per_position.tolist() == [3, 3, 2]
    assert out.num_valid_tokens == 8 and out.num_blocks == 3
    torch.testing.assert_close(out.accuracy_per_position, torch.tensor([2 / 3, 1.0, 1 / 2]))
    # accepted prefixes 2, 0, 2 (the last block ends with the sequence) -> lengths 3, 1, 3
    torch.testing.assert_close(out.accept_len, torch.tensor(7 / 3))


def test_no_anchors_gives_zero_loss():
    head = FrozenTargetHead(torch.randn(5, 3))
    anchors = anchors_from_local([4], [[]])
    hidden = torch.zeros(0, 4, 3, requires_grad=True)
    cfg = DrafterConfig(block_size=4, loss_gamma=2.0)
    out = dflash_loss(hidden, anchors, torch.zeros(4, dtype=torch.long), torch.ones(4), head, cfg)
    assert out.loss.item() == 0.0 and out.accept_len.item() == 0.0
    out.loss.backward()


# --- learning a deterministic rule ------------------------------------------------------------------

PERIOD, SEQ_LEN = 64, 32  # tokens count up mod PERIOD, so token[p + k] == (token[p] + k) % PERIOD


@pytest.fixture(scope="module")
def counting_setup(tmp_path_factory):
    path = tmp_path_factory.mktemp("counting-target")
    # initializer_range: a well-spread random lm_head, so argmax margins grow quickly
    config = save_tiny_qwen3(path, initializer_range=0.5).config
    return config, load_target_head(path)


def counting_batch(gen: torch.Generator, num_seqs: int, position_features: torch.Tensor):
    starts = torch.randint(0, PERIOD, (num_seqs, 1), generator=gen)
    input_ids = ((starts + torch.arange(SEQ_LEN)) % PERIOD).reshape(-1)
    # Features depend on the position only: the next tokens must come from the anchor token.
    context = position_features.repeat(num_seqs, 1)
    loss_mask = torch.ones_like(input_ids, dtype=torch.bool)
    return context, input_ids, loss_mask, cu_seqlens_from_lengths([SEQ_LEN] * num_seqs)


@pytest.fixture
def single_thread():
    """Tiny matmuls gain nothing from threads, and thread contention on a busy CI box costs 10x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow  # a learning run of many steps
def test_learns_counting_rule_at_every_block_position(counting_setup, single_thread):
    target_config, head = counting_setup
    torch.manual_seed(0)
    cfg = DrafterConfig(block_size=4, loss_gamma=4.0, num_anchors=16, mask_token_id=255)
    model = build_drafter(cfg, target_config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    position_features = torch.randn(SEQ_LEN, 64, generator=gen)
    steps = 400
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    for _ in range(steps):
        context, input_ids, loss_mask, cu = counting_batch(gen, 4, position_features)
        anchors = sample_anchors(loss_mask, cu, cfg.num_anchors, gen)
        out = dflash_loss(model(context, input_ids, anchors, head), anchors, input_ids, loss_mask, head, cfg)
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        schedule.step()

    with torch.no_grad():
        context, input_ids, loss_mask, cu = counting_batch(gen, 8, position_features)
        anchors = sample_anchors(loss_mask, cu, SEQ_LEN, gen)  # every valid anchor
        hidden = model(context, input_ids, anchors, head)
        out = dflash_loss(hidden, anchors, input_ids, loss_mask, head, cfg)
    assert out.valid_per_position.min() > 200
    # Independent of block_labels: position k must name (anchor token + k) mod PERIOD.
    predicted = head.logits(hidden[:, 1:]).argmax(-1)
    rule = (input_ids[anchors.positions][:, None] + torch.arange(1, 4)) % PERIOD
    assert (predicted == rule).float().mean() >= 0.95
    assert (out.accuracy_per_position >= 0.95).all(), out.accuracy_per_position
    assert out.accept_len > 3.8  # at most 4 (block_size); blocks cut by the sequence end count less
