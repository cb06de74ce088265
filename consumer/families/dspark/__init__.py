"""DSpark (DeepSeek, arXiv 2607.05147): the DFlash backbone with every slot drafting (slot k predicts anchor + k + 1:
B drafts a block), a low-rank Markov head and a confidence head (dspark_heads.py, model.py). Its layout is
DeepSeek's flat Qwen3DSparkModel (DeepSpec's save_pretrained; what vLLM's "dspark" method, SGLang's DSPARK, TRT-LLM
and llama.cpp load): settings top-level, the tensors unprefixed plus the target's embed_tokens.weight and
lm_head.weight (SGLang refuses a checkpoint without them; a tied target's lm_head is its embedding); the export's
dspark.py is hf_dspark.py."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from dflash_ring.common.config.drafter import DrafterConfig
from dflash_ring.common.config.families.dspark import DSPARK as CONFIG
from dflash_ring.consumer.modeling.draft import Draft, sample_tokens
from dflash_ring.consumer.families.dspark.dspark_heads import check_dspark_head
from dflash_ring.consumer.families.dspark.model import DSparkDraftModel
from dflash_ring.consumer.families.dspark.figures import dspark_figures
from dflash_ring.consumer.families.family import DrafterFamily
from dflash_ring.consumer.modeling.qwen3_blocks import rope_parameters
from dflash_ring.consumer.modeling.target_head import FrozenTargetHead

CODE_SOURCE = Path(__file__).with_name("hf_dspark.py")


def layout(cfg: DrafterConfig, layers: int) -> dict[str, Any]:
    """Every DFlash key top-level, head_dim explicit (drafter_geometry writes it; SGLang refuses a derived one),
    sample_from_anchor top-level (vLLM's DFlash base refuses it inside dflash_config) and dspark_bonus_anchor false
    (the key vLLM's DSpark speculator and older speculators mappings read for the 1+N layout: written so no build can
    take this anchor-first checkpoint for the other), the confidence head fed with the Markov embedding (the only
    form SGLang loads)."""
    return {
        "architectures": ["Qwen3DSparkModel"],
        "auto_map": {"AutoModel": "dspark.Qwen3DSparkModel"},
        "model_type": "qwen3",
        "block_size": cfg.block_size,
        "num_target_layers": layers,
        "target_layer_ids": cfg.resolved_target_layer_ids(layers),
        "mask_token_id": cfg.mask_token_id,
        "num_anchors": cfg.num_anchors,
        "sample_from_anchor": True,
        "dspark_bonus_anchor": False,
        "markov_rank": cfg.markov_rank,
        "markov_head_type": cfg.markov_head,
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
    }


def settings(config: Mapping[str, Any]) -> tuple[int, int, list[int]]:
    return config["block_size"], config["mask_token_id"], config["target_layer_ids"]


def finish_config(config: dict[str, Any]) -> None:
    """The RoPE in both spellings: rope_theta/rope_scaling for transformers-4 readers and engines that read
    rope_theta, rope_parameters as transformers 5 writes it (and a third-party loader's schema requires);
    transformers 5 reads either, equal."""
    config["rope_parameters"] = rope_parameters(config["rope_theta"], config["rope_scaling"])


def draft(
    drafter: DSparkDraftModel,
    head: FrozenTargetHead,
    committed: torch.Tensor,
    context: torch.Tensor,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> Draft:
    """A DSpark block's B drafts: one backbone forward (slot k's hidden state h_k drafts token anchor + k + 1), then
    B Markov steps left to right. Step k forms the Markov features and the confidence of slot k from the drafted
    prefix, prev = [anchor, x_0 .. x_{k-1}], with the training forward's own `heads` (exact for the recurrent head
    too: it re-reads the prefix), adds the bias to lm_head(h_k) and picks x_k: the argmax, or a sample of
    q_k = softmax(logits_k / temperature), which the Draft carries for verification."""
    hidden = drafter.draft_block(context.to(drafter.fc.weight.dtype), committed, head)  # [B, H]
    base = head.logits(hidden).float()  # [B, V]
    prev = committed[-1:]
    tokens, probs, confidence = [], [], []
    for k in range(drafter.block_size):
        features, conf = drafter.heads(hidden[None, : k + 1], prev[None])
        token, q = sample_tokens(base[k] + drafter.markov_head.bias(features[0, -1]).float(), temperature, generator)
        tokens.append(token)
        probs.append(q)
        confidence.append(conf[0, -1])
        prev = torch.cat([prev, token.view(1).to(prev.device)])
    return Draft(
        tokens=torch.stack(tokens),
        probs=None if temperature == 0 else torch.stack(probs),
        confidence=torch.stack(confidence).float(),
    )


def speculators_keys(
    source: Mapping[str, Any], key: Callable[[str], Any], refuse: Callable[[str], Exception]
) -> dict[str, Any]:
    """A speculators DSpark drafter's heads: ours always has the Markov head and the confidence head fed with the
    Markov embedding (the only form SGLang loads)."""
    if not key("markov_rank") > 0:
        raise refuse("markov_rank 0 (no Markov head)")
    if not source.get("enable_confidence_head") or not source.get("confidence_head_with_markov"):
        raise refuse("no confidence head, or one without the Markov embedding (confidence_head_with_markov)")
    return {"markov_rank": source["markov_rank"], "markov_head": key("markov_head_type")}


DSPARK = DrafterFamily(
    config=CONFIG,
    model=DSparkDraftModel,
    architectures=("Qwen3DSparkModel",),
    code=(("dspark.py", CODE_SOURCE),),
    layout=layout,
    settings=settings,
    draft=draft,
    no_draft_tree=(
        "a DSpark drafter's slots depend on the drafted prefix (its Markov head), which a tree of independent "
        "slots would drop"
    ),
    model_keys={"markov_rank": "drafter.markov_rank", "markov_head_type": "drafter.markov_head"},
    training_keys=("ce_weight", "tv_weight", "confidence_weight"),
    finish_config=finish_config,
    speculators_keys=speculators_keys,
    head_tensors=("embed_tokens.weight", "lm_head.weight"),
    check_head=check_dspark_head,
    figures=dspark_figures,
)
