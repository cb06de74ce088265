"""The target's frozen token embedding and lm_head, read from its checkpoint for each supported family.

The drafter embeds its block tokens and scores its drafts in the target's token
space, so both must be exactly what the target computes: the rows its first layer
receives (Gemma3 scales them by sqrt(hidden_size)) and the logits it emits
(softcapped where the config says so). A family whose embedding we have not
checked against its own model is refused, never guessed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from dflash_ring.common.bounded_read import CONFIG_BYTES, read_text
from dflash_ring.common.safetensors_check import DamagedWeightsError, weight_files

# Checkpoint names, in order: text models, transformers-5 multimodal wrappers (Qwen3.5, Gemma3 as
# loaded), and the multimodal layout published on the hub (Gemma3: language_model.model.*).
EMBED_KEYS = (
    "model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
    "language_model.model.embed_tokens.weight",
)
LM_HEAD_KEYS = ("lm_head.weight", "language_model.lm_head.weight")

# model_type (top level of config.json) -> does the model scale its input embedding by sqrt(hidden_size)?
# Each entry is checked in tests/test_drafter_families.py against the family's own HF model.
EMBED_SCALED: dict[str, bool] = {
    "llama": False, "mistral": False, "qwen2": False, "qwen3": False, "qwen3_moe": False,
    "gpt_oss": False, "qwen3_next": False, "qwen3_5_text": False, "qwen3_5_moe_text": False,
    "qwen3_5": False, "qwen3_5_moe": False,
    "gemma3_text": True, "gemma3": True,  # Gemma3TextScaledWordEmbedding: lookup * sqrt(H) in weight dtype
}


@dataclass(frozen=True)
class HeadSpec:
    """How a target turns ids into first-layer inputs and final hidden states into logits."""

    tied: bool
    embed_scale: float | None  # None: plain lookup
    logit_softcap: float | None  # None: plain lm_head


def head_spec(root: Path) -> HeadSpec:
    """Read tying, embedding scale and softcapping from the target's config, as its HF class resolves them."""
    from transformers import AutoConfig  # the installed config classes only: defaults differ per family

    file = root / "config.json"
    try:
        raw = json.loads(read_text(file, CONFIG_BYTES, DamagedWeightsError, "the target's config"))
    except (ValueError, RecursionError) as e:
        if isinstance(e, DamagedWeightsError):
            raise
        raise DamagedWeightsError(f"{file} is not valid JSON ({type(e).__name__}: {e})") from None
    if not isinstance(raw, dict):
        raise DamagedWeightsError(f"{file} is not a JSON object")
    model_type = raw.get("model_type")
    if model_type not in EMBED_SCALED:
        raise ValueError(
            f"{root}: target model_type {model_type!r} has no checked embedding rule (known: "
            f"{sorted(EMBED_SCALED)}); add it to EMBED_SCALED in consumer/target_head.py after testing it"
        )
    config = AutoConfig.from_pretrained(root)
    text = config.get_text_config()
    # transformers 5 ties a multimodal wrapper by its top-level flag (checked in the family tests).
    tied = bool(config.tie_word_embeddings)
    scale = float(text.hidden_size) ** 0.5 if EMBED_SCALED[model_type] else None
    softcap = getattr(text, "final_logit_softcapping", None)
    return HeadSpec(tied=tied, embed_scale=scale, logit_softcap=float(softcap) if softcap else None)


class FrozenTargetHead(nn.Module):
    """The target's embed_tokens and lm_head: the drafter writes in the target's token space.

    Kept out of the drafter so they are never trained nor shipped. Buffers,
    not parameters, so an optimizer built from .parameters() cannot touch them.
    """

    def __init__(
        self,
        embed_weight: torch.Tensor,
        lm_head_weight: torch.Tensor | None = None,
        *,
        embed_scale: float | None = None,
        logit_softcap: float | None = None,
    ) -> None:
        super().__init__()
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        # None = tied: a second buffer would be copied separately by .to().
        untied = None if lm_head_weight is None else lm_head_weight.detach()
        self.register_buffer("untied_lm_head_weight", untied, persistent=False)
        self.embed_scale = embed_scale
        self.logit_softcap = logit_softcap

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_weight if self.untied_lm_head_weight is None else self.untied_lm_head_weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(input_ids, self.embed_weight)
        if self.embed_scale is None:
            return rows
        # As Gemma3TextScaledWordEmbedding: the fp32 scale is rounded to the weight dtype first.
        return rows * torch.tensor(self.embed_scale).to(self.embed_weight.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.lm_head_weight
        return softcap(F.linear(hidden.to(weight.dtype), weight), self.logit_softcap)


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
        raise ValueError(f"{root}: the checkpoint holds several {what} tensors {found}; keep only the model's own")
    return found[0] if found else None


def load_target_head(
    target_dir: str | Path, *, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> FrozenTargetHead:
    """Read only embed_tokens and lm_head from a target checkpoint (never the whole model)."""
    root = Path(target_dir)
    spec = head_spec(root)
    files = _tensor_files(root)

    def read(key: str) -> torch.Tensor:
        with safe_open(files[key], framework="pt", device=str(device)) as f:
            tensor = f.get_tensor(key)
        return tensor if dtype is None else tensor.to(dtype)

    embed_key = _one_key(files, EMBED_KEYS, root, "embedding")
    if embed_key is None:
        raise KeyError(f"{root}: none of {EMBED_KEYS} in the checkpoint")
    embed = read(embed_key)
    lm_head_key = _one_key(files, LM_HEAD_KEYS, root, "lm_head")
    if spec.tied:
        # The model uses the embedding as its lm_head; a stored copy that differs would be ignored by it.
        if lm_head_key is not None and not torch.equal(read(lm_head_key), embed):
            raise ValueError(f"{root}: tie_word_embeddings is true but {lm_head_key} differs from {embed_key}; "
                             "fix the checkpoint or set tie_word_embeddings false in its config.json")
        lm_head = None
    elif lm_head_key is None:
        raise KeyError(f"{root}: no lm_head.weight although tie_word_embeddings is false")
    else:
        lm_head = read(lm_head_key)
    return FrozenTargetHead(embed, lm_head, embed_scale=spec.embed_scale, logit_softcap=spec.logit_softcap)
