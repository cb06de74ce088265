"""The roles are peers over common/: common imports no role, no role imports another, the supervisor only common.

Read from the source (every import statement, also those inside functions), so a lazy import that
crosses a boundary is caught as well as a top-level one.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROLES = ("producer", "consumer", "supervisor")
# What each package may import from dflash_ring (besides itself). Tools, the embedded default and the
# benchmarks sit above the roles and may use them; the CLI dispatches to all.
ALLOWED = {
    "common": set(),
    "producer": {"common"},
    "consumer": {"common"},
    "supervisor": {"common"},
}


def imported_packages(path: Path) -> set[str]:
    """dflash_ring sub-packages a module imports (absolute or relative)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the module's package
                base = path.relative_to(ROOT).parts[:-1]
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                names = [".".join(("dflash_ring", *base, node.module or ""))]
            else:
                names = [node.module or ""]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "dflash_ring" and len(parts) > 1 and parts[1]:
                found.add(parts[1])
    return found


def violations() -> list[str]:
    out = []
    for package, allowed in ALLOWED.items():
        for path in sorted((ROOT / package).glob("*.py")):
            for other in imported_packages(path) - allowed - {package}:
                out.append(f"{path.relative_to(ROOT)} imports dflash_ring.{other}")
    return out


def test_roles_are_peers_over_common():
    assert violations() == []


def test_the_check_sees_a_crossing(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from dflash_ring.consumer.model import X\n")
    assert "consumer" in imported_packages(module)
