"""DFlash drafter: layer-id rule, parameter names, its Qwen3 blocks against transformers', frozen target head
loading, anchors and the block mask."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from transformers import Qwen3Config
from transformers.models.qwen3 import modeling_qwen3

from dflash_ring.common.config.drafter import DrafterConfig, build_target_layer_ids
from dflash_ring.common.config.target import TargetConfigError
from dflash_ring.consumer.modeling import qwen3_blocks
from dflash_ring.consumer.modeling.model import (
    FLEX_KERNEL_OPTIONS,
    FLEX_TILE,
    FrozenTargetHead,
    block_attention_mask,
    cu_seqlens_from_lengths,
    flex_kernel_options,
    flex_layout,
    load_target_head,
    sample_anchors,
)
from dflash_ring.consumer.families.build import build_drafter
from support import anchors_from_local, save_tiny_qwen3, tiny_qwen3_config

VOCAB, HIDDEN, MASK_ID = 256, 64, 255  # vocabulary and width of tiny_qwen3_config


# The CPU runs flex_attention eagerly on purpose (the reference check of the GPU path), so its
# "use torch.compile" advice is expected here.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile:UserWarning")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    save_tiny_qwen3(path)
    return path


# --- configuration -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 1e6},
        {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0},
        {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 1024},
        {
            "rope_type": "llama3",
            "rope_theta": 5e5,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
    ],
)
def test_qwen3_blocks_equal_transformers_qwen3(rope):
    """The drafter's own RMSNorm, MLP, rotate_half and RoPE frequencies (kept out of modeling_qwen3 for start-up
    time) have transformers' parameter names and give its results bit for bit."""
    config = Qwen3Config(
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        rope_parameters=rope,
    )
    torch.manual_seed(0)
    x = torch.randn(5, 64)
    for ours, theirs in (
        (qwen3_blocks.Qwen3MLP(config), modeling_qwen3.Qwen3MLP(config)),
        (qwen3_blocks.Qwen3RMSNorm(64, eps=1e-6), modeling_qwen3.Qwen3RMSNorm(64, eps=1e-6)),
    ):
        with torch.no_grad():
            for p in ours.parameters():
                p.normal_()
        theirs.load_state_dict(ours.state_dict())  # strict: the same names and shapes
        assert torch.equal(ours(x), theirs(x)), type(ours).__name__
    assert torch.equal(qwen3_blocks.rotate_half(x), modeling_qwen3.rotate_half(x))
    inv_freq, scaling = qwen3_blocks.rope_frequencies(config)
    rotary = modeling_qwen3.Qwen3RotaryEmbedding(config)
    assert torch.equal(inv_freq, rotary.inv_freq) and scaling == rotary.attention_scaling


# Every config attribute the drafter's modules read (consumer/modeling/model.py, qwen3_blocks.py, dspark_heads.py,
# dflash2_blocks.py): what model_config must give exactly as Qwen3Config does.
MODEL_READS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_hidden_layers",
    "rms_norm_eps",
    "hidden_act",
    "initializer_range",
    "layer_types",
    "sliding_window",
    "vocab_size",
    "rope_parameters",
    "dflash_config",
    "block_size",
    "mask_token_id",
    "target_layer_ids",
    "markov_head_type",
    "markov_rank",
)


@pytest.mark.parametrize("arch", ["dflash", "dspark", "dflash2"])
@pytest.mark.parametrize("rope_theta", [None, 5e5])
def test_the_drafter_is_built_without_transformers_config_class_as_with_it(arch, rope_theta):
    """A drafter process builds from model_config (no transformers import at its start: seconds of a restart on
    the H200's transformers 5.17), the export from Qwen3Config: every attribute the modules read is the same, and
    the same seed gives the same weights and the same RoPE."""
    from dflash_ring.consumer.layouts.drafter_hf_config import drafter_hf_config, model_config, qwen3_config
    from dflash_ring.consumer.families import family

    layer_types = ["sliding_attention", "full_attention"] if arch == "dflash2" else ["full_attention"] * 2
    cfg = DrafterConfig(
        arch=arch,
        num_hidden_layers=2,
        block_size=8,
        mask_token_id=MASK_ID,
        rope_theta=rope_theta,
        layer_types=layer_types,
        **({"sliding_window": 8} if arch == "dflash2" else {}),
    )
    hf = drafter_hf_config(cfg, tiny_qwen3_config().to_dict())
    light, full = model_config(hf), qwen3_config(hf)
    assert type(light).__name__ == "SimpleNamespace"
    for key in MODEL_READS:
        assert getattr(light, key, None) == getattr(full, key, None), key
    models = []
    for config in (light, full):
        torch.manual_seed(0)
        models.append(family(arch).model(config))
    ours, theirs = (m.state_dict() for m in models)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert torch.equal(qwen3_blocks.rope_frequencies(light)[0], qwen3_blocks.rope_frequencies(full)[0])


