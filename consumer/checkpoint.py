"""Atomic, pickle-free training checkpoints.

    checkpoint_dir/
      step-00000200/  model.safetensors  optimizer.safetensors  state.safetensors  trainer.json
      step-00000400/  ...
      latest          -> "step-00000400" (a file, replaced by rename)

A checkpoint is written into a temporary directory, every file fsync'ed, then
renamed into place; only then does `latest` move. Resume takes the newest
checkpoint that loads completely and refuses a partial one, falling back to
the one before it (a crash mid-save, or a truncated file, costs one interval,
never the run).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from dflash_ring.common.durable import fsync

log = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step-(\d{8})$")
FILES = ("model.safetensors", "optimizer.safetensors", "state.safetensors", "trainer.json")


class CheckpointError(RuntimeError):
    """A checkpoint directory that cannot be loaded completely."""


@dataclass
class Checkpoint:
    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    tensors: dict[str, torch.Tensor]  # RNG states and other tensors of the trainer
    info: dict[str, Any] = field(default_factory=dict)  # JSON: schedule, high-water marks, configs
    path: Path | None = None


def optimizer_to_flat(state_dict: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """torch optimizer state -> (tensors for safetensors, JSON-able rest)."""
    tensors, scalars = {}, {}
    for idx, per_param in state_dict["state"].items():
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{idx}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{idx}.{key}"] = value
    return tensors, {"param_groups": state_dict["param_groups"], "scalars": scalars}


def optimizer_from_flat(tensors: dict[str, torch.Tensor], rest: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for name, value in list(tensors.items()) + list(rest["scalars"].items()):
        idx, key = name.split(".", 1)
        state.setdefault(int(idx), {})[key] = value
    return {"state": state, "param_groups": rest["param_groups"]}


class CheckpointStore:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def save(self, ckpt: Checkpoint, keep: int) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"step-{ckpt.step:08d}"
        tmp = self.root / f".tmp-step-{ckpt.step:08d}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        opt_tensors, opt_rest = optimizer_to_flat(ckpt.optimizer)
        save_file({k: v.detach().cpu().contiguous() for k, v in ckpt.model.items()}, tmp / "model.safetensors")
        save_file(opt_tensors, tmp / "optimizer.safetensors")
        save_file({k: v.cpu().contiguous() for k, v in ckpt.tensors.items()}, tmp / "state.safetensors")
        info = dict(ckpt.info, step=ckpt.step, optimizer=opt_rest)
        (tmp / "trainer.json").write_text(json.dumps(info, indent=1))
        for name in FILES:
            fsync(tmp / name)
        fsync(tmp)
        if final.exists():  # a checkpoint of the same step from before a crash: replace it
            shutil.rmtree(final)
        tmp.rename(final)
        fsync(self.root)
        pointer = self.root / ".latest.tmp"
        pointer.write_text(final.name + "\n")
        fsync(pointer)
        pointer.rename(self.root / "latest")
        fsync(self.root)
        self._prune(keep)
        return final

    def load_latest(self) -> Checkpoint | None:
        """The newest checkpoint that loads completely; None if there is none at all."""
        candidates = self._complete_dirs()
        latest = self.root / "latest"
        if latest.exists():
            name = latest.read_text().strip()
            candidates.sort(key=lambda p: (p.name != name, -int(STEP_DIR.match(p.name).group(1))))
        for path in candidates:
            try:
                return self.load(path)
            except CheckpointError as e:
                log.error("refusing checkpoint %s: %s; trying the one before it", path, e)
        return None

    def load(self, path: Path) -> Checkpoint:
        missing = [n for n in FILES if not (path / n).is_file()]
        if missing:
            raise CheckpointError(f"missing {', '.join(missing)}")
        try:
            info = json.loads((path / "trainer.json").read_text())
            model = load_file(path / "model.safetensors")
            opt = optimizer_from_flat(load_file(path / "optimizer.safetensors"), info.pop("optimizer"))
            tensors = load_file(path / "state.safetensors")
        except (SafetensorError, OSError, ValueError, KeyError) as e:
            raise CheckpointError(f"unreadable ({type(e).__name__}: {e})") from None
        return Checkpoint(int(info.pop("step")), model, opt, tensors, info, path)

    def _complete_dirs(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted((p for p in self.root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)),
                      key=lambda p: p.name, reverse=True)

    def _prune(self, keep: int) -> None:
        for old in self._complete_dirs()[keep:]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in self.root.glob(".tmp-step-*"):
            if not stale.name.endswith(f"-{os.getpid()}"):
                shutil.rmtree(stale, ignore_errors=True)



def export_checkpoint(ckpt_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """`dflash-ring export`: a training checkpoint (a step dir, or a checkpoint root) -> HF DFlash dir."""
    from dflash_ring.common.drafter_config import DrafterConfig
    from dflash_ring.consumer.export import export_drafter
    from dflash_ring.consumer.model import build_drafter

    path = Path(ckpt_path)
    store = CheckpointStore(path.parent if STEP_DIR.match(path.name) else path)
    ckpt = store.load(path) if STEP_DIR.match(path.name) else store.load_latest()
    if ckpt is None:
        raise CheckpointError(f"no complete checkpoint under {path}")
    drafter = DrafterConfig(**ckpt.info["drafter"])
    model = build_drafter(drafter, ckpt.info["target_config"])
    model.load_state_dict(ckpt.model)
    return export_drafter(model, drafter, ckpt.info["target_config"], out_dir)
