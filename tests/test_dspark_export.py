"""DSpark export in DeepSeek's flat Qwen3DSparkModel layout (shared/reference/dspark-dflash2.md section 1.5 (A)),
loading it back, `dflash-ring export` of a DSpark checkpoint, and the refusals of a layout where the other is expected.
The same weights through peers' model code: tests/test_peer_conformance.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModel

from dflash_ring.cli import main
from dflash_ring.common.config.drafter import DrafterConfig
from dflash_ring.consumer.training.checkpoint import Checkpoint, CheckpointError, CheckpointStore, export_checkpoint
from dflash_ring.consumer.layouts.export import export_drafter, load_drafter
from dflash_ring.consumer.families.dspark import CODE_SOURCE as DSPARK_CODE_SOURCE
from dflash_ring.consumer.modeling.model import FrozenTargetHead, load_target_head
from dflash_ring.consumer.families.dspark.model import DSparkDraftModel
from dflash_ring.consumer.families.build import build_drafter
from dflash_ring.consumer.modeling.target_head import HeadSpec
from support import save_tiny_qwen3

HIDDEN, VOCAB, RANK, BLOCK, MASK_ID = 64, 256, 8, 4, 250


@pytest.fixture(scope="module", params=["untied", "tied"])
def target(request, tmp_path_factory):
    """(dir, config dict, our frozen head) of a tiny Qwen3 target, its lm_head its own or its embedding."""
    path = tmp_path_factory.mktemp("target")
    save_tiny_qwen3(
        path,
        num_hidden_layers=8,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=request.param == "tied",
        bos_token_id=1,
        eos_token_id=2,
    )
    return path, json.loads((path / "config.json").read_text()), load_target_head(path)


def dspark_config(kind: str = "vanilla") -> DrafterConfig:
    return DrafterConfig(
        recipe="dspark",
        num_hidden_layers=2,
        block_size=BLOCK,
        markov_rank=RANK,
        markov_head=kind,
        mask_token_id=MASK_ID,
    )


def dspark_drafter(target_config, kind: str = "vanilla"):
    torch.manual_seed(4)
    cfg = dspark_config(kind)
    model = build_drafter(cfg, target_config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return cfg, model


def test_dspark_export_is_deepseeks_flat_layout(tmp_path, target):
    path, target_config, head = target
    cfg, model = dspark_drafter(target_config)
    out = export_drafter(model, cfg, target_config, tmp_path / "drafter", head=head)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "dspark.py", "model.safetensors"]
    assert (out / "dspark.py").read_bytes() == DSPARK_CODE_SOURCE.read_bytes()
    config = json.loads((out / "config.json").read_text())
    expected = {
        "architectures": ["Qwen3DSparkModel"],  # never DSparkDraftModel: vLLM maps that name to DeepSeek-V4
        "auto_map": {"AutoModel": "dspark.Qwen3DSparkModel"},
        "model_type": "qwen3",
        "num_hidden_layers": 2,
        "hidden_size": HIDDEN,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,  # explicit: SGLang refuses a derived one
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512,
        "vocab_size": VOCAB,
        "rope_theta": 1e6,
        "rope_scaling": None,  # transformers 4 and the engines reading rope_theta
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},  # as transformers 5 writes it
        "tie_word_embeddings": False,  # even for a tied target: both tensors ship
        "layer_types": ["full_attention"] * 2,
        "num_target_layers": 8,
        "block_size": BLOCK,
        "target_layer_ids": [1, 5],
        "mask_token_id": MASK_ID,
        "num_anchors": 512,
        "sample_from_anchor": True,
        "dspark_bonus_anchor": False,  # top-level: anchor-first, every slot drafts
        "markov_rank": RANK,
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    assert {k: config.get(k) for k in expected} == expected
    assert "dflash_config" not in config  # the DFlash nesting: vLLM's DFlash base refuses sample_from_anchor in it
    with safe_open(out / "model.safetensors", framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    assert set(tensors) == set(model.state_dict()) | {"embed_tokens.weight", "lm_head.weight"}
    assert {
        "markov_head.markov_w1.weight",
        "markov_head.markov_w2.weight",
        "confidence_head.proj.weight",
        "confidence_head.proj.bias",
        "fc.weight",
        "hidden_norm.weight",
        "norm.weight",
    } <= set(tensors)
    assert not any(k.startswith("model.") for k in tensors)
    assert (
        tensors["markov_head.markov_w1.weight"].shape,
        tensors["markov_head.markov_w2.weight"].shape,
        tensors["confidence_head.proj.weight"].shape,
    ) == ((VOCAB, RANK), (VOCAB, RANK), (1, HIDDEN + RANK))
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert torch.equal(tensors["embed_tokens.weight"], head.embed_weight.to(torch.bfloat16))
    assert torch.equal(tensors["lm_head.weight"], head.lm_head_weight.to(torch.bfloat16))
    loaded = load_drafter(out, arch="dspark", target_head=head)
    assert isinstance(loaded, DSparkDraftModel) and loaded.fc.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_fp32_dspark_export_round_trips_bitwise(tmp_path, target, kind):
    path, target_config, head = target
    cfg, model = dspark_drafter(target_config, kind)
    out = export_drafter(model, cfg, target_config, tmp_path / "drafter", dtype=torch.float32, head=head)
    for arch in ("dspark", None):
        loaded = load_drafter(out, arch=arch, target_head=head)
        assert loaded.markov_head.kind == kind
        for name, tensor in model.state_dict().items():
            assert torch.equal(loaded.state_dict()[name], tensor), name
    hf = AutoModel.from_pretrained(out, trust_remote_code=True, dtype=torch.float32)
    assert torch.equal(hf.lm_head.weight, head.lm_head_weight)  # tied target: its embedding


def test_a_layout_where_the_other_is_expected_is_refused_naming_both(tmp_path, target):
    path, target_config, head = target
    cfg, model = dspark_drafter(target_config)
    dspark = export_drafter(model, cfg, target_config, tmp_path / "dspark", head=head)
    dflash_cfg = DrafterConfig(num_hidden_layers=2, block_size=BLOCK, loss_gamma=2.0, mask_token_id=MASK_ID)
    dflash = export_drafter(build_drafter(dflash_cfg, target_config), dflash_cfg, target_config, tmp_path / "dflash")
    dspark_names, dflash_names = r"\['Qwen3DSparkModel'\]", r"\['DFlashDraftModel'\]"
    both = rf"DSpark drafter \(architectures {dspark_names}\).*DFlash drafter \(architectures {dflash_names}\)"
    with pytest.raises(ValueError, match=f"is a {both} is expected here"):
        load_drafter(dspark)  # the default: what every caller before DSpark decodes
    reverse = rf"DFlash drafter \(architectures {dflash_names}\).*DSpark drafter \(architectures {dspark_names}\)"
    with pytest.raises(ValueError, match=f"is a {reverse} is expected here"):
        load_drafter(dflash, arch="dspark")
    # transformers with the other layout's code file: the shipped files refuse too, naming both
    (tmp_path / "swap").mkdir()
    for name in ("config.json", "model.safetensors"):
        (tmp_path / "swap" / name).write_bytes((dflash / name).read_bytes())
    (tmp_path / "swap" / "dspark.py").write_bytes((dspark / "dspark.py").read_bytes())
    config = json.loads((dflash / "config.json").read_text())
    (tmp_path / "swap" / "config.json").write_text(
        json.dumps({**config, "auto_map": {"AutoModel": "dspark.Qwen3DSparkModel"}})
    )
    with pytest.raises(ValueError, match="DFlash drafter.*not a DSpark one.*Qwen3DSparkModel"):
        AutoModel.from_pretrained(tmp_path / "swap", trust_remote_code=True)
    (tmp_path / "swap2").mkdir()
    (tmp_path / "swap2" / "model.safetensors").write_bytes((dspark / "model.safetensors").read_bytes())
    (tmp_path / "swap2" / "dflash.py").write_bytes((dflash / "dflash.py").read_bytes())
    config = json.loads((dspark / "config.json").read_text())
    (tmp_path / "swap2" / "config.json").write_text(
        json.dumps({**config, "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}})
    )
    with pytest.raises(ValueError, match="not a DFlash drafter.*Qwen3DSparkModel.*dspark.py"):
        AutoModel.from_pretrained(tmp_path / "swap2", trust_remote_code=True)
    # and export refuses a model of one arch with the config of the other
    with pytest.raises(ValueError, match="the model is a DSpark drafter.*arch = 'dflash'.*DFlash drafter"):
        export_drafter(model, dflash_cfg, target_config, tmp_path / "mixed")
    with pytest.raises(ValueError, match="architectures is \\['Qwen3Model'\\], neither .*DFlash.*DSpark.* nor "):
        (tmp_path / "other").mkdir()
        (tmp_path / "other" / "config.json").write_text(json.dumps({"architectures": ["Qwen3Model"]}))
        load_drafter(tmp_path / "other", arch=None)


def test_a_dspark_export_needs_the_targets_head(tmp_path, target):
    path, target_config, head = target
    cfg, model = dspark_drafter(target_config)
    with pytest.raises(ValueError, match="ships the target's embed_tokens and lm_head"):
        export_drafter(model, cfg, target_config, tmp_path / "drafter")
    scaled = FrozenTargetHead(
        head.embed_weight, head.untied_lm_head_weight, spec=HeadSpec(tied=head.spec.tied, logit_softcap=30.0)
    )
    with pytest.raises(ValueError, match="plain embedding and lm_head"):
        export_drafter(model, cfg, target_config, tmp_path / "drafter", head=scaled)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "tamper, message",
    [
        (lambda t: t.pop("lm_head.weight"), r"missing \['lm_head.weight'\]"),
        (lambda t: t.pop("markov_head.markov_w2.weight"), r"missing \['markov_head.markov_w2.weight'\]"),
        (
            lambda t: t.update({"markov_head.gate_proj.weight": torch.zeros(RANK, HIDDEN + RANK)}),
            r"unexpected \['markov_head.gate_proj.weight'\]",
        ),
        (
            lambda t: t.update({"embed_tokens.weight": torch.zeros(VOCAB - 1, HIDDEN)}),
            r"embed_tokens.weight: \(255, 64\) != \(256, 64\)",
        ),
        (
            lambda t: t.update({"confidence_head.proj.weight": torch.zeros(1, HIDDEN)}),
            r"confidence_head.proj.weight: \(1, 64\) != \(1, 72\)",
        ),
    ],
)
def test_load_refuses_dspark_tensors_that_do_not_match_the_config(tmp_path, target, tamper, message):
    path, target_config, head = target
    cfg, model = dspark_drafter(target_config)
    out = export_drafter(model, cfg, target_config, tmp_path / "drafter", head=head)
    tensors = load_file(out / "model.safetensors")
    tamper(tensors)
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(ValueError, match=f"does not match its DSpark config.*{message}"):
        load_drafter(out, arch="dspark")


def test_load_refuses_a_dspark_export_of_another_target(tmp_path, target):
    path, target_config, head = target
    cfg, model = dspark_drafter(target_config)
    out = export_drafter(model, cfg, target_config, tmp_path / "drafter", head=head)
    other = FrozenTargetHead(head.embed_weight + 1, head.untied_lm_head_weight)
    with pytest.raises(ValueError, match="embed_tokens.weight differs from the target's"):
        load_drafter(out, arch="dspark", target_head=other)


def save_checkpoint(root, model, cfg, target_config, **info):
    from dataclasses import asdict

    store = CheckpointStore(root)
    store.save(
        Checkpoint(
            step=3,
            model=model.state_dict(),
            optimizer={"state": {}, "param_groups": []},
            tensors={},
            info={
                "drafter": asdict(cfg),
                "target_config": target_config,
                "target_head": HeadSpec(tied=False).to_json(),
                **info,
            },
        ),
        keep=1,
    )
    return root


def test_dflash_ring_export_of_a_dspark_checkpoint_reads_the_recorded_target(tmp_path, target):
    path, target_config, head = target
    cfg, model = dspark_drafter(target_config)
    spec = head.spec.to_json()
    ckpt = save_checkpoint(tmp_path / "ckpt", model, cfg, target_config, target_path=str(path), target_head=spec)
    out = export_checkpoint(ckpt, tmp_path / "out")
    loaded = load_drafter(out, arch="dspark", target_head=head)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor.to(torch.bfloat16)), name
    # --target overrides what the checkpoint recorded
    assert main(["export", str(ckpt), str(tmp_path / "out2"), "--target", str(path)]) == 0
    assert torch.equal(
        load_file(tmp_path / "out2" / "model.safetensors")["lm_head.weight"], head.lm_head_weight.to(torch.bfloat16)
    )


def test_dflash_ring_export_of_a_dspark_checkpoint_without_a_target_is_one_line(tmp_path, target, capsys):
    path, target_config, head = target
    cfg, model = dspark_drafter(target_config)
    ckpt = save_checkpoint(tmp_path / "ckpt", model, cfg, target_config, target_head=head.spec.to_json())
    with pytest.raises(CheckpointError, match="records no target path.*--target DIR"):
        export_checkpoint(ckpt, tmp_path / "out")
    assert main(["export", str(ckpt), str(tmp_path / "out"), "--target", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nowhere (--target) gives none" in err[0], err
    (tmp_path / "small").mkdir()
    save_tiny_qwen3(tmp_path / "small", vocab_size=128, tie_word_embeddings=head.spec.tied)
    with pytest.raises(
        CheckpointError, match=r"not the target this drafter trained with: its embedding is \(128, 64\)"
    ):
        export_checkpoint(ckpt, tmp_path / "out", tmp_path / "small")
    assert not (tmp_path / "out").exists()
