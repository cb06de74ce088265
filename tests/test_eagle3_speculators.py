"""EAGLE-3 in vLLM speculators' own layout (Eagle3Speculator, shared/reference/eagle3.md 4.2), both ways, with
speculators as the oracle (installed as a test oracle: tests/test_peer_conformance.py's `oracle`).

Read: a drafter of speculators' own Eagle3DraftModel, its weights its own, saved by its save_pretrained, imports as
our drafter (drafter_import.released_drafter, and drafter.init_from's warm start) with the same logits at every TTT
step as speculators' model on the same inputs, a reduced draft vocabulary (d2t/t2d) or the target's, the residual
normed or not. Written: `dflash-ring export --layout speculators` loads in speculators'
Eagle3SpeculatorConfig.from_pretrained + Eagle3DraftModel.from_pretrained with our logits, and reads back here as the
same drafter. What our model has no equivalent of is refused in one line; so is the layout for a family we write no
speculators layout of.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, replace

import pytest
import torch

from dflash_ring.cli import main
from dflash_ring.common.config.drafter import DrafterConfig
from dflash_ring.consumer.families import family
from dflash_ring.consumer.families.build import build_drafter
from dflash_ring.consumer.layouts.drafter_hf_config import qwen3_config
from dflash_ring.consumer.layouts.drafter_import import ReleasedDrafterError, released_drafter
from dflash_ring.consumer.layouts.export import ExportLayoutError, export_drafter
from dflash_ring.consumer.modeling.model import load_target_head
from dflash_ring.consumer.modeling.target_head import HeadSpec
from dflash_ring.consumer.training.checkpoint import Checkpoint, CheckpointStore
from dflash_ring.consumer.training.warm_start import warm_start
from support import save_tiny_qwen3, tiny_qwen3_config
from test_eagle3 import TARGET_LAYERS, VOCAB, batch, drafter_and_head, eagle3_config, speculators_model
from test_peer_conformance import oracle

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # speculators' loading warnings

CASES = [  # (ttt_steps, draft vocabulary (0: the target's), norm_before_residual)
    (3, 100, True),
    (3, 100, False),
    (2, 0, True),
]


def their_logits(theirs, data, steps: int) -> list[torch.Tensor]:
    """speculators' draft logits [rows, Vd] at each TTT step on one document, shifted as its data loader does."""
    eagle3 = oracle("speculators.models.eagle3", "speculators")
    n = data["input_ids"].shape[0]
    shifted = eagle3.shift_batch(
        {
            "input_ids": data["input_ids"],
            "hidden_states": data["features"],
            "verifier_last_hidden_states": data["final_hidden"],
            "loss_mask": data["loss_mask"],
            "lengths": torch.tensor([n]),
            "position_ids": torch.arange(n),
        }
    )
    logits = []
    hook = theirs.lm_head.register_forward_hook(lambda m, i, o: logits.append(o[0]))
    with torch.no_grad():
        theirs.eval()(
            shifted["hidden_states"][None],
            shifted["input_ids"][None],
            torch.zeros(1, n - 1, dtype=torch.long),
            position_ids=shifted["position_ids"][None],
            ttt_steps=steps,
        )
    hook.remove()
    return logits


def assert_same_logits(ours, head, theirs, steps: int) -> None:
    """Our drafter's logits at every step equal speculators' on a 12-token document: their row t is ours; their last
    k rows read past the document at step k, ours never do."""
    data = batch([12])
    logits = their_logits(theirs, data, steps)
    with torch.no_grad():
        hidden = ours(data["features"], data["input_ids"], data["cu_seqlens"], head, steps)
    for k in range(steps):
        rows = 11 - k
        torch.testing.assert_close(ours.logits(hidden[k])[:rows], logits[k][:rows], rtol=0, atol=1e-5, msg=f"step {k}")


