"""Named training recipes: what each expands to, how explicit keys win, and that a drafter trained with each
checkpoints, resumes exactly and exports in the z-lab format (a ddtree drafter with its sliding windows)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from transformers import AutoModel

from dflash_ring.common.config.dump import dump_toml
from dflash_ring.common.config.load import load_config
from dflash_ring.common.config.schema import ConfigError, Config
from dflash_ring.common.config.drafter import DrafterConfig
from dflash_ring.common.ring_spec import run_fingerprint_fields
from dflash_ring.consumer.training.checkpoint import CheckpointStore, export_checkpoint
from dflash_ring.consumer.layouts.export import load_drafter
from dflash_ring.consumer.modeling.model import load_target_head
from dflash_ring.consumer.families.build import build_drafter
from dflash_ring.common.config.train import TrainConfig
from dflash_ring.consumer.training.trainer import DeviceBatch, Trainer
from support import save_tiny_qwen3


def test_ddtree_expands_to_the_replaced_pipelines_recipe():
    d = DrafterConfig(recipe="ddtree")
    assert (d.block_size, d.num_anchors, d.loss_gamma, d.kl_weight, d.cap_weight, d.loss) == (
        32,
        1024,
        10.0,
        0.15,
        0.1,
        "ce",
    )
    assert d.layer_types == ["sliding_attention"] * 4 + ["full_attention"] and d.sliding_window == 2048
    assert d.needs_target_logits
    dpace = DrafterConfig(recipe="dpace")
    assert (dpace.loss, dpace.dpace_alpha, dpace.block_size, dpace.num_hidden_layers) == ("dpace", 0.5, 16, 5)
    assert DrafterConfig() == DrafterConfig(
        num_hidden_layers=1, block_size=16, num_anchors=512, loss="ce", kl_weight=0.0, cap_weight=0.0, label="data"
    )  # no recipe: as before


def test_explicit_keys_override_the_recipe_and_the_resolved_values_are_fingerprinted(tmp_path):
    cfg = load_config(None, ['drafter.recipe="ddtree"', "drafter.cap_weight=0.3", "drafter.num_hidden_layers=3"])
    assert cfg.drafter.cap_weight == 0.3 and cfg.drafter.kl_weight == 0.15
    assert cfg.drafter.layer_types == ["sliding_attention", "sliding_attention", "full_attention"]
    fields = run_fingerprint_fields(cfg)
    assert fields["drafter.cap_weight"] == 0.3 and fields["drafter.block_size"] == 32
    assert fields["drafter.recipe"] == "ddtree"
    # The written config says what was chosen, and reads back equal.
    text = dump_toml(cfg)
    assert 'recipe = "ddtree"' in text and "cap_weight = 0.3" in text and "block_size" not in text
    (tmp_path / "c.toml").write_text(text)
    assert load_config(tmp_path / "c.toml") == cfg


def test_a_recipe_that_loses_keys_to_the_config_says_so(tmp_path, capsys):
    """The embedded default sets block_size 8 and 48 anchors; `--set drafter.recipe=dspark` keeps them (a set key
    wins) and check-config names both values and why; a key equal to the recipe's, or none, is no note."""
    from dflash_ring.cli import main

    assert DrafterConfig(recipe="dspark").recipe_note() is None
    assert DrafterConfig(recipe="dspark", block_size=7).recipe_note() is None
    note = DrafterConfig(recipe="dspark", block_size=8, num_anchors=48).recipe_note()
    assert note == (
        "drafter.recipe 'dspark' sets block_size = 7, num_anchors = 512; this config sets block_size = 8, "
        "num_anchors = 48, which win (remove them from [drafter] to train the recipe's)"
    )
    (tmp_path / "c.toml").write_text("[drafter]\nblock_size = 8\nnum_anchors = 48\n")
    assert main(["check-config", "--config", str(tmp_path / "c.toml"), "--set", 'drafter.recipe="dspark"']) == 0
    assert f"note: {note}" in capsys.readouterr().out


def test_the_final_hidden_state_ships_exactly_when_the_objective_reads_it():
    assert load_config(None, ['drafter.recipe="ddtree"']).target.ship_final_hidden is True
    assert load_config(None, ['drafter.label="target_argmax"']).target.ship_final_hidden is True
    assert load_config(None, []).target.ship_final_hidden is False
    assert load_config(None, ["target.ship_final_hidden=true"]).target.ship_final_hidden is True
    with pytest.raises(ConfigError, match="target.ship_final_hidden = false"):
        load_config(None, ["drafter.kl_weight=0.1", "target.ship_final_hidden=false"])


