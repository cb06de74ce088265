"""No run harms another, and no one else gets in: run names, ownership of IPC objects and lock directories."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_ring.common.config import default_runtime_root


def cli(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash_ring", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env=env)


def one_line_error(out: subprocess.CompletedProcess) -> str:
    """The CLI's contract for bad input: exit 2, exactly one line on stderr, no traceback."""
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and "Traceback" not in out.stderr, (out.returncode, out.stderr)
    return lines[0]


@pytest.fixture
def runtime_root(tmp_path):
    """The lock-directory root a config without run_dir uses (as root /run/dflash-ring; created if missing)."""
    env = dict(os.environ, XDG_RUNTIME_DIR=str(tmp_path / "xdg"))
    old = os.environ.get("XDG_RUNTIME_DIR")
    os.environ["XDG_RUNTIME_DIR"] = env["XDG_RUNTIME_DIR"]
    root = default_runtime_root()
    made = not root.exists()
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        yield root, env
    finally:
        if old is None:
            os.environ.pop("XDG_RUNTIME_DIR", None)
        else:
            os.environ["XDG_RUNTIME_DIR"] = old
        if made:
            try:
                root.rmdir()
            except OSError:
                pass


@pytest.mark.parametrize("how,name", [
    ("clean", "TRAVERSAL"), ("clean", ".."), ("status", "."), ("stop", "a/b"), ("status", ""),
    ("config", ".."), ("set", ".hidden"), ("config", "TRAVERSAL"),
])
def test_every_way_a_run_name_comes_in_is_validated(tmp_path, runtime_root, how, name):
    root, env = runtime_root
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.lock").write_text("not yours\n")
    if name == "TRAVERSAL":  # `clean ../../<dir>` once removed <dir>/*.lock
        name = os.path.relpath(victim, root)
    config = tmp_path / "run.toml"
    config.write_text(f'[run]\nname = "{name}"\n')
    args = {
        "clean": ["clean", name],
        "status": ["status", name],
        "stop": ["stop", name, "--timeout", "1"],
        "config": ["clean", "--config", str(config)],
        "set": ["status", "--set", f'run.name="{name}"'],
    }[how]
    out = cli(*args, cwd=tmp_path, env=env)
    line = one_line_error(out)
    assert "is not allowed" in line and "starting with a letter or digit" in line, line
    assert (victim / "precious.lock").exists()
