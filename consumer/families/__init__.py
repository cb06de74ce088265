"""The drafter families, registered once: drafter.arch names one of FAMILIES.

A family is its folder here (model, export layout, draft function, the code an export ships) and its config half in
common/config/families/<name>.py (keys, defaults, recipes, checks), with one entry in each registry. Adding one:
README "Adding a drafter family".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dflash_ring.consumer.families.dflash import DFLASH
from dflash_ring.consumer.families.dflash2 import DFLASH2
from dflash_ring.consumer.families.dspark import DSPARK
from dflash_ring.consumer.families.eagle3 import EAGLE3
from dflash_ring.consumer.families.family import DrafterFamily

FAMILIES: dict[str, DrafterFamily] = {family.name: family for family in (DFLASH, DFLASH2, DSPARK, EAGLE3)}


def family(arch: str) -> DrafterFamily:
    """The family drafter.arch names (DrafterConfig has checked it is one)."""
    return FAMILIES[arch]


def family_of(model: Any) -> DrafterFamily:
    """The family whose training model `model` is (by its exact class)."""
    for candidate in FAMILIES.values():
        if type(model) is candidate.model:
            return candidate
    raise ValueError(f"{type(model).__name__} is no registered drafter family's model")


def family_of_layout(config: Mapping[str, Any]) -> DrafterFamily | None:
    """The family whose export layout config.json's `architectures` names, or None."""
    found = config.get("architectures")
    return next((f for f in FAMILIES.values() if found == list(f.architectures)), None)
