"""The drafter for every target family: geometry from its config, its frozen head, training, export, reload.

Each family's tiny random target is a real HF directory (tests/support.build_target, for every family
of bench/target_shapes.FAMILIES); the truth for the head is the
target's own forward (its first-layer input and its logits), and the features the drafter trains on are
the target's real hidden states at the DFlash layer ids. The head probe derives each family's
transforms, keeps its decoder layers on the meta device, and refuses a deliberately wrong head.
"""

from __future__ import annotations

import ast
import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel, AutoModelForCausalLM

from dflash_ring.bench.target_shapes import shape_config
from dflash_ring.common.config.drafter import DrafterConfig, build_target_layer_ids
from dflash_ring.consumer.layouts.drafter_hf_config import drafter_hf_config, drafter_rope
from dflash_ring.consumer.layouts.export import TARGET_HEAD_KEY, export_drafter, load_drafter
from dflash_ring.consumer.families.dspark import CODE_SOURCE as DSPARK_CODE_SOURCE
from dflash_ring.consumer.families.dflash import CODE_SOURCE as MODEL_CODE_SOURCE
from dflash_ring.consumer.modeling.head_probe import HeadProbeError, TargetHeadProbe, check, derive
from dflash_ring.consumer.training.loss import dflash_loss
from dflash_ring.consumer.modeling.model import Anchors, load_target_head
from dflash_ring.consumer.families.build import build_drafter
from dflash_ring.common.config.train import TrainConfig
from dflash_ring.consumer.training.trainer import DeviceBatch, Trainer

from dflash_ring.consumer.modeling.target_head import HeadSpec
from dflash_ring.embedded.tiny_tokenizer import tiny_chat_tokenizer

from support import ARCHS, build_target

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

