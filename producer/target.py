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
sequence; producer/packing.py keeps every token mixer inside its sequence, and the conformance probe
(producer/conformance.py) checks that it did for this very model before anything is published.
Padded batches (target.packing = "padded", or "auto" when the probe fails) run the model's own
attention with a padding mask.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import PreTrainedModel

from .packing import PerSequence, packed_implementation, packed_spans, packing_refusal, recurrent_mixers
from .varlen_gated_deltanet import FlaKernels, VarlenGatedDeltaNet, varlen_refusal
from .tensor_group import TensorGroup, send_run
from dflash_ring.common.device import checked_device
from dflash_ring.common.safetensors_check import weight_files
from dflash_ring.common.config.target import TargetConfig, TargetConfigError
from dflash_ring.common.target_geometry import read_model_config, target_geometry
from dflash_ring.common.target_loading import load_target_hf_config, load_target_lm

log = logging.getLogger(__name__)


class _StopForward(Exception):
    """Raised by the deepest captured layer's hook: nothing after it is needed."""


@dataclass
class TargetOutput:
    features: torch.Tensor  # [tokens, n_layers * hidden], in the batch's token order
    final_hidden: torch.Tensor | None  # [tokens, hidden] after the final norm, when shipped


def resolve_device(name: str) -> torch.device:
    """ "auto" -> cuda if present, else cpu; a bare "cuda" gets the current index (streams need one)."""
    device = checked_device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def check_weights(cfg: TargetConfig) -> Path:
    """The model directory, refused by name unless it has a config.json and safetensors weights whose headers parse
    (a cheap check: a missing, truncated or damaged file is one line naming it, before anything slow is loaded)."""
    root = Path(cfg.path).expanduser()
    read_model_config(cfg)  # a missing path or config.json: its own clear error
    if not any((root / name).is_file() for name in WEIGHT_FILES):
        raise TargetConfigError(
            f"target.path = {cfg.path}: no model.safetensors or model.safetensors.index.json "
            "there (a local HF model directory with safetensors weights is needed)"
        )
    weight_files(root)
    return root


def load_causal_lm(cfg: TargetConfig, device: torch.device) -> PreTrainedModel:
    """The whole causal LM (head included) from a local directory of safetensors weights, on `device` in
    eval mode: nothing is downloaded and nothing is unpickled, and a directory without weights is named."""
    return _load(cfg, device).to(device).eval().requires_grad_(False)


def load_sharded(cfg: TargetConfig, device: torch.device):
    """The causal LM sharded by its family's tensor-parallel plan, in the group this process has joined. The plan is
    named as the installed transformers takes it: DistributedConfig where it has one (5.2x), `tp_plan` otherwise."""
    try:
        from transformers.distributed.configuration_utils import DistributedConfig

        plan = {"distributed_config": DistributedConfig(tp_plan="auto", tp_size=dist.get_world_size())}
    except (ImportError, TypeError):  # a transformers before DistributedConfig took the plan (5.17)
        plan = {"tp_plan": "auto"}
    return _load(cfg, device, **plan).eval().requires_grad_(False)


def _load(cfg: TargetConfig, device: torch.device, **plan: Any) -> PreTrainedModel:
    """The one load of both (`plan`: a tensor-parallel plan's arguments): the weights checked and named first, a
    config.json transformers refuses named by its field, and what the weights' own bytes refuse as one line."""
    root = check_weights(cfg)
    load_target_hf_config(root)  # a config.json transformers refuses: one line naming its field, before the weights
    attn = None if cfg.attn_implementation == "auto" else cfg.attn_implementation  # HF: sdpa, else eager
    from safetensors import SafetensorError

    try:  # a config.json the model code cannot build, weights of other shapes, dtypes or missing tensors: one line
        return load_target_lm(
            root,
            dtype=resolve_dtype(cfg.dtype, device),
            attn_implementation=attn,
            local_files_only=True,
            use_safetensors=True,
            **plan,
        )
    except SafetensorError as e:  # damage the header check cannot see (a tensor's bytes of the wrong kind)
        raise TargetConfigError(
            f"target.path = {cfg.path}: its safetensors weights do not load ({e}); copy or download them again"
        ) from None


