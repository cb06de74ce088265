"""A freshly initialised drafter of the configured family, as wide as the target: the one place a drafter is built
from settings (a run's, a bench's, an untrained baseline's)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from dflash_ring.common.config.drafter import DrafterConfig
from dflash_ring.consumer.layouts.drafter_hf_config import drafter_hf_config, model_config
from dflash_ring.consumer.families import family
from dflash_ring.consumer.modeling.model import DFlashDraftModel

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def build_drafter(cfg: DrafterConfig, target_config: Mapping[str, Any] | PretrainedConfig) -> DFlashDraftModel:
    return family(cfg.arch).model(model_config(drafter_hf_config(cfg, target_config)))
