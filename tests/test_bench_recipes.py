"""`dflash-ring bench recipes`: its table (means, spread over seeds, ratios to the same seed's baseline) and
its refusal of an unknown variant before anything is built or trained."""

from __future__ import annotations

import pytest

from dflash_ring.bench.recipes import summarize_runs
from dflash_ring.cli import main


def run(variant: str, seed: int, chain: float, tree16: float) -> dict:
    return {"variant": variant, "seed": seed, "chain_tau": chain, "tree_tau": {"16": tree16}}


def test_table_means_spreads_and_same_seed_ratios():
    runs = [run("paper", 0, 2.0, 3.0), run("dpace", 0, 2.5, 3.3), run("paper", 1, 2.2, 3.2), run("dpace", 1, 2.2, 4.0)]
    paper, dpace = summarize_runs(runs, [16])
    assert paper["variant"] == "paper" and dpace["seeds"] == [0, 1]
    assert paper["chain_tau"] == {"mean": 2.1, "spread": 0.2, "vs_baseline": 1.0}
    assert dpace["chain_tau"] == {"mean": 2.35, "spread": 0.3, "vs_baseline": pytest.approx((1.25 + 1.0) / 2)}
    assert dpace["tree_tau_16"]["vs_baseline"] == pytest.approx((1.1 + 1.25) / 2, abs=1e-3)


def test_a_seed_without_its_baseline_gets_no_ratio():
    (row,) = summarize_runs([run("ddtree", 3, 2.0, 2.5)], [16])
    assert row["chain_tau"] == {"mean": 2.0, "spread": 0.0}


def test_unknown_variant_is_refused_before_any_run(tmp_path, capsys):
    assert main(["bench", "recipes", "--workdir", str(tmp_path / "w"), "--variants", "paper,eagle3"]) == 2
    assert "unknown variants ['eagle3']" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


def test_a_variant_without_tree_verification_has_chain_figures_only():
    runs = [run("paper", 0, 2.0, 3.0), {"variant": "dspark", "seed": 0, "chain_tau": 3.0, "tree_tau": {}}]
    _, dspark = summarize_runs(runs, [16])
    assert dspark["chain_tau"] == {"mean": 3.0, "spread": 0.0, "vs_baseline": 1.5} and "tree_tau_16" not in dspark
