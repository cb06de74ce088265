"""`dflash-ring bench quality`'s own arithmetic and picture, on runs of known figures (the bench's training and
evaluation are the real run's, `dflash-ring real`, tested in tests/test_real_model.py and by the commands in
docs/quality.md): tau's mean and spread over seeds per recipe, set and temperature; the held-out curve read from a
drafter's record file; the picture drawn; an unknown recipe refused before anything is built."""

from __future__ import annotations

import json

import pytest

from dflash_ring.bench.quality import UnknownRecipe, _heldout_curve, _trained_tokens, draw, run_quality_bench, summarize


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
    with pytest.raises(UnknownRecipe, match="unknown recipes \\['eagle'\\]; known: paper, ddtree, dspark, dflash2"):
        run_quality_bench(tmp_path, recipes=["paper", "eagle"])
    assert not list(tmp_path.iterdir())
