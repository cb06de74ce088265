"""`dflash-ring bench quality`'s own arithmetic and picture, on runs of known figures (the bench's training and
evaluation are the real run's, `dflash-ring real`, tested in tests/test_real_model.py and by the commands in
docs/quality.md): tau's mean and spread over seeds per recipe, set and temperature; the held-out curve read from a
drafter's record file; the picture drawn; an unknown recipe refused before anything is built; each recipe's run
config at each scale one its drafter and the target accept (EAGLE-3 reads three target layers, not the scale's
five)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_ring.bench.quality import (
    RECIPES,
    UnknownRecipe,
    _heldout_curve,
    _trained_tokens,
    draw,
    run_quality_bench,
    summarize,
)
from dflash_ring.common.config.drafter import DrafterConfig
from dflash_ring.common.config.schema import drafter_target_settings
from dflash_ring.tools.real_run import SCALES, run_config

# SmolLM2-135M-Instruct's shape (hidden, layers, vocabulary), the bench's target; 16 its mask token.
SMOLLM2 = (576, 30, 49152)


def _run(recipe: str, seed: int, trained: float, untrained: float | None = None) -> dict:
    rows = {"trained": {"sharegpt": trained, "gsm8k": trained + 1}, "prompt-lookup": {"sharegpt": 1.5, "gsm8k": 2.0}}
    if untrained is not None:
        rows["untrained"] = {"sharegpt": untrained, "gsm8k": untrained}
    return {"recipe": recipe, "seed": seed, "tau": {"T=0": rows}, "heldout_curve": [[0.0, 1.0], [100.0, 1.5 + seed]]}


def test_the_table_is_the_mean_and_spread_over_seeds_and_a_baseline_run_once_is_not_averaged_with_nothing():
    runs = [_run("paper", 0, 2.0, untrained=1.0), _run("paper", 1, 3.0), _run("dspark", 0, 4.0, untrained=1.0)]
    table = {(r["recipe"], r["drafter"], r["set"]): r for r in summarize(runs)}
    assert table["paper", "trained", "sharegpt"] == {
        "recipe": "paper",
        "temperature": "T=0",
        "drafter": "trained",
        "set": "sharegpt",
        "mean": 2.5,
        "spread": 1.0,
        "seeds": 2,
    }
    assert table["paper", "trained", "gsm8k"]["mean"] == 3.5
    assert table["paper", "untrained", "sharegpt"]["seeds"] == 1  # the untrained drafter ran with the first seed only
    assert table["dspark", "trained", "sharegpt"]["spread"] == 0.0


def test_the_held_out_curve_and_trained_tokens_come_from_the_record_file(tmp_path):
    tracking = tmp_path / "tracking"
    tracking.mkdir()
    held = {"sharegpt-heldout": {"blocks": 10, "accept_sum": 12.0}}
    lines = [
        {"series": "config"},
        {"series": "held-out", "item": "a", "sources": held},
        {"series": "train", "step": 5, "source/sharegpt/tokens": 300.0, "loss": 9.0},
        {"series": "held-out", "item": "b", "sources": {"sharegpt-heldout": {"blocks": 4, "accept_sum": 6.0}}},
        {"series": "train", "step": 10, "source/sharegpt/tokens": 200.0},
    ]
    (tracking / "drafter-0.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"torn')
    assert _heldout_curve(tmp_path / "checkpoints") == [[0.0, 1.2], [300.0, 1.5]]
    assert _trained_tokens(tmp_path / "checkpoints") == 500


def test_the_picture_is_drawn(tmp_path):
    runs = [_run("paper", 0, 2.0, untrained=1.0), _run("dspark", 0, 3.0, untrained=1.0)]
    draw(runs, tmp_path / "quality.png")
    assert (tmp_path / "quality.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_unknown_recipe_is_refused_before_anything_is_built(tmp_path):
    known = "paper, ddtree, dspark, dflash2, eagle3"
    with pytest.raises(UnknownRecipe, match=f"unknown recipes \\['eagle'\\]; known: {known}$"):
        run_quality_bench(tmp_path, recipes=["paper", "eagle"])
    assert not list(tmp_path.iterdir())


def _bench_config(tmp_path: Path, scale: str, recipe: str):
    """The run config the bench writes for `recipe` at `scale`, with the drafter's target settings resolved against
    SmolLM2's shape as every drafter process resolves them before building anything (a refusal raises)."""
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"hidden_size": SMOLLM2[0]}))
    cfg = run_config(SCALES[scale], model, 16, tmp_path / "replies", tmp_path / recipe, DrafterConfig(recipe=recipe))
    return cfg, drafter_target_settings(cfg.drafter, cfg.target.geometry(*SMOLLM2))


@pytest.mark.parametrize("scale", SCALES)
def test_the_eagle3_recipe_runs_at_each_scale_as_an_eagle3_drafter_of_three_target_layers(tmp_path, scale):
    cfg, (mask, layer_ids) = _bench_config(tmp_path, scale, "eagle3")
    assert (cfg.drafter.arch, cfg.drafter.num_hidden_layers, mask) == ("eagle3", 1, 16)
    assert len(layer_ids) == 3 and layer_ids == sorted(layer_ids) == cfg.target.layer_ids
    # its round is a chain of ttt_steps drafts: prompt lookup's baseline gets as many
    assert cfg.drafter.block_size == cfg.drafter.ttt_steps + 1 and cfg.drafter.drafts_per_block == 7


@pytest.mark.parametrize("scale", SCALES)
def test_every_recipe_keeps_its_own_shape_and_the_block_families_the_scale_s_layers(tmp_path, scale):
    for recipe in RECIPES:
        cfg, (_, layer_ids) = _bench_config(tmp_path, scale, recipe)
        assert cfg.drafter.recipe == recipe and cfg.drafter.recipe_note() is None
        if recipe != "eagle3":  # a block family reads the scale's layers, as `dflash-ring real` does
            assert layer_ids == list(SCALES[scale].layer_ids)
        # the ring's slots hold a full batch of the layers this drafter reads and the final hidden state
        assert cfg.ring.slot_bytes >= SCALES[scale].max_tokens_per_batch * (len(layer_ids) + 1) * SMOLLM2[0] * 4
