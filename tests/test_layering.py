"""The floors of the house: common/ at the bottom; the roles (producer, consumer, supervisor) peers over it, with
the embedded default beside them; tools above the roles; the benchmarks above the tools; the CLI on top. Nothing
imports a floor above its own, no role imports another, and no set of modules imports itself in a circle.

Read from the source (every import statement, also those inside functions), so a lazy import that
crosses a boundary or closes a circle is caught as well as a top-level one.
"""

from __future__ import annotations

import ast
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
ROLES = ("producer", "consumer", "supervisor")
# What each package may import from dflash_ring (besides itself); the CLI (cli.py, __main__.py) dispatches to all.
ALLOWED = {
    "common": set(),
    "producer": {"common"},
    "consumer": {"common"},
    "supervisor": {"common"},
    "embedded": {"common"},
    "real": {"common"},
    "tools": {"common", *ROLES, "embedded", "real"},
    "bench": {"common", *ROLES, "embedded", "real", "tools"},
}
TOP = {"cli", "__main__"}


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(("dflash_ring", *(parts[:-1] if parts[-1] == "__init__" else parts)))


def imported_modules(path: Path, root: Path = ROOT) -> set[str]:
    """dflash_ring modules a module imports (absolute or relative, at any depth of the file); `from P import x`
    counts x when it is a module of P, else P."""
    found = set()
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the module's package
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join((*base, node.module)) if node.module else ".".join(base)
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{a.name}" for a in node.names)
    return {name for name in found if name.startswith("dflash_ring.")}


