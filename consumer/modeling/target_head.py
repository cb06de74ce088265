"""The target's frozen token embedding and lm_head, read from its checkpoint, with the transforms its own code applies.

The drafter embeds its block tokens and scores its drafts in the target's token space, so both must be
exactly what the target computes: the rows its first layer receives and the logits it emits. Which
transforms a family applies (embedding scale, logit multiplier, softcap) is not listed here: the head
probe (head_probe.py) derives them from the target's own modules and verifies them, once per target;
head_cache.py keeps the result so that a restart reads it without importing any modeling code; head_loader.py
puts the three together.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from dflash_ring.common.bounded_read import CONFIG_BYTES, read_text
from dflash_ring.common.safetensors_check import DamagedWeightsError, weight_files
from dflash_ring.common.config.target import TargetConfigError
from dflash_ring.common.target_loading import load_target_hf_config
from dflash_ring.consumer.modeling.fp8_head import Fp8Head

# Checkpoint names, in order: text models, transformers-5 multimodal wrappers (Qwen3.5, Gemma3 as
# loaded), and the multimodal layout published on the hub (Gemma3: language_model.model.*); nemotron_h
# names its embedding `embeddings`, Bailing (Ling / Ring hybrids) `word_embeddings`, as transformers saves them.
EMBED_KEYS = (
    "model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
    "language_model.model.embed_tokens.weight",
    "model.embeddings.weight",
    "backbone.embeddings.weight",
    "model.word_embeddings.weight",
)
LM_HEAD_KEYS = ("lm_head.weight", "language_model.lm_head.weight")


@dataclass(frozen=True)
class HeadSpec:
    """How a target turns ids into first-layer inputs and final hidden states into logits, as derived by
    the head probe: logits = softcap(logit_multiplier * (h @ W^T), logit_softcap)."""

    tied: bool
    embed_scale: float | None = None  # None: plain lookup; else rows * scale rounded to the weight dtype
    logit_multiplier: float | None = None  # None: 1 (Granite: 1 / logits_scaling, Cohere: logit_scale)
    logit_softcap: float | None = None  # None: no cap (Gemma: final_logit_softcapping)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> HeadSpec:
        return cls(
            tied=bool(data["tied"]),
            **{
                k: None if data.get(k) is None else float(data[k])
                for k in ("embed_scale", "logit_multiplier", "logit_softcap")
            },
        )

    def describe(self) -> str:
        return (
            f"tied={self.tied}, embed_scale={self.embed_scale}, logit_multiplier={self.logit_multiplier}, "
            f"logit_softcap={self.logit_softcap}"
        )


def config_tied(root: Path) -> bool:
    """tie_word_embeddings as the target's HF config class resolves it (defaults differ per family;
    transformers 5 ties a multimodal wrapper by its top-level flag, checked in the family tests)."""
    file = root / "config.json"
    try:
        raw = json.loads(read_text(file, CONFIG_BYTES, DamagedWeightsError, "the target's config"))
    except (ValueError, RecursionError) as e:
        if isinstance(e, DamagedWeightsError):
            raise
        raise DamagedWeightsError(f"{file} is not valid JSON ({type(e).__name__}: {e})") from None
    if not isinstance(raw, dict):
        raise DamagedWeightsError(f"{file} is not a JSON object")
    return bool(load_target_hf_config(root).tie_word_embeddings)


class FrozenTargetHead(nn.Module):
    """The target's embed_tokens and lm_head: the drafter writes in the target's token space.

    Kept out of the drafter so they are never trained nor shipped. Buffers,
    not parameters, so an optimizer built from .parameters() cannot touch them.
    """

    def __init__(
        self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor | None = None, *, spec: HeadSpec | None = None
    ) -> None:
        super().__init__()
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        # None = tied: a second buffer would be copied separately by .to().
        untied = None if lm_head_weight is None else lm_head_weight.detach()
        self.register_buffer("untied_lm_head_weight", untied, persistent=False)
        self.spec = spec or HeadSpec(tied=lm_head_weight is None)
        self.fp8: Fp8Head | None = None  # set by quantize_fp8: the draft's head products then run in FP8

    def quantize_fp8(self) -> None:
        """Run the loss's products of the draft through FP8 copies of the head (drafter.precision = "fp8"),
        made once here on the head's device: call it after moving the head there."""
        self.fp8 = Fp8Head.of(self.lm_head_weight)

    @property
    def embed_scale(self) -> float | None:
        return self.spec.embed_scale

    @property
    def logit_multiplier(self) -> float | None:
        return self.spec.logit_multiplier

    @property
    def logit_softcap(self) -> float | None:
        return self.spec.logit_softcap

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_weight if self.untied_lm_head_weight is None else self.untied_lm_head_weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(input_ids, self.embed_weight)
        if self.embed_scale is None:
            return rows
        # As Gemma's scaled embedding: the fp32 scale is rounded to the weight dtype first (exact for the
        # multipliers of Granite and Falcon-H1 that are powers of two; within one bf16 ulp otherwise).
        return rows * torch.tensor(self.embed_scale).to(self.embed_weight.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.lm_head_weight
        return head_logits(F.linear(hidden.to(weight.dtype), weight), self.logit_multiplier, self.logit_softcap)


def head_logits(plain: torch.Tensor, multiplier: float | None, cap: float | None) -> torch.Tensor:
    """softcap(multiplier * plain, cap): the target's logits from the plain lm_head product."""
    return softcap(plain if multiplier is None else plain * multiplier, cap)


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(logits / cap), as Gemma's final_logit_softcapping; identity for None."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


def _tensor_files(root: Path) -> dict[str, Path]:
    """Which safetensors file holds each tensor, for single-file and sharded checkpoints; a file that does not
    parse is a one-line DamagedWeightsError naming it (checked before safetensors reads it)."""
    index = root / "model.safetensors.index.json"
    single = root / "model.safetensors"
    if not index.exists() and not single.exists():
        raise FileNotFoundError(f"{root}: no model.safetensors or model.safetensors.index.json")
    files = {}
    for path in weight_files(root):
        with safe_open(path, framework="pt") as f:
            files.update((k, path) for k in f.keys())
    return files


def _one_key(files: dict[str, Any], keys: tuple[str, ...], root: Path, what: str) -> str | None:
    found = [k for k in keys if k in files]
    if len(found) > 1:
        raise TargetConfigError(
            f"{root}: the checkpoint holds several {what} tensors {found}; keep only the model's own"
        )
    return found[0] if found else None


def head_tensor_keys(root: Path) -> tuple[dict[str, Path], str, str | None]:
    """Where the checkpoint keeps its embedding and lm_head (None: not stored): the files and the names."""
    files = _tensor_files(root)
    embed_key = _one_key(files, EMBED_KEYS, root, "embedding")
    if embed_key is None:
        raise TargetConfigError(f"{root}: none of {EMBED_KEYS} in the checkpoint")
    return files, embed_key, _one_key(files, LM_HEAD_KEYS, root, "lm_head")


def read_head(
    root: Path,
    files: dict[str, Path],
    embed_key: str,
    lm_head_key: str | None,
    tied: bool,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The embedding and lm_head (None: tied) as stored, checking the stored copy of a tied one."""

    def read(name: str) -> torch.Tensor:
        with safe_open(files[name], framework="pt", device=str(device)) as f:
            tensor = f.get_tensor(name)
        if not tensor.is_floating_point() or tensor.element_size() < 2:  # int8, bool, float8: not values to use as is
            raise TargetConfigError(
                f"{files[name]}: the target's {name} is stored as {tensor.dtype}, not float16, bfloat16 or float32: "
                "the drafter would use it as is; point target.path at the model's floating-point weights"
            )
        return tensor

    embed = read(embed_key)
    if tied:
        # The model uses the embedding as its lm_head; a stored copy that differs would be ignored by it.
        if lm_head_key is not None and not torch.equal(read(lm_head_key), embed):
            raise TargetConfigError(
                f"{root}: tie_word_embeddings is true but {lm_head_key} differs from {embed_key}; "
                "fix the checkpoint or set tie_word_embeddings false in its config.json"
            )
        return embed, None
    if lm_head_key is None:
        raise TargetConfigError(f"{root}: no lm_head.weight although tie_word_embeddings is false")
    return embed, read(lm_head_key)
