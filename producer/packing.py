"""Packed batches kept exact: no token mixer ever sees across a sequence boundary.

A packed batch is one row of concatenated sequences with positions restarting at 0 per sequence.
Per-token parts (norms, MLPs, MoE routing, RoPE at the restarted positions) are exact by
construction; the token mixers are not, and each kind is handled here:

- Attention (full, sliding window, attention sinks): the model runs `packed_attention` through
  HF's AttentionInterface. On CUDA it is torch's varlen flash kernel over the whole pack (sliding
  windows as its window size). Elsewhere, and for layers the kernel cannot express (gpt-oss's
  sinks), each sequence goes through the very attention function the unpacked model calls (sdpa or
  the model's own eager function, sinks included), with the mask the unpacked model would build.
- Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, GLM-4.7-Flash, LongCat-Flash): the latent
  projections and the RoPE on the rope part of each head are per token; what reaches the attention
  function is plain attention over qk heads of nope + rope dims and value heads of v_head_dim, which
  may differ (DeepSeek-V3: 192 and 128). The per-sequence paths take any widths; the varlen kernel
  takes one head dim for q, k and v, so the narrower side is zero-padded (zero key/query columns add
  nothing to the scores, zero value columns are sliced off the output): exact, not approximate.
- DeepSeek sparse attention (GLM-5's glm_moe_dsa, DeepSeek-V3.2): an indexer picks each query's top-k
  keys through a dense [tokens, tokens] mask over the row and later layers reuse those picks by
  position. Packing it exactly would need a per-sequence indexer whose picks layers share per sequence
  (and a pack's dense mask costs more than padding), so `packing_refusal` names it and such a target
  runs padded batches, where the model's own mask keeps it exact.
- Recurrent mixers (Gated DeltaNet in Qwen3.5/3.6, Qwen3-Next and olmo_hybrid; Kimi Delta Attention in
  kimi_linear and bailing_hybrid, named `self_attn` there; the Mamba2 mixers of nemotron_h, falcon_h1, bamba,
  granitemoehybrid and zamba2; jamba's and zamba's Mamba1; the short convolutions of LFM2, LFM2-MoE and LFM3):
  a causal convolution (and a state) run over time, and handed the whole pack they carry both from one sequence
  into the next (the tiny hybrid families' first Mamba layer differs by 1e-1 to 5e-1, jamba's and zamba's by
  1e-3: their random Mamba1 forgets within a few tokens; KDA by 4e-1 to 1.4; LFM2's conv reads the previous
  sequence's last tokens, 7.5e-4, LFM2-MoE's 2.6e-4). So each sequence runs through the module's own forward
  alone, state and convolution starting from zero as for a sequence alone, with whatever kernel HF picks for
  one sequence (flash-linear-attention, mamba_ssm/causal_conv1d when installed, else its PyTorch scan). The
  exception is the Qwen3.5/3.6 Gated DeltaNet on CUDA with flash-linear-attention installed: its varlen
  convolution and delta-rule kernels take the whole pack with cu_seqlens, each sequence from a zero window and
  state (producer/varlen_gated_deltanet.py). The Mamba kernels' seq_idx / cu_seqlens arguments could do the
  same for the Mamba families (not done: speed work, not needed for exactness).

Anything else (a new mixer, a new attention argument) is what the conformance probe
(producer/conformance.py) exists to catch before a batch is published: MiniMax-01's lightning attention (a
decaying linear-attention state with no convolution, so not found above) leaks 8e-2 across a pack and runs
padded. It also caught, on tiny targets of families not supported here, attention that applies a window or
chunk only through the mask the packed attention never reads (PhiMoE's sliding window, Llama 4's chunked
attention: 2e-1 and 5e-1 at layer 0).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .varlen_gated_deltanet import VarlenGatedDeltaNet

try:
    from torch.nn.attention.varlen import varlen_attn

    # Its keywords moved between releases (is_causal -> window_size, enable_gqa added later).
    _VARLEN_KEYWORDS = set(inspect.signature(varlen_attn).parameters)
except ImportError:  # torch < 2.9
    varlen_attn, _VARLEN_KEYWORDS = None, set()

# No "flash" in the names: transformers treats any such name as a flash-attention kernel to import.
PACKED = {"sdpa": "packed_varlen", "eager": "packed_varlen_eager"}
FLASH = ("flash_attention_2", "flash_attention_3")
# Keyword arguments the packed forward adds; stripped before a module sees one sequence.
PACK_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


# The pack being run: its sequences' [start, end) spans on the host (for the per-sequence paths) and its
# cumulative lengths as int64 on the device and the host (for the varlen recurrent kernels). A context variable,
# not a forward argument: a Python list among a compiled layer's inputs is guarded element by element, so every
# new batch shape would compile the layer again.
@dataclass(frozen=True)
class Pack:
    spans: list[tuple[int, int]]
    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: torch.Tensor


_PACK: ContextVar[Pack | None] = ContextVar("pack", default=None)


@contextmanager
def packed_spans(spans: list[tuple[int, int]], device: torch.device) -> Iterator[None]:
    """While a packed forward runs: where each sequence lies in the pack."""
    bounds = torch.tensor([0] + [end for _, end in spans], dtype=torch.int64)
    token = _PACK.set(Pack(spans, bounds.to(device, non_blocking=True), bounds))
    try:
        yield
    finally:
        _PACK.reset(token)


def current_spans() -> list[tuple[int, int]] | None:
    pack = _PACK.get()
    return None if pack is None else pack.spans


# Decoder-layer attributes (nested ones too: zamba2's hybrid layer holds `mamba_decoder.mamba`) that may hold a
# recurrent token mixer: Gated DeltaNet (`linear_attn`), Mamba1/2 (`mamba`, `mixer`), LFM2's short convolution
# (`conv`), Kimi Delta Attention (`self_attn` in kimi_linear's and bailing_hybrid's linear layers). nemotron_h names
# every block's mixer `mixer`, attention and MoE included, and every family names its attention `self_attn`, so a
# module counts only if it convolves over time (a Conv1d child), as all of these do before their scan.
RECURRENT_MIXERS = ("linear_attn", "mamba", "mixer", "conv", "self_attn")


def _sequence_mask(length: int, sliding_window: int | None, reference: str, like: torch.Tensor) -> torch.Tensor | None:
    """The mask an unpadded forward of this one sequence builds: None (is_causal) unless a window bites."""
    if reference == "sdpa" and (sliding_window is None or length <= sliding_window):
        return None
    i = torch.arange(length, device=like.device)
    allowed = i[:, None] >= i[None, :]
    if sliding_window is not None:
        allowed &= i[:, None] - i[None, :] < sliding_window
    if reference == "sdpa":
        return allowed[None, None]
    return torch.zeros(allowed.shape, dtype=like.dtype, device=like.device).masked_fill_(
        ~allowed, torch.finfo(like.dtype).min
    )[None, None]


def _reference_attention(module: nn.Module, reference: str) -> Callable:
    """The function the unpacked model calls: sdpa, or the model file's own eager (gpt-oss's has the sinks)."""
    if reference == "sdpa":
        return sdpa_attention_forward
    own = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if own is None:
        raise TypeError(f"{type(module).__name__}: its model file has no eager_attention_forward")
    return own


def _varlen_kernel_fits(query: torch.Tensor, sliding_window: int | None, sinks: torch.Tensor | None) -> bool:
    return (
        query.is_cuda
        and sinks is None
        and varlen_attn is not None
        and query.dtype in (torch.bfloat16, torch.float16)
        and ("window_size" in _VARLEN_KEYWORDS or ("is_causal" in _VARLEN_KEYWORDS and sliding_window is None))
    )


def _varlen_kernel(query, key, value, cu_seqlens, max_len, scaling, sliding_window) -> torch.Tensor:
    """torch's flash varlen kernel over the whole pack: [tokens, heads, head_dim] in and out."""
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    options: dict = {"scale": scaling}
    if "window_size" in _VARLEN_KEYWORDS:
        options["window_size"] = (-1 if sliding_window is None else sliding_window - 1, 0)
    else:
        options["is_causal"] = True
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and "enable_gqa" in _VARLEN_KEYWORDS:
        options["enable_gqa"] = True
    elif groups > 1:  # head h reads kv head h // groups, as HF's repeat_kv lays them out
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    v_width = v.shape[-1]
    if q.shape[-1] != v_width:  # MLA: the kernel takes one head dim; zero columns change nothing (module docstring)
        head = max(q.shape[-1], v_width)
        q, k, v = (F.pad(t, (0, head - t.shape[-1])) for t in (q, k, v))
    out = varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, **options)
    return out[..., :v_width].unsqueeze(0)


