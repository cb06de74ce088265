"""Will a `bench drafter` step fit on the GPU? Its peak memory, estimated from the shapes alone.

Why: a step too large for the GPU dies with a CUDA out-of-memory error minutes into the bench, after the
model is built and its layers compiled (the 27B width with the ddtree recipe at the Qwen3-8B default of
4 x 3072 tokens did, on the H200). The estimate runs before anything is built, so `bench drafter` can pick
sample counts that fit when they are left unset, and refuse at once, in one line, when the ones given do not.

The peak allocated bytes of a step (what torch.cuda.max_memory_allocated reports), for P trainable
parameters, T context tokens (seqs x seq_len), N block tokens (seqs x blocks per sample x B), L drafter
layers of width h, MLP width I and key/value width kv, n target layers fed, a vocabulary of V and loss
chunks of C rows:

  weights         14 P              fp32 master weights (4), AdamW's two moments (8), the bf16 weight copies
                                    autocast keeps for the backward (2); the fp32 gradients (4) grow only as
                                    the activations are freed, so they are not added at the peak
  frozen head     4 V h             the target's embedding and lm_head, bf16
  inputs          T (2 n h + 2 h)   the context features on the GPU, plus the final hidden state where the
                                    objective reads the target (KL, target-argmax labels)
  teacher logits  2 T V             those objectives' target logits: once per sequence position, bf16, kept
                                    for the step
  context         T (2 n h + 8 h + 8 L kv)  the fc's bf16 input, its fp32 output and norm, each layer's keys
                                    and values of the context
  blocks          N (20 h + a L (h + I))    per block token: its fp32 embedding, final norm, loss rows and their
                                    gradient (20 h), and per layer what the layer keeps for its backward
  loss chunk      8 C V             two fp32 [C, V] temporaries of the chunked loss

DSpark adds its heads' parameters; DFlash2 its convolutions' and selector's parameters, and per block token the
convolutions' activations (per layer) and the selector objective's (dflash2_activation_bytes: counted from the
code, not fitted; the two dflash2 rows below were measured before the count was written, and without these terms
the estimate would read 35.5 and 60.9 GiB for them).

`a`, the one fitted number, is bytes per block token, layer and unit of (h + I): 9 for the default step
(flex attention, compiled layers), 20 for an eager one (--no-compile or --attention sdpa), 15.5 for the
flex-vs-SDPA gradient check (its two passes run eager before the first optimizer step: no AdamW moments
yet, but both passes' fp32 gradients, so again 14 P). With the check on, the peak is the larger of the two.

Calibration: the peaks measured on one H200 (docs/benchmarks.md, "Drafter training step on the H200": the
issue 16 and issue 21 sections; the raw JSON beside it). Those runs predate the teacher logits kept per
position (the loss then gathered the final hidden state per block row instead), so for ddtree the estimate
sits above them by that term (2 GB per 4,096 tokens of the 27B):

  run (GiB)                                          measured   estimate   without teacher logits
  Qwen3-8B shape, paper, 4 x 3072                       43.7       43.9       43.9  (+0.5%)
  27B width, ddtree, 1 x 4096                           65.3       67.3       65.4  (+0.1%)
  27B width, ddtree, 2 x 4096                          100.0      104.0      100.2  (+0.2%)
  27B width, paper, 1 x 4096                            39.3       39.8       39.8  (+1.2%)
  Qwen3-8B shape, paper, 4 x 3072, gradient check       62.1       60.2       60.2  (-3.1%)
  27B width, ddtree, 1 x 4096, gradient check           84.6       89.6       87.7  (+3.7%)
  Qwen3-8B shape, paper, 4 x 3072, eager SDPA           71.2       71.4       71.4  (+0.3%)
  27B width, dflash2, 1 x 4096                          40.3       39.3       39.3  (-2.4%)
  27B width, dflash2, 4 x 3072, gradient check          78.9       82.6       82.6  (+4.6%)

The eager SDPA run is docs/bench-drafter-h200-sdpa.json (2026-11-29); tests/test_drafter_bench.py checks the
table. A step fits when its estimate is at most (1 - MARGIN) of the GPU's memory: the margin covers the
estimate's error, the allocator's cached but unused blocks and what CUDA itself holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dflash_ring.common.config.drafter import DrafterConfig
from dflash_ring.consumer.layouts.drafter_hf_config import drafter_geometry

MARGIN = 0.10
COMPILED, EAGER, GRAD_CHECK = 9.0, 20.0, 15.5  # `a` above, bytes per block token, layer and (h + I)
GiB = 2**30


class DoesNotFit(MemoryError):
    """The step asked for would not fit the GPU's memory (a usage error: the CLI prints it in one line, exit 2)."""


