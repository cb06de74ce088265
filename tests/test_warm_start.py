"""Warm start (drafter.init_from): a released drafter's weights as the first weights of a run's drafter.

The released drafters are saved by the peers' own code where a package of theirs is installed (z-lab's
DFlashDraftModel and DFlash2DraftModel through save_pretrained; speculators' layouts are read in
tests/test_drafter_import.py) and by our export for DeepSeek's flat DSpark layout (no DeepSeek package exists to
save one). The drafter is built as a run builds it (consumer/process.build) and started as a run starts it
(Resumed.load with no checkpoint): its first forward equals the peer model's, the checkpoints record where the
weights came from, and a drafter that resumes takes its checkpoint instead. Whatever is not this drafter is
refused in one line naming the difference.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from dflash_ring.common.config.drafter import DrafterConfig
from dflash_ring.common.config.target import TargetConfig
from dflash_ring.common.config.train import TrainConfig
from dflash_ring.consumer.training.checkpoint import CheckpointStore
from dflash_ring.consumer.layouts.drafter_hf_config import drafter_hf_config
from dflash_ring.consumer.layouts.export import export_drafter
from dflash_ring.consumer.modeling.model import load_target_head
from dflash_ring.consumer.families.build import build_drafter
from dflash_ring.consumer.training.process import Resumed, build
from dflash_ring.consumer.training.warm_start import WarmStartError

from support import anchors_from_local, save_tiny_qwen3

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile:UserWarning")

MASK_ID, BLOCK, TOLERANCE = 250, 4, 1e-5
LENGTH, ANCHORS = 24, [3, 11, 19]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """(dir, config dict, HF model fp32) of a tiny Qwen3 target of 8 layers."""
    path = tmp_path_factory.mktemp("target")
    save_tiny_qwen3(path, num_hidden_layers=8)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, json.loads((path / "config.json").read_text()), model


def zlab():
    """z-lab's dflash.model (a test oracle `make setup` installs; CI fails without it, as the conformance tests)."""
    from test_peer_conformance import oracle

    return oracle("dflash.model", "dflash")


def drafter_cfg(**fields) -> DrafterConfig:
    return DrafterConfig(block_size=BLOCK, loss_gamma=2.0, mask_token_id=MASK_ID, num_hidden_layers=2, **fields)


