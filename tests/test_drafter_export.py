"""Drafter export in the public DFlash format, and loading it back."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config

from dflash_ring.common.config.drafter import DrafterConfig
from dflash_ring.consumer.layouts.drafter_hf_config import drafter_hf_config
from dflash_ring.common.refusal import Refusal
from dflash_ring.common.safetensors_check import DamagedWeightsError
from dflash_ring.consumer.layouts.export import export_drafter, load_drafter
from dflash_ring.consumer.modeling.model import Anchors, block_attention_mask, cu_seqlens_from_lengths, load_target_head
from dflash_ring.consumer.families.build import build_drafter
from support import save_tiny_qwen3

HIDDEN, NUM_LAYERS = 64, 2


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    save_tiny_qwen3(
        path,
        num_hidden_layers=8,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        bos_token_id=1,
        eos_token_id=2,
    )
    return json.loads((path / "config.json").read_text()), load_target_head(path)


@pytest.fixture
def drafter(target):
    target_config, _ = target
    torch.manual_seed(3)
    cfg = DrafterConfig(num_hidden_layers=NUM_LAYERS, block_size=4, loss_gamma=2.0, mask_token_id=250)
    model = build_drafter(cfg, target_config)
    with torch.no_grad():  # non-trivial norms, so a dropped or swapped norm weight would show
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return cfg, model


def public_names(num_layers: int) -> set[str]:
    per_layer = [f"self_attn.{p}_proj.weight" for p in "qkvo"] + [
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
    ]
    return {f"layers.{i}.{n}" for i in range(num_layers) for n in per_layer} | {
        "fc.weight",
        "hidden_norm.weight",
        "norm.weight",
    }


def logits(model, head, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths = [20, 12]
    total = sum(lengths)
    context = torch.randn(total, NUM_LAYERS * HIDDEN, generator=gen)
    input_ids = torch.randint(0, 250, (total,), generator=gen)
    anchors = Anchors(
        positions=torch.tensor([2, 9, 15, 21, 27]),
        cu_anchors=torch.tensor([0, 3, 5]),
        cu_seqlens=cu_seqlens_from_lengths(lengths),
    )
    with torch.no_grad():
        return head.logits(model(context, input_ids, anchors, head))


def test_fp32_export_round_trips_bitwise(tmp_path, target, drafter):
    target_config, head = target
    cfg, model = drafter
    out = export_drafter(model, cfg, target_config, tmp_path / "drafter", dtype=torch.float32)
    loaded = load_drafter(out)
    assert loaded.fc.weight.dtype == torch.float32
    assert torch.equal(logits(loaded, head), logits(model, head))


def test_export_writes_the_public_dflash_format(tmp_path, target, drafter):
    target_config, _ = target
    cfg, model = drafter
    out = export_drafter(model, cfg, target_config, tmp_path / "drafter")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "dflash.py", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["drafter"]  # no temp dir left behind

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}
    assert config["model_type"] == "qwen3"
    assert config["block_size"] == 4
    assert config["num_target_layers"] == 8
    assert config["dflash_config"] == {"mask_token_id": 250, "target_layer_ids": [1, 5]}
    assert config["tie_word_embeddings"] is False
    assert config["dtype"] == "bfloat16"
    expected_qwen3 = {
        "num_hidden_layers": NUM_LAYERS,
        "hidden_size": HIDDEN,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e6,
        "rope_scaling": None,
        "max_position_embeddings": 512,
        "vocab_size": 256,
        "layer_types": ["full_attention"] * NUM_LAYERS,
        "sliding_window": None,
        "use_sliding_window": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    assert {k: config[k] for k in expected_qwen3} == expected_qwen3

    with safe_open(out / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
        dtypes = {f.get_tensor(k).dtype for k in names}
    assert names == public_names(NUM_LAYERS)
    assert not any("embed_tokens" in n or "lm_head" in n for n in names)
    assert dtypes == {torch.bfloat16}
    assert load_drafter(out).fc.weight.dtype == torch.bfloat16


def test_hf_config_reads_legacy_and_transformers5_rope_keys():
    cfg = DrafterConfig(block_size=16, mask_token_id=5)
    common = dict(
        hidden_size=64,
        num_hidden_layers=36,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=256,
        rms_norm_eps=1e-6,
        max_position_embeddings=131072,
    )
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    legacy = drafter_hf_config(cfg, {**common, "rope_theta": 1e6, "rope_scaling": yarn})
    modern = drafter_hf_config(cfg, Qwen3Config(**common, rope_parameters={**yarn, "rope_theta": 1e6}))
    for config in (legacy, modern):
        assert config["rope_theta"] == 1e6
        assert config["rope_scaling"] == yarn
        assert config["dflash_config"]["target_layer_ids"] == [18]
    nested = drafter_hf_config(cfg, {"text_config": {**common, "rope_theta": 1e6}, "tie_word_embeddings": False})
    assert nested["num_target_layers"] == 36 and nested["rope_scaling"] is None


def test_export_refuses_to_overwrite(tmp_path, target, drafter):
    target_config, _ = target
    cfg, model = drafter
    (tmp_path / "drafter").mkdir()
    with pytest.raises(FileExistsError):
        export_drafter(model, cfg, target_config, tmp_path / "drafter")


def test_export_refuses_a_model_that_does_not_match_the_config(tmp_path, target, drafter):
    target_config, _ = target
    cfg, model = drafter
    deeper = DrafterConfig(
        num_hidden_layers=NUM_LAYERS + 1, block_size=4, loss_gamma=2.0, mask_token_id=250, target_layer_ids=[1, 5]
    )
    with pytest.raises(ValueError, match="missing"):
        export_drafter(model, deeper, target_config, tmp_path / "drafter")
    other_mask = DrafterConfig(num_hidden_layers=NUM_LAYERS, block_size=4, loss_gamma=2.0, mask_token_id=7)
    with pytest.raises(ValueError, match="mask_token_id"):
        export_drafter(model, other_mask, target_config, tmp_path / "drafter")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "tamper, message",
    [
        (lambda t: t.pop("norm.weight"), "missing \\['norm.weight'\\]"),
        (lambda t: t.update({"lm_head.weight": torch.zeros(256, HIDDEN)}), "unexpected \\['lm_head.weight'\\]"),
        (lambda t: t.update({"fc.weight": torch.zeros(HIDDEN, HIDDEN)}), "fc.weight: \\(64, 64\\) != \\(64, 128\\)"),
    ],
)
def test_load_refuses_mismatched_weights(tmp_path, target, drafter, tamper, message):
    target_config, _ = target
    cfg, model = drafter
    out = export_drafter(model, cfg, target_config, tmp_path / "drafter")
    tensors = load_file(out / "model.safetensors")
    tamper(tensors)
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(ValueError, match=message):
        load_drafter(out)


def test_load_refuses_truncated_weights_in_one_line_naming_the_file(tmp_path, target, drafter):
    """An export cut short (a copy interrupted, a full disk): one Refusal naming the file, before safetensors reads it
    (whose own error is a traceback from deep inside the loader)."""
    target_config, _ = target
    cfg, model = drafter
    out = export_drafter(model, cfg, target_config, tmp_path / "drafter")
    weights = out / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(DamagedWeightsError, match="model.safetensors") as e:
        load_drafter(out)
    assert isinstance(e.value, Refusal)


def vllm_layer_causal(config: dict, layer: int) -> bool:
    """vLLM's _dflash_layer_causal as read from its code (shared/reference/dspark-dflash2.md 2.1): top-level
    is_causal, then dflash_config.causal, else a sliding layer is causal and a full one not."""
    if config.get("is_causal") is not None:
        return bool(config["is_causal"])
    if config.get("dflash_config", {}).get("causal") is not None:
        return bool(config["dflash_config"]["causal"])
    return config["layer_types"][layer] == "sliding_attention"


def zlab_layer_causal(config: dict, layer: int) -> bool:
    """z-lab's Qwen3DFlashAttention (dflash 0.1.0): top-level is_causal, else sliding => causal."""
    if config.get("is_causal") is not None:
        return bool(config["is_causal"])
    return config["layer_types"][layer] == "sliding_attention"


