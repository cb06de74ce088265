"""The tree stays as the formatter writes it, within the line limit (pyproject.toml's [tool.ruff])."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.processes
def test_every_file_is_as_ruff_format_writes_it():
    out = _ruff("format", "--check", ".")
    assert out.returncode == 0, f"run `ruff format .` (pyproject.toml [tool.ruff]):\n{out.stdout[-3000:]}{out.stderr}"


@pytest.mark.processes
def test_no_line_is_over_the_limit():
    """The formatter splits code; a comment, docstring or string over the limit is left to whoever wrote it."""
    out = _ruff("check", "--output-format", "concise", ".")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr
