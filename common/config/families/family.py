"""What a drafter family brings to the [drafter] config section: its own keys, their defaults, its recipes and its
checks. Registered once in common/config/families/__init__.py; DrafterConfig (common/config/drafter.py) reads
nothing about a family but this.

Import-light (no torch, no transformers): every process reads it while loading the run's config. The family's model,
objective, layouts and draft function are consumer/families/<name>/.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class FamilyConfig:
    """A family's part of the [drafter] section (drafter.arch = name)."""

    name: str  # drafter.arch
    display: str  # how messages name it ("DSpark")
    # Keys only this family has, at the value every other family's config holds: set to anything else on another
    # family's drafter they are refused, and at that value model_fields leaves them out (so the fingerprints of
    # configs written before the family existed stay what they were).
    own_keys: Mapping[str, Any] = field(default_factory=dict)
    # The family's defaults of any [drafter] key, over the shared ones (a recipe's values and set keys win).
    defaults: Mapping[str, Any] = field(default_factory=dict)
    # Named recipes the family contributes to drafter.recipe (a recipe naming arch = name selects the family).
    recipes: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # A recipe's layer pattern for however many layers the drafter has (default: every layer full attention).
    layer_types: Mapping[str, Callable[[int], list[str]]] = field(default_factory=dict)
    # Whether the anchor's slot drafts too (DSpark): a block then drafts B tokens, not B - 1.
    drafts_from_anchor: bool = False
    # The family's default target layers for (target layers, drafter layers) where target_layer_ids is unset
    # (None: build_target_layer_ids, DFlash's rule; EAGLE-3: low, middle and high).
    target_layer_ids: Callable[[int, int], list[int]] | None = None
    # The family's checks of one field against another, on the resolved config (ValueError naming the fields).
    check: Callable[[Any], None] = lambda cfg: None
    # Its checks against the target (the resolved config, the target's TargetGeometry: vocabulary, layer count, the
    # layers the producers capture), before a drafter builds anything (ValueError naming the fields; one line).
    check_target: Callable[[Any, Any], None] = lambda cfg, geometry: None
    # Keys naming a file whose bytes are part of the model, with the digest of such a file: model_fields holds the
    # digest, not the path, so replicas and standbys with another file are refused and a moved copy is not
    # (EAGLE-3: drafter.draft_vocab, the draft vocabulary's maps).
    digests: Mapping[str, Callable[[str], str]] = field(default_factory=dict)