def speculators_drafter(cfg: DrafterConfig, seed: int = 11):
    """(speculators' Eagle3DraftModel with weights of its own, not our drafter's; our frozen head, whose embedding
    and head rows it shares)."""
    model, head = drafter_and_head(cfg)
    theirs = speculators_model(model, head, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in theirs.named_parameters():
            if name in ("embed_tokens.weight", "verifier_lm_head.weight"):  # the target's
                continue
            noise = torch.randn(param.shape, generator=g)
            param.copy_(1 + 0.2 * noise if name.endswith("norm.weight") else 0.1 * noise)
    return theirs, head


def target_config() -> dict:
    return tiny_qwen3_config(num_hidden_layers=TARGET_LAYERS).to_dict()


@pytest.mark.parametrize("steps,draft_vocab,norm_before_residual", CASES)
def test_a_speculators_save_imports_and_warm_starts_with_speculators_logits(
    tmp_path, steps, draft_vocab, norm_before_residual
):
    cfg = eagle3_config(steps, draft_vocab, norm_before_residual)
    theirs, head = speculators_drafter(cfg)
    theirs.save_pretrained(tmp_path / "theirs")
    saved = json.loads((tmp_path / "theirs" / "config.json").read_text())
    assert saved["speculators_model_type"] == "eagle3" and saved["draft_vocab_size"] == (draft_vocab or VOCAB)
    config, state = released_drafter(tmp_path / "theirs")
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == saved["eagle_aux_hidden_state_layer_ids"]
    assert (config["draft_vocab_size"], config["norm_before_residual"]) == (draft_vocab or VOCAB, norm_before_residual)
    assert "embed_tokens.weight" not in state and ("d2t" in state) == bool(draft_vocab)
    ours = family("eagle3").model(qwen3_config(config))
    ours.load_state_dict(state, strict=True)
    assert_same_logits(ours, head, theirs, steps)
    # drafter.init_from: speculators' layout records no mask token, and EAGLE-3 reads none: the run's is not compared
    assert cfg.mask_token_id != 0
    fresh = build_drafter(cfg, target_config()).float()
    warm_start(fresh, cfg, target_config(), tmp_path / "theirs")
    for name, tensor in state.items():
        assert torch.equal(fresh.state_dict()[name], tensor), name


@pytest.mark.parametrize("steps,draft_vocab,norm_before_residual", CASES)
def test_the_speculators_export_loads_in_speculators_with_our_logits_and_reads_back(
    tmp_path, steps, draft_vocab, norm_before_residual
):
    eagle3 = oracle("speculators.models.eagle3", "speculators")
    save_tiny_qwen3(tmp_path / "target", num_hidden_layers=TARGET_LAYERS)
    target = json.loads((tmp_path / "target" / "config.json").read_text())
    cfg = eagle3_config(steps, draft_vocab, norm_before_residual)
    model, _ = drafter_and_head(cfg)
    head = load_target_head(tmp_path / "target")
    out = export_drafter(
        model,
        cfg,
        target,
        tmp_path / "eagle3",
        dtype=torch.float32,
        head=head,
        layout="speculators",
        verifier=str(tmp_path / "target"),
    )
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]  # no code, atomic rename
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Eagle3Speculator"] and config["speculators_model_type"] == "eagle3"
    assert config["speculators_config"] == {
        "algorithm": "eagle3",
        "proposal_methods": [
            {"proposal_type": "greedy", "speculative_tokens": steps, "verifier_accept_k": 1, "accept_tolerance": 0.0}
        ],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": str(tmp_path / "target"), "architectures": ["Qwen3ForCausalLM"]},
    }
    assert config["norm_before_residual"] is norm_before_residual  # always written: absent is true in vLLM
    assert (config["norm_before_fc"], config["fc_norm"], config["norm_output"]) == (False, False, False)
    assert (config["draft_vocab_size"], config["target_hidden_size"]) == (draft_vocab or VOCAB, 64)
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 6]  # HF hidden_states indices: ours + 1
    assert config["transformer_layer_config"]["model_type"] == "llama"
    loaded = eagle3.Eagle3SpeculatorConfig.from_pretrained(out)
    assert loaded.norm_before_residual is norm_before_residual and loaded.draft_vocab_size == (draft_vocab or VOCAB)
    loaded.transformer_layer_config._attn_implementation = "eager"
    theirs = eagle3.Eagle3DraftModel.from_pretrained(out, config=loaded)
    assert theirs.target_layer_ids == [2, 4, 6]
    with torch.no_grad():  # the file ships no embedding (vLLM shares the target's); their load leaves it unset
        theirs.embed_tokens.weight.copy_(head.embed_weight)
    assert_same_logits(model.eval(), head, theirs, steps)
    # drafter.init_from of our own export: the same drafter (its mask token kept beside speculators' keys)
    fresh = build_drafter(cfg, target)
    warm_start(fresh, cfg, target, out)
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name


@pytest.fixture(scope="module")
def their_save(tmp_path_factory):
    """A speculators Eagle3 save (reduced vocabulary) to edit."""
    theirs, _ = speculators_drafter(eagle3_config(3, 100, True))
    path = tmp_path_factory.mktemp("speculators") / "eagle3"
    theirs.save_pretrained(path)
    return path


def refused(source, tmp_path, top=None, layer=None) -> str:
    """The one-line refusal of a copy of `source` with config.json's keys (and transformer_layer_config's) changed."""
    out = shutil.copytree(source, tmp_path / "edited")
    config = json.loads((out / "config.json").read_text())
    config |= top or {}
    config["transformer_layer_config"] |= layer or {}
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ReleasedDrafterError) as e:
        released_drafter(out)
    assert "\n" not in str(e.value) and "config.json" in str(e.value)
    return str(e.value)


