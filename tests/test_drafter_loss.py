"""DFlash loss: label alignment, position weights, chunking, metrics, and learning a known rule."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dflash_ring.common.config.drafter import DrafterConfig
from dflash_ring.consumer.modeling.fp8 import Fp8Unavailable
from dflash_ring.consumer.modeling.fp8_head import E5M2, Fp8Head, quantize_rows
from dflash_ring.consumer.training.loss import block_labels, dflash_loss
from dflash_ring.consumer.objectives.cap import accept_products
from dflash_ring.consumer.objectives.dpace import dpace_weights
from dflash_ring.consumer.objectives.position_decay import position_weights
from dflash_ring.consumer.objectives.teacher import teacher_logits
from dflash_ring.consumer.modeling.model import (
    FrozenTargetHead,
    cu_seqlens_from_lengths,
    load_target_head,
    sample_anchors,
)
from dflash_ring.consumer.families.build import build_drafter
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


# --- D-PACE, CAP and target-argmax labels -----------------------------------------------------------


def test_dpace_weights_equal_a_hand_computed_example():
    # Block 1: q = 0.6, (masked), 0.2 -> q~ = 0.8, 1 (masked counts as 1), 0.6; C = 0.8, 0.8, 0.48;
    # w_1 = C_1 + C_3 = 1.28 (C_2 is masked out of the sum), w_3 = C_3 = 0.48, w_2 = 0 (not supervised).
    # Block 2: q = 0.5, 0.4, 0.5 -> q~ = 0.75, 0.7, 0.75; C = 0.75, 0.525, 0.39375; w = suffix sums.
    q = torch.tensor([[0.6, 0.3, 0.2], [0.5, 0.4, 0.5]])
    valid = torch.tensor([[True, False, True], [True, True, True]])
    w = dpace_weights(-q.log(), valid, alpha=0.5)
    c = [0.75, 0.525, 0.39375]
    torch.testing.assert_close(w, torch.tensor([[1.28, 0.0, 0.48], [sum(c), c[1] + c[2], c[2]]]))
    # alpha = 1: every q~ is 1 and w_k counts the supervised positions from k on.
    torch.testing.assert_close(dpace_weights(-q.log(), valid, alpha=1.0), torch.tensor([[2.0, 0, 1], [3, 2, 1]]))


def test_accept_products_end_at_an_unsupervised_position():
    q = torch.tensor([[0.6, 0.3, 0.2], [0.5, 0.4, 0.5]])
    valid = torch.tensor([[True, False, True], [True, True, True]])
    products = accept_products(-q.log(), valid)
    torch.testing.assert_close(products, torch.tensor([[0.6, 0.0, 0.0], [0.5, 0.2, 0.1]]))


def two_token_fixture(q_label):
    """Blocks whose drafter probability of each label is exactly q_label[n][k] (vocab 2, identity head):
    logits (log q, log(1 - q)) with label token 0 everywhere."""
    q = torch.tensor(q_label)
    n, k = q.shape
    hidden = torch.zeros(n, k + 1, 2)
    hidden[:, 1:, 0], hidden[:, 1:, 1] = q.log(), (1 - q).log()
    return hidden, FrozenTargetHead(torch.eye(2), torch.eye(2))


def test_loss_terms_equal_hand_computed_values():
    # Two blocks of B = 4 in one sequence of 9 tokens, all labels token 0; position 2 of the first block is
    # prompt (loss_mask 0), the second block runs past the sequence end after two positions.
    hidden, head = two_token_fixture([[0.6, 0.3, 0.2], [0.5, 0.4, 0.9]])
    input_ids = torch.zeros(9, dtype=torch.long)
    loss_mask = torch.ones(9, dtype=torch.bool)
    loss_mask[3] = False
    anchors = anchors_from_local([9], [[1, 6]])  # labels at 2, (3), 4 | 7, 8, (9: past the end)
    ce = -torch.tensor([0.6, 0.2, 0.5, 0.4]).log()  # supervised positions, in order

    cfg = DrafterConfig(block_size=4, loss_gamma=1.0, cap_weight=0.5)
    out = dflash_loss(hidden, anchors, input_ids, loss_mask, head, cfg)
    decay = torch.tensor([1.0, math.exp(-2), 1.0, math.exp(-1)])  # positions k = 1, 3 | 1, 2
    expected_ce = (decay * ce).sum() / decay.sum()
    a = torch.tensor([0.6, 0.5 + 0.5 * 0.4])  # expected accepted length per block (the first ends at k = 2)
    expected_cap = a.sum() / (2 * 3)
    torch.testing.assert_close(out.ce, expected_ce)
    torch.testing.assert_close(out.cap, expected_cap)
    torch.testing.assert_close(out.loss, expected_ce - 0.5 * expected_cap)
    torch.testing.assert_close(out.accept_len_prob, 1 + a.mean())
    torch.testing.assert_close(out.block_accept_prob, 1 + a)

    cfg = DrafterConfig(block_size=4, loss="dpace", dpace_alpha=0.5)
    out = dflash_loss(hidden, anchors, input_ids, loss_mask, head, cfg)
    smoothed = 0.5 * torch.tensor([0.6, 0.2, 0.5, 0.4]) + 0.5  # 0.8, 0.6 | 0.75, 0.7
    w = torch.tensor([0.8 + 0.8 * 0.6, 0.8 * 0.6, 0.75 + 0.75 * 0.7, 0.75 * 0.7])
    torch.testing.assert_close(smoothed[0] * smoothed[1], w[1])
    torch.testing.assert_close(out.loss, (w * ce).sum() / 4)  # normalised by the 4 supervised positions
    torch.testing.assert_close(out.block_loss_sum, torch.stack([(w * ce)[:2].sum(), (w * ce)[2:].sum()]))
    torch.testing.assert_close(out.block_weight_sum, torch.tensor([2.0, 2.0]))


def reference_loss(hidden, anchors, input_ids, loss_mask, head, cfg, target_hidden=None):
    """Every objective written out on full [N, B-1, V] logits, differentiated by autograd."""
    block = hidden.shape[1]
    labels = block_labels(anchors, input_ids, loss_mask, block)
    valid = labels.valid[:, 1:]
    log_q = F.log_softmax(head.logits(hidden[:, 1:]).float(), dim=-1)
    tokens, kl = labels.tokens[:, 1:], torch.zeros(valid.shape)
    if target_hidden is not None:
        teacher = (anchors.positions[:, None] + torch.arange(block - 1)).clamp(max=len(input_ids) - 1)
        log_p = F.log_softmax(head.logits(target_hidden[teacher]).float(), dim=-1)
        if cfg.label == "target_argmax":
            tokens = log_p.argmax(-1)
        kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    ce = -log_q.gather(-1, tokens[..., None]).squeeze(-1)
    if cfg.loss == "ce":
        w = position_weights(block, cfg.loss_gamma)[1:] * valid
        normaliser = w.sum()
    else:
        smoothed = torch.where(valid, (1 - cfg.dpace_alpha) * torch.exp(-ce.detach()) + cfg.dpace_alpha, 1.0)
        reach = torch.cumprod(smoothed, 1) * valid
        w = reach.flip(1).cumsum(1).flip(1) * valid
        normaliser = valid.sum()
    main = (w * (ce + cfg.kl_weight * kl) * valid).sum() / normaliser
    products = torch.cumprod(torch.where(valid, torch.exp(-ce), 0.0), dim=1)
    return main - cfg.cap_weight * products.sum() / (max(anchors.num_blocks, 1) * (block - 1))


OBJECTIVES = [
    {"loss": "ce", "cap_weight": 0.3},
    {"loss": "ce", "kl_weight": 0.5, "cap_weight": 0.3},
    {"loss": "dpace", "dpace_alpha": 0.3},
    {"loss": "dpace", "kl_weight": 0.5, "cap_weight": 0.3},
    {"label": "target_argmax"},
    {"loss": "dpace", "label": "target_argmax", "kl_weight": 0.2, "cap_weight": 1.0},
]


@pytest.mark.parametrize("objective", OBJECTIVES, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_every_objective_equals_its_unchunked_reference(objective):
    torch.manual_seed(1)
    vocab, hidden_size, block = 40, 8, 5
    head = FrozenTargetHead(torch.randn(vocab, hidden_size), torch.randn(vocab, hidden_size))
    lengths = [13, 9]
    input_ids = torch.randint(0, vocab, (22,))
    loss_mask = torch.rand(22) > 0.2
    anchors = sample_anchors(torch.ones(22, dtype=torch.bool), cu_seqlens_from_lengths(lengths), 6, torch.Generator())
    hidden = torch.randn(anchors.num_blocks, block, hidden_size, requires_grad=True)
    cfg = DrafterConfig(block_size=block, loss_gamma=3.0, **objective)
    target_hidden = torch.randn(22, hidden_size) if cfg.needs_target_logits else None
    reference = reference_loss(hidden, anchors, input_ids, loss_mask, head, cfg, target_hidden)
    (reference_grad,) = torch.autograd.grad(reference, hidden)
    for chunk in (1, 7, 10_000):  # a block per chunk, a few blocks per chunk, all at once
        chunked = DrafterConfig(block_size=block, loss_gamma=3.0, loss_chunk_tokens=chunk, **objective)
        out = dflash_loss(hidden, anchors, input_ids, loss_mask, head, chunked, target_hidden)
        (grad,) = torch.autograd.grad(out.loss, hidden)
        torch.testing.assert_close(out.loss.detach(), reference.detach())
        torch.testing.assert_close(grad, reference_grad)


def test_target_argmax_labels_are_the_targets_greedy_tokens():
    # Identity head: the target's argmax at packed position p is argmax(target_hidden[p]), which is the
    # label of block position k for the anchor at p - k + 1; data tokens are all 0 and never the argmax.
    vocab = block = 4
    head = FrozenTargetHead(torch.eye(vocab), torch.eye(vocab))
    greedy = torch.tensor([1, 2, 3, 1, 2, 3, 1, 2])
    target_hidden = F.one_hot(greedy, vocab).float() * 5
    input_ids = torch.zeros(8, dtype=torch.long)
    anchors = anchors_from_local([8], [[0, 3]])
    hidden = torch.zeros(2, block, vocab)
    hidden[:, 1:] = F.one_hot(torch.stack([greedy[0:3], greedy[3:6]]), vocab).float()  # the drafter agrees
    cfg = DrafterConfig(block_size=block, loss_gamma=1.0, label="target_argmax")
    out = dflash_loss(hidden, anchors, input_ids, torch.ones(8, dtype=torch.bool), head, cfg, target_hidden)
    assert out.accept_len.item() == 4.0 and out.correct_per_position.tolist() == [2, 2, 2]
    data = dflash_loss(
        hidden,
        anchors,
        input_ids,
        torch.ones(8, dtype=torch.bool),
        head,
        DrafterConfig(block_size=block, loss_gamma=1.0),
    )
    assert data.accept_len.item() == 1.0  # against the data tokens every draft misses


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


# --- the teacher once per position, the FP8 head ----------------------------------------------------


def test_teacher_logits_are_computed_once_per_distinct_position_and_equal_a_product_per_row():
    torch.manual_seed(2)
    vocab, hidden_size = 48, 16
    head = FrozenTargetHead(
        torch.randn(vocab, hidden_size, dtype=torch.float64), torch.randn(vocab, hidden_size, dtype=torch.float64)
    )
    target_hidden = torch.randn(30, hidden_size, dtype=torch.float64)
    positions = torch.tensor([3, 4, 5, 4, 5, 6, 5, 6, 7, 29, 0])  # overlapping blocks read shared positions
    for chunk in (1, 4, 100):
        teacher = teacher_logits(target_hidden, positions, head.lm_head_weight, None, None, chunk, keep_logits=True)
        assert teacher.logits.shape[0] == len(set(positions.tolist())) == 7
        per_row = head.logits(target_hidden[positions])
        torch.testing.assert_close(teacher.logits[teacher.row], per_row, rtol=0, atol=1e-12)
        torch.testing.assert_close(teacher.lse[teacher.row], torch.logsumexp(per_row, -1).float())
        assert torch.equal(teacher.argmax[teacher.row], per_row.argmax(-1))
    only_argmax = teacher_logits(target_hidden, positions, head.lm_head_weight, None, None, 4, keep_logits=False)
    assert only_argmax.logits is None and torch.equal(only_argmax.argmax, teacher.argmax)


def test_fp8_head_products_equal_their_dequantized_reference():
    torch.manual_seed(3)
    weight = torch.randn(64, 32) * 0.05
    fp8 = Fp8Head.of(weight)
    hidden = torch.randn(10, 32)
    rows, scale = quantize_rows(hidden)
    reference = (rows.float() * scale) @ (fp8.by_vocab.float() * fp8.vocab_scale.t()).t()
    torch.testing.assert_close(fp8.logits(hidden).float(), reference, rtol=1e-2, atol=1e-3)
    exact = hidden @ weight.t()
    assert (fp8.logits(hidden).float() - exact).norm() / exact.norm() < 0.05  # e4m3: 3 mantissa bits
    d = torch.randn(10, 64)
    d8, d_scale = quantize_rows(d, E5M2)
    reference = (d8.float() * d_scale) @ (fp8.by_hidden.float() * fp8.hidden_scale.t()).t()
    torch.testing.assert_close(fp8.grad_hidden(d8, d_scale).float(), reference, rtol=1e-2, atol=1e-3)
    with pytest.raises(Fp8Unavailable, match="divisible by 16"):
        Fp8Head.of(torch.randn(50, 32))


@pytest.mark.parametrize("objective", [{"kl_weight": 0.5, "cap_weight": 0.3}, {"loss": "dpace", "kl_weight": 0.2}])
def test_fp8_head_loss_and_gradient_stay_close_to_the_exact_ones(objective):
    torch.manual_seed(4)
    vocab, hidden_size, block = 64, 32, 5
    weight = torch.randn(vocab, hidden_size) * 0.3
    lengths = [13, 9]
    input_ids = torch.randint(0, vocab, (22,))
    loss_mask = torch.rand(22) > 0.2
    anchors = sample_anchors(torch.ones(22, dtype=torch.bool), cu_seqlens_from_lengths(lengths), 6, torch.Generator())
    hidden = torch.randn(anchors.num_blocks, block, hidden_size, requires_grad=True)
    target_hidden = torch.randn(22, hidden_size)
    cfg = DrafterConfig(block_size=block, loss_gamma=3.0, loss_chunk_tokens=7, **objective)
    results = []
    for fp8 in (False, True):
        head = FrozenTargetHead(weight.clone(), weight.clone())
        if fp8:
            head.quantize_fp8()
        out = dflash_loss(hidden, anchors, input_ids, loss_mask, head, cfg, target_hidden)
        results.append((out.loss.detach(), torch.autograd.grad(out.loss, hidden)[0]))
    (exact, exact_grad), (quantized, quantized_grad) = results
    assert not torch.equal(exact_grad, quantized_grad)  # the FP8 products really ran
    torch.testing.assert_close(quantized, exact, rtol=0.03, atol=0)
    assert (quantized_grad - exact_grad).norm() / exact_grad.norm() < 0.1
