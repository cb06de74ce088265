"""DFlash (z-lab's block-diffusion drafter): the backbone (consumer/modeling/model.py) alone. Its layout is z-lab's and
SpecForge's: architectures ["DFlashDraftModel"], the drafter's settings nested in dflash_config, the drafter's own
tensors only (the target's embedding and lm_head are shared at serve time); the export's dflash.py is hf_dflash.py,
copied verbatim. A block is [anchor, MASK x (B-1)]: slots 1..B-1 draft."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from dflash_ring.common.config.drafter import DrafterConfig
from dflash_ring.common.config.families.dflash import DFLASH as CONFIG
from dflash_ring.consumer.modeling.draft import Draft, sample_tokens
from dflash_ring.consumer.families.family import DrafterFamily
from dflash_ring.consumer.modeling.model import DFlashDraftModel
from dflash_ring.consumer.modeling.target_head import FrozenTargetHead

CODE_SOURCE = Path(__file__).with_name("hf_dflash.py")


def layout(cfg: DrafterConfig, layers: int) -> dict[str, Any]:
    return {
        "architectures": ["DFlashDraftModel"],
        # transformers' AutoModel with trust_remote_code reads this; vLLM and SGLang ignore it.
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "block_size": cfg.block_size,
        "num_target_layers": layers,
        "dflash_config": {
            "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": cfg.resolved_target_layer_ids(layers),
        },
    }


def settings(config: Mapping[str, Any]) -> tuple[int, int, list[int]]:
    nested = config["dflash_config"]
    return config["block_size"], nested["mask_token_id"], nested["target_layer_ids"]


def draft(
    drafter: DFlashDraftModel,
    head: FrozenTargetHead,
    committed: torch.Tensor,
    context: torch.Tensor,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> Draft | torch.Tensor:
    """The block's hidden states through the target's lm_head, each of slots 1..B-1 independently (ids alone when
    greedy)."""
    hidden = drafter.draft_block(context.to(drafter.fc.weight.dtype), committed, head)
    tokens, probs = sample_tokens(head.logits(hidden[1:]), temperature, generator)
    return tokens if probs is None else Draft(tokens, probs)


DFLASH = DrafterFamily(
    config=CONFIG,
    model=DFlashDraftModel,
    architectures=("DFlashDraftModel",),
    code=(("dflash.py", CODE_SOURCE),),
    layout=layout,
    settings=settings,
    draft=draft,
)