@torch._dynamo.disable  # a Python loop over the pack's sequences: never traced into a compiled layer
def _per_sequence_attention(module, query, key, value, reference, scaling, sliding_window, extra) -> torch.Tensor:
    attend = _reference_attention(module, reference)
    outs = []
    for start, end in current_spans():
        q, k, v = (t[:, :, start:end] for t in (query, key, value))
        mask = _sequence_mask(end - start, sliding_window, reference, query)
        outs.append(attend(module, q, k, v, mask, scaling=scaling, sliding_window=sliding_window, **extra)[0])
    return torch.cat(outs, dim=1)


def _packed_attention(reference: str) -> Callable:
    def packed_attention(
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        *,
        cu_seq_lens_q: torch.Tensor,
        max_length_q: int,
        scaling: float | None = None,
        sliding_window: int | None = None,
        s_aux: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        """Causal attention within each packed sequence, none across. q/k/v: [1, heads, tokens, head_dim]."""
        if _varlen_kernel_fits(query, sliding_window, s_aux):
            return _varlen_kernel(query, key, value, cu_seq_lens_q, max_length_q, scaling, sliding_window), None
        extra = {k: v for k, v in kwargs.items() if k not in PACK_KWARGS}
        if s_aux is not None:
            extra["s_aux"] = s_aux
        return _per_sequence_attention(module, query, key, value, reference, scaling, sliding_window, extra), None

    return packed_attention


for _reference, _name in PACKED.items():
    AttentionInterface.register(_name, _packed_attention(_reference))


def packed_implementation(reference: str) -> str:
    """The attention implementation a packed forward runs, for a model whose own one is `reference`."""
    if reference in FLASH:
        return reference  # HF's flash path reads cu_seq_lens_* itself
    if reference not in PACKED:
        raise ValueError(
            f"packed batches support attention implementations {sorted(PACKED) + list(FLASH)}, "
            f'not {reference!r}; set target.packing = "padded" or another target.attn_implementation'
        )
    return PACKED[reference]


class PerSequence:
    """The forward of a recurrent mixer while a packed forward runs: each sequence from a zero state and window.

    With a varlen binding (producer/varlen_gated_deltanet.py) on CUDA, the whole pack goes through the varlen
    kernels in one call; otherwise each sequence runs through the module's own forward alone. Outside a packed
    forward (padded batches, the probe's per-sequence reference) the module's own forward runs unchanged."""

    def __init__(self, mixer: nn.Module, varlen: VarlenGatedDeltaNet | None, why_not: str | None = None):
        self.module = mixer
        self.own_forward = mixer.forward
        self.varlen = varlen
        self.why_not = why_not  # why there is no varlen forward, for the start-up log
        self.use_varlen = varlen is not None
        mixer.forward = self

    def __call__(self, *args, **kwargs):
        pack = _PACK.get()
        if pack is None:
            return self.own_forward(*args, **kwargs)
        if "hidden_states" in kwargs:
            hidden = kwargs.pop("hidden_states")
        else:
            hidden, args = args[0], args[1:]
        if self.use_varlen and hidden.device.type == self.varlen.kernels.device_type:
            return self.varlen(hidden, pack.cu_seqlens, pack.cu_seqlens_cpu)
        for name in PACK_KWARGS:
            kwargs.pop(name, None)
        if "attention_mask" in kwargs:
            kwargs["attention_mask"] = None
        return torch.cat([self.own_forward(hidden[:, a:b], *args, **kwargs) for a, b in pack.spans], dim=1)


def packing_refusal(layers: nn.ModuleList) -> str | None:
    """Why packed batches cannot be exact for these layers (a sparse-attention indexer), or None."""
    for i, layer in enumerate(layers):
        attention = getattr(layer, "self_attn", None)
        if isinstance(getattr(attention, "indexer", None), nn.Module):
            return (
                f"layer {i} ({type(attention).__name__}) picks each query's keys with a sparse-attention indexer, "
                "a top-k over the whole row that later layers reuse by position; packing has no per-sequence "
                'form of it, padded batches are exact (set target.packing = "padded" or "auto")'
            )
    return None


def is_recurrent_mixer(name: str, module: nn.Module) -> bool:
    return name.rsplit(".", 1)[-1] in RECURRENT_MIXERS and any(
        isinstance(child, nn.Conv1d) for child in module.children()
    )


def recurrent_mixers(layers: nn.ModuleList) -> dict[int, nn.Module]:
    """Layer index -> its recurrent token mixer, for the families whose layers carry one (one per layer in every
    family we know; a second one would be left whole and the conformance probe would say so)."""
    found = {}
    for i, layer in enumerate(layers):
        mixer = next((m for name, m in layer.named_modules() if is_recurrent_mixer(name, m)), None)
        if mixer is not None:
            found[i] = mixer
    return found
