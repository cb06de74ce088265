"""The conformance probe's result kept for restarts: a target restarted on the same model, code and GPU skips it.

The probe (producer/conformance.py) runs the model packed and one sequence at a time: 1.1-1.5 s of a restarted
target's start on the H200 (docs/benchmarks.md), with an answer that only changes when something it depends on
does. So its report is saved under `target.state_dir`/probe/, named by a digest of all of that, exactly: the model
directory (every file's name, size and modification time, and config.json's bytes), the probe's own code and the
packed path's (their source files' bytes), torch's and transformers' versions, the GPU, dtype, attention
implementation, the captured layers and whether the final state ships. Any change names another entry, so a stale
one is never read. An entry that does not read back as a probe report is moved aside (`.damaged`), with a warning,
and the probe runs again: the cache is never more authoritative than the probe it saves.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path

import torch

from dflash_ring.common.bounded_read import CONFIG_BYTES, RECORD_BYTES, read_bytes, read_own
from dflash_ring.common.config.target import TargetConfigError
from dflash_ring.common.durable import fsync
from dflash_ring.common.ownership import ensure_private_dir

from . import conformance, packing, target as target_module
from .conformance import LayerCheck, ProbeReport
from .target import TargetModel

log = logging.getLogger(__name__)


def cached_probe(directory: Path, model_dir: str | os.PathLike) -> Callable[[TargetModel], ProbeReport]:
    """conformance.probe through the results saved under `directory` (target.state_dir/probe): what a target passes
    to conformance.choose_packing, so that a restart on the same model, code and device reads the saved result."""

    def run(target: TargetModel) -> ProbeReport:
        key = probe_key(target, model_dir)
        if (report := cached_report(directory, key)) is not None:
            log.info("conformance probe: the result saved for this model, code and device (%s)", directory / key)
            return report
        report = conformance.probe(target)
        save_report(directory, key, report)
        return report

    return run


def probe_key(target: TargetModel, model_dir: str | os.PathLike) -> str:
    import transformers

    root = Path(model_dir).expanduser().resolve()
    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in root.iterdir() if p.is_file())
    code = {
        Path(m.__file__).name: hashlib.sha256(Path(m.__file__).read_bytes()).hexdigest()
        for m in (conformance, packing, target_module)
    }
    device = torch.cuda.get_device_name(target.device) if target.device.type == "cuda" else target.device.type
    identity = {
        "model": str(root),
        "files": files,
        "config": hashlib.sha256(
            read_bytes(root / "config.json", CONFIG_BYTES, TargetConfigError, "target config")
        ).hexdigest(),
        "code": code,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": device,
        "dtype": str(target.dtype),
        "attention": target.attn_implementation,
        "layers": target.layer_ids,
        "final_hidden": target.final_hidden,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]


def cached_report(directory: Path, key: str) -> ProbeReport | None:
    """The saved report for `key`, or None (none saved; a damaged one is moved aside with a warning)."""
    path = directory / f"{key}.json"
    try:
        if (data := read_own(path, RECORD_BYTES, "probe cache")) is None:  # not a file: kept aside (read_own)
            return None
        raw = json.loads(data)
        names = {f.name for f in fields(ProbeReport)}
        report = ProbeReport(
            **{k: raw[k] for k in names if k != "layers"}, layers=[LayerCheck(**c) for c in raw["layers"]]
        )
        if report.passed != raw["passed"]:
            raise ValueError("its verdict does not follow from its figures")
        return report
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        aside = path.with_suffix(".damaged")
        os.replace(path, aside)
        log.warning("probe cache %s is damaged (%s: %s): moved to %s, probing again", path, type(e).__name__, e, aside)
        return None


def save_report(directory: Path, key: str, report: ProbeReport) -> None:
    ensure_private_dir(directory, "probe cache directory", "target.state_dir")
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{key}.")  # mode 0600
    with os.fdopen(fd, "w") as f:
        json.dump(report.to_json(), f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / f"{key}.json")
    fsync(directory)
