"""The head probe's result kept beside the drafter's checkpoints, so a restart skips the probe.

The probe imports the target's modeling code and builds its skeleton: seconds a restart (<= 10 s) cannot
spare, and the import path a restart must avoid (tests/test_startup.py). What it derives depends only on
the target's config and its head tensors, so the cache is keyed by a fingerprint of config.json's bytes
and the head tensors' safetensors header entries (name, dtype, shape, size of the file holding it): the
same target reuses the entry, a different one (new config, other weights) is probed again. Reading the
headers costs no tensor data. Written atomically (temp file, fsync, rename): drafters starting side by
side write the same content.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from safetensors import safe_open

from dflash_ring.common.durable import fsync

from .target_head import HeadSpec

CACHE_NAME = "target-head.json"


def fingerprint(root: Path, files: dict[str, Path], keys: list[str]) -> str:
    """sha256 of the target's config.json and its head tensors' header entries."""
    digest = hashlib.sha256((root / "config.json").read_bytes())
    for key in keys:
        with safe_open(files[key], framework="pt") as f:
            tensor = f.get_slice(key)
            entry = [key, tensor.get_dtype(), list(tensor.get_shape()), files[key].stat().st_size]
        digest.update(json.dumps(entry).encode())
    return digest.hexdigest()


def cached_spec(cache: str | Path | None, key: str) -> HeadSpec | None:
    """The cached head for `key`, or None (no cache, another target, an unreadable file: probe again)."""
    if cache is None:
        return None
    try:
        data = json.loads(Path(cache).read_text())
        return HeadSpec.from_json(data["head"]) if data.get("key") == key else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def store_spec(cache: str | Path | None, key: str, spec: HeadSpec, errors) -> None:
    """Write the derived head and the errors its verification measured (for a reader of the file)."""
    if cache is None:
        return
    path = Path(cache)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"key": key, "head": spec.to_json(),
              "verified_relative_error": {"embedding": errors.embedding, "logits": errors.logits}}
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=2, sort_keys=True)
            f.write("\n")
        fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync(path.parent)