def trained_layer_causal(model, layer: int) -> bool:
    """Whether the training mask of this layer is causal inside the block (lower triangular), else bidirectional
    there: read off the mask the model builds, not off its attributes."""
    window = model.layers[layer].self_attn.sliding_window
    mask = block_attention_mask(
        torch.tensor([5]), ctx_len=5, block_size=4, sliding_window=window, sliding_causal=model.sliding_causal
    )[:, 5:]
    if torch.equal(mask, torch.ones(4, 4, dtype=torch.bool).tril()):
        return True
    assert mask.all()
    return False


@pytest.mark.parametrize("recipe", ["paper", "ddtree", "dflash2"])
def test_an_export_serves_its_layers_as_they_trained(tmp_path, target, recipe):
    """The engines read a drafter's attention semantics off its config.json (shared/reference/dspark-dflash2.md,
    "Causality of sliding layers"): vLLM takes top-level is_causal, then dflash_config.causal, else sliding => causal
    and full => not; z-lab top-level is_causal, else the same default. Our DFlash sliding layers train causal inside
    the block and our full ones bidirectional, which is that default: so a DFlash export writes neither key
    (is_causal: false would serve every layer non-causal). DFlash2 trains its sliding layers bidirectional too: its
    export writes is_causal: false. Either way each layer, as both rules read the export, is what trained, and
    use_sliding_window is true exactly when a layer slides. For z-lab this is also run, not only read:
    tests/test_peer_conformance.py gets our drafts to 1e-5 through z-lab's own models (DFlash and DFlash2)."""
    target_config, _ = target
    cfg = DrafterConfig(
        recipe=recipe, num_hidden_layers=NUM_LAYERS, mask_token_id=250, sliding_window=None if recipe == "paper" else 64
    )
    model = build_drafter(cfg, target_config)
    out = export_drafter(model, cfg, target_config, tmp_path / recipe)
    config = json.loads((out / "config.json").read_text())
    trained = [trained_layer_causal(model, i) for i in range(NUM_LAYERS)]
    assert [vllm_layer_causal(config, i) for i in range(NUM_LAYERS)] == trained
    assert [zlab_layer_causal(config, i) for i in range(NUM_LAYERS)] == trained
    if recipe == "dflash2":
        assert config["is_causal"] is False and trained == [False] * NUM_LAYERS
    else:
        assert "is_causal" not in config and "causal" not in config["dflash_config"]
        assert trained == [kind == "sliding_attention" for kind in config["layer_types"]]
    sliding = [kind == "sliding_attention" for kind in config["layer_types"]]
    assert config["use_sliding_window"] is any(sliding) is (recipe != "paper")
