"""EAGLE-3: the recipe and its refusals, the training objective against vLLM speculators' Eagle3DraftModel (the test
oracle, installed --no-deps: its forward, loss and gradients on the same weights and inputs, shared/reference/eagle3.md
6), each document's steps kept inside it where speculators 0.9.0 reads the next document's labels, the attention
paths against each other, the chain drafter against the unroll, and a Trainer that learns on CPU.

speculators is prepared as eagle3.md 6 says: shift_batch per document, eager attention, its eager kl_div loss, the
vocabulary mapping loaded, the verifier's lm_head rows and embedding copied from our frozen head, Identity for its
verifier norm (our final hidden states are post-norm) and its lm_head unfrozen, so that gradients are compared on
every tensor we train. Its loss divides each step by (supervised rows + 1e-5), ours by max(rows, 1): the losses agree
to a relative 1e-5, not bit for bit.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig

from dflash_ring.common.config.drafter import DrafterConfig
from dflash_ring.common.config.schema import ConfigError, drafter_target_settings
from dflash_ring.common.config.target import TargetGeometry
from dflash_ring.common.config.train import TrainConfig
from dflash_ring.consumer.layouts.drafter_hf_config import drafter_hf_config
from dflash_ring.consumer.families import family
from dflash_ring.consumer.families.build import build_drafter
from dflash_ring.consumer.families.eagle3 import draft
from dflash_ring.consumer.families.eagle3.model import Eagle3DraftModel
from dflash_ring.consumer.families.eagle3.vocab import token_counts, vocab_mapping
from dflash_ring.consumer.layouts.export import export_drafter, load_drafter
from dflash_ring.consumer.training.warm_start import warm_start
from dflash_ring.consumer.modeling.model import Anchors, FrozenTargetHead, load_target_head
from dflash_ring.consumer.training.objective import ObjectiveInputs
from dflash_ring.consumer.training.trainer import DeviceBatch, Trainer

from dflash_ring.consumer.evaluation.evaluate import drafter_draft_fn, evaluate_drafter, speculative_generate
from support import (  # noqa: F401 (fixtures, asked for by name; one_thread is autouse)
    EVAL_VOCAB,
    data,
    head_of,
    one_thread,
    plain_greedy,
    save_tiny_qwen3,
    target,
    target_dir,
    tiny_qwen3_config,
)
from test_peer_conformance import oracle

VOCAB, HIDDEN, TARGET_LAYERS = 256, 64, 8
EAGLE3 = family("eagle3")


def test_the_eagle3_recipe_is_the_papers_and_the_refusals_are_one_line():
    d = DrafterConfig(recipe="eagle3", mask_token_id=5)
    assert (d.arch, d.num_hidden_layers, d.ttt_steps, d.ttt_step_loss_decay, d.block_size) == ("eagle3", 1, 7, 0.8, 8)
    assert (d.draft_vocab_size, d.norm_before_residual, d.kl_weight, d.ce_weight) == (0, False, 1.0, 0.0)
    assert d.needs_target_logits and not d.sample_from_anchor and d.drafts_per_block == 7
    # low, middle, high as outputs of layers 1, L//2 - 1, L - 4: EAGLE's hidden_states[2, L//2, L-3]
    assert d.resolved_target_layer_ids(36) == [1, 17, 32] and d.resolved_target_layer_ids(32) == [1, 15, 28]
    assert DrafterConfig().model_fields() == DrafterConfig(arch="dflash").model_fields()  # no new keys on DFlash
    refusals = [
        ({"ttt_steps": 3}, "ttt_steps is EAGLE-3-only; this drafter has arch = 'dflash'"),
        ({"recipe": "dspark", "draft_vocab_size": 32000}, "EAGLE-3-only; this drafter has arch = 'dspark'"),
        ({"recipe": "eagle3", "ttt_steps": 0, "block_size": 1}, "ttt_steps >= 1"),
        ({"recipe": "eagle3", "ttt_steps": 3}, "block_size must be ttt_steps \\+ 1 = 4"),
        ({"recipe": "eagle3", "ce_weight": 1.0}, "forward KL to the target alone"),
        ({"recipe": "eagle3", "cap_weight": 0.1}, "forward KL to the target alone"),
        ({"recipe": "eagle3", "draft_vocab_size": 32000}, "needs the d2t/t2d maps .* start from a drafter that has"),
    ]
    for settings, message in refusals:
        with pytest.raises(ValueError, match=message) as e:
            DrafterConfig(**settings)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="no distinct low, middle and high"):
        DrafterConfig(recipe="eagle3").resolved_target_layer_ids(6)
    with pytest.raises(ValueError, match="out of range for 8 target layers"):
        DrafterConfig(recipe="eagle3", target_layer_ids=[1, 4, 8]).resolved_target_layer_ids(8)
    geometry = TargetGeometry(HIDDEN, 36, VOCAB, (18,), None, True)  # the producers capture one layer
    with pytest.raises(ConfigError, match=r"reads three target layers.*\(\[1, 17, 32\] for this target\)"):
        drafter_target_settings(d, geometry)
    reduced = DrafterConfig(recipe="eagle3", draft_vocab_size=300, init_from="x", mask_token_id=5)
    with pytest.raises(ConfigError, match="draft_vocab_size 300 exceeds the target's vocabulary of 256"):
        drafter_target_settings(reduced, replace(geometry, layer_ids=(1, 17, 32)))
    target = tiny_qwen3_config(num_hidden_layers=TARGET_LAYERS).to_dict()
    with pytest.raises(ValueError, match="draft_vocab_size 300 exceeds the target's vocabulary of 256"):
        drafter_hf_config(DrafterConfig(recipe="eagle3", draft_vocab_size=300, init_from="x", mask_token_id=5), target)


def eagle3_config(steps: int, draft_vocab: int = 0, norm_before_residual: bool = False) -> DrafterConfig:
    return DrafterConfig(
        recipe="eagle3",
        ttt_steps=steps,
        block_size=steps + 1,
        draft_vocab_size=draft_vocab,
        # a reduced vocabulary's maps come from a released drafter in a run; here drafter_and_head loads them
        init_from="released-eagle3" if draft_vocab else None,
        norm_before_residual=norm_before_residual,
        target_layer_ids=[1, 3, 5],
        mask_token_id=VOCAB - 1,
        loss_chunk_tokens=5,  # several chunks per step
    )


def drafter_and_head(cfg: DrafterConfig, seed: int = 0) -> tuple[Eagle3DraftModel, FrozenTargetHead]:
    """Our fp32 drafter (norms off 1, a random draft vocabulary when reduced) and a random frozen head."""
    torch.manual_seed(seed)
    model = build_drafter(cfg, tiny_qwen3_config(num_hidden_layers=TARGET_LAYERS).to_dict()).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    if cfg.draft_vocab_size:
        selected = torch.randperm(VOCAB)[: cfg.draft_vocab_size].sort().values
        model.load_vocab_mapping(selected - torch.arange(selected.numel()), torch.isin(torch.arange(VOCAB), selected))
    return model, FrozenTargetHead(torch.randn(VOCAB, HIDDEN), torch.randn(VOCAB, HIDDEN) * 0.3)


def batch(lengths: list[int], seed: int = 1, prompt: int = 3) -> dict[str, torch.Tensor]:
    """Packed documents: features, ids, a loss mask off over each document's first `prompt` tokens and at random
    after, post-norm final hidden states."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    mask = torch.cat([(torch.arange(n) >= prompt) & (torch.rand(n, generator=g) > 0.2) for n in lengths])
    return {
        "features": torch.randn(total, 3 * HIDDEN, generator=g),
        "input_ids": torch.randint(0, VOCAB, (total,), generator=g),
        "loss_mask": mask,
        "cu_seqlens": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]),
        "final_hidden": torch.randn(total, HIDDEN, generator=g),
    }


