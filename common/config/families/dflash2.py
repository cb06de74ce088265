"""DFlash2's [drafter] keys (z-lab's "Keep Drafting Parallel"): the grouped dynamic causal convolution around every
attention and MLP sublayer (taps per channel, conv_kernel_size of them, the dynamic part shared by conv_group_size
channels) and the candidate selector (codebooks of rank selector_rank rescoring the unary top selector_top_k), whose
K-way CE against the true predecessor's candidates weighs selector_weight. Model and objective:
consumer/families/dflash2/."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from dflash_ring.common.config.families.family import FamilyConfig
from dflash_ring.common.config.ranges import Range


@dataclass
class DFlash2Keys:
    """The [drafter] keys only DFlash2 has (None: the family's default, below)."""

    conv_kernel_size: Annotated[int, Range(0, 64)] | None = None  # default 2
    conv_group_size: Annotated[int, Range(0, 1 << 16)] | None = None  # default 16
    selector_rank: Annotated[int, Range(0, 4096)] | None = None  # default 256
    selector_top_k: Annotated[int, Range(0, 4096)] | None = None  # default 16
    selector_weight: float | None = None  # default 1


def _check(cfg: Any) -> None:
    if min(cfg.conv_kernel_size, cfg.conv_group_size, cfg.selector_rank, cfg.selector_top_k) < 1:
        raise ValueError(
            "arch 'dflash2' needs conv_kernel_size, conv_group_size, selector_rank and selector_top_k >= 1"
        )
    if cfg.conv_kernel_size > cfg.block_size:
        raise ValueError(
            f"conv_kernel_size {cfg.conv_kernel_size} exceeds block_size {cfg.block_size}: its taps "
            "never cross a block, so the extra ones would read nothing"
        )
    if cfg.selector_weight < 0:
        raise ValueError("selector_weight must be >= 0")


def _check_target(cfg: Any, geometry: Any) -> None:
    """What the model's blocks (consumer/families/dflash2/dflash2_blocks.py) refuse when built, refused before: the
    convolution's dynamic part is shared by groups of conv_group_size channels of the drafter's width (the target's
    hidden_size), and the selector rescores the top selector_top_k of the target's vocabulary."""
    if geometry.hidden_size % cfg.conv_group_size:
        raise ValueError(
            f"drafter.conv_group_size {cfg.conv_group_size} does not divide the target's hidden_size "
            f"{geometry.hidden_size} (the drafter's width, shared by groups of that many channels): set a divisor of it"
        )
    if cfg.selector_top_k > geometry.vocab_size:
        raise ValueError(
            f"drafter.selector_top_k {cfg.selector_top_k} exceeds the target's vocabulary of {geometry.vocab_size} "
            "(the selector rescores the top k of it): set it to at most that"
        )


DFLASH2 = FamilyConfig(
    name="dflash2",
    display="DFlash2",
    # 0: no convolution, no selector (every other family's config); left out of model_fields there.
    own_keys={
        "conv_kernel_size": 0,
        "conv_group_size": 0,
        "selector_rank": 0,
        "selector_top_k": 0,
        "selector_weight": 0.0,
    },
    defaults={
        "conv_kernel_size": 2,
        "conv_group_size": 16,
        "selector_rank": 256,
        "selector_top_k": 16,
        "selector_weight": 1.0,
    },
    # From the released checkpoint's config.json (incoai/Qwen3.8-27B-DFlash2, shared/reference/dspark-dflash2.md 2.1):
    # 5 layers, all sliding_attention with window 2048, block 8, conv_kernel_size 2, conv_group_size 16,
    # selector_rank 256, selector_top_k 16. z-lab published no objective; from the peers' trainers (2.2): selector
    # loss weight 1.0 (SpecForge/speculators/NeMo AM alpha_sel), 512 anchors (speculators' max_anchors). The
    # backbone's loss is the paper's position-decayed CE with its B8 gamma 4 (speculators' default is KL: set
    # kl_weight).
    recipes={
        "dflash2": {
            "arch": "dflash2",
            "num_hidden_layers": 5,
            "block_size": 8,
            "num_anchors": 512,
            "loss": "ce",
            "loss_gamma": 4.0,
            "kl_weight": 0.0,
            "cap_weight": 0.0,
            "sliding_window": 2048,
            "conv_kernel_size": 2,
            "conv_group_size": 16,
            "selector_rank": 256,
            "selector_top_k": 16,
            "selector_weight": 1.0,
        }
    },
    layer_types={"dflash2": lambda n: ["sliding_attention"] * n},  # all sliding, as the released checkpoint
    check=_check,
    check_target=_check_target,
)