LAYERS, HIDDEN, BLOCK = 6, 64, 4
# Tiny family geometry (bench/target_shapes.tiny_config): intermediate 128; MoE: 2 of 4 experts of 32 (+ a
# shared expert where the family has one: 32, Granite-MoE-hybrid's 64); gpt-oss, MiniMax(-M2), Mixtral, OLMoE,
# Granite-MoE and Cohere2-MoE experts are intermediate_size wide (128), as are Hunyuan-MoE's (+ its shared one).
MLP_WIDTH = {
    "qwen3_moe": 2 * 32,
    "gpt_oss": 2 * 128,
    "qwen3_next": 2 * 32 + 32,
    "qwen3_5_moe": 2 * 32 + 32,
    "deepseek_v3": 2 * 32 + 32,
    "deepseek_v2": 2 * 32 + 32,
    "glm4_moe_lite": 2 * 32 + 32,
    "glm4_moe": 2 * 32 + 32,
    "glm_moe_dsa": 2 * 32 + 32,
    "minimax_m2": 2 * 128,
    "nemotron_h": 2 * 32 + 32,
    "longcat_flash": 2 * 32,
    "granitemoehybrid": 2 * 128 + 64,
    "jamba": 2 * 128,
    "qwen2_moe": 2 * 32 + 32,
    "mixtral": 2 * 128,
    "olmoe": 2 * 128,
    "granitemoe": 2 * 128,
    "ernie4_5_moe": 2 * 32 + 32,
    "hunyuan_v1_moe": 2 * 128 + 128,
    "hy_v3": 2 * 32 + 32,
    "exaone_moe": 2 * 32 + 32,
    "dots1": 2 * 32 + 32,
    "solar_open": 2 * 32 + 32,
    "afmoe": 2 * 32 + 32,
    "cohere2_moe": 2 * 128,
    "mimo_v2_flash": 2 * 32,
    "deepseek_v32": 2 * 32 + 32,
    "lfm2_moe": 2 * 32,
    "kimi_linear": 2 * 32 + 32,
    "bailing_hybrid": 2 * 32 + 32,
    "minimax": 2 * 128,
}
# Multi-head latent attention: key/value heads = heads; head_dim = v_head_dim (12; the config's head_dim is the rope
# part).
MLA = (
    "deepseek_v3",
    "deepseek_v2",
    "glm4_moe_lite",
    "youtu",
    "glm_moe_dsa",
    "longcat_flash",
    "deepseek_v32",
    "kimi_linear",
    "bailing_hybrid",
)
ROPE = {
    "gemma3": (1e6, None),  # the full-attention entry of its per-layer-type rope
    "gemma4_text": (1e6, None),  # the same; its "proportional" partial rotary is a whole-head default one
    "gpt_oss": (
        150000.0,
        {
            "rope_type": "yarn",
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        },
    ),
    "minimax_m2": (5e6, None),
    "lfm2": (1e6, None),
    "longcat_flash": (1e7, None),
    "cohere": (5e5, None),
    "smollm3": (2e6, None),
    "olmo3": (5e5, None),
    "ernie4_5": (5e5, None),
    "ernie4_5_moe": (5e5, None),
    "mixtral": (1e6, None),
    "minimax": (1e6, None),
    "hy_v3": (11158840.0, None),
    "solar_open": (1e6, None),
    "lfm2_moe": (1e6, None),
    "lfm3": (1e6, None),  # the full-attention entry; its "proportional" partial rotary = a whole-head default one
    "mimo_v2_flash": (5e6, None),  # the full-attention entry; partial rotary dropped
    "bailing_hybrid": (6e6, None),
    "apertus": (
        1.2e7,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    # yarn kept; llama_4_scaling_beta (a query temperature of the target's attention) dropped.
    "ministral3": (
        1e6,
        {
            "rope_type": "yarn",
            "type": "yarn",
            "factor": 16.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 16384,
            "max_position_embeddings": 4096,
        },
    ),
}
# The transforms the probe must find (none for every other family), as the tiny configs set them.
HEADS = {
    "gemma3": dict(embed_scale=8.0),
    "gemma4_text": dict(embed_scale=8.0),  # sqrt(64)
    "gemma2": dict(embed_scale=8.0, logit_softcap=30.0),
    "granite": dict(embed_scale=12.0, logit_multiplier=0.125),  # 1 / logits_scaling 8
    "granitemoehybrid": dict(embed_scale=12.0, logit_multiplier=0.1),
    "falcon_h1": dict(embed_scale=5.656854, logit_multiplier=0.0390625),
    "cohere": dict(logit_multiplier=0.0625),
    "cohere2": dict(logit_multiplier=0.125),
    "gemma": dict(embed_scale=8.0),
    "afmoe": dict(embed_scale=8.0),  # Trinity's muP input scale, sqrt(64)
    "granitemoe": dict(embed_scale=12.0, logit_multiplier=0.125),
    "cohere2_moe": dict(logit_multiplier=0.25),
}
# Position-free attention (Kimi-Linear's MLA is NoPE; Zamba's shared attention block takes no positions): the
# drafter's RoPE is set explicitly.
NO_ROPE = ("nemotron_h", "jamba", "zamba", "kimi_linear")


def drafter_cfg(vocab: int, name: str = "") -> DrafterConfig:
    # One sliding and one full layer: the remote-code model must reproduce both masks.
    return DrafterConfig(
        num_hidden_layers=2,
        block_size=BLOCK,
        loss_gamma=2.0,
        num_anchors=6,
        mask_token_id=vocab - 8,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
        rope_theta=1e4 if name in NO_ROPE else None,
    )


# qwen3 in the quick subset; the other families are `slow` (pytest -m "not processes and not slow").
@pytest.fixture(scope="module", params=[a if a == "qwen3" else pytest.param(a, marks=pytest.mark.slow) for a in ARCHS])
def family(request, tmp_path_factory):
    """(name, target dir, config.json, the target loaded by AutoModelForCausalLM in fp32)."""
    name, where = request.param, tmp_path_factory.mktemp(request.param)
    path = build_target(where, name, layers=LAYERS, hidden=HIDDEN)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return name, path, json.loads((path / "config.json").read_text()), model


def sequences(vocab: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab - 8, (n,), generator=g) for n in (40, 28)]