def test_a_non_default_rope_builds_through_qwen3_config():
    from dflash_ring.consumer.layouts.drafter_hf_config import drafter_hf_config, model_config

    target = tiny_qwen3_config(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}).to_dict()
    config = model_config(
        drafter_hf_config(DrafterConfig(num_hidden_layers=2, block_size=8, mask_token_id=MASK_ID), target)
    )
    assert isinstance(config, Qwen3Config) and config.rope_parameters["rope_type"] == "linear"


def test_build_target_layer_ids_matches_published_drafters():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B
    assert build_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]  # Qwen3.6-27B
    assert build_target_layer_ids(36, 1) == [18]
    assert build_target_layer_ids(4, 1) == [2]
    assert build_target_layer_ids(36, 2) == [1, 33]


def test_loss_gamma_follows_paper_rule_unless_set():
    assert DrafterConfig().loss_gamma == 7.0
    assert DrafterConfig(block_size=10).loss_gamma == 5.0
    assert DrafterConfig(block_size=8).loss_gamma == 4.0
    assert DrafterConfig(block_size=16, loss_gamma=3.0).loss_gamma == 3.0
    with pytest.raises(ValueError, match="loss_gamma"):
        DrafterConfig(block_size=4)


def test_sliding_layers_need_a_window():
    with pytest.raises(ValueError, match="sliding_window"):
        DrafterConfig(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])


# --- parameters and the frozen head ------------------------------------------------------------------


def test_parameter_names_are_the_public_ones():
    cfg = DrafterConfig(num_hidden_layers=2, block_size=4, loss_gamma=2.0, mask_token_id=MASK_ID)
    model = build_drafter(cfg, tiny_qwen3_config())
    per_layer = [
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
    ]
    expected = {f"layers.{i}.{name}" for i in range(2) for name in per_layer}
    expected |= {"fc.weight", "hidden_norm.weight", "norm.weight"}
    assert set(model.state_dict()) == expected
    assert model.fc.weight.shape == (HIDDEN, 2 * HIDDEN)  # target layers [1, 1]: n = 2 draft layers


@pytest.mark.parametrize("variant", ["untied", "tied", "sharded"])
def test_frozen_head_loads_only_embed_and_lm_head(tmp_path, variant):
    target = save_tiny_qwen3(tmp_path, tie_word_embeddings=variant == "tied", sharded=variant == "sharded")
    if variant == "sharded":
        assert (tmp_path / "model.safetensors.index.json").exists()
    head = load_target_head(tmp_path)
    assert torch.equal(head.embed_weight, target.model.embed_tokens.weight)
    assert torch.equal(head.lm_head_weight, target.lm_head.weight)
    assert not any(t.requires_grad for t in head.buffers())
    assert list(head.parameters()) == []  # nothing an optimizer could pick up
    ids = torch.tensor([3, 7])
    assert torch.equal(head.embed(ids), target.model.embed_tokens(ids))
    hidden = torch.randn(2, HIDDEN)
    torch.testing.assert_close(head.logits(hidden), target.lm_head(hidden))


