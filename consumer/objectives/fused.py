"""The passes over one chunk of [rows, vocab] logits: every row term and, given the coefficients, the gradient.

One function per pass so that on a GPU torch.compile fuses the softmax, the teacher's gather, the terms, the argmax and
the gradient into a pass or two over the chunk instead of one per op. Which terms a pass computes and how the logits
were transformed are constants of the compiled graph (ChunkSpec), never branches on runtime values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from dflash_ring.consumer.modeling.fp8_head import E5M2, quantize_rows
from .cross_entropy import ce_grad, ce_of
from .soft_kl import kl_grad, kl_of
from .total_variation import l1_grad, l1_of


@dataclass(frozen=True)
class ChunkSpec:
    """What the chunk computes besides CE, and the logits' transform: constants of the compiled passes."""

    kl: bool  # KL from the teacher (needs the teacher's logits)
    tv: bool  # L1 to the teacher (DSpark; needs the teacher's logits)
    multiplier: float | None  # the target's logit multiplier (Granite, Cohere, Falcon-H1), then
    cap: float | None  # its logit softcap (Gemma): applied to draft and teacher alike
    fp8: bool  # the gradient leaves the chunk quantized per row for the FP8 head product (fp8_head.py)

    @property
    def taught(self) -> bool:
        return self.kl or self.tv


class Coefficients(NamedTuple):
    """Per row: d loss / d term, for each term the chunk computes (None: the spec leaves the term out). A NamedTuple:
    the compiled passes take it as a plain tuple of tensors."""

    ce: torch.Tensor
    kl: torch.Tensor | None
    tv: torch.Tensor | None


def _teacher_log_p(teacher: torch.Tensor, teacher_lse: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """log p of the rows [rows, V] from the per-position teacher logits: a gather the compiled chunk fuses."""
    return teacher[row].float() - teacher_lse[row][:, None]


def _logit_grad(
    logits: torch.Tensor,
    log_q: torch.Tensor,
    label: torch.Tensor,
    p: torch.Tensor | None,
    c: Coefficients,
    spec: ChunkSpec,
):
    """sum_t c_t d term_t / d logits per row, through the logit transform to the plain head product: (d in the
    logits' dtype, None), or (d in E5M2, its row scales) for the FP8 head."""
    q = log_q.exp()
    d = ce_grad(q, label) * c.ce[:, None]
    if spec.kl:
        d = d + kl_grad(q, p) * c.kl[:, None]
    if spec.tv:
        d = d + l1_grad(q, p) * c.tv[:, None]
    if spec.cap is not None:  # d(cap * tanh(z / cap))/dz = 1 - tanh^2, with tanh = capped / cap
        d = d * (1 - (logits.float() / spec.cap) ** 2)
    if spec.multiplier is not None:  # d(m z)/dz = m
        d = d * spec.multiplier
    return quantize_rows(d, E5M2) if spec.fp8 else (d.to(logits.dtype), None)


def chunk_terms(
    logits: torch.Tensor,
    label: torch.Tensor,
    teacher: torch.Tensor | None,
    teacher_lse: torch.Tensor | None,
    row: torch.Tensor | None,
    c: Coefficients | None,
    spec: ChunkSpec,
):
    """Per-row CE, KL and L1 (zeros for a term the spec leaves out), the draft's top-1, the rows' log-normaliser
    and, when the coefficients are known already, d loss / d head product (fp32 inside; _logit_grad)."""
    lse_q = torch.logsumexp(logits.float(), dim=-1)
    log_q = logits.float() - lse_q[:, None]
    predictions = logits.argmax(dim=-1)
    p = None
    kl = tv = torch.zeros_like(lse_q)
    if spec.taught:
        log_p = _teacher_log_p(teacher, teacher_lse, row)
        p = log_p.exp()
        if spec.kl:
            kl = kl_of(p, log_p, log_q)
        if spec.tv:
            tv = l1_of(log_q.exp(), p)
    ce = ce_of(log_q, label)
    d_logits = (None, None) if c is None else _logit_grad(logits, log_q, label, p, c, spec)
    return ce, kl, tv, predictions, lse_q, d_logits


def chunk_grad(
    logits: torch.Tensor,
    label: torch.Tensor,
    teacher: torch.Tensor | None,
    teacher_lse: torch.Tensor | None,
    row: torch.Tensor | None,
    lse_q: torch.Tensor,
    c: Coefficients,
    spec: ChunkSpec,
):
    """d loss / d head product of one chunk once its coefficients are known (they depend on its CE: D-PACE, CAP):
    one elementwise pass, the softmax normalisers coming from the first."""
    p = _teacher_log_p(teacher, teacher_lse, row).exp() if spec.taught else None
    return _logit_grad(logits, logits.float() - lse_q[:, None], label, p, c, spec)


_compiled: dict[str, object] = {}


def on(device: torch.device, fn):
    """fn compiled on CUDA. Sizes become symbolic only once they change between calls (the rows of a chunk,
    the step's teacher positions), so the vocabulary stays a constant and each element's row is not an
    integer division by a runtime value in the fused passes over [rows, vocab]."""
    if device.type != "cuda":
        return fn
    if fn.__name__ not in _compiled:
        _compiled[fn.__name__] = torch.compile(fn, dynamic=None)
    return _compiled[fn.__name__]
