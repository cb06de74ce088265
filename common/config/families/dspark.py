"""DSpark's [drafter] keys (DeepSeek, arXiv 2607.05147): the DFlash backbone with the anchor as the first prediction
(a block of B drafts B tokens), a low-rank Markov head over the previous token's logits and a confidence head whose
BCE is trained against the detached analytic acceptance. Model and objective: consumer/families/dspark/."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from dflash_ring.common.config.families.family import FamilyConfig
from dflash_ring.common.config.ranges import Range

MarkovHeadType = Literal["vanilla", "gated", "rnn"]
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


@dataclass
class DSparkKeys:
    """The [drafter] keys only DSpark has (None: the family's default, below)."""

    # BCE of the confidence head against the detached analytic acceptance 1 - TV, position-weighted.
    confidence_weight: float | None = None  # default 1
    # The rank of the Markov head's factorisation (markov_w1 [V, r], markov_w2 [V, r]), and its kind.
    markov_rank: Annotated[int, Range(0, 4096)] | None = None  # >= 1 here (0: none, every other family); default 256
    markov_head: MarkovHeadType | None = None  # default "vanilla"


def _check(cfg: Any) -> None:
    if cfg.markov_head is not None and cfg.markov_head not in MARKOV_HEAD_TYPES:
        raise ValueError(f"markov_head {cfg.markov_head!r} must be one of {', '.join(map(repr, MARKOV_HEAD_TYPES))}")
    if "sliding_attention" in cfg.layer_types:
        raise ValueError(
            "arch 'dspark' takes full_attention layers only: the engines that serve DSpark (vLLM, "
            "SGLang, llama.cpp) read no sliding window from its layout; remove layer_types or the "
            "sliding layers"
        )
    if cfg.markov_rank < 1:
        raise ValueError("arch 'dspark' needs markov_rank >= 1 (the Markov head and the confidence head read it)")
    if cfg.confidence_weight < 0:
        raise ValueError("confidence_weight must be >= 0")
    if cfg.confidence_weight > 0 and cfg.loss != "ce":
        raise ValueError(
            "confidence_weight > 0 needs loss = 'ce': the confidence's BCE is weighted by the "
            "position decay, which D-PACE replaces"
        )


DSPARK = FamilyConfig(
    name="dspark",
    display="DSpark",
    own_keys={"confidence_weight": 0.0, "markov_rank": 0, "markov_head": None},
    defaults={"confidence_weight": 1.0, "markov_rank": 256, "markov_head": "vanilla"},
    # DeepSpec config/dspark/dspark_qwen3_8b.py: block 7 = 7 drafts, a vanilla Markov head of rank 256 and a
    # confidence head; loss 0.1 CE + 0.9 L1 (= 2 TV) + 1.0 BCE of the confidence, weights exp(-k/4).
    recipes={
        "dspark": {
            "arch": "dspark",
            "num_hidden_layers": 5,
            "block_size": 7,
            "num_anchors": 512,
            "loss": "ce",
            "loss_gamma": 4.0,
            "ce_weight": 0.1,
            "tv_weight": 0.9,
            "confidence_weight": 1.0,
            "kl_weight": 0.0,
            "cap_weight": 0.0,
            "markov_rank": 256,
            "markov_head": "vanilla",
        }
    },
    drafts_from_anchor=True,
    check=_check,
)
