"""A file shipped inside an installed package, found without importing the package: the model's package imports
`llm` (not installed: only its GGUF file is read), and a data set's needs nothing but its file."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def package_path(module: str, relative: str) -> tuple[Path | None, bool]:
    """(the file's path, whether it is a file there); (None, False) when the package is not installed."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None, False
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    return path, path.is_file()
