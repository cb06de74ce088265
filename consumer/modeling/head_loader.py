"""Loading a target's frozen head: the checkpoint's embedding and lm_head (target_head.py) with the transforms the head
probe derives (head_probe.py), kept across restarts by head_cache.py.

It sits above those three so that none of them imports another's caller: the probe needs the head's types, the
cache the spec, and only this module needs all of them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dflash_ring.common.target_loading import load_target_hf_config

from dflash_ring.consumer.modeling.head_cache import cached_entry, doubt, fingerprint, store_spec
from dflash_ring.consumer.modeling.head_probe import RECORDED_TOLERANCE, outputs_error, probe_head_recorded
from dflash_ring.consumer.modeling.target_head import FrozenTargetHead, config_tied, head_tensor_keys, read_head


def probe_target_head(target_dir: str | Path, embed: torch.Tensor | None = None, lm_head: torch.Tensor | None = None):
    """The head probe on a target directory (head_probe.py): (HeadSpec, HeadErrors), or HeadProbeError.
    `embed`/`lm_head`: the tensors, when the caller has read them already."""
    spec, errors, _ = _probe(target_dir, embed, lm_head)
    return spec, errors


def _probe(target_dir: str | Path, embed: torch.Tensor | None = None, lm_head: torch.Tensor | None = None):
    """probe_target_head, and the target's outputs the probe recorded (for the cache)."""
    root = Path(target_dir)
    if embed is None:
        files, embed_key, lm_head_key = head_tensor_keys(root)
        embed, lm_head = read_head(root, files, embed_key, lm_head_key, config_tied(root))
    config = load_target_hf_config(root)
    return probe_head_recorded(config, embed.cpu(), None if lm_head is None else lm_head.cpu(), str(root))


def load_target_head(
    target_dir: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    cache: str | Path | None = None,
) -> FrozenTargetHead:
    """Read only embed_tokens and lm_head from a target checkpoint (never the whole model), with the
    transforms the head probe derives; `cache` (a JSON file) keeps them for the next start of this target."""
    root = Path(target_dir)
    files, embed_key, lm_head_key = head_tensor_keys(root)
    key = fingerprint(root, files, [k for k in (embed_key, lm_head_key) if k is not None])
    entry = cached_entry(cache, key, untied_head=lm_head_key is not None)
    spec = None if entry is None else entry[0]
    try:
        embed, lm_head = read_head(
            root, files, embed_key, lm_head_key, spec.tied if spec else config_tied(root), device
        )
    except ValueError as e:
        if spec is None or cache is None:
            raise
        doubt(cache, f"tied=true, which the checkpoint contradicts ({e})")  # the cache, not the target
        spec = None
        embed, lm_head = read_head(root, files, embed_key, lm_head_key, config_tied(root), device)
    if spec is not None:  # checked against the target's own outputs: a digest proves integrity, not truth
        if entry[1] is None:
            doubt(cache, "holds none of the target's outputs to check its values against (written before they were)")
            spec = None
        elif not (error := outputs_error(entry[1], embed, lm_head, spec)) <= RECORDED_TOLERANCE:
            doubt(
                cache,
                f"values ({spec.describe()}) do not reproduce the target's own outputs the probe recorded "
                f"(relative error {error:.3g} > {RECORDED_TOLERANCE:g}): changed since they were written",
            )
            spec = None
    if spec is None:
        spec, errors, outputs = _probe(root, embed, lm_head)
        store_spec(cache, key, spec, errors, outputs)
    if dtype is not None:
        embed, lm_head = embed.to(dtype), None if lm_head is None else lm_head.to(dtype)
    return FrozenTargetHead(embed, lm_head, spec=spec)