def ours(model, head, cfg, data, attention: str = "sdpa"):
    cu = data["cu_seqlens"]
    none = Anchors(torch.zeros(0, dtype=torch.long), torch.zeros_like(cu), cu)  # the objective samples no anchors
    return EAGLE3.objective(model, ObjectiveInputs(**data, anchors=none, attention=attention), head, cfg)


def speculators_model(model: Eagle3DraftModel, head: FrozenTargetHead, cfg: DrafterConfig):
    """speculators' Eagle3DraftModel with our drafter's tensors (their names are ours) and our head's rows."""
    eagle3 = oracle("speculators.models.eagle3", "speculators")
    config_module = oracle("speculators.config", "speculators")
    greedy = oracle("speculators.proposals.greedy", "speculators")
    c = model.config
    layer = LlamaConfig(
        hidden_size=c.hidden_size,
        num_hidden_layers=1,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        intermediate_size=c.intermediate_size,
        hidden_act="silu",
        rms_norm_eps=c.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        max_position_embeddings=c.max_position_embeddings,
        vocab_size=VOCAB,
        attention_bias=False,
        tie_word_embeddings=False,
    )
    layer._attn_implementation = "eager"
    config = eagle3.Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=c.draft_vocab_size,
        norm_before_residual=cfg.norm_before_residual,
        eagle_aux_hidden_state_layer_ids=c.eagle_config["eagle_aux_hidden_state_layer_ids"],
        speculators_config=config_module.SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[greedy.GreedyTokenProposalConfig(speculative_tokens=cfg.ttt_steps)],
            default_proposal_method="greedy",
            verifier=config_module.VerifierConfig(name_or_path=None, architectures=["Qwen3ForCausalLM"]),
        ),
    )
    theirs = eagle3.Eagle3DraftModel(config)
    mapped = model.draft_ids is not None
    theirs.load_vocab_mappings(model.t2d if mapped else None, model.d2t if mapped else None)
    loaded = theirs.load_state_dict(model.state_dict(), strict=False)
    assert (sorted(loaded.missing_keys), loaded.unexpected_keys) == (
        ["embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight"],
        [],
    )
    rows = head.lm_head_weight if not mapped else head.lm_head_weight[model.draft_ids]
    with torch.no_grad():
        theirs.embed_tokens.weight.copy_(head.embed_weight)
        theirs.verifier_lm_head.weight.copy_(rows)
    theirs.verifier_norm = torch.nn.Identity()
    theirs.lm_head.weight.requires_grad_(True)
    return theirs