def decoder_of(model: nn.Module) -> nn.Module:
    """The base decoder of a causal LM (`model.model` for Qwen2/3, Llama, Mistral), with `.layers`."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    if not isinstance(getattr(base, "layers", None), nn.ModuleList):
        raise TargetConfigError(
            f"{type(model).__name__}: cannot find its decoder layer list (expected model.model.layers)"
        )
    return base


class TargetModel:
    """Runs the decoder on packed or padded batches and returns the selected layers' outputs."""

    def __init__(self, model: PreTrainedModel, layer_ids: list[int], *, final_hidden: bool, packed: bool):
        self.decoder = decoder_of(model).eval().requires_grad_(False)
        self.config = model.config.get_text_config()  # multimodal wrappers: the language model's config
        self.layer_ids = list(layer_ids)
        self.final_hidden = final_hidden
        layers = self.decoder.layers
        if max(self.layer_ids) > len(layers) - 2:
            raise TargetConfigError(f"layer ids {self.layer_ids} must lie in 0..{len(layers) - 2}")
        self.deepest = max(self.layer_ids)
        self._captured: dict[int, torch.Tensor] = {}
        self._active = False
        for layer_id in set(self.layer_ids):
            layers[layer_id].register_forward_hook(self._hook(layer_id))
        recurrent = recurrent_mixers(layers)
        kernels = FlaKernels.load() if recurrent else None
        self._recurrent = {}
        for i, mixer in recurrent.items():
            why_not = varlen_refusal(mixer, kernels)
            self._recurrent[i] = PerSequence(mixer, None if why_not else VarlenGatedDeltaNet(mixer, kernels), why_not)
        self._packing_refusal = packing_refusal(layers)
        # The model's own attention: what padded batches and the conformance probe's reference run.
        self.attn_implementation = self.decoder.config._attn_implementation
        self.packed = False
        self.use_packing(packed)
        self.param = next(self.decoder.parameters())

    def use_packing(self, packed: bool) -> None:
        """Packed batches run packing-aware attention; padded ones (and each sequence alone) the model's own.
        Refuses packing a model whose token mixers packing cannot keep exact (packing_refusal)."""
        if packed and self._packing_refusal is not None:
            raise TargetConfigError(f"packed batches refused: {self._packing_refusal}")
        self.decoder.set_attn_implementation(
            packed_implementation(self.attn_implementation) if packed else self.attn_implementation
        )
        self.packed = packed

    @classmethod
    def load(
        cls,
        cfg: TargetConfig,
        device: torch.device,
        *,
        packed: bool,
        group: TensorGroup | None = None,
    ) -> TargetModel:
        """From a local directory only; the LM head is dropped with the wrapper (no logits, less memory). With a
        group (target.tensor_parallel > 1, this process its leader), sharded by the family's plan over its ranks."""
        geometry = target_geometry(cfg)
        model = load_causal_lm(cfg, device) if group is None else load_sharded(cfg, device)
        args = (model, list(geometry.layer_ids))
        target = (
            cls(*args, final_hidden=bool(cfg.ship_final_hidden), packed=packed)
            if group is None
            else ShardedTarget(*args, final_hidden=bool(cfg.ship_final_hidden), packed=packed, group=group)
        )
        del model
        log.info(
            "target %s (%s) on %s%s (%s, %s attention): layers %s of %d%s",
            cfg.path,
            target.config.model_type,
            device,
            "" if group is None else f" and {group.size - 1} more rank(s), tensor parallel",
            target.dtype,
            target.attn_implementation,
            target.layer_ids,
            len(target.decoder.layers),
            ", final hidden shipped" if cfg.ship_final_hidden else f", stops after layer {target.deepest}",
        )
        if target.recurrent_path is not None:
            log.info("recurrent token mixers of a pack: %s", target.recurrent_description())
        return target

    def compile_layers(self, backend: str = "inductor") -> list[int]:
        """torch.compile the forward of each decoder layer that runs (one graph per layer kind, any token count),
        fusing the norms, RoPE, SiLU and residual adds around the matmuls. The capture hooks stay outside the
        compiled forward, so truncation and capture work as in eager. A layer with a recurrent mixer keeps its
        layer forward and mixer eager (a Python loop over the pack, or Triton kernels with host-side lengths) and
        has its other children compiled instead (its MLP or MoE block, its norms). Returns the compiled layer ids."""
        depth = len(self.decoder.layers) if self.final_hidden else self.deepest + 1
        for i in range(depth):
            layer = self.decoder.layers[i]
            if i not in self._recurrent:
                layer.forward = torch.compile(layer.forward, backend=backend, dynamic=True)
                continue
            mixer = self._recurrent[i].module
            for child in layer.children():
                if all(m is not mixer for m in child.modules()) and any(True for _ in child.parameters()):
                    child.forward = torch.compile(child.forward, backend=backend, dynamic=True)
        return list(range(depth))

    @property
    def recurrent_layers(self) -> list[int]:
        """The layers whose token mixer carries a state over time."""
        return sorted(self._recurrent)

    @property
    def recurrent_path(self) -> str | None:
        """How the recurrent mixers run a pack: "varlen" (flash-linear-attention kernels over the whole pack),
        "per-sequence", or None for a model without them."""
        if not self._recurrent:
            return None
        return "varlen" if all(m.use_varlen for m in self._recurrent.values()) else "per-sequence"

    def recurrent_description(self) -> str:
        mixers = list(self._recurrent.values())
        if all(m.use_varlen for m in mixers):
            return f"{len(mixers)} layers through flash-linear-attention's varlen kernels, the whole pack at once"
        unbound = next((m for m in mixers if m.varlen is None), None)
        why = "varlen kernels switched off" if unbound is None else unbound.why_not
        return f"{len(mixers)} layers run each sequence alone ({why})"

    def use_varlen_mixers(self, on: bool) -> None:
        """Run bound varlen mixers through their kernels (on) or each sequence alone (off: the bench's baseline)."""
        for mixer in self._recurrent.values():
            mixer.use_varlen = on and mixer.varlen is not None

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
    def forward_packed(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor, cu_seqlens_cpu: list[int]
    ) -> TargetOutput:
        """input_ids/position_ids [tokens] (positions restart at 0 per sequence), cu_seqlens [n + 1] int32."""
        spans = list(zip(cu_seqlens_cpu[:-1], cu_seqlens_cpu[1:]))
        max_len = max(b - a for a, b in spans)
        with packed_spans(spans, self.device):
            final = self._run(
                input_ids=input_ids[None],
                position_ids=position_ids[None],
                cu_seq_lens_q=cu_seqlens,
                cu_seq_lens_k=cu_seqlens,
                max_length_q=max_len,
                max_length_k=max_len,
            )
        features = torch.cat([self._captured[i][0] for i in self.layer_ids], dim=-1)
        self._captured.clear()
        return TargetOutput(features, None if final is None else final[0])

    @torch.inference_mode()
    def forward_padded(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_index: torch.Tensor
    ) -> TargetOutput:
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


class ShardedTarget(TargetModel):
    """The group leader's target: every forward (a batch's, the probe's) goes to the group's ranks first, so their
    collectives meet; the features are the leader's, replicated after each layer's all-reduce."""

    def __init__(
        self, model: PreTrainedModel, layer_ids: list[int], *, final_hidden: bool, packed: bool, group: TensorGroup
    ):
        self.group = group
        super().__init__(model, layer_ids, final_hidden=final_hidden, packed=packed)

    def compile_layers(self, backend: str = "inductor") -> list[int]:
        self.group.compile()
        return super().compile_layers(backend)

    def _run(self, **inputs) -> torch.Tensor | None:
        with self.group.waiting("in a forward"):
            send_run(inputs, self.packed, self.device)
            return super()._run(**inputs)
