"""DFlash (z-lab's block-diffusion drafter): the shared [drafter] keys alone; the drafter every other family extends.
Its recipes (paper, dpace, ddtree) are the shared ones (common/config/drafter.py), since every family can run them."""

from __future__ import annotations

from dflash_ring.common.config.families.family import FamilyConfig

DFLASH = FamilyConfig(name="dflash", display="DFlash")
