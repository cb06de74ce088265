"""The drafter families as units: each one registered once in each half, and no code outside them asking which
architecture a drafter is.

A family is consumer/families/<name>/ (model, layout, draft function, the code an export ships) and its config half
common/config/families/<name>.py; the registries are the two packages' __init__.py.
Code elsewhere asks the family (`family(arch).head_tensors`, `family_of(model).draft`), never compares an arch name or
tests a family's model class (a family's own keys, at 0 for every other family, say whether a module exists).
"""

from __future__ import annotations

import ast
from pathlib import Path

from dflash_ring.common.config.drafter import DrafterConfig
from dflash_ring.common.config.families import FAMILIES as CONFIG_FAMILIES
from dflash_ring.consumer.layouts.drafter_hf_config import drafter_hf_config
from dflash_ring.consumer.families import FAMILIES, family_of, family_of_layout
from dflash_ring.consumer.families.build import build_drafter

from support import tiny_qwen3_config

ROOT = Path(__file__).resolve().parents[1]
FAMILY_DIRS = (ROOT / "consumer" / "families", ROOT / "common" / "config" / "families")
MODEL_CLASSES = {f.model.__name__ for f in FAMILIES.values() if f.name != "dflash"}


def branches_on_a_family(path: Path) -> list[str]:
    """Comparisons with a family's name and isinstance tests of a family's model class in one module."""
    names = set(FAMILIES)
    found = []
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for operand in operands:
                values = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
                if any(isinstance(v, ast.Constant) and v.value in names for v in values):
                    found.append(f"{where}:{node.lineno}")
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2:
            classes = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            if any(getattr(c, "id", getattr(c, "attr", None)) in MODEL_CLASSES for c in classes):
                found.append(f"{where}:{node.lineno}")
    return found


def package_sources() -> list[Path]:
    return [
        p
        for p in sorted(ROOT.rglob("*.py"))
        if not any(part in ("tests", "build", "runs") or part.startswith(".") for part in p.relative_to(ROOT).parts)
        and not any(d in p.parents for d in FAMILY_DIRS)
    ]


def test_every_family_is_registered_once_in_each_half():
    assert list(FAMILIES) == [name for name in FAMILIES if name in CONFIG_FAMILIES]
    assert set(FAMILIES) == set(CONFIG_FAMILIES)
    for name, family in FAMILIES.items():
        assert family.config is CONFIG_FAMILIES[name]
        assert all(source.is_file() for _, source in family.code), name
    architectures = [f.architectures for f in FAMILIES.values()]
    assert len(set(architectures)) == len(architectures)


def test_each_family_builds_its_own_model_writes_its_layout_and_is_found_from_both():
    target = tiny_qwen3_config(num_hidden_layers=4).to_dict()
    recipes = {
        "dflash": {},
        "dspark": {"recipe": "dspark", "markov_rank": 4},
        "dflash2": {"recipe": "dflash2"},
        "eagle3": {"recipe": "eagle3", "target_layer_ids": [0, 1, 2]},  # 4 layers: no low/mid/high default
    }
    for name in FAMILIES:
        cfg = DrafterConfig(**recipes[name], num_hidden_layers=1, block_size=8, mask_token_id=250)
        model = build_drafter(cfg, target)
        assert family_of(model) is FAMILIES[name]
        config = drafter_hf_config(cfg, target)
        assert family_of_layout(config) is FAMILIES[name]
        # auto_map names the first code file the export ships, and its class the layout's architecture; a layout
        # the engines load natively (EAGLE-3's) ships no code and names none
        code = FAMILIES[name].code
        assert config.get("auto_map", {}).get("AutoModel") == (
            f"{code[0][0].removesuffix('.py')}.{FAMILIES[name].architectures[0]}" if code else None
        )
        assert FAMILIES[name].settings(config) == (8, 250, cfg.resolved_target_layer_ids(4))


def test_nothing_outside_the_families_branches_on_one():
    found = {
        str(path.relative_to(ROOT)): places for path in package_sources() if (places := branches_on_a_family(path))
    }
    assert found == {}


def test_the_scan_sees_a_comparison_and_an_isinstance(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text('def f(cfg, m):\n    return cfg.arch == "dspark" or isinstance(m, DFlash2DraftModel)\n')
    assert len(branches_on_a_family(path)) == 2
