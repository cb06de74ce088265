"""The frozen target: a Hugging Face decoder run only as deep as the drafter needs, never to logits.

Features. For layer id l the feature is decoder layer l's output (HF `hidden_states[l + 1]`),
captured by a forward hook and concatenated on channels in `layer_ids` order: [tokens, n * hidden].

Truncation. Only the decoder (`model.model`) is kept; the LM head is dropped at load, so no logits
can ever be computed. Unless the final normed state is shipped, the hook of the deepest captured
layer raises `_StopForward` once it has recorded its output, and `forward` catches it: deeper
layers and the final norm never run. An exception rather than a truncated layer list, because it
leaves the model's own forward (masks, rotary embeddings, per-layer attention types) untouched
for every architecture.

Packing. A packed batch is one row of concatenated sequences with positions restarting at 0 per
sequence, so every sequence sees exactly the positions it would alone. Attention must not cross
sequences: with sdpa/eager the model runs `packed_varlen_attention` (registered below), which on
CUDA runs torch's varlen flash kernel over the whole pack and elsewhere runs each sequence through
the very sdpa call an unpacked forward makes, so CPU features equal unpacked ones bit for bit.
flash_attention_2/3 get `cu_seq_lens_*` and use their own varlen path. Padded batches (packing off)
use the model's attention with a padding mask.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AttentionInterface, AutoModelForCausalLM, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .target_config import TargetConfig, TargetConfigError

log = logging.getLogger(__name__)

# No "flash" in the name: transformers treats any such name as a flash-attention kernel to import.
PACKED_VARLEN = "packed_varlen"
_FLASH = ("flash_attention_2", "flash_attention_3")

try:
    from torch.nn.attention.varlen import varlen_attn

    # Its keywords moved between releases (is_causal -> window_size, enable_gqa added later).
    _VARLEN_KEYWORDS = set(inspect.signature(varlen_attn).parameters)
except ImportError:  # torch < 2.9
    varlen_attn, _VARLEN_KEYWORDS = None, set()


class _StopForward(Exception):
    """Raised by the deepest captured layer's hook: nothing after it is needed."""


def packed_varlen_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    cu_seq_lens_q: torch.Tensor,
    max_length_q: int,
    cu_seqlens_cpu: list[int],
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Causal attention within each packed sequence, none across. q/k/v: [1, heads, tokens, head_dim]."""
    if _varlen_kernel_fits(query, sliding_window):
        return _varlen_kernel(query, key, value, cu_seq_lens_q, max_length_q, scaling, sliding_window), None
    outs = []
    for start, end in zip(cu_seqlens_cpu[:-1], cu_seqlens_cpu[1:]):
        mask = None
        if sliding_window is not None and end - start > sliding_window:
            i = torch.arange(end - start, device=query.device)
            mask = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < sliding_window)
        q, k, v = (t[:, :, start:end] for t in (query, key, value))
        outs.append(sdpa_attention_forward(module, q, k, v, mask, scaling=scaling)[0])
    return torch.cat(outs, dim=1), None


def _varlen_kernel_fits(query: torch.Tensor, sliding_window: int | None) -> bool:
    return (query.is_cuda and varlen_attn is not None and query.dtype in (torch.bfloat16, torch.float16)
            and ("window_size" in _VARLEN_KEYWORDS or ("is_causal" in _VARLEN_KEYWORDS and sliding_window is None)))


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
    return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, **options).unsqueeze(0)


AttentionInterface.register(PACKED_VARLEN, packed_varlen_attention)


@dataclass
class TargetOutput:
    features: torch.Tensor  # [tokens, n_layers * hidden], in the batch's token order
    final_hidden: torch.Tensor | None  # [tokens, hidden] after the final norm, when shipped


def resolve_device(name: str) -> torch.device:
    """"auto" -> cuda if present, else cpu; a bare "cuda" gets the current index (streams need one)."""
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def decoder_of(model: nn.Module) -> nn.Module:
    """The base decoder of a causal LM (`model.model` for Qwen2/3, Llama, Mistral), with `.layers`."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    if not isinstance(getattr(base, "layers", None), nn.ModuleList):
        raise TargetConfigError(f"{type(model).__name__}: cannot find its decoder layer list (expected model.model.layers)")
    return base