def target_features(model, ids: torch.Tensor, layer_ids: list[int]):
    """The DFlash context of one sequence (hidden_states[l + 1] per layer id), its first-layer input, its logits."""
    with torch.no_grad():
        out = model(ids[None], output_hidden_states=True, use_cache=False)
    # LongCat-Flash returns a hidden state per pair of its sublayers (num_layers + 1), fewer than its
    # num_hidden_layers: the last one stands in here (which state a layer id names is the target side's).
    last = len(out.hidden_states) - 1
    feats = torch.cat([out.hidden_states[min(i + 1, last)][0] for i in layer_ids], dim=-1)
    return feats, out.hidden_states[0][0], out.hidden_states[-1][0], out.logits[0]


def test_drafter_geometry_follows_the_target(family):
    name, _, config, _ = family
    hf = drafter_hf_config(drafter_cfg(410, name), config)
    assert hf["dflash_config"]["target_layer_ids"] == build_target_layer_ids(LAYERS, 2) == [1, 3]
    assert hf["num_target_layers"] == LAYERS
    got = {
        k: hf[k]
        for k in (
            "hidden_size",
            "vocab_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "hidden_act",
            "model_type",
            "tie_word_embeddings",
        )
    }
    assert got == {
        "hidden_size": HIDDEN,
        "vocab_size": config.get("text_config", config)["vocab_size"],
        "num_attention_heads": 4,
        "num_key_value_heads": 4 if name in MLA else 2,
        "head_dim": 12 if name in MLA else 16,
        "intermediate_size": MLP_WIDTH.get(name, 128),
        "hidden_act": "silu",
        "model_type": "qwen3",
        "tie_word_embeddings": False,
    }
    assert (hf["rope_theta"], hf["rope_scaling"]) == ROPE.get(name, (10000.0, None))
    if name in NO_ROPE:
        with pytest.raises(ValueError, match="has no RoPE.*set drafter.rope_theta"):
            drafter_hf_config(drafter_cfg(410), config)
    assert hf["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}
    assert not {"partial_rotary_factor", "mrope_section", "rope_parameters"} & set(hf)


def test_frozen_head_is_the_targets_own(family, tmp_path):
    """Embedding = what the target's first layer receives (Gemma: scaled); logits = the target's logits; the
    transforms the probe derived are the family's (HEADS), and the cache records them."""
    name, path, config, model = family
    head = load_target_head(path, cache=tmp_path / "target-head.json")
    assert head.spec == HeadSpec(tied=False, **HEADS.get(name, {}))
    assert json.loads((tmp_path / "target-head.json").read_text())["head"] == head.spec.to_json()
    ids = sequences(config.get("text_config", config)["vocab_size"])[0]
    _, first_layer_input, final_hidden, logits = target_features(model, ids, [1])
    assert torch.equal(head.embed(ids), first_layer_input)
    torch.testing.assert_close(head.logits(final_hidden), logits, rtol=1e-5, atol=1e-5)


def test_head_probe_keeps_the_layers_on_meta_and_refuses_a_wrong_head(family):
    """The probe materializes no decoder-layer weight (a 1T target's experts stay on disk), and the check
    catches a scale off by sqrt(H), a missing softcap, a missing or spurious multiplier."""
    name, path, config, model = family
    embed, lm_head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    probe = TargetHeadProbe(model.config, embed.detach(), lm_head.detach())
    assert all(p.is_meta for p in probe.layers.parameters()) and len(probe.layers) > 0
    real = sum(p.numel() for p in probe.model.parameters() if not p.is_meta)
    layer_params = sum(p.numel() for p in probe.layers.parameters())
    assert real < embed.numel() + lm_head.numel() + layer_params / len(probe.layers)  # less than one layer besides
    spec = derive(probe, tied=False)
    assert spec == HeadSpec(tied=False, **HEADS.get(name, {}))
    check(probe, spec, name)
    hidden = probe.hidden
    wrong = [
        (dict(embed_scale=(spec.embed_scale or 1.0) * hidden**0.5), "embedding"),
        (dict(logit_multiplier=(spec.logit_multiplier or 1.0) * 2), "logits"),
    ]
    if spec.embed_scale is not None:
        wrong.append((dict(embed_scale=None), "embedding"))
    if spec.logit_multiplier is not None:
        wrong.append((dict(logit_multiplier=None), "logits"))
    if spec.logit_softcap is not None:
        wrong.append((dict(logit_softcap=None), "logits"))
    for change, part in wrong:
        bad = HeadSpec(**{**spec.to_json(), **change})
        with pytest.raises(HeadProbeError, match=f"does not reproduce the target's {part}.*relative error"):
            check(probe, bad, name)


def train_batch(model, vocab: int, layer_ids: list[int]) -> DeviceBatch:
    seqs = sequences(vocab)
    feats = [target_features(model, s, layer_ids)[0] for s in seqs]
    masks = [torch.arange(len(s)) >= len(s) // 3 for s in seqs]  # prompt, then a supervised reply
    return DeviceBatch(
        features=torch.cat(feats),
        input_ids=torch.cat(seqs),
        loss_mask=torch.cat(masks),
        cu_seqlens=torch.tensor([0, len(seqs[0]), len(seqs[0]) + len(seqs[1])]),
    )


def remote_draft(remote, head, feats, ids, anchor: int, mask_id: int) -> torch.Tensor:
    block = torch.full((BLOCK,), mask_id)
    block[0] = ids[anchor]
    with torch.no_grad():
        return remote(head.embed(block)[None], feats[:anchor][None])[0]


def test_drafter_trains_exports_and_loads_back_both_ways(family, tmp_path):
    name, path, config, target = family
    vocab = config.get("text_config", config)["vocab_size"]
    cfg = drafter_cfg(vocab, name)
    torch.manual_seed(0)
    drafter = build_drafter(cfg, config)
    head = load_target_head(path)
    batch = train_batch(target, vocab, drafter.target_layer_ids)
    trainer = Trainer(
        drafter, head, cfg, TrainConfig(lr=3e-3, warmup_ratio=0.0, total_steps=100, seed=0), torch.device("cpu")
    )
    losses = [trainer.train_step(batch, 100).loss for _ in range(6)]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses

    out = export_drafter(drafter, cfg, config, tmp_path / "drafter", dtype=torch.float32, head_spec=head.spec)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "dflash.py", "model.safetensors"]
    assert json.loads((out / "config.json").read_text())[TARGET_HEAD_KEY] == head.spec.to_json()
    assert (out / "dflash.py").read_bytes() == MODEL_CODE_SOURCE.read_bytes()
    drafter.eval()
    ids, feats = batch.input_ids[:40], batch.features[:40]
    with torch.no_grad():
        ours = drafter.draft_block(feats[:30], ids[:31], head)
        assert torch.equal(load_drafter(out).eval().draft_block(feats[:30], ids[:31], head), ours)

    remote = AutoModel.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    assert type(remote).__name__ == "DFlashDraftModel" and remote.target_layer_ids == drafter.target_layer_ids
    # Context 30 > window 8: the sliding layer's mask matters here. fp32, same ops: agree to 1e-5.
    torch.testing.assert_close(
        remote_draft(remote, head, feats, ids, 30, cfg.mask_token_id), ours, rtol=1e-5, atol=1e-5
    )

    tensors = load_file(out / "model.safetensors")
    fc = tensors["fc.weight"]  # a tampered weight must show in the remote model's output (not a rescale:
    tensors["fc.weight"] = fc + 0.5 * fc.std() * torch.randn_like(fc)  # hidden_norm would undo it)
    save_file(tensors, out / "model.safetensors")
    tampered = AutoModel.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    assert not torch.allclose(remote_draft(tampered, head, feats, ids, 30, cfg.mask_token_id), ours, atol=1e-3)


# --- tying, softcapping and multimodal names ----------------------------------------------------------


@pytest.fixture(scope="module")
def gemma3_tied_capped(tmp_path_factory):
    """Gemma3 as published (tied, no lm_head.weight), with final logit softcapping on, small enough to bind on random
    weights."""
    path = build_target(
        tmp_path_factory.mktemp("gemma3_tied"),
        "gemma3",
        layers=LAYERS,
        hidden=HIDDEN,
        tie_word_embeddings=True,
        final_logit_softcapping=0.1,
    )
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_tied_softcapped_gemma3_head_matches_the_target(gemma3_tied_capped):
    path, model = gemma3_tied_capped
    assert "lm_head.weight" not in load_file(path / "model.safetensors")
    head = load_target_head(path)
    assert head.untied_lm_head_weight is None and head.logit_softcap == 0.1 and head.embed_scale == 8.0
    ids = sequences(410)[0]
    _, first, final_hidden, logits = target_features(model, ids, [1])
    assert torch.equal(head.embed(ids), first)
    uncapped = torch.nn.functional.linear(final_hidden, head.lm_head_weight)
    assert not torch.allclose(uncapped, logits, atol=1e-2)  # the cap binds here
    torch.testing.assert_close(head.logits(final_hidden), logits, rtol=1e-5, atol=1e-5)


def test_softcapped_loss_gradient_equals_autograd_through_the_cap(gemma3_tied_capped):
    """The chunked loss builds d(loss)/d(hidden) by hand; through tanh it must match plain autograd."""
    path, _ = gemma3_tied_capped
    head = load_target_head(path, dtype=torch.float64)
    cfg = DrafterConfig(block_size=BLOCK, loss_gamma=2.0, mask_token_id=402, loss_chunk_tokens=3)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 400, (12,), generator=g)
    anchors = Anchors(positions=torch.tensor([1, 5]), cu_anchors=torch.tensor([0, 2]), cu_seqlens=torch.tensor([0, 12]))
    hidden = torch.randn(2, BLOCK, HIDDEN, generator=g, dtype=torch.float64, requires_grad=True)
    loss = dflash_loss(hidden, anchors, ids, torch.ones(12, dtype=torch.bool), head, cfg).loss
    (grad,) = torch.autograd.grad(loss, hidden)

    weights = torch.exp(-torch.arange(BLOCK - 1, dtype=torch.float64) / 2.0)
    labels = torch.stack([ids[a + 1 : a + BLOCK] for a in (1, 5)])
    reference_hidden = hidden.detach().clone().requires_grad_(True)
    ce = torch.nn.functional.cross_entropy(
        head.logits(reference_hidden[:, 1:]).transpose(1, 2), labels, reduction="none"
    )
    reference = (ce * weights).sum() / (2 * weights.sum())
    (reference_grad,) = torch.autograd.grad(reference, reference_hidden)
    torch.testing.assert_close(loss.double(), reference.detach())
    torch.testing.assert_close(grad, reference_grad)