@dataclass(frozen=True)
class StepMemory:
    """Estimated peak bytes of one step; `check` is the gradient check's, or None where it does not run."""

    step: float
    check: float | None

    @property
    def peak(self) -> float:
        return max(self.step, self.check or 0.0)


def trainable_parameters(target: Mapping[str, Any], drafter: DrafterConfig) -> int:
    """The drafter's parameters (consumer/modeling/model.py: the decoder layers, fc and two norms), counted, not
    built."""
    g = drafter_geometry(drafter, target)
    h, hd, inner = g["hidden_size"], g["head_dim"], g["intermediate_size"]
    q, kv = g["num_attention_heads"] * hd, g["num_key_value_heads"] * hd
    layer = h * q + 2 * h * kv + q * h + 3 * h * inner + 2 * h + 2 * hd  # projections, MLP, 2 norms, q/k norms
    fed = len(drafter.resolved_target_layer_ids(int(target["num_hidden_layers"])))
    return (
        drafter.num_hidden_layers * layer
        + fed * h * h
        + 2 * h
        + dspark_head_parameters(g, drafter)
        + dflash2_parameters(g, drafter)
    )


def dflash2_parameters(g: Mapping[str, Any], drafter: DrafterConfig) -> int:
    """DFlash2's additions: per layer two convolutions (base_kernel [2, k, h], kernel_projection [2 k G, h], G = h /
    group), and the selector (two [V, r] codebooks, hidden_projection [r, h]); 0 without them (conv_kernel_size 0:
    every other family)."""
    if not drafter.conv_kernel_size:
        return 0
    h, k, vocab, r = g["hidden_size"], drafter.conv_kernel_size, g["vocab_size"], drafter.selector_rank
    conv = 2 * k * h + 2 * k * (h // drafter.conv_group_size) * h
    return drafter.num_hidden_layers * 2 * conv + 2 * vocab * r + r * h


def dflash2_activation_bytes(g: Mapping[str, Any], drafter: DrafterConfig, compiled: bool) -> tuple[float, float]:
    """(bytes per block token and layer for the convolutions, bytes per block token for the selector), 0 for another
    arch. Counted from the code (consumer/dflash2_blocks.py, consumer/objectives/selector.py), not yet measured.

    Convolutions: each tap of the four per layer keeps its shifted input and its h-wide coefficient for the
    backward, in the sublayer's dtype: fp32 into the sublayer (prepare), bf16 out of it (finish): 2 x k x 2 x (4 + 2)
    h = 24 k h eager; compiled, the taps are recomputed from each convolution's input: 2 x (4 + 2) h = 12 h.
    Selector, per supervised row (at most one per block token): the candidates' successor codes gathered as fp32
    and kept as bf16 (6 K r), the top-K's fp32 values and int64 ids (12 K), the projection and its predecessor
    product (8 r). 0 without them (conv_kernel_size 0: every other family)."""
    if not drafter.conv_kernel_size:
        return 0.0, 0.0
    h, k, r, top_k = g["hidden_size"], drafter.conv_kernel_size, drafter.selector_rank, drafter.selector_top_k
    return (12 * h if compiled else 24 * k * h), 6 * top_k * r + 12 * top_k + 8 * r


def dspark_head_parameters(g: Mapping[str, Any], drafter: DrafterConfig) -> int:
    """DSpark's Markov head (markov_w1, markov_w2: [V, r] each, and the gated/rnn projections) and confidence head; 0
    without them (markov_rank 0: every other family)."""
    if not drafter.markov_rank:
        return 0
    h, r, vocab = g["hidden_size"], drafter.markov_rank, g["vocab_size"]
    extra = {"vanilla": 0, "gated": (h + r + 1) * r, "rnn": (2 * r + h + 1) * 3 * r}[drafter.markov_head]
    return 2 * vocab * r + extra + h + r + 1


def step_memory(
    target: Mapping[str, Any], drafter: DrafterConfig, seqs: int, seq_len: int, *, compiled: bool, check: bool
) -> StepMemory:
    """The module docstring's estimate for `seqs` samples of `seq_len` tokens (every sample gets the recipe's
    anchors, at most one per token: an upper bound on the blocks the bench samples)."""
    g = drafter_geometry(drafter, target)
    h, vocab, layers = g["hidden_size"], g["vocab_size"], drafter.num_hidden_layers
    kv = g["num_key_value_heads"] * g["head_dim"]
    fed = len(drafter.resolved_target_layer_ids(int(target["num_hidden_layers"])))
    tokens = seqs * seq_len
    block_tokens = seqs * min(drafter.num_anchors, seq_len) * drafter.block_size
    teacher = drafter.needs_target_logits
    rows = max(drafter.loss_chunk_tokens, drafter.block_size - 1)  # a chunk holds at least one whole block
    fixed = (
        14 * trainable_parameters(target, drafter)
        + 4 * vocab * h
        + tokens * (2 * fed * h + (2 * h if teacher else 0))
        + (2 * tokens * vocab if teacher else 0)
        + tokens * (2 * fed * h + 8 * h + 8 * layers * kv)
        + block_tokens * 20 * h
        + 8 * rows * vocab
    )
    per_unit = block_tokens * layers * (h + g["intermediate_size"])
    # DFlash2: its convolutions per layer and its selector objective per row (the gradient check runs eager)
    conv, selector = dflash2_activation_bytes(g, drafter, compiled)
    eager_conv, _ = dflash2_activation_bytes(g, drafter, False)
    fixed += block_tokens * selector
    return StepMemory(
        step=fixed + (COMPILED if compiled else EAGER) * per_unit + block_tokens * layers * conv,
        check=fixed + GRAD_CHECK * per_unit + block_tokens * layers * eager_conv if check else None,
    )


def usable_bytes(gpu_bytes: float) -> float:
    return gpu_bytes * (1 - MARGIN)


def fit_samples(
    target: Mapping[str, Any],
    drafter: DrafterConfig,
    seqs: int | None,
    seq_len: int | None,
    gpu_bytes: float,
    *,
    compiled: bool,
    check: bool,
    default: tuple[int, int] = (4, 3072),
    fallback_len: int = 3072,
) -> tuple[int, int, StepMemory]:
    """The samples per step and tokens per sample to run, and their estimate; DoesNotFit if none fits.

    Unset values are chosen: `default` (the paper's 4 x 3072) where it fits, else as many samples of
    `fallback_len` tokens (the shape's) as fit, from default[0] down to 1. Values given are kept, and a step
    that does not fit with them is refused, with the estimate and what would fit.
    """
    candidates = [default] + [(n, fallback_len) for n in range(default[0], 0, -1)]
    candidates = list(dict.fromkeys((seqs or n, seq_len or length) for n, length in candidates))
    usable = usable_bytes(gpu_bytes)
    for n, length in candidates:
        memory = step_memory(target, drafter, n, length, compiled=compiled, check=check)
        if memory.peak <= usable:
            return n, length, memory
    n, length = candidates[-1]  # the smallest tried, whose estimate `memory` is
    asked = " ".join(f"--{flag} {value}" for flag, value in (("seqs", seqs), ("seq-len", seq_len)) if value)
    what = f"{asked} does not fit" if asked else f"no default --seqs/--seq-len fits (down to {n} x {length})"
    parts = f"the gradient check {memory.check / GiB:.0f}, the step {memory.step / GiB:.0f}" if check else ""
    why = (
        f"{what}: the step needs ~{memory.peak / GiB:.0f} GiB by the estimate of bench/drafter_memory.py"
        f"{f' ({parts})' if parts else ''}, over the {usable / GiB:.0f} GiB usable of the GPU's "
        f"{gpu_bytes / GiB:.0f} GiB (--gpu-memory-gib)"
    )
    fits = _largest_fit(target, drafter, n, length, usable, compiled=compiled, check=check)
    suggestion = f"at most --seqs {fits[0]} --seq-len {fits[1]} fits" if fits else "not even 1 x 256 tokens fits"
    unchecked = _largest_fit(target, drafter, n, length, usable, compiled=compiled, check=False) if check else None
    if unchecked and unchecked != fits:
        suggestion += (
            f"; with --no-check (the gradient check runs eager): --seqs {unchecked[0]} --seq-len {unchecked[1]}"
        )
    raise DoesNotFit(f"{why}; {suggestion}")


def _largest_fit(
    target: Mapping[str, Any],
    drafter: DrafterConfig,
    seqs: int,
    seq_len: int,
    usable: float,
    *,
    compiled: bool,
    check: bool,
) -> tuple[int, int] | None:
    """The most samples of seq_len tokens (up to seqs) that fit, else the longest single sample (256 at a time)."""

    def fits(n: int, length: int) -> bool:
        return step_memory(target, drafter, n, length, compiled=compiled, check=check).peak <= usable

    shapes = [(n, seq_len) for n in range(seqs, 0, -1)] + [(1, length) for length in range(seq_len - 256, 0, -256)]
    return next((shape for shape in shapes if fits(*shape)), None)
