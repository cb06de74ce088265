"""The drafter families' config sections, registered once: drafter.arch names one of FAMILIES.

A family (consumer/families/<name>/ holds its model, objective, layouts and draft function) adds its [drafter] keys
as a dataclass of their own (DrafterConfig derives from it), and its FamilyConfig here: nothing else in the config
branches on an architecture.
"""

from __future__ import annotations

from dflash_ring.common.config.families.dflash import DFLASH
from dflash_ring.common.config.families.dflash2 import DFLASH2, DFlash2Keys
from dflash_ring.common.config.families.dspark import DSPARK, MARKOV_HEAD_TYPES, DSparkKeys, MarkovHeadType
from dflash_ring.common.config.families.eagle3 import EAGLE3, Eagle3Keys
from dflash_ring.common.config.families.family import FamilyConfig

FAMILIES: dict[str, FamilyConfig] = {family.name: family for family in (DFLASH, DSPARK, DFLASH2, EAGLE3)}

__all__ = ["FAMILIES", "FamilyConfig", "DSparkKeys", "DFlash2Keys", "Eagle3Keys", "MARKOV_HEAD_TYPES", "MarkovHeadType"]