def randomised(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights unlike a fresh initialisation of ours (norms off 1 too), so a warm start that loaded nothing shows."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.uniform_(0.5, 1.5) if name.endswith("norm.weight") else param.normal_(std=0.05)
    return model


def start(cfg: DrafterConfig, target_dir, tmp_path) -> tuple[Resumed, torch.nn.Module]:
    """The drafter as a run builds and starts it: consumer/process.build, then Resumed.load with the run's store."""
    built = build(
        cfg,
        TargetConfig(path=str(target_dir), layer_ids=[1, 5]),  # the two layers a 2-layer drafter reads (8 layers)
        TrainConfig(compile=False),
        (),
        "",
        torch.device("cpu"),
        tmp_path / "head-cache",
    )
    resumed = Resumed(str(tmp_path / "checkpoints"), 0, built)
    resumed.load()
    return resumed, built.trainer.model


def test_a_zlab_dflash_drafter_starts_ours_with_its_weights_and_its_drafts(target, tmp_path):
    module = zlab()
    path, config, hf = target
    cfg = drafter_cfg()
    theirs = randomised(module.DFlashDraftModel(Qwen3Config(**drafter_hf_config(cfg, config))), seed=7).eval()
    theirs.save_pretrained(tmp_path / "released")
    resumed, ours = start(drafter_cfg(init_from=str(tmp_path / "released")), path, tmp_path)
    for name, tensor in theirs.state_dict().items():
        assert torch.equal(ours.state_dict()[name], tensor), name
    assert resumed.warm_start["arch"] == "dflash" and resumed.warm_start["path"] == str(tmp_path / "released")
    assert len(resumed.warm_start["weights_sha256"]) == 64
    # The first forward: our training forward against z-lab's drafter on each block alone, as dflash_generate runs it.
    head = load_target_head(path)
    ids = torch.randint(0, MASK_ID, (LENGTH,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = hf(ids[None], output_hidden_states=True, use_cache=False).hidden_states
        features = torch.cat([hidden[i + 1][0] for i in ours.target_layer_ids], dim=-1)
        got = ours.eval()(features, ids, anchors_from_local([LENGTH], [ANCHORS]), head, attention="sdpa")
        want = []
        for a in ANCHORS:
            block = torch.full((1, BLOCK), MASK_ID)
            block[0, 0] = ids[a]
            want.append(
                theirs(
                    position_ids=torch.arange(a + BLOCK)[None],
                    noise_embedding=hf.get_input_embeddings()(block),
                    target_hidden=features[:a][None],
                )[0]
            )
        want = torch.stack(want)
        got_logits, want_logits = head.logits(got), theirs.compute_logits(want, hf.lm_head)
    assert (got - want).abs().max() <= TOLERANCE
    assert (got_logits - want_logits).abs().max() <= TOLERANCE
    assert want_logits.abs().max() > 0.1


def test_a_zlab_dflash2_drafter_starts_ours_with_its_weights(target, tmp_path):
    module = zlab()
    path, config, _ = target
    cfg = drafter_cfg(recipe="dflash2", selector_rank=8, selector_top_k=4, conv_group_size=16)
    theirs = randomised(module.DFlash2DraftModel(Qwen3Config(**drafter_hf_config(cfg, config))), seed=8)
    theirs.save_pretrained(tmp_path / "released")
    resumed, ours = start(
        drafter_cfg(
            recipe="dflash2",
            selector_rank=8,
            selector_top_k=4,
            conv_group_size=16,
            init_from=str(tmp_path / "released"),
        ),
        path,
        tmp_path,
    )
    assert resumed.warm_start["arch"] == "dflash2"
    theirs_state = {k.removesuffix(".weight") if "codebook" in k else k: v for k, v in theirs.state_dict().items()}
    mine = ours.state_dict()
    assert set(mine) == set(theirs_state)
    for name, tensor in theirs_state.items():
        assert torch.equal(mine[name], tensor), name


def dspark_export(target, tmp_path, **fields):
    """Our DSpark export (DeepSeek's flat Qwen3DSparkModel layout), with weights unlike a fresh initialisation."""
    path, config, _ = target
    cfg = drafter_cfg(recipe="dspark", markov_rank=8, **fields)
    model = randomised(build_drafter(cfg, config), seed=9)
    out = export_drafter(model, cfg, config, tmp_path / "released", dtype=torch.float32, head=load_target_head(path))
    return model, out


def test_a_deepseek_flat_dspark_drafter_starts_ours_and_its_checkpoints_record_it(target, tmp_path):
    path = target[0]
    model, out = dspark_export(target, tmp_path)
    cfg = drafter_cfg(recipe="dspark", markov_rank=8, init_from=str(out))
    resumed, ours = start(cfg, path, tmp_path)
    for name, tensor in model.state_dict().items():
        assert torch.equal(ours.state_dict()[name], tensor), name
    # A checkpoint taken from here records the warm start; a drafter that resumes takes the checkpoint's weights
    # (here: changed after the warm start) and its record, and reads init_from no more.
    with torch.no_grad():
        next(ours.parameters()).add_(1.0)
    trainer = resumed.trainer
    CheckpointStore(tmp_path / "checkpoints" / "drafter-0").save(
        trainer.state({"drafter": {"arch": "dspark"}, "warm_start": resumed.warm_start, "consumed": {}, "items": 0}),
        keep=1,
    )
    (out / "model.safetensors").unlink()  # were it read again, the resume would fail here
    again, restarted = start(cfg, path, tmp_path)
    assert again.warm_start == resumed.warm_start
    assert torch.equal(next(restarted.parameters()), next(ours.parameters()))


@pytest.mark.parametrize(
    ("released", "here", "named"),
    [
        ({"num_hidden_layers": 3}, {}, "num_hidden_layers 3 there, 2 here (drafter.num_hidden_layers)"),
        (
            {"num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 12},
            {},
            "num_attention_heads 6 there, 4 here (drafter.num_attention_heads); head_dim 12 there, 16 here",
        ),
        ({"mask_token_id": 251}, {}, "mask_token_id 251 there, 250 here (drafter.mask_token_id)"),
        ({}, {"recipe": "dspark", "markov_rank": 8}, "is a DFlash drafter, this run trains arch = 'dspark'"),
    ],
)
def test_a_drafter_that_is_not_this_one_is_refused_in_one_line(target, tmp_path, released, here, named):
    path, config, _ = target
    theirs = {**dict(block_size=BLOCK, loss_gamma=2.0, mask_token_id=MASK_ID, num_hidden_layers=2), **released}
    model = build_drafter(DrafterConfig(**theirs), config)
    out = export_drafter(model, DrafterConfig(**theirs), config, tmp_path / "released", dtype=torch.float32)
    with pytest.raises(WarmStartError) as caught:
        start(drafter_cfg(init_from=str(out), **here), path, tmp_path)
    message = str(caught.value)
    assert named in message and "\n" not in message


def test_a_drafter_of_another_vocabulary_is_refused(target, tmp_path):
    path = target[0]
    other = tmp_path / "other-target"
    save_tiny_qwen3(other, num_hidden_layers=8, vocab_size=320)
    config = json.loads((other / "config.json").read_text())
    cfg = drafter_cfg()
    out = export_drafter(build_drafter(cfg, config), cfg, config, tmp_path / "released", dtype=torch.float32)
    with pytest.raises(WarmStartError, match=r"vocab_size 320 there, 256 here \(the target"):
        start(drafter_cfg(init_from=str(out)), path, tmp_path)


def test_no_drafter_there_is_refused_naming_the_path(target, tmp_path):
    with pytest.raises(WarmStartError, match="drafter.init_from: .*config.json does not exist"):
        start(drafter_cfg(init_from=str(tmp_path / "nothing")), target[0], tmp_path)


@pytest.mark.processes
def test_a_drafter_process_still_imports_no_transformers_at_start():
    """Warm start is read at a drafter's start, but its readers import transformers only where a config class is
    built: a restarted drafter's imports stay what they were (a drafter's start is measured in seconds)."""
    probe = "import sys, dflash_ring.consumer.training.process; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"