@pytest.mark.parametrize(
    "top, layer, words",
    [
        ({"norm_before_fc": True}, None, "norm_before_fc true"),
        ({"fc_norm": True}, None, "fc_norm true"),
        ({"norm_output": True}, None, "norm_output true"),
        ({"embed_requires_grad": True}, None, "embed_requires_grad true"),
        ({"norm_before_residual": None}, None, "no norm_before_residual"),
        ({"eagle_aux_hidden_state_layer_ids": [0, 4, 6]}, None, "eagle_aux_hidden_state_layer_ids [0, 4, 6]"),
        ({"eagle_aux_hidden_state_layer_ids": None}, None, "no eagle_aux_hidden_state_layer_ids"),
        ({"target_hidden_size": 32}, None, "target_hidden_size 32"),
        ({"draft_vocab_size": 300}, None, "draft_vocab_size 300 is not in 1..256"),
        (None, {"model_type": "qwen3"}, "model_type 'qwen3'"),
        (None, {"num_hidden_layers": 2}, "num_hidden_layers 2"),
        (None, {"mlp_bias": True}, "mlp_bias true"),
        (None, {"attention_bias": True}, "attention_bias true"),
        (None, {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        (None, {"layer_types": ["sliding_attention"], "sliding_window": 8}, "layer_types ['sliding_attention']"),
        (
            None,
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
            "partial rotary",
        ),
    ],
)
def test_speculators_eagle3_options_without_an_equivalent_are_refused(their_save, tmp_path, top, layer, words):
    message = refused(their_save, tmp_path, top, layer)
    assert words in message, message


def save_checkpoint(root, model, cfg: DrafterConfig, target: dict, **info):
    CheckpointStore(root).save(
        Checkpoint(
            step=3,
            model=model.state_dict(),
            optimizer={"state": {}, "param_groups": []},
            tensors={},
            info={
                "drafter": asdict(cfg),
                "target_config": target,
                "target_head": HeadSpec(tied=False).to_json(),
                **info,
            },
        ),
        keep=1,
    )
    return root


def test_dflash_ring_export_layout_speculators_of_a_checkpoint(tmp_path, capsys):
    """The command's path: the verifier is the target path the run recorded (or --target as given); a checkpoint
    that records none, and a family without a speculators writer, are refused in one line, nothing written."""
    save_tiny_qwen3(tmp_path / "target", num_hidden_layers=TARGET_LAYERS)
    target = json.loads((tmp_path / "target" / "config.json").read_text())
    cfg = eagle3_config(3, 100)
    model, _ = drafter_and_head(cfg)
    ckpt = save_checkpoint(tmp_path / "ckpt", model, cfg, target, target_path=str(tmp_path / "target"))
    assert main(["export", str(ckpt), str(tmp_path / "out"), "--layout", "speculators"]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(tmp_path / "target")
    assert (
        main(["export", str(ckpt), str(tmp_path / "hub"), "--layout", "speculators", "--target", "Qwen/Qwen3-8B"]) == 0
    )
    assert json.loads((tmp_path / "hub" / "config.json").read_text())["speculators_config"]["verifier"] == {
        "name_or_path": "Qwen/Qwen3-8B",
        "architectures": ["Qwen3ForCausalLM"],
    }
    assert main(["export", str(ckpt), str(tmp_path / "flat")]) == 0  # the default stays the flat layout
    assert json.loads((tmp_path / "flat" / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    capsys.readouterr()

    unrecorded = save_checkpoint(tmp_path / "unrecorded", model, cfg, target)
    assert main(["export", str(unrecorded), str(tmp_path / "none"), "--layout", "speculators"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "names its verifier" in err[0] and "--target" in err[0], err

    dflash = DrafterConfig(mask_token_id=VOCAB - 1, target_layer_ids=[1, 3], num_hidden_layers=1)
    block = build_drafter(dflash, target)
    other = save_checkpoint(tmp_path / "dflash", block, dflash, target, target_path=str(tmp_path / "target"))
    assert main(["export", str(other), str(tmp_path / "refused"), "--layout", "speculators"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "layout 'speculators'" in err[0] and "is written for EAGLE-3 drafters" in err[0], err
    assert not (tmp_path / "none").exists() and not (tmp_path / "refused").exists()
    with pytest.raises(ExportLayoutError, match=r"not a DFlash drafter \(architectures \['DFlashDraftModel'\]\)"):
        export_drafter(block, dflash, target, tmp_path / "refused", layout="speculators", verifier="t")
