"""An EAGLE-3 run's reduced draft vocabulary from its own training data: `dflash-ring draft-vocab` counts the
loss-masked tokens of the training rows as the producers tokenize them (the held-out rows left out) and writes
speculators' maps of those counts; drafter.draft_vocab names the file, a fresh drafter trains with its maps, the
file's sha256 is part of the drafter's fingerprint, and a file that does not fit is refused in one line."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_ring.cli import main
from dflash_ring.common.config.drafter import DrafterConfig
from dflash_ring.common.config.schema import ConfigError, drafter_target_settings
from dflash_ring.common.target_geometry import target_geometry
from dflash_ring.consumer.training.process import build
from dflash_ring.consumer.training.trainer import DeviceBatch
from dflash_ring.producer.batching import split_sources
from dflash_ring.producer.pretokenized import load_sources, target_tokenizer
from support import build_target, load_tokenizer, one_thread, override, run_config, write_chat_rows  # noqa: F401
from test_peer_conformance import oracle

DRAFT_VOCAB, LAYERS, HIDDEN = 24, 8, 64


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny target, chat rows with a quarter held out, and an EAGLE-3 config naming the file the command writes."""
    tmp = tmp_path_factory.mktemp("vocab")
    target = build_target(tmp / "target", "qwen3", layers=LAYERS, hidden=HIDDEN)
    settings = {
        "data": {
            "path": str(write_chat_rows(tmp / "chat.jsonl", 40)),
            "max_length": 128,
            "cache_dir": str(tmp / "cache"),
            "eval_fraction": 0.25,
        },
        "target": {
            "path": str(target),
            "mask_token_id": len(load_tokenizer(target)),
            "device": "cpu",
            "layer_ids": [1, 3, 4],  # low, middle and high of 8 layers (EAGLE-3 reads three)
        },
        "drafter": {
            "recipe": "eagle3",
            "ttt_steps": 3,
            "block_size": 4,
            "num_anchors": 8,
            "draft_vocab_size": DRAFT_VOCAB,
            "draft_vocab": str(tmp / "vocab.safetensors"),
        },
    }
    return tmp, settings


def sets(settings) -> list[str]:
    return [a for s, keys in settings.items() for k, v in keys.items() for a in ("--set", override(s, k, v))]


def test_the_command_writes_speculators_maps_of_the_training_rows_counts(run, capsys):
    tmp, settings = run
    assert main(["draft-vocab", *sets(settings)]) == 0
    line = capsys.readouterr().out.strip()
    path = tmp / "vocab.safetensors"
    assert line.startswith(f"wrote {path}: {DRAFT_VOCAB} of ") and "% of " in line and "\n" not in line
    # The expected counts, row by row, from the producers' own tokenization: the training rows' loss-masked tokens.
    cfg = run_config(settings)
    geometry = target_geometry(cfg.target)
    sources = load_sources(cfg.data, target_tokenizer(cfg.target), reserved_token=cfg.target.mask_token_id)
    (held,) = split_sources(sources, cfg.data.eval_fraction, cfg.data.seed)
    data = sources[0].data
    assert 0 < held.sum() < len(held)
    counts = Counter()
    for row in np.flatnonzero(~held):
        span = slice(data.offsets[row], data.offsets[row + 1])
        counts.update(int(t) for t in np.asarray(data.tokens[span])[np.asarray(data.loss_mask[span]).astype(bool)])
    maps = load_file(path)
    want = torch.zeros(geometry.vocab_size, dtype=torch.long)
    want[list(counts)] = torch.tensor(list(counts.values()))
    assert torch.equal(maps["counts"], want)
    builder = oracle("speculators.train.vocab_mapping", "speculators").build_vocab_mappings_from_distribution
    d2t, t2d = builder(dict(counts), DRAFT_VOCAB, geometry.vocab_size)
    assert torch.equal(maps["d2t"], d2t) and torch.equal(maps["t2d"], t2d)
    coverage = int(want[t2d].sum()) / int(want.sum())
    assert f"covering {coverage:.2%} of {int(want.sum())} loss-masked training tokens" in line
    with open(path, "rb") as f:
        meta = json.loads(f.read(int.from_bytes(f.read(8), "little")))["__metadata__"]
    assert meta["vocab_size"] == str(geometry.vocab_size) and meta["draft_vocab_size"] == str(DRAFT_VOCAB)
    assert len(meta["data_plan_sha256"]) == 64


