"""DFlash2's candidate selector objective: a K-way CE over the unary top-K, scored with the true predecessor.

For a supervised draft row r with label y, the head loss's chunk loop (head_loss.py) keeps the unary top-K of the
draft's logits (ids c_1..c_K and their logits u_k: never more than the chunk's [rows, V] at once). The selector
scores them given the teacher-forced predecessor (the data's token before y; the anchor for the first draft):

    s_k = u_k + < predecessor_codebook[prev] * hidden_projection(h_r), successor_codebook[c_k] >
    CE_r = logsumexp_k s_k - s_{k*},  c_{k*} = y

    selector term = sum_{r: y in top-K} w_r CE_r / sum_{r: y in top-K} w_r

w: the head loss's weight of the row (position decay or D-PACE), so the term is the w-weighted mean of the K-way CE.
The gradient reaches the backbone through both parts (u_k through the frozen head's rows of the candidates), the
hidden projection and both codebooks.

A gold token outside the unary top-K: the row is left out of the selector's CE (NeMo Automodel's rule, #3605), and
counted in the top-K recall. Why this one: it is exact (the CE is over the set the selector will choose from when
serving, never one serving cannot produce), needs no choice of which candidate to evict (SpecForge puts the gold
into the last slot, speculators in place of the weakest, which trains the selector on a set it never sees), and the
unary CE already works on such a row: it is what can bring the gold into the top-K. The recall says how many rows
the selector learns from.

Figures, from quantities the loss has anyway (no walk, no extra vocabulary pass): the top-K recall, the draft's own
probability mass on its top-K, the selector's teacher-forced accuracy (over all supervised rows: a gold outside the
top-K is a miss), and two accepted lengths: the serving path's, 1 + the prefix of selector hits (exact for the greedy
walk from the anchor: while the walk is right its predecessor is the true token, so it scores what teacher forcing
scores), and the top-K oracle's, 1 + the prefix of rows whose gold is in the top-K (an oracle picking among the
candidates).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


class CandidateLogits(torch.autograd.Function):
    """The candidates' logits u [R, K] (given: the chunk loop's top-K values), with their gradient to the rows'
    hidden states through the frozen head: d u_k / d h = t'(z_k) W[c_k], z = h . W[c], t = softcap(multiplier z).
    Formed with one embedding_bag over the candidates' head rows, no [R, K, H] tensor."""

    @staticmethod
    def forward(ctx, hidden, values, candidates, weight, multiplier, cap):
        ctx.save_for_backward(values, candidates, weight)
        ctx.multiplier, ctx.cap, ctx.dtype = multiplier, cap, hidden.dtype
        return values.float()

    @staticmethod
    def backward(ctx, grad):
        values, candidates, weight = ctx.saved_tensors
        coefficient = grad.float()
        if ctx.cap is not None:  # d(cap tanh(x / cap))/dx = 1 - tanh^2, tanh = value / cap
            coefficient = coefficient * (1 - (values.float() / ctx.cap) ** 2)
        if ctx.multiplier is not None:
            coefficient = coefficient * ctx.multiplier
        if not candidates.shape[0]:
            return weight.new_zeros(0, weight.shape[1]).to(ctx.dtype), None, None, None, None, None
        grad_hidden = F.embedding_bag(candidates, weight, per_sample_weights=coefficient.to(weight.dtype), mode="sum")
        return grad_hidden.to(ctx.dtype), None, None, None, None, None


@dataclass(frozen=True)
class SelectorTerms:
    """The selector's term and its per-row quantities (all [R] over the supervised rows, detached but `loss`)."""

    loss: torch.Tensor  # the w-weighted mean CE over rows whose gold is in the top-K (0 when none is)
    ce: torch.Tensor  # the row's K-way CE (0 where left out)
    in_top_k: torch.Tensor  # bool: the gold is among the unary top-K
    correct: torch.Tensor  # bool: the selector's argmax is the gold (teacher-forced predecessor)
    top_k_mass: torch.Tensor  # the draft's probability mass on its top-K
    normaliser: torch.Tensor  # sum of w over the rows in the CE


def selector_terms(
    hidden: torch.Tensor,
    context: torch.Tensor,
    successor_codebook: torch.Tensor,
    values: torch.Tensor,
    candidates: torch.Tensor,
    lse: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    head_weight: torch.Tensor,
    multiplier: float | None,
    cap: float | None,
) -> SelectorTerms:
    """hidden [R, H] the supervised rows' draft states; context [R, r] their predecessor_codebook[prev] *
    hidden_projection(h); values/candidates [R, K] the chunk loop's top-K logits and ids; lse [R] the rows'
    log-normalisers; labels [R]; weights [R] the head loss's row weights (detached)."""
    unary = CandidateLogits.apply(hidden, values, candidates, head_weight, multiplier, cap)
    pairwise = (context.unsqueeze(-2) * successor_codebook[candidates].to(context.dtype)).sum(-1)
    scores = unary + pairwise.float()
    hits = candidates == labels[:, None]
    in_top_k = hits.any(-1)
    gold = hits.long().argmax(-1)
    ce = F.cross_entropy(scores, gold, reduction="none") * in_top_k
    w = weights.float() * in_top_k
    normaliser = w.sum()
    loss = (w * ce).sum() / normaliser.clamp_min(torch.finfo(torch.float32).tiny)
    with torch.no_grad():
        correct = (scores.argmax(-1) == gold) & in_top_k
        mass = torch.exp(torch.logsumexp(values.float(), -1) - lse.float())
    return SelectorTerms(loss, ce.detach(), in_top_k, correct, mass, normaliser.detach())
