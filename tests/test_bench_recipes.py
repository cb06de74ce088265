"""`dflash-ring bench recipes`: its table (means, spread over seeds, ratios to the same seed's baseline) and
its refusal of an unknown variant before anything is built or trained."""

from __future__ import annotations

import pytest

from dflash_ring.bench.recipes import NO_TREE, VARIANTS, summarize_runs
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


def test_seeds_that_are_not_integers_are_argparse_s_refusal(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "recipes", "--workdir", str(tmp_path / "w"), "--seeds", "0,x"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    says = "dflash-ring bench recipes: error: argument --seeds: takes comma-separated integers, got '0,x'"
    assert e.value.code == 2 and last == says, last
    assert not (tmp_path / "w").exists()


def test_a_variant_without_tree_verification_has_chain_figures_only():
    runs = [run("paper", 0, 2.0, 3.0), {"variant": "dspark", "seed": 0, "chain_tau": 3.0, "tree_tau": {}}]
    _, dspark = summarize_runs(runs, [16])
    assert dspark["chain_tau"] == {"mean": 3.0, "spread": 0.0, "vs_baseline": 1.5} and "tree_tau_16" not in dspark


def test_the_embedded_default_trains_the_dflash2_variant(tmp_path):
    """The dflash2 variant's overrides on the embedded config (as `bench recipes` writes it, without building the
    tiny target): a valid DFlash2 drafter of the embedded geometry, whose sliding window is wider than the tiny
    run's sequences, built at the tiny target's width; chain-verified only."""
    from dataclasses import replace

    from dflash_ring.common.config.dump import dump_toml
    from dflash_ring.common.config.load import load_config
    from dflash_ring.consumer.families.dflash2.model import DFlash2DraftModel
    from dflash_ring.consumer.families.build import build_drafter
    from dflash_ring.embedded.tiny_target import TinyTargetRecipe
    from dflash_ring.tools.launcher import embedded_run_config
    from support import tiny_qwen3_config

    path = tmp_path / "run.toml"
    path.write_text(dump_toml(embedded_run_config(tmp_path, tmp_path / "target", 700, tmp_path / "replies.jsonl")))
    cfg = load_config(path, VARIANTS["dflash2"])
    d = cfg.drafter
    assert (d.arch, d.num_hidden_layers, d.block_size, d.num_anchors) == ("dflash2", 2, 8, 48)
    assert d.layer_types == ["sliding_attention"] * 2 and d.sliding_window == 2048 > cfg.data.max_length
    assert (d.conv_kernel_size, d.conv_group_size, d.selector_rank, d.selector_top_k) == (2, 16, 256, 16)
    tiny = TinyTargetRecipe()
    target = tiny_qwen3_config(
        hidden_size=tiny.hidden_size,
        num_hidden_layers=tiny.num_hidden_layers,
        num_attention_heads=tiny.num_attention_heads,
        head_dim=tiny.hidden_size // tiny.num_attention_heads,
        vocab_size=704,
        intermediate_size=tiny.intermediate_size,
    )
    # the run gives the drafter the target's mask token and layers (target.mask_token_id, target.layer_ids)
    drafter = replace(d, mask_token_id=cfg.target.mask_token_id, target_layer_ids=cfg.target.layer_ids)
    assert isinstance(build_drafter(drafter, target), DFlash2DraftModel)
    assert "dflash2" in NO_TREE


def test_help_lists_every_variant(capsys):
    """--variants' help is derived from VARIANTS (it once listed neither dflash2 nor the bench's default list)."""
    with pytest.raises(SystemExit):
        main(["bench", "recipes", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert all(variant in text for variant in VARIANTS), text
