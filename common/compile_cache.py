"""Persistent torch.compile caches: a restarted process loads its compiled kernels instead of compiling again.

A drafter restarted on an H200 spent 27 of its 31.6 s to the first step recompiling. Inductor and
Triton cache what they compile, but by default under /tmp (wiped by a reboot, and private per unit
under systemd's PrivateTmp). Here each process points both caches at a directory of its own under
`run.compile_cache_dir`, named by a digest of everything its compiled code depends on: torch,
Triton and CUDA versions, the GPU, and the model configuration it compiles (the role passes it). A
changed config therefore never meets a cache built for another one; Inductor's own content keys
stand behind that as a second check.

The caches hold generated Python and kernels that are imported and run, so the directory must be
this user's and private (mode 0700, every existing parent ours or root's): a cache another user
could write is code they could run as us.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from .ownership import ensure_private_dir


def cache_key(role: str, fields: dict[str, Any]) -> str:
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    identity = {
        "role": role,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "device": device,
        "config": fields,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]


def use_compile_cache(root: str, role: str, fields: dict[str, Any]) -> Path | None:
    """Point Inductor's and Triton's caches at <root>/<role>-<key> (before anything compiles); "" keeps
    torch's defaults. Returns the directory used."""
    if not root:
        return None
    path = Path(root).expanduser() / f"{role}-{cache_key(role, fields)}"
    ensure_private_dir(path, "compile cache directory", "run.compile_cache_dir")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(path / "triton")
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
    functorch_config.enable_autograd_cache = True
    return path