def test_a_run_config_with_the_file_trains_with_its_maps_and_fingerprints_its_digest(run, tmp_path):
    tmp, settings = run
    path = tmp / "vocab.safetensors"
    if not path.exists():
        assert main(["draft-vocab", *sets(settings)]) == 0
    cfg = run_config(settings)
    # The run's drafter as a drafter process builds it: the file checked against the target, the maps loaded.
    built = build(
        cfg.drafter, cfg.target, cfg.train, ("chat",), cfg.run.compile_cache_dir, torch.device("cpu"), tmp_path / "head"
    )
    trainer, maps = built.trainer, load_file(path)
    assert torch.equal(trainer.model.d2t, maps["d2t"]) and torch.equal(trainer.model.t2d, maps["t2d"])
    assert not torch.equal(maps["t2d"], torch.arange(maps["t2d"].numel()) < DRAFT_VOCAB)  # not the model's default
    torch.manual_seed(0)
    length = 30
    batch = DeviceBatch(
        features=torch.randn(length, 3 * HIDDEN),
        input_ids=torch.randint(0, int(maps["t2d"].numel()), (length,)),
        loss_mask=torch.ones(length, dtype=torch.bool),
        cu_seqlens=torch.tensor([0, length]),
        final_hidden=torch.randn(length, HIDDEN),
        meta={"sources": ["chat"]},
        source_ids=torch.tensor([0]),
    )
    metrics = trainer.train_step(batch, total_steps=2)
    assert torch.isfinite(torch.tensor(metrics.loss)) and trainer.step == 1
    assert torch.equal(trainer.model.d2t, maps["d2t"])  # buffers: never trained
    # The file's digest, not its path, is the drafter's: a copy elsewhere is the same model, another file is not.
    digest = "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
    assert cfg.drafter.model_fields()["draft_vocab"] == digest
    copy = tmp_path / "copy.safetensors"
    copy.write_bytes(path.read_bytes())
    assert (
        DrafterConfig(**{**_keys(cfg.drafter), "draft_vocab": str(copy)}).model_fields() == cfg.drafter.model_fields()
    )
    other = tmp_path / "other.safetensors"
    save_file({k: v for k, v in maps.items()}, other, {"vocab_size": "1"})
    assert DrafterConfig(**{**_keys(cfg.drafter), "draft_vocab": str(other)}).model_fields()["draft_vocab"] != digest


def _keys(drafter: DrafterConfig) -> dict:
    return {k: v for k, v in vars(drafter).items() if not k.startswith("_")}


def test_the_refusals_are_one_line(run, tmp_path, capsys):
    tmp, settings = run
    path = tmp / "vocab.safetensors"
    if not path.exists():
        assert main(["draft-vocab", *sets(settings)]) == 0
    base = {"recipe": "eagle3", "ttt_steps": 3, "block_size": 4, "draft_vocab_size": DRAFT_VOCAB}
    for keys, message in (
        ({}, 'set draft_vocab = "PATH" and build that file .* `dflash-ring draft-vocab --config RUN.toml`'),
        ({"draft_vocab": str(path), "draft_vocab_size": 0}, "draft_vocab_size is 0"),
        ({"draft_vocab": str(path), "init_from": "x"}, "a warm start takes its release's d2t/t2d"),
    ):
        with pytest.raises(ValueError, match=message) as e:
            DrafterConfig(**{**base, **keys})
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="draft_vocab is EAGLE-3-only; this drafter has arch = 'dflash'"):
        DrafterConfig(draft_vocab=str(path))
    cfg = run_config(settings)
    geometry = target_geometry(cfg.target)
    maps = load_file(path)
    disagreeing = tmp_path / "disagreeing.safetensors"
    t2d = maps["t2d"].clone()
    t2d[int(t2d.nonzero()[0])], t2d[int((~t2d).nonzero()[0])] = False, True
    save_file({**maps, "t2d": t2d}, disagreeing)
    (tmp_path / "dir").mkdir()
    for name, file, size, vocab, message in (
        (
            "a missing file",
            tmp_path / "none",
            DRAFT_VOCAB,
            geometry.vocab_size,
            "does not exist: build it .* draft-vocab",
        ),
        ("a directory", tmp_path / "dir", DRAFT_VOCAB, geometry.vocab_size, "is a directory, not a regular file"),
        ("another size", path, DRAFT_VOCAB + 1, geometry.vocab_size, r"needs d2t I64 \[25\]"),
        ("disagreeing maps", disagreeing, DRAFT_VOCAB, geometry.vocab_size, "the maps disagree"),
        ("another target", path, DRAFT_VOCAB, geometry.vocab_size + 8, f"the target's has {geometry.vocab_size + 8}"),
    ):
        drafter = DrafterConfig(**{**_keys(cfg.drafter), "draft_vocab": str(file), "draft_vocab_size": size})
        with pytest.raises(ConfigError, match=message) as e:
            drafter_target_settings(drafter, geometry.__class__(**{**vars(geometry), "vocab_size": vocab}))
        assert "\n" not in str(e.value), name
    # At the command line: exit 2 and one line, before any data is read.
    assert main(["draft-vocab", *sets({"drafter": {"recipe": "eagle3", "draft_vocab_size": DRAFT_VOCAB}})]) == 2
    assert "`dflash-ring draft-vocab --config RUN.toml`" in capsys.readouterr().err
    no_size = {"drafter": {"recipe": "eagle3"}}
    assert main(["draft-vocab", *sets(no_size), "--out", str(tmp_path / "x.safetensors")]) == 2
    assert "draft_vocab_size is 0" in capsys.readouterr().err
