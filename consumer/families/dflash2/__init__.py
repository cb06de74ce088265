"""DFlash2 (z-lab's "Keep Drafting Parallel"): the DFlash layout (slot 0 the anchor) with each layer's grouped
dynamic causal convolutions and the candidate selector after the target's head (dflash2_blocks.py, model.py). Its
layout is z-lab's DFlash2DraftModel (the released checkpoint's; vLLM and SGLang serve it under "dflash"): settings
nested in dflash_config, top-level is_causal false (its sliding layers train bidirectional in the block), the
codebooks stored without .weight; the export's dflash2.py is hf_dflash2.py, shipped with the dflash2_blocks.py it
imports."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from dflash_ring.common.config.drafter import DrafterConfig
from dflash_ring.common.config.families.dflash2 import DFLASH2 as CONFIG
from dflash_ring.consumer.modeling.draft import Draft
from dflash_ring.consumer.families.dflash2.model import DFlash2DraftModel
from dflash_ring.consumer.families.dflash2.figures import dflash2_figures
from dflash_ring.consumer.families.family import DrafterFamily
from dflash_ring.consumer.modeling.target_head import FrozenTargetHead, HeadSpec

HERE = Path(__file__).parent
# dflash_config's keys for a target head's transforms (z-lab's dflash_generate and compute_logits read them).
HEAD_KEYS = {
    "embed_scale": "input_embedding_scale",
    "logit_multiplier": "output_multiplier",
    "logit_softcap": "final_logit_softcapping",
}


def layout(cfg: DrafterConfig, layers: int) -> dict[str, Any]:
    """The drafter's keys nested in dflash_config, and top-level is_causal false, because DFlash2 trains its sliding
    layers bidirectional inside the block (vLLM's _dflash_layer_causal and z-lab read top-level is_causal first;
    without it a sliding layer would serve causal)."""
    return {
        "architectures": ["DFlash2DraftModel"],
        "auto_map": {"AutoModel": "dflash2.DFlash2DraftModel"},
        "model_type": "qwen3",
        "num_target_layers": layers,
        "is_causal": False,
        "dflash_config": {
            "block_size": cfg.block_size,
            "conv_kernel_size": cfg.conv_kernel_size,
            "conv_group_size": cfg.conv_group_size,
            "selector_rank": cfg.selector_rank,
            "selector_top_k": cfg.selector_top_k,
            "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": cfg.resolved_target_layer_ids(layers),
        },
    }


def settings(config: Mapping[str, Any]) -> tuple[int, int, list[int]]:
    nested = config["dflash_config"]
    return nested["block_size"], nested["mask_token_id"], nested["target_layer_ids"]


def write_head_spec(config: dict[str, Any], spec: HeadSpec) -> None:
    """The target head's transforms where z-lab's DFlash2 reads them."""
    config["dflash_config"] |= {
        key: getattr(spec, ours) for ours, key in HEAD_KEYS.items() if getattr(spec, ours) is not None
    }


def draft(
    drafter: DFlash2DraftModel,
    head: FrozenTargetHead,
    committed: torch.Tensor,
    context: torch.Tensor,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> Draft:
    """A DFlash2 block's B - 1 drafts, walked through the candidate selector from the anchor (z-lab's `propose`).

    One backbone forward; slot k's candidates are the top-K of lm_head(h_k), scored with the token before it (the
    anchor, then the path's), `CandidateSelector.walk`. Greedy: the path of argmaxes, ids only. At temperature T > 0
    the path is sampled from q_k = softmax(scores_k / T) over the candidates, and the Draft carries q_k as a [V] row,
    zero outside the candidates: the distribution the draft was sampled from, for `verify_sampled`."""
    hidden = drafter.draft_block(context.to(drafter.fc.weight.dtype), committed, head)[1:]  # [B - 1, H]
    logits = head.logits(hidden)
    path, candidates, scores = drafter.candidate_selector.walk(
        hidden[None], logits[None], committed[-1:], temperature, generator
    )
    if temperature == 0:
        return Draft(tokens=path[0])
    q = torch.softmax(scores[0].float() / temperature, dim=-1)  # [B - 1, K], as walk sampled from
    probs = torch.zeros(logits.shape, dtype=q.dtype, device=q.device).scatter_(-1, candidates[0], q)
    return Draft(tokens=path[0], probs=probs)


# z-lab's model holds the selector's codebooks as nn.Embedding, so its save_pretrained writes `.weight` names; the
# released files (and ours, and speculators') store them without it.
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")
OWN_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


DFLASH2 = DrafterFamily(
    config=CONFIG,
    model=DFlash2DraftModel,
    architectures=("DFlash2DraftModel",),
    code=(("dflash2.py", HERE / "hf_dflash2.py"), ("dflash2_blocks.py", HERE / "dflash2_blocks.py")),
    layout=layout,
    settings=settings,
    draft=draft,
    no_draft_tree=(
        "a DFlash2 drafter's selector scores each slot with the token drafted before it, which a tree of "
        "independent slots would drop"
    ),
    model_keys={key: f"drafter.{key}" for key in OWN_KEYS},
    speculators_keys=lambda source, key, refuse: {name: key(name) for name in OWN_KEYS},
    released_names={f"{name}.weight": name for name in CODEBOOKS},
    training_keys=("selector_weight",),
    write_head_spec=write_head_spec,
    figures=dflash2_figures,
)