def test_gemma3_multimodal_checkpoint_names(tmp_path):
    """Gemma3ForConditionalGeneration saves the hub's language_model.model.* names; tied, scaled."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = dict(
        vocab_size=300,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        sliding_window=16,
    )
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    torch.manual_seed(0)
    Gemma3ForConditionalGeneration(
        Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    ).save_pretrained(tmp_path)
    names = set(load_file(tmp_path / "model.safetensors"))
    assert "language_model.model.embed_tokens.weight" in names and "lm_head.weight" not in names
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    head = load_target_head(tmp_path)
    ids = torch.arange(5, 25)
    _, first, final_hidden, logits = target_features(model, ids, [0])
    assert torch.equal(head.embed(ids), first)
    torch.testing.assert_close(head.logits(final_hidden), logits, rtol=1e-5, atol=1e-5)
    assert (
        drafter_hf_config(
            DrafterConfig(block_size=BLOCK, loss_gamma=2.0, mask_token_id=299),
            json.loads((tmp_path / "config.json").read_text()),
        )["rope_theta"]
        == 1e6
    )


# --- what is refused, and the real shapes ----------------------------------------------------------


def test_unrepresentable_rope_is_refused_with_a_way_out():
    for rope_type in ("dynamic", "longrope"):
        with pytest.raises(ValueError, match=f"rope_type '{rope_type}' is not representable.*drafter.rope_theta"):
            drafter_rope({"rope_parameters": {"rope_type": rope_type, "rope_theta": 1e4, "factor": 2.0}})
    assert drafter_rope({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}}, rope_theta=5e5) == {
        "rope_theta": 5e5,
        "rope_scaling": None,
    }
    with pytest.raises(ValueError, match="no 'full_attention'"):
        drafter_rope({"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}})
    llama31 = {
        "rope_type": "llama3",
        "rope_theta": 5e5,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert drafter_rope({"rope_parameters": llama31})["rope_scaling"] == {
        k: v for k, v in llama31.items() if k != "rope_theta"
    }


def test_a_head_the_probe_cannot_run_is_one_line(tmp_path):
    """A config the family's own code rejects (here a Gemma2 without its sliding_window) is refused by the
    probe in one line naming the error, not a traceback from inside the model."""
    path = build_target(tmp_path, "qwen3", layers=2, hidden=32)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "gemma2", "sliding_window": None}))
    with pytest.raises(HeadProbeError, match="the head probe could not run ValueError") as e:
        load_target_head(path)
    assert "\n" not in str(e.value)


def test_tied_checkpoint_with_a_different_lm_head_is_refused(tmp_path):
    path = build_target(tmp_path, "llama", layers=2, hidden=32)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    with pytest.raises(ValueError, match="tie_word_embeddings is true but lm_head.weight differs"):
        load_target_head(path)


def test_real_shapes_give_the_published_drafter_geometry():
    cfg = DrafterConfig(num_hidden_layers=5, block_size=16, mask_token_id=5)
    qwen3_8b = drafter_hf_config(cfg, shape_config("qwen3-8b"))
    assert (qwen3_8b["intermediate_size"], qwen3_8b["head_dim"], qwen3_8b["rope_theta"]) == (12288, 128, 1e6)
    assert qwen3_8b["dflash_config"]["target_layer_ids"] == [1, 9, 17, 25, 33]
    assert drafter_hf_config(cfg, shape_config("qwen3-30b-a3b"))["intermediate_size"] == 6144  # 8 x 768
    gpt_oss = drafter_hf_config(cfg, shape_config("gpt-oss-20b"))
    assert (gpt_oss["intermediate_size"], gpt_oss["num_attention_heads"], gpt_oss["head_dim"]) == (4 * 2880, 64, 64)
    qwen36 = drafter_hf_config(cfg, shape_config("qwen3.6-27b"))
    assert (qwen36["head_dim"], qwen36["num_key_value_heads"], qwen36["intermediate_size"]) == (256, 4, 17408)
    assert qwen36["dflash_config"]["target_layer_ids"] == [1, 16, 31, 46, 61]
    override = DrafterConfig(num_hidden_layers=5, block_size=16, mask_token_id=5, intermediate_size=4096)
    assert drafter_hf_config(override, shape_config("gpt-oss-20b"))["intermediate_size"] == 4096


@pytest.mark.parametrize("source", [MODEL_CODE_SOURCE, DSPARK_CODE_SOURCE], ids=["dflash.py", "dspark.py"])
def test_shipped_model_file_imports_only_torch_and_transformers(source):
    tree = ast.parse(source.read_text())
    roots = {
        alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
    }
    roots |= {
        node.module.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
    }
    assert roots <= {"__future__", "torch", "transformers"}, roots
    assert not any(isinstance(node, ast.ImportFrom) and node.level for node in ast.walk(tree))


@pytest.mark.processes
def test_a_restart_reuses_the_derived_head_without_modeling_code(tmp_path):
    """The cache keyed by config.json and the head tensors' header entries: the same target reads it in a fresh
    process that imports no transformers modeling file; a changed config.json probes again."""
    import subprocess
    import sys

    path = build_target(tmp_path / "target", "gemma3", layers=2, hidden=32)
    cache = tmp_path / "drafter-0" / "target-head.json"
    first = load_target_head(path, cache=cache)
    code = (
        "import json, sys; from dflash_ring.consumer.modeling.head_loader import load_target_head; "
        f"head = load_target_head({str(path)!r}, cache={str(cache)!r}); "
        "print(json.dumps([head.spec.to_json(), "
        "[m for m in sys.modules if m.startswith('transformers') and 'modeling' in m]]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout) == [first.spec.to_json(), []]
    key = json.loads(cache.read_text())["key"]
    (path / "config.json").write_text((path / "config.json").read_text() + "\n")  # another target, as far as we know
    assert load_target_head(path, cache=cache).spec == first.spec and json.loads(cache.read_text())["key"] != key