def test_frozen_head_refuses_untied_checkpoint_without_lm_head(tmp_path, target_dir):
    from safetensors.torch import load_file, save_file

    tensors = load_file(target_dir / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((target_dir / "config.json").read_text())
    with pytest.raises(TargetConfigError, match="lm_head"):  # a refusal: one line at the CLI
        load_target_head(tmp_path)


# --- anchors ---------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    masks=st.lists(st.lists(st.booleans(), min_size=0, max_size=20), min_size=1, max_size=4),
    num_anchors=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_sample_anchors_picks_valid_sorted_positions_within_each_sequence(masks, num_anchors, seed):
    lengths = [len(m) for m in masks]
    loss_mask = torch.tensor([b for m in masks for b in m], dtype=torch.bool)
    cu = cu_seqlens_from_lengths(lengths)
    anchors = sample_anchors(loss_mask, cu, num_anchors, torch.Generator().manual_seed(seed))
    again = sample_anchors(loss_mask, cu, num_anchors, torch.Generator().manual_seed(seed))
    assert torch.equal(anchors.positions, again.positions)
    for i, mask in enumerate(masks):
        valid = [p for p in range(len(mask) - 1) if mask[p] and mask[p + 1]]
        picked = (anchors.positions[anchors.cu_anchors[i] : anchors.cu_anchors[i + 1]] - cu[i]).tolist()
        assert picked == sorted(set(picked))
        assert set(picked) <= set(valid)
        assert len(picked) == min(num_anchors, len(valid))


def test_sample_anchors_is_uniform_enough_to_reach_every_valid_position():
    loss_mask = torch.ones(12, dtype=torch.bool)
    cu = cu_seqlens_from_lengths([12])
    gen = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(50):
        seen |= set(sample_anchors(loss_mask, cu, 3, gen).positions.tolist())
    assert seen == set(range(11))


# --- attention mask --------------------------------------------------------------------------------


def reference_mask(anchors: list[int], ctx_len: int, block: int, window: int | None) -> torch.Tensor:
    n = len(anchors)
    mask = torch.zeros(n * block, ctx_len + n * block, dtype=torch.bool)
    for b, a in enumerate(anchors):
        for k in range(block):
            row = b * block + k
            for j in range(ctx_len):
                mask[row, j] = j < a and (window is None or a + k - j < window)
            for k2 in range(block):
                mask[row, ctx_len + b * block + k2] = window is None or k2 <= k
    return mask


@pytest.mark.parametrize("window", [None, 4])
def test_block_attention_mask_matches_reference(window):
    anchors = [0, 3, 7]
    got = block_attention_mask(torch.tensor(anchors), ctx_len=8, block_size=3, sliding_window=window)
    assert torch.equal(got, reference_mask(anchors, 8, 3, window))


LENGTHS = [24, 17]
LOCAL_ANCHORS = [[3, 9, 15], [2, 10]]


@pytest.fixture(scope="module")
def setup(target_dir):
    torch.manual_seed(1)
    cfg = DrafterConfig(num_hidden_layers=2, block_size=4, loss_gamma=2.0, mask_token_id=MASK_ID)
    target_config = json.loads((target_dir / "config.json").read_text())
    model = build_drafter(cfg, target_config).eval()
    head = load_target_head(target_dir)
    total = sum(LENGTHS)
    context = torch.randn(total, 2 * HIDDEN)
    input_ids = torch.randint(0, 250, (total,))
    return model, head, context, input_ids


def draft_logits(model, head, context, input_ids, anchors, group=64):
    attention = "flex" if group == "flex" else "sdpa"
    with torch.no_grad():
        return head.logits(
            model(
                context,
                input_ids,
                anchors,
                head,
                attention=attention,
                anchors_per_group=group if attention == "sdpa" else 64,
            )
        )


@pytest.mark.parametrize("group", [1, 2, 64, "flex"])
def test_block_sees_only_context_before_its_anchor_and_its_own_block(setup, group):
    model, head, context, input_ids = setup
    anchors = anchors_from_local(LENGTHS, LOCAL_ANCHORS)
    base = draft_logits(model, head, context, input_ids, anchors, group)
    b = 1  # sequence 0, anchor 9

    future = context.clone()
    future[9:] = torch.randn_like(future[9:])  # at/after the anchor, and all of sequence 1
    changed = draft_logits(model, head, future, input_ids, anchors, group)
    assert torch.equal(changed[b], base[b])
    assert not torch.allclose(changed[2], base[2])  # anchor 15 does see positions 9..14

    other_block = input_ids.clone()
    other_block[15] = (other_block[15] + 1) % 250  # anchor token of block 2
    changed = draft_logits(model, head, context, other_block, anchors, group)
    assert torch.equal(changed[b], base[b])
    assert not torch.allclose(changed[2], base[2])

    past = context.clone()
    past[8] += 1.0  # the last position strictly before the anchor
    changed = draft_logits(model, head, past, input_ids, anchors, group)
    assert not torch.allclose(changed[b], base[b])

    own_anchor = input_ids.clone()
    own_anchor[9] = (own_anchor[9] + 1) % 250
    changed = draft_logits(model, head, context, own_anchor, anchors, group)
    assert not torch.allclose(changed[b], base[b])


def test_packed_neighbour_does_not_affect_a_sequence(setup):
    model, head, context, input_ids = setup
    first = slice(0, LENGTHS[0])
    alone = draft_logits(
        model, head, context[first], input_ids[first], anchors_from_local(LENGTHS[:1], LOCAL_ANCHORS[:1])
    )
    # Pack the other sequence *before* it: positions must restart at each sequence.
    second = slice(LENGTHS[0], sum(LENGTHS))
    packed_context = torch.cat([context[second], context[first]])
    packed_ids = torch.cat([input_ids[second], input_ids[first]])
    packed = draft_logits(
        model, head, packed_context, packed_ids, anchors_from_local(LENGTHS[::-1], LOCAL_ANCHORS[::-1])
    )
    torch.testing.assert_close(packed[len(LOCAL_ANCHORS[1]) :], alone, rtol=1e-5, atol=1e-5)


def sliding_drafter(num_layers: int):
    torch.manual_seed(2)
    cfg = DrafterConfig(
        num_hidden_layers=num_layers,
        block_size=4,
        loss_gamma=2.0,
        mask_token_id=MASK_ID,
        target_layer_ids=[1, 2],
        layer_types=["sliding_attention"] * num_layers,
        sliding_window=6,
    )
    return build_drafter(cfg, tiny_qwen3_config()).eval()


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_sliding_layers_ignore_context_outside_the_window(target_dir, attention):
    head = load_target_head(target_dir)
    context, input_ids = torch.randn(24, 2 * HIDDEN), torch.randint(0, 250, (24,))
    anchors = anchors_from_local([24], [[15]])
    far = context.clone()
    far[:10] = torch.randn_like(far[:10])  # query anchor+k keeps keys > 15 + k - 6, i.e. >= 10
    near = context.clone()
    near[10] += 1.0

    g = "flex" if attention == "flex" else 64
    deep = sliding_drafter(2)
    base = draft_logits(deep, head, context, input_ids, anchors, g)
    assert torch.equal(draft_logits(deep, head, far, input_ids, anchors, g), base)
    assert not torch.allclose(draft_logits(deep, head, near, input_ids, anchors, g), base)

    # One layer shows the window is per query: a query at anchor+1 no longer sees key 10.
    shallow = sliding_drafter(1)
    base = draft_logits(shallow, head, context, input_ids, anchors, g)
    changed = draft_logits(shallow, head, near, input_ids, anchors, g)
    assert not torch.allclose(changed[0, 0], base[0, 0])
    assert torch.equal(changed[0, 1:], base[0, 1:])


def test_batch_without_anchors_still_backpropagates(setup):
    model, head, context, input_ids = setup
    anchors = anchors_from_local(LENGTHS, [[], []])
    out = model(context, input_ids, anchors, head)
    assert out.shape == (0, 4, HIDDEN)
    out.sum().backward()


def test_bfloat16_drafter_keeps_fp32_rope_and_tracks_fp32(setup):
    model, head, context, input_ids = setup
    anchors = anchors_from_local(LENGTHS, LOCAL_ANCHORS)
    reference = draft_logits(model, head, context, input_ids, anchors)
    half = build_drafter(
        DrafterConfig(num_hidden_layers=2, block_size=4, loss_gamma=2.0, mask_token_id=MASK_ID), tiny_qwen3_config()
    )
    half.load_state_dict(model.state_dict())
    half.to(torch.bfloat16)
    assert half._inv_freq.dtype == torch.float32
    bf16_head = FrozenTargetHead(head.embed_weight.bfloat16(), head.lm_head_weight.bfloat16())
    got = draft_logits(half, bf16_head, context.bfloat16(), input_ids, anchors)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), reference, rtol=0.1, atol=0.05)


