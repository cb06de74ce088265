"""The head probe's result kept beside the drafter's checkpoints, so a restart skips the probe.

The probe imports the target's modeling code and builds its skeleton: seconds a restart (<= 10 s) cannot
spare, and the import path a restart must avoid (tests/test_startup.py). What it derives depends only on
the target's config and its head tensors, so the cache is keyed by a fingerprint of config.json's bytes
and the head tensors' safetensors header entries (name, dtype, shape, size of the file holding it): the
same target reuses the entry, a different one (new config, other weights) is probed again. Reading the
headers costs no tensor data. Written atomically (temp file, fsync, rename): drafters starting side by
side write the same content.

A digest over the entry proves it is what was written, not that it is true: a value changed with the digest
recomputed was trusted. So the entry also holds a few of the target's own outputs the probe recorded
(head_probe.record_outputs), and each start checks the head built from the cached values against them on the
checkpoint's tensors (head_loader.py); an entry off by more than float32 rounding is doubted and probed again.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from safetensors import safe_open

from dflash_ring.common.bounded_read import CONFIG_BYTES, read_bytes, read_own
from dflash_ring.common.config.target import TargetConfigError
from dflash_ring.common.damaged_file import keep_aside
from dflash_ring.common.durable import fsync

from dflash_ring.consumer.modeling.target_head import HeadSpec

CACHE_NAME = "target-head.json"


def fingerprint(root: Path, files: dict[str, Path], keys: list[str]) -> str:
    """sha256 of the target's config.json and its head tensors' header entries."""
    digest = hashlib.sha256(read_bytes(root / "config.json", CONFIG_BYTES, TargetConfigError, "target config"))
    for key in keys:
        with safe_open(files[key], framework="pt") as f:
            tensor = f.get_slice(key)
            entry = [key, tensor.get_dtype(), list(tensor.get_shape()), files[key].stat().st_size]
        digest.update(json.dumps(entry).encode())
    return digest.hexdigest()


def _digest(key: str, head: dict) -> str:
    """sha256 of what the entry says: a byte changed in the file (its key, a flag, a value) no longer matches. It
    proves the entry is what was written, not that it is true: a value changed with the digest recomputed is caught
    by the target's outputs recorded beside it (head_loader.py), which need no digest (changed, they fail that check
    as well)."""
    return hashlib.sha256(json.dumps({"key": key, "head": head}, sort_keys=True).encode()).hexdigest()


def _plausible(spec: HeadSpec) -> bool:
    """What the probe can derive: every factor finite, the scale and the cap positive (a softcap is a
    magnitude), the multiplier non-zero."""
    return (
        (spec.embed_scale is None or (math.isfinite(spec.embed_scale) and spec.embed_scale > 0))
        and (spec.logit_multiplier is None or (math.isfinite(spec.logit_multiplier) and spec.logit_multiplier != 0))
        and (spec.logit_softcap is None or (math.isfinite(spec.logit_softcap) and spec.logit_softcap > 0))
    )


def cached_spec(cache: str | Path | None, key: str, untied_head: bool) -> HeadSpec | None:
    """The cached head for `key`, or None: probe again (`cached_entry`, without the target's outputs)."""
    entry = cached_entry(cache, key, untied_head)
    return None if entry is None else entry[0]


def cached_entry(cache: str | Path | None, key: str, untied_head: bool) -> tuple[HeadSpec, Any] | None:
    """The cached head for `key` and the target's outputs the probe recorded with it (None in an entry written
    before they were: the caller probes again), or None: probe again. The cache is only a cache, trusted only when it is
    exactly what `store_spec` wrote for this target: its digest matches, its values are ones the probe can
    derive, and an untied head is one the checkpoint holds (`untied_head`: it has an lm_head of its own; a tied
    head read against a stored lm_head that differs is doubted by the caller, `doubt`). On any
    doubt the damaged file is kept aside (common/damaged_file.py) and the probe's result replaces it; another
    target's entry (a different key) is simply probed again."""
    if cache is None:
        return None
    path = Path(cache)
    try:
        raw = read_own(path, CONFIG_BYTES, "head cache")  # not a regular file: kept aside, None
        if raw is None:
            return None
        data = json.loads(raw.decode("utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        return _doubt(path, f"unreadable ({type(e).__name__})")
    if not isinstance(data, dict) or not isinstance(data.get("key"), str):
        return _doubt(path, "not a head cache entry")
    if data["key"] != key:
        return None
    head = data.get("head")
    if not isinstance(head, dict) or data.get("digest") != _digest(key, head):
        return _doubt(path, "its digest does not match its content")
    try:
        if not isinstance(head["tied"], bool) or any(
            not (head.get(k) is None or (type(head[k]) in (int, float)))
            for k in ("embed_scale", "logit_multiplier", "logit_softcap")
        ):
            raise TypeError("a value of the wrong type")
        spec = HeadSpec.from_json(head)
    except (KeyError, TypeError, ValueError) as e:
        return _doubt(path, f"its head does not read ({type(e).__name__}: {e})")
    if not _plausible(spec):
        return _doubt(path, f"its values are none the probe derives ({spec.describe()})")
    if not spec.tied and not untied_head:
        return _doubt(path, "tied=false but the checkpoint has no lm_head of its own")
    return spec, data.get("target_outputs")


def doubt(cache: str | Path, why: str) -> None:
    """A cached head the checkpoint contradicts: kept aside, to be probed again."""
    _doubt(Path(cache), why)


def _doubt(path: Path, why: str) -> None:
    keep_aside(path, f"head cache {why}: the head probe runs again and rewrites it")
    return None


def store_spec(cache: str | Path | None, key: str, spec: HeadSpec, errors, outputs: Any = None) -> None:
    """Write the derived head, the errors its verification measured (for a reader of the file) and the target's
    outputs the probe recorded (head_probe.record_outputs), which each later start checks the head against."""
    if cache is None:
        return
    path = Path(cache)
    path.parent.mkdir(parents=True, exist_ok=True)
    head = spec.to_json()
    record = {
        "key": key,
        "head": head,
        "digest": _digest(key, head),
        "verified_relative_error": {"embedding": errors.embedding, "logits": errors.logits},
    }
    if outputs is not None:
        record["target_outputs"] = outputs
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
