"""Persistent compile caches: one private directory per role and config, and a second process reuses it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_ring.common.compile_cache import cache_key, use_compile_cache
from dflash_ring.common.ownership import ForeignObjectError


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    saved = inductor_config.fx_graph_cache, functorch_config.enable_autograd_cache
    yield
    inductor_config.fx_graph_cache, functorch_config.enable_autograd_cache = saved


def test_each_role_and_config_gets_its_own_private_directory(tmp_path, clean_env):
    a = use_compile_cache(str(tmp_path), "drafter", {"hidden": 64})
    assert a == tmp_path / f"drafter-{cache_key('drafter', {'hidden': 64})}"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(a / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(a / "triton")
    assert a.stat().st_mode & 0o777 == 0o700
    assert use_compile_cache(str(tmp_path), "drafter", {"hidden": 64}) == a
    assert use_compile_cache(str(tmp_path), "drafter", {"hidden": 128}) != a  # a config change never meets it
    assert use_compile_cache(str(tmp_path), "target", {"hidden": 64}) != a
    assert use_compile_cache("", "drafter", {"hidden": 64}) is None


def test_a_cache_others_may_write_is_refused(tmp_path, clean_env):
    """Its generated code is imported and run: a directory others can write is code they could run as us."""
    path = tmp_path / f"drafter-{cache_key('drafter', {})}"
    path.mkdir()
    path.chmod(0o777)
    with pytest.raises(ForeignObjectError, match="compile cache directory .* others may write") as e:
        use_compile_cache(str(tmp_path), "drafter", {})
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    path.chmod(0o700)
    (tmp_path / "shared").mkdir(mode=0o777)
    (tmp_path / "shared").chmod(0o777)
    with pytest.raises(ForeignObjectError, match="run.compile_cache_dir"):
        use_compile_cache(str(tmp_path / "shared" / "cache"), "drafter", {})


COMPILE_TWICE = """
import json, sys, torch
from torch._dynamo.utils import counters
from dflash_ring.common.compile_cache import use_compile_cache
use_compile_cache(sys.argv[1], "drafter", {"layers": 1})
f = torch.compile(lambda x: torch.nn.functional.silu(x) * x + 1)
f(torch.randn(8, 8))
print(json.dumps(dict(counters["inductor"])))
"""


@pytest.mark.processes
@pytest.mark.skipif(shutil.which("cc") is None, reason="Inductor on the CPU needs a C compiler")
def test_a_restarted_process_loads_the_compiled_graph_instead_of_compiling(tmp_path):
    def run() -> dict:
        out = subprocess.run(
            [sys.executable, "-c", COMPILE_TWICE, str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": "/nonexistent"},
        )
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    first, second = run(), run()
    assert first.get("fxgraph_cache_miss", 0) >= 1 and not first.get("fxgraph_cache_hit")
    assert second.get("fxgraph_cache_hit", 0) >= 1 and not second.get("fxgraph_cache_miss")
    assert any(Path(tmp_path).glob("drafter-*/inductor/*"))
