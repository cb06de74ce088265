"""EAGLE-3 (arXiv 2503.01840): one Llama decoder layer over the target's low, middle and high layers, trained by
training-time test (model.py, objective.py; shared/reference/eagle3.md). Its layout is the flat
LlamaForCausalLMEagle3 of EAGLE and SpecForge, which vLLM (Eagle3LlamaForCausalLM) and SGLang load natively, so an
export ships no model code: the target layers as EAGLE's hidden_states indices in
eagle_config.eagle_aux_hidden_state_layer_ids (ours + 1: eagle3.md 1.1), draft_vocab_size always written (SGLang
replaces the head when it is absent) and norm_before_residual always written (absent means false in this layout
and true in speculators': eagle3.md 4.4). The tensors are the drafter's own (fc, layers.0, norm, lm_head, and d2t,
t2d with a reduced vocabulary); the target's embedding is shared at serve time. A round drafts a chain of ttt_steps
tokens. speculators' own layout of the drafter (Eagle3Speculator, which `vllm serve <dir>` serves alone) is read as a
warm start's release and written by `export --layout speculators` (speculators.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from dflash_ring.common.config.drafter import DrafterConfig
from dflash_ring.common.config.families.eagle3 import EAGLE3 as CONFIG
from dflash_ring.common.config.families.eagle3 import read_draft_vocab
from dflash_ring.consumer.modeling.draft import Draft, sample_tokens
from dflash_ring.consumer.families.eagle3.figures import eagle3_figures
from dflash_ring.consumer.families.eagle3.flops import eagle3_step_flops
from dflash_ring.consumer.families.eagle3.model import Eagle3DraftModel, Unroll, eagle3_settings, teacher_ids
from dflash_ring.consumer.families.eagle3.objective import eagle3_objective
from dflash_ring.consumer.families.eagle3.speculators import speculators_keys, speculators_layout
from dflash_ring.consumer.families.family import DrafterFamily
from dflash_ring.consumer.modeling.target_head import FrozenTargetHead


LAYER_TENSORS = (
    *(f"self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    *(f"{norm}.weight" for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm")),
)


def layout(cfg: DrafterConfig, layers: int) -> dict[str, Any]:
    """draft_vocab_size 0 (the target's) is written as the target's size by finish_config, which knows it."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "draft_vocab_size": cfg.draft_vocab_size,
        "norm_before_residual": cfg.norm_before_residual,
        "num_target_layers": layers,
        "mask_token_id": cfg.mask_token_id,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i + 1 for i in cfg.resolved_target_layer_ids(layers)]},
    }


def finish_config(config: dict[str, Any]) -> None:
    """The draft vocabulary's size against the target's, and the fc input width (target_hidden_size: the target's
    width, which the drafter shares)."""
    vocab, draft_vocab = config["vocab_size"], config["draft_vocab_size"]
    if draft_vocab > vocab:
        raise ValueError(
            f"drafter.draft_vocab_size {draft_vocab} exceeds the target's vocabulary of {vocab}: set it to at most "
            f"{vocab} (0: the target's whole vocabulary)"
        )
    config["draft_vocab_size"] = draft_vocab or vocab
    config["target_hidden_size"] = config["hidden_size"]


def settings(config: Mapping[str, Any]) -> tuple[int, int, list[int]]:
    layer_ids, steps = eagle3_settings(dict(config))
    return steps + 1, config["mask_token_id"], layer_ids


def initialise(model: Eagle3DraftModel, cfg: DrafterConfig) -> None:
    """A fresh drafter's draft vocabulary: the maps `dflash-ring draft-vocab` built from the run's training data
    (drafter.draft_vocab, checked against the target when the config was resolved; load_vocab_mapping checks them
    against the model once more). Without the key a reduced vocabulary comes from init_from's release."""
    if cfg.draft_vocab is None:
        return
    from safetensors.torch import load

    maps = load(read_draft_vocab(cfg.draft_vocab))
    model.load_vocab_mapping(maps["d2t"].to(model.d2t.device), maps["t2d"].to(model.t2d.device))


def draft(
    drafter: Eagle3DraftModel,
    head: FrozenTargetHead,
    committed: torch.Tensor,
    context: torch.Tensor,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> Draft:
    """A chain of block_size - 1 drafts: the training unroll over the context's rows (row t reads features t and
    token t + 1), the last row (the last committed token) fed its own draft at each later step. Greedy: the argmax;
    else a sample of q_k = softmax(logits_k / temperature) over the target's vocabulary (zero off the draft
    vocabulary), which the Draft carries for verification."""
    rows = context.shape[0]
    if committed.shape[0] != rows + 1:
        raise ValueError(
            f"{committed.shape[0]} committed tokens need {committed.shape[0] - 1} context rows, got {rows}"
        )
    # A row past the last committed token keeps the packed shapes; no row attends to it.
    features = torch.cat([context, context.new_zeros(1, context.shape[1])]).to(drafter.fc.weight.dtype)
    cu_seqlens = torch.tensor([0, rows + 1], device=committed.device)
    unroll = Unroll(drafter, features, cu_seqlens, head, "sdpa")
    ids = teacher_ids(committed, cu_seqlens, 0)
    draft_ids, vocab = drafter.draft_ids, head.lm_head_weight.shape[0]
    tokens, probs = [], []
    for _ in range(drafter.block_size - 1):
        logits = drafter.logits(unroll.step(ids)[rows - 1]).float()
        if draft_ids is not None:
            logits = logits.new_full((vocab,), float("-inf")).index_copy(0, draft_ids, logits)
        token, q = sample_tokens(logits, temperature, generator)
        tokens.append(token)
        probs.append(q)
        ids = ids.clone()
        ids[rows - 1] = token
    return Draft(tokens=torch.stack(tokens), probs=None if temperature == 0 else torch.stack(probs))


EAGLE3 = DrafterFamily(
    config=CONFIG,
    model=Eagle3DraftModel,
    architectures=("LlamaForCausalLMEagle3",),
    code=(),
    layout=layout,
    settings=settings,
    draft=draft,
    no_draft_tree="an EAGLE-3 drafter drafts a chain, each step reading the one before it",
    reads_mask_token=False,
    model_keys={
        "draft_vocab_size": "drafter.draft_vocab_size",
        "norm_before_residual": "drafter.norm_before_residual",
        "target_hidden_size": "the target (target.path)",
    },
    training_keys=("ttt_steps", "ttt_step_loss_decay"),
    # EAGLE's and SpecForge's flat files name the decoder layer midlayer (speculators' converter maps it the same way).
    released_names={f"midlayer.{name}": f"layers.0.{name}" for name in LAYER_TENSORS},
    finish_config=finish_config,
    speculators_keys=speculators_keys,
    speculators_layout=speculators_layout,
    objective=eagle3_objective,
    figures=eagle3_figures,
    initialise=initialise,
    step_flops=eagle3_step_flops,
)
