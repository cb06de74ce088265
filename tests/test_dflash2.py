"""DFlash2: the recipe and its refusals, the grouped dynamic causal convolution (identity at init, taps inside the
block), the mask of its sliding layers, the candidate selector's loss (gold outside the top-K excluded), its figures,
and a training step of a real drafter on a tiny target. Conformance with z-lab's model:
tests/test_peer_conformance.py."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_ring.common.config.drafter import DrafterConfig
from dflash_ring.consumer.families.dflash2.dflash2_blocks import GroupedDynamicCausalConv, grouped_dynamic_causal_conv
from dflash_ring.consumer.modeling.model import DFlashDraftModel, block_attention_mask, load_target_head
from dflash_ring.consumer.families.dflash2.model import DFlash2DraftModel
from dflash_ring.consumer.families.build import build_drafter
from support import anchors_from_local, build_target, save_tiny_qwen3, tiny_qwen3_config

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


@pytest.mark.parametrize(
    "key",
    [
        {"conv_kernel_size": 2},
        {"selector_rank": 8},
        {"selector_top_k": 4},
        {"selector_weight": 0.5},
        {"conv_group_size": 8},
    ],
)
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
    return (
        torch.randn(total, n_features, generator=gen),
        torch.randint(0, 250, (total,), generator=gen),
        anchors_from_local(lengths, [[2, 11, 19], [3, 12]]),
    )


def test_a_fresh_dflash2_drafter_drafts_what_its_dflash_backbone_does(target):
    """Identity convolutions: with the same backbone weights, DFlash2 and DFlash draft alike (full layers: there the
    two archs' masks agree)."""
    _, config, head = target
    cfg2 = DrafterConfig(
        arch="dflash2",
        num_hidden_layers=2,
        block_size=4,
        loss_gamma=2.0,
        mask_token_id=250,
        conv_group_size=8,
        selector_rank=8,
        selector_top_k=4,
    )
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
    cfg = DrafterConfig(
        arch="dflash2",
        num_hidden_layers=2,
        block_size=4,
        loss_gamma=2.0,
        mask_token_id=250,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
        conv_group_size=8,
        selector_rank=8,
        selector_top_k=4,
    )
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


# --- the selector's objective ---------------------------------------------------------------------------------------


def selector_case(seed=2, vocab=30, hidden_size=8, rank=4, block=5, top_k=4, spec=None):
    from dflash_ring.consumer.families.dflash2.dflash2_blocks import CandidateSelector
    from dflash_ring.consumer.modeling.model import FrozenTargetHead, cu_seqlens_from_lengths, sample_anchors

    torch.manual_seed(seed)
    head = FrozenTargetHead(torch.randn(vocab, hidden_size), torch.randn(vocab, hidden_size), spec=spec)
    lengths = [13, 9]
    input_ids = torch.randint(0, vocab, (22,))
    loss_mask = torch.rand(22) > 0.15
    anchors = sample_anchors(loss_mask, cu_seqlens_from_lengths(lengths), 6, torch.Generator().manual_seed(seed))
    hidden = torch.randn(anchors.num_blocks, block, hidden_size, requires_grad=True)
    chooser = CandidateSelector(vocab, hidden_size, rank, top_k, init_std=0.5)
    return head, input_ids, loss_mask, anchors, hidden, chooser


def selector_reference(hidden, chooser, anchors, input_ids, loss_mask, head, cfg):
    """The recipe's loss on full [N, B, V] logits, autograd: position-decayed CE + selector_weight x the w-weighted
    mean K-way CE over rows whose gold is in the unary top-K (scores = top-K logits + the bilinear term of the true
    predecessor input_ids[anchor + k - 1])."""
    from dflash_ring.consumer.training.loss import block_labels
    from dflash_ring.consumer.objectives.position_decay import position_weights

    block = hidden.shape[1]
    labels = block_labels(anchors, input_ids, loss_mask, block)
    valid = labels.valid
    w = position_weights(block, cfg.loss_gamma).expand_as(valid)[valid]
    logits = head.logits(hidden[valid]).float()
    gold = labels.tokens[valid]
    ce = torch.nn.functional.cross_entropy(logits, gold, reduction="none")
    prev = input_ids[(anchors.positions[:, None] + torch.arange(block) - 1).clamp(0, len(input_ids) - 1)][valid]
    unary, cand = logits.topk(cfg.selector_top_k, -1)
    scores = unary + (
        chooser.predecessor_codebook[prev][:, None]
        * chooser.hidden_projection(hidden[valid])[:, None]
        * chooser.successor_codebook[cand]
    ).sum(-1)
    inside = (cand == gold[:, None]).any(-1)
    target = (cand == gold[:, None]).long().argmax(-1)
    sel = torch.nn.functional.cross_entropy(scores[inside], target[inside], reduction="none")
    sel_term = (w[inside] * sel).sum() / w[inside].sum() if inside.any() else scores.sum() * 0
    return (w * ce).sum() / w.sum() + cfg.selector_weight * sel_term, inside, scores, target


@pytest.mark.parametrize("spec", [None, "transformed"])
def test_the_selector_loss_and_gradients_equal_the_full_logits_reference(spec):
    from dflash_ring.consumer.training.loss import SelectorInputs, dflash_loss
    from dflash_ring.consumer.families.dflash2.model import _predecessors
    from dflash_ring.consumer.modeling.target_head import HeadSpec

    head_spec = HeadSpec(tied=False, logit_multiplier=0.7, logit_softcap=3.0) if spec else None
    head, input_ids, loss_mask, anchors, hidden, chooser = selector_case(spec=head_spec)
    cfg = DrafterConfig(
        arch="dflash2",
        block_size=5,
        loss_gamma=3.0,
        selector_top_k=4,
        selector_rank=4,
        selector_weight=0.7,
        conv_group_size=8,
    )
    params = [hidden, *chooser.parameters()]
    reference, inside, *_ = selector_reference(hidden, chooser, anchors, input_ids, loss_mask, head, cfg)
    assert 0 < int(inside.sum()) < inside.numel()  # both kinds of rows: the rule is exercised
    expected = torch.autograd.grad(reference, params)
    for chunk in (1, 7, 10_000):
        chunked = DrafterConfig(**{**cfg.model_fields(), "loss_chunk_tokens": chunk})
        context = chooser.context(hidden, _predecessors(input_ids, anchors, 5))
        out = dflash_loss(
            hidden,
            anchors,
            input_ids,
            loss_mask,
            head,
            chunked,
            selector=SelectorInputs(context, chooser.successor_codebook, 4),
        )
        torch.testing.assert_close(out.loss.detach(), reference.detach())
        for got, want in zip(torch.autograd.grad(out.loss, params), expected):
            torch.testing.assert_close(got, want)
        torch.testing.assert_close(out.block_loss_sum.sum() / out.block_weight_sum.sum(), reference.detach())
        assert int(out.selector.in_top_k) == int(inside.sum()) and int(out.selector.rows) == inside.numel()


def test_a_gold_outside_the_top_k_is_left_out_of_the_selector_and_counted_in_the_recall():
    from dflash_ring.consumer.training.loss import SelectorInputs, dflash_loss
    from dflash_ring.consumer.families.dflash2.model import _predecessors

    head, input_ids, loss_mask, anchors, hidden, chooser = selector_case(top_k=2)
    cfg = DrafterConfig(
        arch="dflash2",
        block_size=5,
        loss_gamma=3.0,
        selector_top_k=2,
        selector_rank=4,
        conv_group_size=8,
        ce_weight=0.0,
    )  # the selector's term alone
    _, inside, scores, target = selector_reference(hidden, chooser, anchors, input_ids, loss_mask, head, cfg)
    context = chooser.context(hidden, _predecessors(input_ids, anchors, 5))
    out = dflash_loss(
        hidden,
        anchors,
        input_ids,
        loss_mask,
        head,
        cfg,
        selector=SelectorInputs(context, chooser.successor_codebook, 2),
    )
    # the gold tokens of the rows left out get no gradient in the successor codebook, unless a kept row has them
    from dflash_ring.consumer.training.loss import block_labels

    labels = block_labels(anchors, input_ids, loss_mask, 5)
    gold = labels.tokens[labels.valid]
    _, cand = head.logits(hidden[labels.valid]).topk(2, -1)
    (grad,) = torch.autograd.grad(out.loss, chooser.successor_codebook)
    untouched = set(gold[~inside].tolist()) - set(cand[inside].flatten().tolist())
    assert untouched and all(grad[t].abs().max() == 0 for t in untouched)
    assert int(out.selector.in_top_k) == int(inside.sum())
    assert int(out.selector.correct) == int(((scores.argmax(-1) == target) & inside).sum())
    # no gold in any top-K: a zero term with a zero gradient, not a NaN
    hopeless = torch.zeros_like(input_ids)  # every label token 0, whose logit is below every other's
    weight = head.lm_head_weight.clone()
    weight[0] = -10 * weight.abs().max()
    positive = hidden.abs()
    out = dflash_loss(
        positive,
        anchors,
        hopeless,
        loss_mask,
        type(head)(head.embed_weight, weight),
        cfg,
        selector=SelectorInputs(
            chooser.context(positive, _predecessors(hopeless, anchors, 5)), chooser.successor_codebook, 2
        ),
    )
    assert int(out.selector.in_top_k) == 0 and float(out.selector.loss) == 0.0
    assert all(torch.isfinite(g).all() for g in torch.autograd.grad(out.loss, [hidden, chooser.successor_codebook]))


def test_the_selector_figures_are_their_definitions():
    from dflash_ring.consumer.training.loss import SelectorInputs, dflash_loss
    from dflash_ring.consumer.families.dflash2.model import _predecessors
    from dflash_ring.consumer.training.loss import block_labels
    from dflash_ring.consumer.families import family

    head, input_ids, loss_mask, anchors, hidden, chooser = selector_case(top_k=3)
    cfg = DrafterConfig(
        arch="dflash2", block_size=5, loss_gamma=3.0, selector_top_k=3, selector_rank=4, conv_group_size=8
    )
    _, inside, scores, target = selector_reference(hidden, chooser, anchors, input_ids, loss_mask, head, cfg)
    out = dflash_loss(
        hidden,
        anchors,
        input_ids,
        loss_mask,
        head,
        cfg,
        selector=SelectorInputs(
            chooser.context(hidden, _predecessors(input_ids, anchors, 5)), chooser.successor_codebook, 3
        ),
    )
    labels = block_labels(anchors, input_ids, loss_mask, 5)
    valid = labels.valid[:, 1:]
    logits = head.logits(hidden[:, 1:].detach()).float()
    q = logits.softmax(-1)
    rows = int(valid.sum())
    figures = family("dflash2").figures(out)
    hit = torch.zeros_like(valid).masked_scatter(valid, (scores.argmax(-1) == target) & inside)
    in_top = torch.zeros_like(valid).masked_scatter(valid, inside)
    assert figures["selector/top_k_recall"] == pytest.approx(float(inside.float().mean()))
    assert figures["selector/top_k_mass"] == pytest.approx(float(q.topk(3, -1).values.sum(-1)[valid].mean()), rel=1e-5)
    assert figures["selector/unary_top1"] == pytest.approx(
        float((logits.argmax(-1) == labels.tokens[:, 1:])[valid].sum()) / rows
    )
    assert figures["selector/accuracy"] == pytest.approx(float(hit.sum()) / rows)
    assert figures["selector/accept_len"] == pytest.approx(float((hit.long().cumprod(1).sum(1) + 1).float().mean()))
    assert figures["selector/oracle_accept_len"] == pytest.approx(
        float((in_top.long().cumprod(1).sum(1) + 1).float().mean())
    )


def test_the_serving_walk_is_greedy_over_the_scores_from_the_anchor():
    """walk: slot 1's predecessor is the anchor, each later slot's the candidate chosen before it."""
    _, _, _, _, _, chooser = selector_case(vocab=30, hidden_size=8, top_k=5)
    hidden, logits = torch.randn(2, 4, 8), torch.randn(2, 4, 30)
    anchor = torch.tensor([3, 7])
    with torch.no_grad():
        path, cand, scores = chooser.walk(hidden, logits, anchor)
        prev = torch.cat([anchor[:, None], path[:, :-1]], 1)
        unary = logits.gather(-1, cand)
        torch.testing.assert_close(scores, chooser.scores(hidden, prev, unary, cand))
    assert torch.equal(path, cand.gather(-1, scores.argmax(-1, keepdim=True))[..., 0])


def test_a_dflash2_drafter_trains_on_a_tiny_target(tmp_path):
    from dflash_ring.common.config.train import TrainConfig
    from dflash_ring.consumer.training.trainer import DeviceBatch, Trainer

    save_tiny_qwen3(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    drafter = DrafterConfig(
        recipe="dflash2",
        num_hidden_layers=1,
        sliding_window=16,
        num_anchors=8,
        conv_group_size=16,
        selector_rank=8,
        selector_top_k=4,
        mask_token_id=config["vocab_size"] - 1,
    )
    model = build_drafter(drafter, config)
    assert isinstance(model, DFlash2DraftModel)
    assert {
        "candidate_selector.predecessor_codebook",
        "candidate_selector.successor_codebook",
        "candidate_selector.hidden_projection.weight",
        "layers.0.attention_conv.base_kernel",
        "layers.0.mlp_conv.kernel_projection.weight",
    } <= set(model.state_dict())
    head = load_target_head(tmp_path)
    trainer = Trainer(model, head, drafter, TrainConfig(lr=3e-3, warmup_ratio=0.0), torch.device("cpu"))
    torch.manual_seed(0)
    n_layers, hidden = len(model.target_layer_ids), config["hidden_size"]
    length = 40
    ids = torch.arange(length) % 7 + 3  # a counting rule the drafter can learn
    batch = DeviceBatch(
        features=torch.randn(length, n_layers * hidden),
        input_ids=ids,
        loss_mask=torch.ones(length, dtype=torch.bool),
        cu_seqlens=torch.tensor([0, length]),
    )
    first = last = None
    for _ in range(25):
        m = trainer.train_step(batch, total_steps=25)
        first = first or m
        last = m
    assert last.loss < first.loss
    # the random start has no gold in its top-K (no selector term yet); training brings them in and the selector learns
    f0, f1 = first.figures, last.figures
    assert f1["selector/top_k_recall"] > f0["selector/top_k_recall"] and f1["selector_loss"] > 0
    assert f1["selector/accuracy"] > f0["selector/accuracy"]
    assert f1["selector/accept_len"] > f0["selector/accept_len"]
    # the convolutions and the selector train: none is left at its initial value
    assert model.layers[0].attention_conv.kernel_projection.weight.abs().max() > 0
    from dflash_ring.consumer.reporting.step_record import WindowStats, step_scalars

    record = step_scalars(last, WindowStats(1.0, 40, 0.0, 1, 40, 0, {}))
    assert {
        "selector_loss",
        "selector/unary_top1",
        "selector/top_k_recall",
        "selector/top_k_mass",
        "selector/accuracy",
        "selector/accept_len",
        "selector/oracle_accept_len",
    } <= set(record)


def test_a_dflash2_export_is_zlabs_layout_and_loads_back(target, tmp_path):
    from safetensors import safe_open

    from dflash_ring.consumer.layouts.export import export_drafter, load_drafter
    from dflash_ring.consumer.modeling.target_head import HeadSpec

    _, config, head = target
    cfg = DrafterConfig(
        recipe="dflash2", num_hidden_layers=2, sliding_window=16, mask_token_id=250, selector_rank=8, selector_top_k=4
    )
    model = tiny_drafter(cfg, config)
    with torch.no_grad():
        model.layers[1].mlp_conv.base_kernel.normal_()
    out = export_drafter(
        model,
        cfg,
        config,
        tmp_path / "drafter",
        dtype=torch.float32,
        head_spec=HeadSpec(tied=False, logit_softcap=30.0),
    )
    exported = json.loads((out / "config.json").read_text())
    assert exported["architectures"] == ["DFlash2DraftModel"] and exported["is_causal"] is False
    assert exported["auto_map"] == {"AutoModel": "dflash2.DFlash2DraftModel"}
    assert exported["dflash_config"] == {
        "block_size": 8,
        "conv_kernel_size": 2,
        "conv_group_size": 16,
        "selector_rank": 8,
        "selector_top_k": 4,
        "mask_token_id": 250,
        "target_layer_ids": model.target_layer_ids,
        "final_logit_softcapping": 30.0,
    }
    assert exported["use_sliding_window"] is True and exported["dflash_training"]["selector_weight"] == 1.0
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "dflash2.py", "dflash2_blocks.py"}
    with safe_open(out / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert {
        "candidate_selector.predecessor_codebook",
        "candidate_selector.successor_codebook",
        "candidate_selector.hidden_projection.weight",
    } <= names
    assert (
        not {"candidate_selector.predecessor_codebook.weight", "candidate_selector.successor_codebook.weight"} & names
    )
    back = load_drafter(out, arch="dflash2")
    assert isinstance(back, DFlash2DraftModel) and isinstance(load_drafter(out, arch=None), DFlash2DraftModel)
    with pytest.raises(ValueError, match="is a DFlash2 drafter.*a DFlash drafter .* is expected"):
        load_drafter(out)  # the default: callers that decode DFlash drafters
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
    context, ids, anchors = packed_inputs(len(model.target_layer_ids) * 64)
    with torch.no_grad():
        assert torch.equal(back(context, ids, anchors, head), model(context, ids, anchors, head))


@pytest.mark.parametrize(
    "setting,says",
    [
        ("drafter.selector_top_k=411", "drafter.selector_top_k 411 exceeds the target's vocabulary of 410"),
        ("drafter.conv_group_size=65536", "drafter.conv_group_size 65536 does not divide the target's hidden_size 64"),
    ],
)
def test_check_config_refuses_in_one_line_the_sizes_the_dflash2_model_refuses(
    tmp_path, capsys, monkeypatch, setting, says
):
    """A selector_top_k past the target's vocabulary, or a conv_group_size that does not divide its width, was a
    ValueError traceback from the drafter's blocks that check-config passed (issue 46): now the family's check_target
    refuses it, in check-config and in every role (drafter_target_settings)."""
    from dflash_ring.cli import main

    target = build_target(tmp_path / "model", "qwen3", layers=4)  # width 64, 410 tokens
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()  # the target's save (its progress bar) is not check-config's output
    args = ["check-config", "--set", f'target.path="{target}"', "--set", "target.mask_token_id=405"]
    args += ["--set", 'drafter.recipe="dflash2"']
    assert main([*args, "--set", setting]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err, err
    assert main(args) == 0