def sources(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package by its dotted name (tests, builds and hidden folders such as the venv left out)."""
    return {
        module_name(path, root): path
        for path in sorted(root.rglob("*.py"))
        if not any(part in ("tests", "build", "runs") or part.startswith(".") for part in path.relative_to(root).parts)
    }


def imported_packages(path: Path, root: Path = ROOT) -> set[str]:
    """dflash_ring sub-packages (floors) a module imports."""
    return {name.split(".")[1] for name in imported_modules(path, root)}


def violations(root: Path = ROOT) -> list[str]:
    out = []
    for name, path in sources(root).items():
        floor = name.split(".")[1] if name.count(".") else "__init__"
        if floor in TOP or floor == "__init__":
            continue
        if floor not in ALLOWED:
            out.append(f"{path.relative_to(root)}: package {floor} has no floor in tests/test_layering.py")
            continue
        for other in imported_packages(path, root) - ALLOWED[floor] - {floor}:
            out.append(f"{path.relative_to(root)} imports dflash_ring.{other}")
    return out


def import_graph(modules: dict[str, Path], root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the modules of `modules` it imports (a package's __init__ counts as the package)."""
    return {
        name: {m for m in imported_modules(path, root) if m in modules and m != name} for name, path in modules.items()
    }


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: strongly connected sets of more than one module (Tarjan's algorithm), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_every_floor_imports_only_the_floors_below():
    assert violations() == []


def test_no_import_circle_anywhere():
    """Function-level imports included: a lazy import that closes a circle is still a circle."""
    assert circles(import_graph(sources())) == []


def test_the_check_sees_a_circle_through_a_function_level_import(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    sources = {
        "a": "from dflash_ring.pkg import b\n",
        "b": "def f():\n    from .a import g\n",
        "c": "from . import b\n",
    }
    modules = {}
    for stem, text in sources.items():
        (package / f"{stem}.py").write_text(text)
        modules[f"dflash_ring.pkg.{stem}"] = package / f"{stem}.py"
    assert circles(import_graph(modules, tmp_path)) == [["dflash_ring.pkg.a", "dflash_ring.pkg.b"]]


def test_the_check_refuses_an_upward_import_and_an_unplaced_package(tmp_path):
    for where, text in {
        "embedded/a.py": "from dflash_ring.consumer.modeling import model\n",
        "tools/b.py": "def f():\n    from ..bench import ring\n",
        "producer/c.py": "from dflash_ring.common import ring\n",
        "extras/d.py": "import os\n",
    }.items():
        (tmp_path / where).parent.mkdir(exist_ok=True)
        (tmp_path / where).write_text(text)
    assert violations(tmp_path) == [
        "embedded/a.py imports dflash_ring.consumer",
        "extras/d.py: package extras has no floor in tests/test_layering.py",
        "tools/b.py imports dflash_ring.bench",
    ]


def test_the_check_sees_a_crossing(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from dflash_ring.consumer.modeling.model import X\n")
    assert "consumer" in imported_packages(module, tmp_path)


def test_the_ring_reaches_no_config():
    """The ring is the IPC primitive config stands on: it takes a RingSpec (common/ring_spec.py makes one from a
    Config), and nothing it imports, at any depth, imports config."""
    modules = sources()
    graph = import_graph(modules)
    ring = {n for n in modules if n == "dflash_ring.common.ring" or n.startswith("dflash_ring.common.ring.")}
    assert len(ring) >= 5, ring
    reached = reached_from(graph, ring)
    assert not {n for n in reached if n == "dflash_ring.common.config" or n.endswith("_config")}, reached


def reached_from(graph: dict[str, set[str]], start: set[str]) -> set[str]:
    """`start` and every module of `graph` it imports at any depth, with the packages holding each (importing a
    module runs its packages' __init__ first)."""
    reached, todo = set(), list(start)
    while todo:
        if (name := todo.pop()) not in reached and name in graph:
            reached.add(name)
            todo.extend(graph[name])
            todo.extend(name.rsplit(".", k)[0] for k in range(1, name.count(".") + 1))
    return reached


# What configuration as data never imports: the libraries that load models and tokenizers.
HEAVY = {"transformers", "torch"}


def third_party_imports(path: Path) -> set[str]:
    """The top-level packages outside dflash_ring a module imports (every import statement, at any depth)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found - {"dflash_ring"}


def config_heavy_imports(root: Path = ROOT) -> dict[str, list[str]]:
    """Each module that common/config/ reaches (itself included) and imports transformers or torch: which."""
    modules = sources(root)
    config = {n for n in modules if n == "dflash_ring.common.config" or n.startswith("dflash_ring.common.config.")}
    reached = reached_from(import_graph(modules, root), config)
    heavy = {name: sorted(third_party_imports(modules[name]) & HEAVY) for name in sorted(reached)}
    return {name: found for name, found in heavy.items() if found}


def test_config_is_data_and_reaches_no_transformers_or_torch():
    """common/config/ is the run's settings as data (dataclasses, their checks, defaults, TOML in and out), read by
    every process at its start: reading a target's config.json, its config class, model or tokenizer is loading,
    in common/target_geometry.py, common/target_loading.py and common/tokenizer_loading.py. Neither config nor any
    module it imports, at any depth and in any function, imports transformers or torch."""
    assert len([n for n in sources() if n.startswith("dflash_ring.common.config.")]) >= 10
    assert config_heavy_imports() == {}


def test_the_check_sees_a_lazy_transformers_import_a_module_away(tmp_path):
    (tmp_path / "common" / "config").mkdir(parents=True)
    (tmp_path / "common" / "config" / "a.py").write_text("def f():\n    from dflash_ring.common import b\n")
    (tmp_path / "common" / "b.py").write_text("import json\n\n\ndef g():\n    import transformers.models.auto\n")
    (tmp_path / "common" / "c.py").write_text("import torch\n")  # not reached from config
    assert config_heavy_imports(tmp_path) == {"dflash_ring.common.b": ["transformers"]}


def test_the_package_ships_every_subpackage():
    """pyproject.toml lists the packages a wheel holds (the repository root is the package, so setuptools cannot
    find them itself): a folder left out is missing from `pip install .` while the editable install of `make setup`
    still finds it. common/ring and common/config were missing so, and every role failed to import from a wheel."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = [d for d in ROOT.iterdir() if d.is_dir() and (d / "__init__.py").is_file() and d.name != "tests"]
    found = {"dflash_ring"} | {
        ".".join(("dflash_ring", *p.parent.relative_to(ROOT).parts)) for d in folders for p in d.rglob("__init__.py")
    }
    assert listed == found, (sorted(found - listed), sorted(listed - found))