def speculators_forward(theirs, data, cfg, documents: list[tuple[int, int]]):
    """Their forward on the given documents packed into one row, each shifted by shift_batch as their data loader
    does: (loss, metrics)."""
    eagle3 = oracle("speculators.models.eagle3", "speculators")
    losses = oracle("speculators.losses", "speculators")
    parts = [
        eagle3.shift_batch(
            {
                "input_ids": data["input_ids"][a:b],
                "hidden_states": data["features"][a:b],
                "verifier_last_hidden_states": data["final_hidden"][a:b],
                "loss_mask": data["loss_mask"][a:b],
                "lengths": torch.tensor([b - a]),
                "position_ids": torch.arange(b - a),
            }
        )
        for a, b in documents
    ]

    def cat(key):
        return torch.cat([p[key] for p in parts])[None]

    document_ids = torch.cat([torch.full((b - a - 1,), i) for i, (a, b) in enumerate(documents)])[None]
    _, loss, metrics = theirs(
        cat("hidden_states"),
        cat("input_ids"),
        document_ids,
        loss_mask=cat("loss_mask"),
        position_ids=cat("position_ids"),
        verifier_last_hidden_states=cat("verifier_last_hidden_states"),
        ttt_steps=cfg.ttt_steps,
        ttt_step_loss_decay=cfg.ttt_step_loss_decay,
        loss_config=losses.resolve_loss_config("kl_div", "eager"),
    )
    return loss, metrics


CASES = [  # (ttt_steps, draft vocabulary (0: the target's), norm_before_residual)
    (1, 0, False),
    (3, 100, True),
    (5, 4, False),  # four draft tokens: the argmax often agrees, so the accuracies are not all 0
]