@pytest.mark.parametrize("block_size,window", [(4, None), (10, None), (10, 13)])
def test_flex_attention_matches_grouped_sdpa(target_dir, block_size, window):
    """The GPU path (one block-sparse flex call) against the dense-mask path, over tiles of 128 rows:
    many blocks, several sequences, a block size that does not divide the tile, sliding layers.
    Forward only: flex has no CPU backward; `bench drafter` compares the gradients on the GPU."""
    torch.manual_seed(3)
    layer_types = ["full_attention", "sliding_attention"] if window else None
    cfg = DrafterConfig(
        num_hidden_layers=2,
        block_size=block_size,
        loss_gamma=2.0,
        mask_token_id=MASK_ID,
        target_layer_ids=[1, 2],
        layer_types=layer_types,
        sliding_window=window,
    )
    model = build_drafter(cfg, tiny_qwen3_config()).double()
    head = load_target_head(target_dir, dtype=torch.float64)
    lengths = [150, 61, 300]
    local = [list(range(1, 149, 5)), [0, 7, 30, 59], list(range(3, 298, 11))]
    anchors = anchors_from_local(lengths, local)
    context = torch.randn(sum(lengths), 2 * HIDDEN, dtype=torch.float64)
    input_ids = torch.randint(0, 250, (sum(lengths),))
    with torch.no_grad():
        sdpa = model(context, input_ids, anchors, head, attention="sdpa", anchors_per_group=7)
        flex = model(context, input_ids, anchors, head, attention="flex")
    torch.testing.assert_close(flex, sdpa, rtol=1e-9, atol=1e-9)


