"""DFlash2: the recipe and its refusals, the grouped dynamic causal convolution (identity at init, taps inside the
block), the mask of its sliding layers, the candidate selector's loss (gold outside the top-K excluded), its figures,
and a training step of a real drafter on a tiny target. Conformance with z-lab's model: tests/test_peer_conformance.py."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_ring.common.drafter_config import DrafterConfig
from dflash_ring.consumer.dflash2_blocks import GroupedDynamicCausalConv, grouped_dynamic_causal_conv
from dflash_ring.consumer.model import (
    DFlash2DraftModel,
    DFlashDraftModel,
    block_attention_mask,
    build_drafter,
    load_target_head,
)
from support import anchors_from_local, save_tiny_qwen3, tiny_qwen3_config

# The CPU runs flex_attention eagerly (the reference check of the GPU path): its torch.compile advice is expected.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile:UserWarning")


def test_the_dflash2_recipe_is_the_released_checkpoints_config():
    d = DrafterConfig(recipe="dflash2", mask_token_id=5)
    assert (d.arch, d.num_hidden_layers, d.block_size, d.sliding_window) == ("dflash2", 5, 8, 2048)
    assert d.layer_types == ["sliding_attention"] * 5
    assert (d.conv_kernel_size, d.conv_group_size, d.selector_rank, d.selector_top_k) == (2, 16, 256, 16)
    assert (d.selector_weight, d.loss, d.loss_gamma, d.num_anchors) == (1.0, "ce", 4.0, 512)
    assert not d.sample_from_anchor and d.drafts_per_block == 7 and not d.needs_target_logits
    assert DrafterConfig(arch="dflash2", block_size=8).selector_top_k == 16  # the arch's defaults without the recipe


@pytest.mark.parametrize("key", [{"conv_kernel_size": 2}, {"selector_rank": 8}, {"selector_top_k": 4},
                                 {"selector_weight": 0.5}, {"conv_group_size": 8}])
@pytest.mark.parametrize("other", [{}, {"recipe": "ddtree"}, {"recipe": "dspark"}])
def test_dflash2_only_keys_on_another_arch_are_refused(key, other):
    with pytest.raises(ValueError, match="DFlash2-only.*arch = 'd"):
        DrafterConfig(**other, **key)


def test_dspark_keys_on_a_dflash2_drafter_are_refused_and_dflash2_checks_its_sizes():
    with pytest.raises(ValueError, match="DSpark-only.*arch = 'dflash2'"):
        DrafterConfig(recipe="dflash2", markov_rank=8)
    with pytest.raises(ValueError, match="exceeds block_size"):
        DrafterConfig(recipe="dflash2", conv_kernel_size=9)
    with pytest.raises(ValueError, match=">= 1"):
        DrafterConfig(recipe="dflash2", selector_top_k=0)


def test_other_configs_fingerprints_are_what_they_were_before_dflash2():
    new = {"conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "selector_weight"}
    for recipe in ("paper", "ddtree", "dspark"):
        assert not new & set(DrafterConfig(recipe=recipe).model_fields())
    assert new <= set(DrafterConfig(recipe="dflash2").model_fields())


def reference_conv(x, delta, base):
    """out[n, t] = sum_o (base[o] + delta[n, t, o, group]) x[n, t - o], t - o >= 0, loops written out."""
    n, b, h = x.shape
    k, g = base.shape[0], delta.shape[-1]
    out = torch.zeros_like(x)
    for i in range(n):
        for t in range(b):
            for o in range(k):
                if t - o >= 0:
                    out[i, t] += (base[o] + delta[i, t, o].repeat_interleave(h // g)) * x[i, t - o]
    return out


def test_the_convolution_is_its_formula_and_never_taps_across_a_block():
    torch.manual_seed(0)
    x, delta, base = torch.randn(3, 5, 8), torch.randn(3, 5, 3, 2), torch.randn(3, 8)
    out = grouped_dynamic_causal_conv(x, delta, base)
    torch.testing.assert_close(out, reference_conv(x, delta, base))
    # rows of another block, or later rows of the same block, change nothing
    changed = x.clone()
    changed[1] += 10
    changed[0, 3:] += 10
    again = grouped_dynamic_causal_conv(changed, delta, base)
    torch.testing.assert_close(again[2], out[2])
    torch.testing.assert_close(again[0, :3], out[0, :3])
    assert not torch.allclose(again[0, 3:], out[0, 3:])
    # a packed drafter's layer: a block's draft depends on nothing of the block before it but through the context
    conv = GroupedDynamicCausalConv(8, 2, 4)
    torch.nn.init.normal_(conv.kernel_projection.weight)
    h, d = conv.prepare(x)
    h_changed, _ = conv.prepare(changed)
    torch.testing.assert_close(h_changed[2], h[2])


def test_the_convolution_is_the_identity_at_init():
    conv = GroupedDynamicCausalConv(16, 2, 4)
    x = torch.randn(2, 4, 16)
    h, d = conv.prepare(x)
    assert torch.equal(h, x) and torch.equal(conv.finish(x * 3, d), x * 3)


def tiny_drafter(cls_cfg: DrafterConfig, target_config):
    torch.manual_seed(3)
    model = build_drafter(cls_cfg, target_config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    save_tiny_qwen3(path, num_hidden_layers=8, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    return path, json.loads((path / "config.json").read_text()), load_target_head(path)


def packed_inputs(n_features: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    lengths = [24, 17]
    total = sum(lengths)
    return (torch.randn(total, n_features, generator=gen), torch.randint(0, 250, (total,), generator=gen),
            anchors_from_local(lengths, [[2, 11, 19], [3, 12]]))


def test_a_fresh_dflash2_drafter_drafts_what_its_dflash_backbone_does(target):
    """Identity convolutions: with the same backbone weights, DFlash2 and DFlash draft alike (full layers: there the
    two archs' masks agree)."""
    _, config, head = target
    cfg2 = DrafterConfig(arch="dflash2", num_hidden_layers=2, block_size=4, loss_gamma=2.0, mask_token_id=250,
                         conv_group_size=8, selector_rank=8, selector_top_k=4)
    model2 = tiny_drafter(cfg2, config).eval()
    model1 = DFlashDraftModel(model2.config).eval()
    missing, unexpected = model1.load_state_dict(model2.state_dict(), strict=False)
    assert not missing and all("conv" in k or "candidate_selector" in k for k in unexpected)
    context, ids, anchors = packed_inputs(2 * 64)
    with torch.no_grad():
        torch.testing.assert_close(model2(context, ids, anchors, head), model1(context, ids, anchors, head))


def test_dflash2_sliding_layers_are_bidirectional_inside_the_block_in_both_attention_paths(target):
    _, config, head = target
    mask = block_attention_mask(torch.tensor([5]), ctx_len=5, block_size=4, sliding_window=16, sliding_causal=False)
    assert mask[:, 5:].all()
    assert torch.equal(mask[:, :5], block_attention_mask(torch.tensor([5]), 5, 4, 16)[:, :5])  # the same window
    cfg = DrafterConfig(arch="dflash2", num_hidden_layers=2, block_size=4, loss_gamma=2.0, mask_token_id=250,
                        layer_types=["sliding_attention", "full_attention"], sliding_window=8, conv_group_size=8,
                        selector_rank=8, selector_top_k=4)
    model = tiny_drafter(cfg, config).eval()
    with torch.no_grad():
        for layer in model.layers:  # non-trivial convolutions
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.normal_()
                conv.kernel_projection.weight.normal_(std=0.1)
    context, ids, anchors = packed_inputs(2 * 64)
    with torch.no_grad():
        sdpa = model(context, ids, anchors, head, attention="sdpa", anchors_per_group=2)
        flex = model(context, ids, anchors, head, attention="flex")
        torch.testing.assert_close(flex, sdpa, rtol=1e-5, atol=1e-5)
        # and the mask is not the DFlash one: its causal sliding layer drafts otherwise
        model.sliding_causal = True
        assert not torch.allclose(model(context, ids, anchors, head), sdpa, atol=1e-4)