@pytest.mark.parametrize("steps,draft_vocab,norm_before_residual", CASES)
def test_loss_gradients_and_accuracies_equal_speculators_per_document(steps, draft_vocab, norm_before_residual):
    cfg = eagle3_config(steps, draft_vocab, norm_before_residual)
    lengths = [13, 9]
    data = batch(lengths)
    bounds = data["cu_seqlens"].tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):  # one document per row, as speculators' batches are
        model, head = drafter_and_head(cfg)
        theirs = speculators_model(model, head, cfg)
        doc = {k: v[a:b] if k != "cu_seqlens" else torch.tensor([0, b - a]) for k, v in data.items()}
        step = ours(model, head, cfg, doc)
        step.out.loss.backward()
        loss, metrics = speculators_forward(theirs, data, cfg, [(a, b)])
        loss.backward()
        torch.testing.assert_close(step.out.loss, loss, rtol=1e-5, atol=0)
        grads = dict(theirs.named_parameters())
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.grad, grads[name].grad, rtol=1e-4, atol=1e-6, msg=name)
        out = step.out
        for k in range(steps):
            assert int(out.valid_per_position[k]) == int(metrics[f"full_acc_{k}_total"])
            figures = EAGLE3.figures(out)
            want = float(metrics[f"full_acc_{k}_sum"] / metrics[f"full_acc_{k}_total"].clamp_min(1))
            assert figures[f"full_acc_{k}"] == pytest.approx(want, abs=1e-4)
    if steps == 5:
        assert any(EAGLE3.figures(out)[f"full_acc_{k}"] > 0 for k in range(steps))


def test_the_targets_distribution_is_computed_once_per_label_position(monkeypatch):
    """Row t's step k reads the target's distribution at t + 1 + k: a position serves every step that reads it, so
    the teacher's head runs once per distinct label position (it ran per (row, step), twice with the checkpoint's
    recompute), and the backward pass runs no head product at all (the gradients are made in the forward)."""
    from dflash_ring.consumer.families.eagle3 import objective
    from dflash_ring.consumer.families.eagle3.objective import step_labels

    cfg = eagle3_config(5)
    model, head = drafter_and_head(cfg)
    data = batch([13, 9])
    rows, real = [], objective.head_logits
    monkeypatch.setattr(objective, "head_logits", lambda x, *a: rows.append(x.shape[0]) or real(x, *a))
    step = ours(model, head, cfg, data)
    valid = step_labels(data["input_ids"], data["loss_mask"], data["cu_seqlens"], 5)
    labels = (torch.arange(valid.shape[0])[:, None] + 1 + torch.arange(5))[valid].unique()
    assert sum(rows) == labels.numel() == step.out.teacher_positions < int(valid.sum())
    step.out.loss.backward()
    assert sum(rows) == labels.numel()


