"""Each objective component on its own: a term's gradient w.r.t. the logits equals autograd's of its value, a
weighting's weights and normaliser are the documented ones, CAP's CE coefficients are the derivative of its loss,
and the confidence's BCE is torch's. The whole loss against full-logits references: test_drafter_loss.py (DFlash
objectives) and test_dspark.py (DSpark)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from dflash_ring.consumer.objectives.cap import Cap, accept_products
from dflash_ring.consumer.objectives.confidence import confidence_loss
from dflash_ring.consumer.objectives.cross_entropy import ce_grad, ce_of
from dflash_ring.consumer.objectives.dpace import DPace, dpace_weights
from dflash_ring.consumer.objectives.position_decay import PositionDecay, draft_weights
from dflash_ring.consumer.objectives.soft_kl import kl_grad, kl_of
from dflash_ring.consumer.objectives.total_variation import l1_grad, l1_of


def logits_and_teacher(rows: int = 5, vocab: int = 11):
    torch.manual_seed(0)
    return torch.randn(rows, vocab, requires_grad=True), torch.softmax(torch.randn(rows, vocab), -1)


def test_each_terms_gradient_is_the_derivative_of_its_value():
    logits, p = logits_and_teacher()
    label = torch.tensor([0, 3, 10, 4, 4])
    log_q = F.log_softmax(logits, -1)
    q = log_q.exp().detach()
    cases = {
        "ce": (ce_of(log_q, label), ce_grad(q, label)),
        "kl": (kl_of(p, p.log(), log_q), kl_grad(q, p)),
        "l1": (l1_of(log_q.exp(), p), l1_grad(q, p)),
    }
    for name, (value, grad) in cases.items():
        (auto,) = torch.autograd.grad(value.sum(), logits, retain_graph=True)
        torch.testing.assert_close(grad, auto, msg=name)
    torch.testing.assert_close(ce_of(log_q, label), F.cross_entropy(logits, label, reduction="none"))
    torch.testing.assert_close(kl_of(p, p.log(), log_q), F.kl_div(log_q, p, reduction="none").sum(-1))


def test_position_decay_weights_each_supervised_draft_by_its_offset():
    valid = torch.tensor([[True, False, True], [True, True, True]])
    decay = PositionDecay.of(valid, gamma=2.0)
    w = [1.0, math.exp(-1.0), 1.0, math.exp(-0.5), math.exp(-1.0)]  # drafts 1, 3 | 1, 2, 3
    torch.testing.assert_close(decay.rows, torch.tensor(w))
    assert math.isclose(decay.normaliser, sum(w), rel_tol=1e-6) and decay.before_ce
    torch.testing.assert_close(draft_weights(3, 2.0), torch.tensor([1.0, math.exp(-0.5), math.exp(-1.0)]))


def test_dpace_is_normalised_by_the_supervised_drafts_and_needs_the_ce():
    valid = torch.tensor([[True, True], [True, False]])
    ce = torch.tensor([[0.1, 0.2], [0.3, 0.0]])
    d = DPace(alpha=0.5, supervised=int(valid.sum()))
    assert d.normaliser == 3 and not d.before_ce and d.fixed(slice(0, 3)) is None
    torch.testing.assert_close(d.weights(slice(0, 3), ce, valid), dpace_weights(ce, valid, 0.5)[valid])


def test_caps_ce_coefficients_are_the_derivative_of_its_loss():
    ce = torch.tensor([[0.2, 0.5, 0.1], [0.4, 0.3, 0.9]], requires_grad=True)
    valid = torch.tensor([[True, True, False], [True, True, True]])
    cap = Cap(weight=0.7, num_blocks=2, drafts=3)
    loss = cap.loss(accept_products(ce, valid))
    (auto,) = torch.autograd.grad(loss, ce)
    products = accept_products(ce.detach(), valid)
    torch.testing.assert_close(cap.ce_coefficients(products, valid), auto[valid])


def test_the_confidence_loss_is_the_weighted_bce_over_the_weights_sum():
    logits, alpha, w = torch.tensor([1.5, -0.3, 0.0]), torch.tensor([0.9, 0.2, 0.5]), torch.tensor([1.0, 0.5, 0.25])
    bce = F.binary_cross_entropy(torch.sigmoid(logits), alpha, reduction="none")
    torch.testing.assert_close(confidence_loss(logits, alpha, w, float(w.sum())), (w * bce).sum() / w.sum())
