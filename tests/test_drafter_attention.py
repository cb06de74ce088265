"""The drafter's own attention geometry (drafter.num_attention_heads, num_key_value_heads, head_dim).

The released 27B-class drafters use 32 heads of 128 with 8 key/value heads beside targets of 24 x 256 with 4: the
geometry is the drafter's, since its K/V of the context come from its own projections. Here: the config's checks,
fingerprints unchanged while it is unset, every family built, trained a step, exported and read back in its own
geometry, the benches' option. z-lab's model loading and drafting such an export is in tests/test_peer_conformance.py
(the "own_heads" case).
"""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from dflash_ring.common.arguments import attention_geometry, attention_geometry_argument
from dflash_ring.common.config.drafter import DrafterConfig
from dflash_ring.common.config.load import load_config
from dflash_ring.consumer.layouts.drafter_hf_config import drafter_hf_config
from dflash_ring.consumer.layouts.export import export_drafter, load_drafter
from dflash_ring.consumer.modeling.model import load_target_head
from dflash_ring.consumer.families.build import build_drafter

from support import save_tiny_qwen3

# The tiny target: 4 heads (2 for K/V) of 16, width 64. The drafter's own: 6 heads (2 for K/V) of 12, so its query
# width (72) is neither the target's (64) nor its hidden size.
OWN = {"num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 12}
RECIPES = {"dflash": {}, "dspark": {"recipe": "dspark", "markov_rank": 8}, "dflash2": {"recipe": "dflash2"}}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    save_tiny_qwen3(path, num_hidden_layers=6)
    return path, json.loads((path / "config.json").read_text())


def drafter(arch: str, **geometry) -> DrafterConfig:
    return DrafterConfig(
        **RECIPES[arch], num_hidden_layers=2, block_size=8, num_anchors=4, mask_token_id=250, **geometry
    )


def test_unset_the_drafter_takes_the_targets_heads_and_the_fingerprint_is_unchanged(target):
    _, config = target
    cfg = drafter("dflash")
    assert not {"num_attention_heads", "num_key_value_heads", "head_dim", "init_from"} & set(cfg.model_fields())
    hf = drafter_hf_config(cfg, config)
    assert (hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]) == (4, 2, 16)


@pytest.mark.parametrize("arch", list(RECIPES))
def test_each_family_trains_exports_and_reads_back_in_its_own_geometry(arch, target, tmp_path):
    path, config = target
    cfg = drafter(arch, **OWN)
    assert {k: cfg.model_fields()[k] for k in OWN} == OWN  # part of the model: its fingerprint compares it
    hf = drafter_hf_config(cfg, config)
    assert {k: hf[k] for k in OWN} == OWN and hf["hidden_size"] == 64
    torch.manual_seed(0)
    model = build_drafter(cfg, config)
    attention = model.layers[0].self_attn
    assert attention.q_proj.weight.shape == (6 * 12, 64)
    assert attention.k_proj.weight.shape == attention.v_proj.weight.shape == (2 * 12, 64)
    assert attention.o_proj.weight.shape == (64, 6 * 12)
    head = load_target_head(path)
    out = export_drafter(model, cfg, config, tmp_path / "drafter", dtype=torch.float32, head=head)
    written = json.loads((out / "config.json").read_text())
    assert {k: written[k] for k in OWN} == OWN
    back = load_drafter(out, arch=arch)
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name


def test_a_geometry_of_the_wrong_shape_is_refused_naming_it(target):
    _, config = target
    with pytest.raises(ValueError, match="num_attention_heads 6 is not a multiple of num_key_value_heads 4"):
        DrafterConfig(num_attention_heads=6, num_key_value_heads=4)
    with pytest.raises(ValueError, match="head_dim 15 is odd"):
        DrafterConfig(head_dim=15)
    # Heads set alone meet the target's key/value heads (2 here): 5 cannot share them.
    with pytest.raises(ValueError, match=r"num_attention_heads 5 \(drafter\), num_key_value_heads 2 \(target\)"):
        drafter_hf_config(drafter("dflash", num_attention_heads=5), config)
    with pytest.raises(ValueError, match="head_dim"):
        load_config(None, ["drafter.head_dim=2048"])  # past its range: the loader checks it


def test_the_benches_take_a_geometry_and_refuse_a_bad_one_in_argparse():
    parser = argparse.ArgumentParser()
    attention_geometry_argument(parser)
    assert parser.parse_args(["--drafter-attention", "32,8,128"]).drafter_attention == (32, 8, 128)
    assert parser.parse_args([]).drafter_attention is None
    for bad in ("32,8", "32,6,128", "32,8,127", "a,b,c", "0,1,2"):
        with pytest.raises(argparse.ArgumentTypeError):
            attention_geometry(bad)