class TargetModel:
    """Runs the decoder on packed or padded batches and returns the selected layers' outputs."""

    def __init__(self, model: PreTrainedModel, layer_ids: list[int], *, final_hidden: bool, packed: bool):
        self.decoder = decoder_of(model).eval().requires_grad_(False)
        self.config = model.config
        self.layer_ids = list(layer_ids)
        self.final_hidden = final_hidden
        self.packed = packed
        layers = self.decoder.layers
        if max(self.layer_ids) > len(layers) - 2:
            raise TargetConfigError(f"layer ids {self.layer_ids} must lie in 0..{len(layers) - 2}")
        self.deepest = max(self.layer_ids)
        self._captured: dict[int, torch.Tensor] = {}
        self._active = False
        for layer_id in set(self.layer_ids):
            layers[layer_id].register_forward_hook(self._hook(layer_id))
        if packed and model.config._attn_implementation not in _FLASH:
            self.decoder.set_attn_implementation(PACKED_VARLEN)
        self.param = next(self.decoder.parameters())

    @classmethod
    def load(cls, cfg: TargetConfig, device: torch.device, *, packed: bool) -> TargetModel:
        """From a local directory only; the LM head is dropped with the wrapper (no logits, less memory)."""
        geometry = cfg.geometry()
        dtype = resolve_dtype(cfg.dtype, device)
        model = AutoModelForCausalLM.from_pretrained(
            cfg.path, dtype=dtype, attn_implementation=cfg.attn_implementation, local_files_only=True
        )
        target = cls(model.to(device), list(geometry.layer_ids), final_hidden=cfg.ship_final_hidden, packed=packed)
        del model
        log.info("target %s on %s (%s): layers %s of %d, %s batches%s", cfg.path, device, dtype,
                 target.layer_ids, len(target.decoder.layers), "packed" if packed else "padded",
                 ", final hidden shipped" if cfg.ship_final_hidden else f", stops after layer {target.deepest}")
        return target

    @property
    def device(self) -> torch.device:
        return self.param.device

    @property
    def dtype(self) -> torch.dtype:
        return self.param.dtype

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def feature_width(self) -> int:
        return len(self.layer_ids) * self.hidden_size

    def _hook(self, layer_id: int):
        def hook(module: nn.Module, args: tuple, output) -> None:
            if not self._active:
                return
            self._captured[layer_id] = output[0] if isinstance(output, tuple) else output
            if layer_id == self.deepest and not self.final_hidden:
                raise _StopForward

        return hook

    @torch.inference_mode()
    def forward_packed(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                       cu_seqlens_cpu: list[int]) -> TargetOutput:
        """input_ids/position_ids [tokens] (positions restart at 0 per sequence), cu_seqlens [n + 1] int32."""
        max_len = max(b - a for a, b in zip(cu_seqlens_cpu[:-1], cu_seqlens_cpu[1:]))
        final = self._run(
            input_ids=input_ids[None], position_ids=position_ids[None], cu_seq_lens_q=cu_seqlens,
            cu_seq_lens_k=cu_seqlens, max_length_q=max_len, max_length_k=max_len, cu_seqlens_cpu=cu_seqlens_cpu,
        )
        features = torch.cat([self._captured[i][0] for i in self.layer_ids], dim=-1)
        self._captured.clear()
        return TargetOutput(features, None if final is None else final[0])

    @torch.inference_mode()
    def forward_padded(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       token_index: torch.Tensor) -> TargetOutput:
        """Right-padded [rows, width] batch; `token_index` (flat positions of real tokens, computed on the host
        so no boolean mask syncs the GPU) keeps only real tokens, rows concatenated as in a packed batch."""
        position_ids = (attention_mask.cumsum(-1) - 1).clamp_(min=0)
        final = self._run(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        features = torch.cat([self._captured[i] for i in self.layer_ids], dim=-1).flatten(0, 1)
        self._captured.clear()
        if final is not None:
            final = final.flatten(0, 1).index_select(0, token_index)
        return TargetOutput(features.index_select(0, token_index), final)

    def _run(self, **inputs) -> torch.Tensor | None:
        self._active = True
        try:
            out = self.decoder(**inputs, use_cache=False)
        except _StopForward:
            return None
        finally:
            self._active = False
        return out.last_hidden_state
