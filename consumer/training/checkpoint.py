"""Atomic, pickle-free training checkpoints.

    checkpoint_dir/
      step-00000200/  model.safetensors  optimizer.safetensors  state.safetensors  trainer.json  manifest.json
      step-00000400/  ...
      latest          -> "step-00000400" (a file, replaced by rename)

A checkpoint is written into a temporary directory, every file fsync'ed, then
renamed into place; only then does `latest` move. Resume tries the one `latest`
names, then the others newest first (common/lifecycle/checkpoint_choice.py, the rule the
journal is sealed by too), and refuses a partial one, falling back to the one
before it (a crash mid-save, or a truncated file, costs one interval, never the run).

manifest.json, written last inside the temporary directory (so the rename publishes it with the
files), holds the sha256 of every 64 MiB chunk of every other file: load refuses a checkpoint whose bytes
changed since (a flipped bit in tensor data loads fine as safetensors and trains or exports NaNs). Chunks,
not whole files, so that all cores hash at once: a restarted 8B-shaped drafter verifies its 12.6 GB in
about a second instead of spending ~8 s on one core before it can train. Manifests of whole-file digests
(earlier versions) still verify; checkpoints written before manifests existed load unverified, with a
warning.

`save` is the one writer, whether the drafter calls it in its step or a background thread calls it on a
host snapshot (consumer/training/async_checkpoint.py): the files are the same either way.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from dflash_ring.common.lifecycle.checkpoint_choice import (
    POINTER,
    STEP_DIR,
    complete_dirs,
    pointer_name,
    resume_order,
    step_of,
)
from dflash_ring.common.crash_points import crash_point
from dflash_ring.common.damaged_file import keep_aside
from dflash_ring.common.durable import fsync
from dflash_ring.common.lifecycle.diverged import Diverged
from dflash_ring.consumer.training.nonfinite import first_non_finite

log = logging.getLogger(__name__)

FILES = ("model.safetensors", "optimizer.safetensors", "state.safetensors", "trainer.json")
MANIFEST = "manifest.json"
CHUNK_BYTES = 64 << 20


class CheckpointError(RuntimeError):
    """A checkpoint directory that cannot be loaded completely."""


class NonFiniteCheckpoint(Diverged, CheckpointError):
    """A state to save whose weights or optimizer moments hold NaN or inf: written, it would be `latest`, and every
    resume and export would carry them. Refused before anything is written; the drafter ends as diverged."""


@dataclass
class Checkpoint:
    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    tensors: dict[str, torch.Tensor]  # RNG states and other tensors of the trainer
    info: dict[str, Any] = field(default_factory=dict)  # JSON: schedule, high-water marks, configs
    path: Path | None = None


def optimizer_to_flat(state_dict: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """torch optimizer state -> (tensors for safetensors, JSON-able rest). The tensors stay where they are
    (a snapshot copies them to host memory itself)."""
    tensors, scalars = {}, {}
    for idx, per_param in state_dict["state"].items():
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{idx}.{key}"] = value.detach()
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

    def save(self, ckpt: Checkpoint, keep: int, on_latest: Callable[[Path], None] | None = None) -> Path:
        """Write `ckpt` and make it `latest`; `on_latest` runs right after `latest` moved, before older checkpoints
        are pruned (what depends on which checkpoint is latest, the journal and the ledger, follows at once). A state
        that is not finite is refused (NonFiniteCheckpoint) before anything is written."""
        opt_tensors, opt_rest = optimizer_to_flat(ckpt.optimizer)
        if bad := first_non_finite(ckpt.model) or first_non_finite(opt_tensors):
            name, what = bad
            where = "" if name in ckpt.model else "optimizer moment "
            raise NonFiniteCheckpoint(
                f"refusing to write checkpoint step-{ckpt.step:08d} under {self.root}: {where}{name} holds {what}: "
                "the drafter's training has diverged, and the latest checkpoint stays the one to resume and export "
                "from. Lower train.lr or train.weight_decay, or check the data and the target, then restart it"
            )
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"step-{ckpt.step:08d}"
        tmp = self.root / f".tmp-step-{ckpt.step:08d}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        save_file({k: v.detach().cpu().contiguous() for k, v in ckpt.model.items()}, tmp / "model.safetensors")
        save_file({k: v.cpu().contiguous() for k, v in opt_tensors.items()}, tmp / "optimizer.safetensors")
        save_file({k: v.cpu().contiguous() for k, v in ckpt.tensors.items()}, tmp / "state.safetensors")
        info = dict(ckpt.info, step=ckpt.step, optimizer=opt_rest)
        (tmp / "trainer.json").write_text(json.dumps(info, indent=1))
        for name in FILES:
            fsync(tmp / name)
        crash_point("checkpoint.written")  # every file synced, nothing published: the previous checkpoint stands
        (tmp / MANIFEST).write_text(
            json.dumps(
                {"chunk_bytes": CHUNK_BYTES, "sha256_chunks": _chunk_digests([tmp / n for n in FILES])}, indent=1
            )
        )
        fsync(tmp / MANIFEST)
        fsync(tmp)
        if final.exists():  # a checkpoint of the same step from before a crash: replace it
            shutil.rmtree(final)
        tmp.rename(final)
        fsync(self.root)
        crash_point("checkpoint.renamed")  # complete, `latest` not moved yet: the pointer still decides the resume
        pointer = self.root / ".latest.tmp"
        pointer.write_text(final.name + "\n")
        fsync(pointer)
        pointer.rename(self.root / POINTER)
        fsync(self.root)
        crash_point("checkpoint.latest")  # the one to resume from; the journal and the ledger not told yet
        if on_latest is not None:
            on_latest(final)
        self._prune(keep)
        return final

    def load_latest(self, fall_back: bool = True, device: torch.device | str = "cpu") -> Checkpoint | None:
        """The newest checkpoint that loads completely; None if there is none at all. With checkpoints and every one
        refused, a CheckpointError: a drafter resumed from none would go on from its initial weights, every batch it
        trained before in no model (and its journal holds only what came after its checkpoints).

        fall_back=False (export): a refused latest checkpoint is an error, not silently an older one.
        device: where the weights and optimizer moments go (a resuming drafter: its GPU, without a host copy).
        """
        self._latest_name()  # a damaged pointer is kept aside first
        candidates = resume_order(self.root)
        refused: list[tuple[Path, CheckpointError]] = []
        for path in candidates:
            try:
                ckpt = self.load(path, device)
            except CheckpointError as e:
                if not fall_back:
                    raise CheckpointError(
                        f"latest checkpoint {path} refused: {e}. To use an earlier one, name "
                        f"its directory (e.g. {candidates[1]})"
                        if len(candidates) > 1
                        else f"checkpoint {path} refused: {e}"
                    ) from None
                refused.append((path, e))
                continue
            for bad, why in refused:  # said once one loads: with none, the refusal below is the one line
                log.error("refusing checkpoint %s: %s; %s is used", bad, why, path.name)
            return ckpt
        if refused:
            raise CheckpointError(
                f"every checkpoint under {self.root} is refused ({', '.join(p.name for p, _ in refused)}; "
                f"{refused[0][0].name}: {refused[0][1]}): resumed from none, this drafter would go on from its "
                "initial weights and what it trained so far would be in no model. Restore a checkpoint there, or "
                f"move {self.root} aside to train this drafter again from the start"
            )
        return None

    def load(self, path: Path, device: torch.device | str = "cpu") -> Checkpoint:
        missing = [n for n in FILES if not (path / n).is_file()]
        if missing:
            raise CheckpointError(f"missing {', '.join(missing)}")
        # Verified while it loads (the digests on their threads, the copies onto the device on this one: both read the
        # page cache and release the GIL), and returned only once verified: a restart does not wait for the hashing
        # of 12.6 GB before its first copy. What a failed check loaded is dropped unused.
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="verify") as pool:
            verified = pool.submit(self._verify, path)
            try:
                info = json.loads((path / "trainer.json").read_text())
                model = load_file(path / "model.safetensors", device=str(device))
                opt = optimizer_from_flat(
                    load_file(path / "optimizer.safetensors", device=str(device)), info.pop("optimizer")
                )
                tensors = load_file(path / "state.safetensors")  # RNG states: host tensors by torch's contract
            except (SafetensorError, OSError, ValueError, KeyError) as e:
                verified.result()  # a corrupted file is named as such, before what its bytes made of the parse
                raise CheckpointError(f"unreadable ({type(e).__name__}: {e})") from None
            verified.result()
        return Checkpoint(int(info.pop("step")), model, opt, tensors, info, path)

    @staticmethod
    def _verify(path: Path) -> None:
        """Every file against the digests in the manifest written with it; no manifest: an older checkpoint."""
        try:
            manifest = json.loads((path / MANIFEST).read_text())
            chunked = "sha256_chunks" in manifest
            digests = manifest["sha256_chunks"] if chunked else manifest["sha256"]
            if chunked and manifest["chunk_bytes"] != CHUNK_BYTES:
                raise ValueError(f"chunk_bytes {manifest['chunk_bytes']}, this version hashes {CHUNK_BYTES}")
        except FileNotFoundError:
            log.warning("checkpoint %s has no %s (written before checksums): loading it unverified", path, MANIFEST)
            return
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"unreadable {MANIFEST} ({type(e).__name__}: {e})") from None
        actual = _chunk_digests([path / n for n in FILES]) if chunked else {n: _sha256(path / n) for n in FILES}
        for name in FILES:
            if not isinstance(digests, dict) or digests.get(name) != actual[name]:
                raise CheckpointError(
                    f"{path / name} does not match the sha256 in its {MANIFEST}: the file is corrupted"
                )

    def contents(self) -> tuple[str, tuple[str, ...]]:
        """What `load_latest` chooses from (the `latest` pointer, the complete checkpoints): it differs after any
        save or prune, so a process that loaded before another wrote here knows to load again."""
        return self._latest_name(), tuple(p.name for p in self._complete_dirs())

    def _latest_name(self) -> str:
        """The checkpoint the `latest` pointer names ("" without one). It only orders the candidates
        (common/lifecycle/checkpoint_choice.py: each is verified, and the complete directories are what there is), so a
        damaged pointer (not ASCII, not a checkpoint's name) is kept aside with a warning and the newest complete
        checkpoint comes first; the next save writes it again."""
        name = pointer_name(self.root)
        if name == "":
            keep_aside(
                self.root / POINTER, "it names no checkpoint directory (step-NNNNNNNN); the newest complete one is used"
            )
        return name or ""

    def oldest_step(self, keep: int) -> int:
        """The step of the oldest of the `keep` newest checkpoints (0 without one): what the journal must still
        hold is after it (a resume may fall back to any of them)."""
        dirs = self._complete_dirs()[:keep]
        return step_of(dirs[-1]) if dirs else 0

    def _complete_dirs(self) -> list[Path]:
        return complete_dirs(self.root)

    def _prune(self, keep: int) -> None:
        for old in self._complete_dirs()[keep:]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in self.root.glob(".tmp-step-*"):
            if not stale.name.endswith(f"-{os.getpid()}"):
                shutil.rmtree(stale, ignore_errors=True)


def check_same_shape(ckpt: Checkpoint, model: torch.nn.Module, drafter: dict[str, Any]) -> None:
    """Before a resume: a checkpoint of another drafter shape (e.g. layer count) is refused by field name, one of
    another architecture (DSpark into DFlash, or the reverse) by naming both."""
    saved = ckpt.info.get("drafter") or {}
    theirs_arch, my_arch = saved.get("arch", "dflash"), drafter.get("arch", "dflash")  # absent: before DSpark
    if theirs_arch != my_arch:
        raise CheckpointError(
            f"checkpoint {ckpt.path} holds a drafter of arch = {theirs_arch!r}, this run trains "
            f"arch = {my_arch!r}: resume it with arch = {theirs_arch!r}, or move {ckpt.path.parent} "
            "away to start afresh"
        )
    mine = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    theirs = {k: tuple(v.shape) for k, v in ckpt.model.items()}
    if mine == theirs:
        return
    diffs = [
        f"drafter.{k} = {saved[k]!r} there, {v!r} here" for k, v in drafter.items() if k in saved and saved[k] != v
    ]
    if not diffs:
        name = next(k for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k))
        diffs = [f"tensor {name} is {theirs.get(name, 'absent')} there, {mine.get(name, 'absent')} here"]
    raise CheckpointError(
        f"checkpoint {ckpt.path} holds a drafter of another shape ({'; '.join(diffs)}): resume "
        f"with the settings it was trained with, or move {ckpt.path.parent} away to start afresh"
    )


def _chunk_digests(paths: list[Path]) -> dict[str, list[str]]:
    """sha256 of each CHUNK_BYTES of each file, on a thread per core (pread and hashlib release the GIL)."""

    def digest(path: Path, offset: int) -> str:
        fd = os.open(path, os.O_RDONLY)
        try:
            return hashlib.sha256(os.pread(fd, CHUNK_BYTES, offset)).hexdigest()
        finally:
            os.close(fd)

    jobs = {p: range(0, max(p.stat().st_size, 1), CHUNK_BYTES) for p in paths}
    with ThreadPoolExecutor(max_workers=min(32, os.cpu_count() or 1)) as pool:
        futures = {p: [pool.submit(digest, p, offset) for offset in offsets] for p, offsets in jobs.items()}
        return {p.name: [f.result() for f in fs] for p, fs in futures.items()}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def export_checkpoint(
    ckpt_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    target: str | os.PathLike | None = None,
    layout: str = "native",
) -> Path:
    """`dflash-ring export`: a training checkpoint (a step dir, or a checkpoint root) -> an HF drafter dir, in the
    layout of its arch (DFlash, or DeepSeek's flat DSpark layout), or with layout "speculators" in vLLM
    speculators' layout of it (EAGLE-3's; consumer/layouts/export.py refuses the others in one line).

    A DSpark export ships the target's embed_tokens and lm_head: they are read from `target` (a model directory),
    else from the target.path the run recorded in the checkpoint; with neither, or where that directory holds no
    head of the trained shapes, the export is refused in one line. A speculators-layout export names the target as
    its verifier: `target` as given (a directory or a hub id, as `vllm serve` will find it), else that recorded
    path."""
    from dflash_ring.common.config.drafter import DrafterConfig
    from dflash_ring.consumer.layouts.export import export_drafter
    from dflash_ring.consumer.families import family
    from dflash_ring.consumer.families.build import build_drafter
    from dflash_ring.consumer.modeling.target_head import HeadSpec

    path = Path(ckpt_path)
    what_to_give = "give a drafter's checkpoint directory (train.checkpoint_dir/drafter-N) or one of its step-N dirs"
    if not path.is_dir():  # a file or a FIFO was an errno line about its 'latest', naming no fix
        raise CheckpointError(f"{path} {'is not a directory' if path.exists() else 'does not exist'}: {what_to_give}")
    store = CheckpointStore(path.parent if STEP_DIR.match(path.name) else path)
    ckpt = store.load(path) if STEP_DIR.match(path.name) else store.load_latest(fall_back=False)
    if ckpt is None:
        raise CheckpointError(f"no complete checkpoint under {path}: {what_to_give}")
    drafter = DrafterConfig(**ckpt.info["drafter"])
    model = build_drafter(drafter, ckpt.info["target_config"])
    model.load_state_dict(ckpt.model)
    head = ckpt.info.get("target_head")  # what the head probe derived (checkpoints before it: none recorded)
    spec = None if head is None else HeadSpec.from_json(head)
    frozen = None
    if family(drafter.arch).head_tensors:
        frozen = _checkpoint_target_head(ckpt, target, spec)
    verifier = str(target) if target is not None else ckpt.info.get("target_path")
    return export_drafter(
        model,
        drafter,
        ckpt.info["target_config"],
        out_dir,
        head_spec=spec,
        head=frozen,
        layout=layout,
        verifier=verifier,
    )


def _checkpoint_target_head(ckpt: Checkpoint, target: str | os.PathLike | None, spec):
    """The target's embedding and lm_head for a DSpark checkpoint's export, as stored (no head probe: the transforms
    are the ones the checkpoint recorded), checked against the shapes the drafter trained with."""
    from dflash_ring.common.config.drafter import target_text_config
    from dflash_ring.common.config.target import TargetConfigError
    from dflash_ring.consumer.modeling.target_head import (
        FrozenTargetHead,
        HeadSpec,
        config_tied,
        head_tensor_keys,
        read_head,
    )

    recorded = ckpt.info.get("target_path")
    where = target if target is not None else recorded
    if not where:
        raise CheckpointError(
            f"checkpoint {ckpt.path} holds a DSpark drafter, whose export ships the target's "
            "embed_tokens and lm_head, and records no target path (written before it was "
            "recorded): pass the target model directory (dflash-ring export --target DIR)"
        )
    root = Path(where).expanduser()
    origin = "--target" if target is not None else "the target path recorded in the checkpoint"
    try:
        files, embed_key, lm_head_key = head_tensor_keys(root)
        embed, lm_head = read_head(root, files, embed_key, lm_head_key, config_tied(root))
    except (OSError, KeyError, ValueError, TargetConfigError) as e:
        raise CheckpointError(
            f"the DSpark export ships the target's embed_tokens and lm_head, but {root} ({origin}) "
            f"gives none: {' '.join(str(e).split())}; pass the target model directory "
            "(dflash-ring export --target DIR)"
        ) from None
    text = target_text_config(ckpt.info["target_config"])
    want = (int(text["vocab_size"]), int(text["hidden_size"]))
    for name, weight in (("embedding", embed), ("lm_head", lm_head)):
        if weight is not None and tuple(weight.shape) != want:
            raise CheckpointError(
                f"{root} ({origin}) is not the target this drafter trained with: its {name} is "
                f"{tuple(weight.shape)}, the checkpoint's target has [vocab, hidden] = {list(want)}"
            )
    if spec is not None and spec.tied != (lm_head is None):
        raise CheckpointError(
            f"{root} ({origin}) is not the target this drafter trained with: its lm_head is "
            f"{'tied' if lm_head is None else 'untied'}, the checkpoint's target head "
            f"{'tied' if spec.tied else 'untied'}"
        )
    return FrozenTargetHead(embed, lm_head, spec=spec or HeadSpec(tied=lm_head is None))
