"""`dflash-ring draft-vocab`: an EAGLE-3 drafter's reduced draft vocabulary, built from the run's own training data as
EAGLE, SpecForge and speculators build theirs (shared/reference/eagle3.md 1.3): the tokens under the loss mask of
the training rows, counted once per row (not under the mixture's weights, as the peers count their data set), the
drafter.draft_vocab_size most frequent kept (consumer/families/eagle3/vocab.py). The data is read as the producers
read it (their tokenizer, chat template, cache and reserved mask token), and the held-out rows (data.eval_fraction,
eval sources) are left out, so the maps never see what the held-out evaluation measures.

The file is a safetensors file (no pickle) of d2t, t2d and the counts, with metadata naming the target's vocabulary
size, the draft vocabulary's and a digest of the data plan, so a file built for other data can be told apart;
drafter.draft_vocab names it, and its sha256 joins the run's fingerprint."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save

from dflash_ring.common.bounded_read import check_output
from dflash_ring.common.chat_encoding import mask_token_refusal
from dflash_ring.common.config.schema import Config, ConfigError
from dflash_ring.common.config.target import TargetConfigError
from dflash_ring.common.durable import fsync
from dflash_ring.common.target_geometry import target_geometry
from dflash_ring.consumer.families.eagle3.vocab import vocab_mapping
from dflash_ring.producer.batching import split_sources
from dflash_ring.producer.pretokenized import SourceData, load_sources, target_tokenizer

_CHUNK_TOKENS = 1 << 24  # tokens counted at once: memory stays flat on large data sets


def training_token_counts(sources: Sequence[SourceData], held: Sequence[np.ndarray], vocab_size: int) -> np.ndarray:
    """[vocab_size] int64: each token's occurrences under the loss mask of the rows not held out."""
    counts = np.zeros(vocab_size, np.int64)
    for source, out in zip(sources, held, strict=True):
        data, offsets = source.data, np.asarray(source.data.offsets)
        i = 0
        while i < len(data):
            j = min(len(data), max(i + 1, int(np.searchsorted(offsets, offsets[i] + _CHUNK_TOKENS, "right")) - 1))
            span = slice(offsets[i], offsets[j])
            trained = np.asarray(data.loss_mask[span]).astype(bool) & np.repeat(~out[i:j], np.diff(offsets[i : j + 1]))
            counts += np.bincount(np.asarray(data.tokens[span])[trained], minlength=vocab_size)[:vocab_size]
            i = j
    return counts


def data_plan_digest(cfg: Config, sources: Sequence[SourceData]) -> str:
    """What fixes the counted rows: each source's tokenized data (its cache key: data, tokenizer, template, length),
    name and eval flag, and the held-out split."""
    plan = {
        "sources": [[s.name, s.data.directory.name, s.eval] for s in sources],
        "eval_fraction": cfg.data.eval_fraction,
        "seed": cfg.data.seed,
    }
    return hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()


def build_draft_vocab(cfg: Config, out: str | None) -> str:
    """Write the draft vocabulary's file to `out` (default: drafter.draft_vocab); the line saying what it wrote."""
    draft_vocab_size = cfg.drafter.draft_vocab_size
    path = out or cfg.drafter.draft_vocab
    if not draft_vocab_size:
        raise ConfigError(
            "drafter.draft_vocab_size is 0 (the target's whole vocabulary): set the draft vocabulary's size (EAGLE "
            "and SpecForge use 32000) to build its maps"
        )
    if not path:
        raise ConfigError('no file to write: give --out PATH, or set drafter.draft_vocab = "PATH"')
    check_output(path, ConfigError, "--out" if out else "drafter.draft_vocab")  # before the data is read
    geometry = target_geometry(cfg.target)
    tokenizer = target_tokenizer(cfg.target)
    mask = cfg.drafter.mask_token_id if cfg.drafter.mask_token_id is not None else cfg.target.mask_token_id
    if mask is not None and (why := mask_token_refusal(tokenizer, mask, geometry.vocab_size)):
        raise TargetConfigError(why)
    if draft_vocab_size > geometry.vocab_size:
        raise ConfigError(
            f"drafter.draft_vocab_size {draft_vocab_size} exceeds the target's vocabulary of {geometry.vocab_size}"
        )
    sources = load_sources(cfg.data, tokenizer, reserved_token=mask)  # the producers' tokenization and cache
    counts = torch.from_numpy(
        training_token_counts(
            sources, split_sources(sources, cfg.data.eval_fraction, cfg.data.seed), geometry.vocab_size
        )
    )
    d2t, t2d = vocab_mapping(counts, draft_vocab_size)
    metadata = {
        "vocab_size": str(geometry.vocab_size),
        "draft_vocab_size": str(draft_vocab_size),
        "data_plan_sha256": data_plan_digest(cfg, sources),
    }
    blob = save({"d2t": d2t, "t2d": t2d, "counts": counts}, metadata)
    temp = Path(f"{path}.tmp-{os.getpid()}")
    try:
        with open(temp, "wb") as f:
            f.write(blob)
        fsync(temp)
        os.replace(temp, path)
        fsync(Path(path).parent)
    finally:
        temp.unlink(missing_ok=True)
    total = int(counts.sum())
    coverage = int(counts[t2d].sum()) / total if total else 0.0
    return (
        f"wrote {path}: {draft_vocab_size} of {geometry.vocab_size} tokens, covering {coverage:.2%} of "
        f"{total} loss-masked training tokens (sha256 {hashlib.sha256(blob).hexdigest()[:16]})"
    )