@pytest.mark.parametrize(
    "override, message",
    [
        ('drafter.recipe="eagle"', "recipe 'eagle' is not one of 'paper', 'dpace', 'ddtree'"),
        ('drafter.loss="mse"', "drafter.loss = 'mse': expected one of 'ce', 'dpace'"),
        ("drafter.dpace_alpha=1.5", "drafter.dpace_alpha = 1.5: must be a finite number >= 0 and <= 1"),
        ("drafter.cap_weight=-1", "drafter.cap_weight = -1.0: must be a finite number >= 0"),
        ("drafter.kl_weight=nan", "drafter.kl_weight = nan: must be a finite number >= 0"),
        ("drafter.block_size=12", "no paper loss_gamma for block_size=12"),
    ],
)
def test_bad_objective_settings_are_refused_by_name(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert message in str(e.value)


# --- each recipe trains, resumes exactly and exports -------------------------------------------------

VOCAB, HIDDEN = 96, 64
RECIPES = {
    "paper": {"recipe": "paper"},
    "dpace": {"recipe": "dpace"},
    # ddtree's block of 32 and 2,048-token windows, shrunk so that the window binds on a 30-token context.
    "ddtree": {"recipe": "ddtree", "block_size": 8, "sliding_window": 8, "num_anchors": 16},
    "target_argmax": {"recipe": "paper", "label": "target_argmax"},
}


@pytest.fixture
def single_thread():
    """Tiny matmuls gain nothing from threads, and thread contention on a busy CI box costs 10x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    save_tiny_qwen3(path, vocab_size=VOCAB, max_position_embeddings=256, tie_word_embeddings=False)
    return path, json.loads((path / "config.json").read_text())


def batch(seed: int, final_hidden: bool) -> DeviceBatch:
    g = torch.Generator().manual_seed(seed)
    lengths = [40, 24]
    ids = torch.randint(0, 90, (sum(lengths),), generator=g)
    mask = torch.ones(sum(lengths), dtype=torch.bool)
    mask[:8] = False  # a prompt
    return DeviceBatch(
        features=torch.randn(sum(lengths), HIDDEN, generator=g),
        input_ids=ids,
        loss_mask=mask,
        cu_seqlens=torch.tensor([0, 40, 64]),
        final_hidden=torch.randn(sum(lengths), HIDDEN, generator=g) if final_hidden else None,
        meta={"producer": 0, "epoch": 0, "position": seed},
    )


def make_trainer(target, drafter: DrafterConfig, seed: int = 0) -> Trainer:
    path, target_config = target
    torch.manual_seed(seed)
    model = build_drafter(drafter, target_config)
    return Trainer(
        model,
        load_target_head(path),
        drafter,
        TrainConfig(lr=3e-3, warmup_ratio=0.0, total_steps=40, seed=seed),
        torch.device("cpu"),
    )


@pytest.mark.parametrize("name", RECIPES)
def test_each_recipe_trains_resumes_exactly_and_exports(name, target, tmp_path, single_thread):
    path, target_config = target
    drafter = DrafterConfig(mask_token_id=95, target_layer_ids=[1], **RECIPES[name])
    shipped = drafter.needs_target_logits
    trainer = make_trainer(target, drafter)
    first = [trainer.train_step(batch(0, shipped), 40) for _ in range(8)]
    assert all(math.isfinite(m.loss) for m in first) and first[-1].loss < first[0].loss, [m.loss for m in first]
    assert 1.0 <= first[-1].accept_len_prob <= drafter.block_size and first[-1].grad_norm > 0
    assert (first[-1].cap > 0) == (drafter.cap_weight > 0) or drafter.cap_weight == 0

    store = CheckpointStore(tmp_path / "ckpt")
    info = {"drafter": dataclasses.asdict(drafter), "target_config": target_config}
    store.save(trainer.state(info), keep=1)
    uninterrupted = [trainer.train_step(batch(s, shipped), 40).loss for s in range(1, 4)]
    resumed = make_trainer(target, drafter, seed=1)  # other init: everything must come from the checkpoint
    resumed.restore(store.load_latest())
    assert [resumed.train_step(batch(s, shipped), 40).loss for s in range(1, 4)] == uninterrupted

    out = export_checkpoint(tmp_path / "ckpt", tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    assert config["dflash_training"]["recipe"] == drafter.recipe
    assert config["dflash_training"]["loss"] == drafter.loss and config["dflash_training"]["label"] == drafter.label
    assert config["layer_types"] == drafter.layer_types and config["block_size"] == drafter.block_size
    head = load_target_head(path)
    ids, feats = batch(9, False).input_ids, batch(9, False).features
    trainer.model.eval()
    with torch.no_grad():
        ours = load_drafter(out, dtype=torch.float32).eval().draft_block(feats[:30], ids[:31], head)
    if name != "ddtree":
        return
    assert config["sliding_window"] == 8 and config["use_sliding_window"] is True
    remote = AutoModel.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    assert remote.config.layer_types == drafter.layer_types and remote.config.sliding_window == 8
    block = torch.full((drafter.block_size,), 95)
    block[0] = ids[30]
    with torch.no_grad():
        theirs = remote(head.embed(block)[None], feats[:30][None])[0]
        full = AutoModel.from_pretrained(
            out, trust_remote_code=True, dtype=torch.float32, layer_types=["full_attention"] * 5
        ).eval()
        unwindowed = full(head.embed(block)[None], feats[:30][None])[0]
    # Context 30 > window 8: served as full attention, the sliding layers would give other drafts.
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(unwindowed, ours, atol=1e-3)