def test_under_autocast_the_gradients_made_in_the_forward_match_the_fp32_ones():
    """The GPU's path (bf16 products under autocast, the hidden states' gradients kept in bf16 and cast back by
    autograd) on the CPU's autocast: the same loss and gradients as fp32, to bf16's precision."""
    cfg = eagle3_config(3, 100)
    data = batch([13, 9])
    grads = {}
    for dtype in (None, torch.bfloat16):
        model, head = drafter_and_head(cfg)
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            step = ours(model, head, cfg, data)
        step.out.loss.backward()
        grads[dtype] = (step.out.loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    (loss32, fp32), (loss16, bf16) = grads.values()
    torch.testing.assert_close(loss16, loss32, rtol=2e-2, atol=0)
    for name, grad in fp32.items():
        assert bf16[name].dtype == torch.float32, name
        assert float((bf16[name] - grad).norm() / grad.norm()) < 5e-2, name


def test_each_documents_steps_stay_inside_it_where_speculators_crosses_into_the_next():
    """Packed [A | B]: speculators 0.9.0 labels A's last rows at step k >= 1 with B's tokens and distributions (its
    shifted labels run on across the document boundary), so each step k counts k rows more than there are; ours
    keeps them out, and its per-row terms in the packed batch are those of each document alone."""
    cfg = eagle3_config(3, 100)
    lengths = [10, 8]
    data = batch(lengths, prompt=0)
    data["loss_mask"][:] = True
    model, head = drafter_and_head(cfg)
    packed = ours(model, head, cfg, data).out
    _, metrics = speculators_forward(speculators_model(model, head, cfg), data, cfg, [(0, 10), (10, 18)])
    for k in range(cfg.ttt_steps):
        supervised = sum(n - 1 - k for n in lengths)  # row t, step k labels t + 1 + k, inside the document
        assert int(packed.valid_per_position[k]) == supervised
        assert int(metrics[f"full_acc_{k}_total"]) == supervised + k * (len(lengths) - 1)
    with torch.no_grad():
        alone = [
            ours(
                model,
                head,
                cfg,
                {k: v[a:b] if k != "cu_seqlens" else torch.tensor([0, b - a]) for k, v in data.items()},
            )
            for a, b in ((0, 10), (10, 18))
        ]
    torch.testing.assert_close(packed.block_loss_sum, torch.cat([s.out.block_loss_sum for s in alone]))
    torch.testing.assert_close(packed.block_accept_prob, torch.cat([s.out.block_accept_prob for s in alone]))
    # with one step nothing crosses: the same loss as speculators'
    one = eagle3_config(1, 100)
    model, head = drafter_and_head(one)
    loss, _ = speculators_forward(speculators_model(model, head, one), data, one, [(0, 10), (10, 18)])
    with torch.no_grad():
        torch.testing.assert_close(ours(model, head, one, data).out.loss, loss, rtol=1e-5, atol=0)


def test_flex_attention_gives_the_sdpa_paths_result():
    """The GPU path (one block-sparse flex call per step) against the dense per-document one, forward only: flex
    has no backward on CPU."""
    cfg = eagle3_config(3, 100)
    data = batch([125, 6, 12])  # two flex tiles, a document inside one and one across their edge
    model, head = drafter_and_head(cfg)
    with torch.no_grad():
        dense, sparse = ours(model, head, cfg, data, "sdpa").out, ours(model, head, cfg, data, "flex").out
    torch.testing.assert_close(sparse.loss, dense.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sparse.block_loss_sum, dense.block_loss_sum, rtol=1e-5, atol=1e-6)


def test_the_rows_are_the_blocks_per_sequence():
    cfg = eagle3_config(3, 100)
    data = batch([12, 4, 9])
    model, head = drafter_and_head(cfg)
    with torch.no_grad():
        step = ours(model, head, cfg, data)
    rows = step.blocks
    assert rows.cu_anchors.tolist()[0] == 0 and rows.cu_anchors.tolist()[-1] == step.out.num_blocks
    starts, ends = rows.seq_bounds()
    assert bool(((rows.positions >= starts) & (rows.positions < ends - 1)).all())
    assert step.out.block_valid.sum() == step.out.valid_per_position.sum()


def test_the_chain_drafter_drafts_what_the_unroll_would_have_read():
    """Greedy drafts fed back as the next steps' tokens give the unroll's own argmax at the last row: the drafter
    serves what it trained on."""
    cfg = eagle3_config(4, 100)
    model, head = drafter_and_head(cfg)
    data = batch([11])
    committed, context = data["input_ids"], data["features"][:-1]
    with torch.no_grad():
        tokens = draft(model, head, committed, context).tokens
        teacher = torch.cat([committed, tokens])  # the drafted continuation as if it were the data
        features = torch.cat([context, torch.zeros(len(tokens) + 1, context.shape[1])])
        hidden = model(features, teacher, torch.tensor([0, teacher.numel()]), head, cfg.ttt_steps)
        row = context.shape[0] - 1
        again = [model.draft_ids[model.logits(h[row]).argmax()] for h in hidden]
    assert tokens.tolist() == [int(t) for t in again]
    sampled = draft(model, head, committed, context, 1.0, torch.Generator().manual_seed(0))
    assert sampled.probs.shape == (4, VOCAB)
    assert bool((sampled.probs[:, ~model.t2d] == 0).all())


def test_a_trainer_learns_eagle3_on_cpu(tmp_path):
    save_tiny_qwen3(tmp_path, num_hidden_layers=TARGET_LAYERS)
    target = json.loads((tmp_path / "config.json").read_text())
    cfg = DrafterConfig(recipe="eagle3", ttt_steps=3, block_size=4, mask_token_id=VOCAB - 1, num_anchors=8)
    model = build_drafter(cfg, target)
    head = load_target_head(tmp_path)
    trainer = Trainer(model, head, cfg, TrainConfig(lr=3e-3, warmup_ratio=0.0), torch.device("cpu"))
    torch.manual_seed(0)
    length = 40
    ids = torch.arange(length) % 7 + 3
    hidden = torch.randn(7, HIDDEN)[ids - 3]  # the target's state follows the token: learnable
    data = DeviceBatch(
        features=torch.randn(length, 3 * HIDDEN),
        input_ids=ids,
        loss_mask=torch.ones(length, dtype=torch.bool),
        cu_seqlens=torch.tensor([0, 25, length]),  # two documents, of two sources
        final_hidden=hidden,
        meta={"sources": ["chat", "code"]},
        source_ids=torch.tensor([0, 1]),
    )
    metrics = [trainer.train_step(data, total_steps=20) for _ in range(20)]
    assert metrics[-1].loss < 0.5 * metrics[0].loss
    assert len(metrics[-1].accuracy_per_position) == 3 and "cond_acc_2" in metrics[-1].figures
    sources = metrics[-1].by_source  # rows per document: 24 and 14, steps inside each (3 x 38 - 2 x 3 = 108)
    assert (sources["chat"].blocks, sources["code"].blocks) == (24, 14)
    assert sources["chat"].valid + sources["code"].valid == 108 and 0 < sources["code"].loss < metrics[0].loss
    held_out = trainer.evaluate(data)
    assert held_out["chat"].valid == sources["chat"].valid and trainer.step == 20  # no update, the same rows


def test_the_draft_vocabulary_is_speculators_mapping_of_the_token_counts():
    builder = oracle("speculators.train.vocab_mapping", "speculators").build_vocab_mappings_from_distribution
    g = torch.Generator().manual_seed(0)
    for draft_vocab, tokens in ((50, 1000), (50, 20), (VOCAB, 5)):  # plenty seen, too few (padded), all of them
        ids = torch.randint(0, 16, (tokens,), generator=g) ** 2 % VOCAB  # skewed, with ties
        mask = torch.rand(tokens, generator=g) > 0.3
        seen, counts = ids[mask].unique(return_counts=True)
        d2t, t2d = vocab_mapping(token_counts(ids, mask, VOCAB), draft_vocab)
        want = builder(dict(zip(seen.tolist(), counts.tolist())), draft_vocab, VOCAB)
        assert torch.equal(d2t, want[0]) and torch.equal(t2d, want[1])
    with pytest.raises(ValueError, match="draft_vocab_size 300 must lie in 1..256"):
        vocab_mapping(torch.ones(VOCAB, dtype=torch.long), 300)


def test_the_export_loads_back_here_and_through_speculators_converter_with_the_same_logits(tmp_path):
    """Our flat LlamaForCausalLMEagle3 export (eagle3.md 4.1): load_drafter gives the same tensors (d2t and t2d in
    their own dtypes); speculators' Eagle3Converter turns it into its Eagle3Speculator format (4.2), whose
    Eagle3DraftModel.from_pretrained (the verifier's embedding and head rows read from the target) drafts the same
    logits as our model at every step."""
    converter = oracle("speculators.convert.eagle.eagle3_converter", "speculators")
    eagle3 = oracle("speculators.models.eagle3", "speculators")
    save_tiny_qwen3(tmp_path / "target", num_hidden_layers=TARGET_LAYERS)
    cfg = eagle3_config(3, 100, norm_before_residual=True)
    model, _ = drafter_and_head(cfg)
    head = load_target_head(tmp_path / "target")
    target = json.loads((tmp_path / "target" / "config.json").read_text())
    out = export_drafter(model, cfg, target, tmp_path / "eagle3", dtype=torch.float32, head=head)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and "auto_map" not in config
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 6]  # HF hidden_states indices
    assert (config["draft_vocab_size"], config["norm_before_residual"], config["target_hidden_size"]) == (100, True, 64)
    back = load_drafter(out, arch="eagle3")
    fresh = build_drafter(cfg, target)
    warm_start(fresh, cfg, target, out)  # drafter.init_from: the maps and lm_head are the drafter's own, kept
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor) and torch.equal(fresh.state_dict()[name], tensor), name
    converter.Eagle3Converter().convert(
        out,
        tmp_path / "speculators",
        str(tmp_path / "target"),
        validate=False,
        norm_before_residual=config["norm_before_residual"],
        eagle_aux_hidden_state_layer_ids=config["eagle_config"]["eagle_aux_hidden_state_layer_ids"],
    )
    loaded = eagle3.Eagle3SpeculatorConfig.from_pretrained(tmp_path / "speculators")
    assert loaded.norm_before_residual and loaded.draft_vocab_size == 100
    loaded.transformer_layer_config._attn_implementation = "eager"
    theirs = eagle3.Eagle3DraftModel.from_pretrained(tmp_path / "speculators", config=loaded).eval()
    with torch.no_grad():  # the file ships no embedding (the engines share the target's); their load leaves it random
        theirs.embed_tokens.weight.copy_(head.embed_weight)
    logits = []
    theirs.lm_head.register_forward_hook(lambda m, i, o: logits.append(o[0]))
    data = batch([12])
    shifted = eagle3.shift_batch(
        {
            "input_ids": data["input_ids"],
            "hidden_states": data["features"],
            "verifier_last_hidden_states": data["final_hidden"],
            "loss_mask": data["loss_mask"],
            "lengths": torch.tensor([12]),
            "position_ids": torch.arange(12),
        }
    )
    with torch.no_grad():
        theirs(
            shifted["hidden_states"][None],
            shifted["input_ids"][None],
            torch.zeros(1, 11, dtype=torch.long),
            position_ids=shifted["position_ids"][None],
            ttt_steps=cfg.ttt_steps,
        )
        hidden = back(data["features"], data["input_ids"], data["cu_seqlens"], head, cfg.ttt_steps)
    for k in range(cfg.ttt_steps):  # their row t is ours; their last k rows read past the document, ours never do
        rows = 11 - k
        torch.testing.assert_close(back.logits(hidden[k])[:rows], logits[k][:rows], rtol=0, atol=1e-5)