def _tiles(counts: torch.Tensor | None, indices: torch.Tensor | None, shape: tuple[int, int]) -> torch.Tensor:
    listed = torch.zeros(shape, dtype=torch.int32)
    if counts is not None:
        for q, (n, row) in enumerate(zip(counts[0, 0].tolist(), indices[0, 0].tolist())):
            for kv in row[:n]:
                listed[q, kv] += 1
    return listed


def test_flex_kernel_options_claim_whole_tiles_only_where_they_are():
    """IS_DIVISIBLE lets the compiled kernels skip their bounds checks (issue 45): it must be given only where both
    lengths are whole tiles, as flex_layout pads them; the tile sizes by head dim are kept beside it."""
    q, k = torch.empty(1, 24, 3 * FLEX_TILE, 256), torch.empty(1, 4, 5 * FLEX_TILE, 256)
    assert flex_kernel_options(q, k) == {**FLEX_KERNEL_OPTIONS[256], "IS_DIVISIBLE": True}
    assert flex_kernel_options(q, k[:, :, :-1]) == FLEX_KERNEL_OPTIONS[256]
    assert flex_kernel_options(q[:, :, :-1, :128], k[..., :128]) is None
    assert flex_kernel_options(q[..., :128], k[..., :128]) == {"IS_DIVISIBLE": True}
    assert FLEX_KERNEL_OPTIONS[256].get("IS_DIVISIBLE") is None  # the shared table is not written to


@settings(max_examples=40, deadline=None)
@given(
    block_size=st.sampled_from([4, 10, 16]),
    window=st.sampled_from([None, 13, 150, 300]),
    lengths=st.lists(st.integers(1, 400), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_flex_tile_lists_cover_the_mask_and_full_tiles_are_whole(block_size, window, lengths, seed):
    """The kernel evaluates the mask only on partial tiles and runs full tiles unmasked: every key a query
    may see must lie in a listed tile, each tile listed once, and a full tile must be allowed throughout."""
    g = torch.Generator().manual_seed(seed)
    local = [
        sorted(torch.randperm(n, generator=g)[: torch.randint(0, n + 1, (1,), generator=g).item()].tolist())
        for n in lengths
    ]
    anchors = anchors_from_local(lengths, local)
    layout = flex_layout(anchors, sum(lengths), block_size, {window})
    mask = layout.masks[window]
    q_len, kv_len = mask.seq_lengths
    allowed = mask.mask_mod(0, 0, torch.arange(q_len)[:, None], torch.arange(kv_len)[None, :])
    tiles = allowed.unflatten(0, (-1, FLEX_TILE)).unflatten(2, (-1, FLEX_TILE))  # [q tile, row, kv tile, key]
    shape = (tiles.shape[0], tiles.shape[2])
    partial = _tiles(mask.kv_num_blocks, mask.kv_indices, shape)
    full = _tiles(mask.full_kv_num_blocks, mask.full_kv_indices, shape)
    assert int((partial + full).max()) <= 1, "a tile listed twice"
    seen = tiles.any(dim=3).any(dim=1)
    assert not (seen & (partial + full == 0)).any(), "a key the mask allows lies in no listed tile"
    assert bool(tiles.all(dim=3).all(dim=1)[full == 1].all()), "a full tile holds a masked key"


def test_a_window_lists_only_the_tiles_inside_it_and_most_of_them_full():
    """ddtree's sliding layers: a late block in a long sequence attends to its window, not its whole context."""
    anchors = anchors_from_local([4096], [list(range(3500, 3600, 3))])
    masks = flex_layout(anchors, 4096, 32, {None, 2048}).masks
    windowed, whole = masks[2048], masks[None]
    listed = int(windowed.kv_num_blocks.sum() + windowed.full_kv_num_blocks.sum())
    assert listed < 0.65 * int(whole.kv_num_blocks.sum() + whole.full_kv_num_blocks.sum())
    assert int(windowed.full_kv_num_blocks.sum()) >= 3 * int(windowed.kv_num_blocks.sum())


def test_long_context_tiles_run_unmasked():
    """The point of full tiles: with the paper's block size, a block late in a long sequence sees most of
    its context in whole tiles."""
    anchors = anchors_from_local([2048], [list(range(1500, 1600, 6))])
    mask = flex_layout(anchors, 2048, 16, {None}).masks[None]
    assert int(mask.full_kv_num_blocks.sum()) >= int(mask.kv_num_blocks.sum())