def test_eval_drafts_chains_losslessly_greedy_and_sampled(target, target_dir, data, tmp_path):
    """`dflash-ring eval`'s path: the export loaded back, chains of ttt_steps drafts verified by the target. Greedy
    speculative decoding is the target's own greedy decode; T = 1 runs and reports its tau beside the others'."""
    config = json.loads((target_dir / "config.json").read_text())
    cfg = DrafterConfig(
        recipe="eagle3",
        ttt_steps=3,
        block_size=4,
        draft_vocab_size=200,
        init_from="released-eagle3",  # the maps: loaded below
        target_layer_ids=[0, 1, 2],
        mask_token_id=5,
    )
    torch.manual_seed(2)
    model = build_drafter(cfg, config)
    model.load_vocab_mapping(*vocab_mapping(torch.arange(EVAL_VOCAB).flip(0), 200))  # the 200 lowest ids
    exported = export_drafter(model, cfg, config, tmp_path / "eagle3")
    drafter = load_drafter(exported, dtype=torch.float32, arch="eagle3").eval()
    for prompt in ([5, 17, 42, 9, 33, 120, 7], list(range(60, 90))):
        got = speculative_generate(
            target,
            prompt,
            drafter_draft_fn(drafter, head_of(target)),
            block_size=drafter.block_size,
            target_layer_ids=drafter.target_layer_ids,
            eos_token_ids=[],
            max_new_tokens=12,
        )
        assert got.tokens == plain_greedy(target, prompt, 12)
    for temperature in (0.0, 1.0):
        report = evaluate_drafter(exported, target_dir, data, max_new_tokens=10, temperature=temperature, seed=3)
        assert report.drafts_per_round == 3 and len(report.accepted_histogram) == 4 and 1 <= report.tau <= 4
