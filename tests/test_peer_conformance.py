"""Our DFlash exports run through peers' own model code: the same drafts as our training model, in fp32.

The oracle is z-lab's `dflash` package (PyPI dflash, module dflash.model: the DFlash authors' reference model,
the one their `dflash_generate` and the published checkpoints run on). A tiny drafter is built and exported by our
real code (build_drafter, export_drafter), loaded with z-lab's `DFlashDraftModel.from_pretrained`, and both are fed
the same inputs: the tiny target's own features of a context (selected as z-lab selects them) and a block
[anchor, MASK...] embedded by the target's embedding. Their draft hidden states, and the logits through the
target's lm_head, agree to 1e-5 (max abs) for every block of a packed training batch (both attention paths) and
for our inference path (draft_block), with full-attention layers, sliding-window layers (the window shorter than
the context, so it cuts) and YaRN RoPE.

Sliding layers: ours train causal inside the block with keys in (q - W, q]; z-lab's model makes a
`sliding_attention` layer causal unless the config sets `is_causal`, and the export sets no such key, so it serves
what trained. What the key would do is measured here too (shared/reference/dspark-dflash2.md, "Causality of
sliding layers").

The oracles are test-only packages, installed by `make setup` with --no-deps (Makefile TEST_ORACLES, pins in
constraints.txt). Without them these tests skip, and fail when CI is set. By hand:
`.venv/bin/pip install --no-deps -c constraints.txt dflash && .venv/bin/python -m pytest -q tests/test_peer_conformance.py`.
Note that z-lab's model runs here on our transformers (constraints.txt), not on the one its package pins.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
from importlib import metadata

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash_ring.common.drafter_config import DrafterConfig
from dflash_ring.consumer.export import export_drafter
from dflash_ring.consumer.model import build_drafter, load_target_head
from dflash_ring.producer.target import TargetModel
from support import anchors_from_local, save_tiny_qwen3

# The CPU runs flex_attention eagerly (the reference check of the GPU path): its torch.compile advice is expected.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile:UserWarning")

TOLERANCE = 1e-5  # fp32, max abs, on draft hidden states and on logits
MASK_ID, BLOCK, WINDOW = 250, 4, 8
LENGTHS = [24, 17]  # two packed sequences
LOCAL_ANCHORS = [[2, 11, 19], [3, 12]]  # anchors past the window (11, 19, 12) and inside it (2, 3)
SLIDING = ["sliding_attention", "full_attention", "sliding_attention"]
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 1e6}
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 128}
CASES = {
    "full": (DEFAULT_ROPE, {"num_hidden_layers": 2}),
    "sliding": (DEFAULT_ROPE, {"num_hidden_layers": 3, "layer_types": SLIDING, "sliding_window": WINDOW}),
    "yarn": (YARN_ROPE, {"num_hidden_layers": 2}),
}


def oracle(module: str, distribution: str):
    """A peer's module, imported; missing: a failure under CI (env CI set), a skip elsewhere, naming the install."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        reason = (f"test oracle {module} ({distribution}) does not import: {error!r}. `make setup` installs it; "
                  f"by hand: .venv/bin/pip install --no-deps -c constraints.txt {distribution}")
        if os.environ.get("CI"):
            pytest.fail(f"{reason} (CI is set: the conformance checks must run in CI)", pytrace=False)
        pytest.skip(reason)


@pytest.fixture(scope="module")
def zlab():
    """z-lab's dflash.model, and its version for the messages."""
    return oracle("dflash.model", "dflash"), metadata.version("dflash")


@pytest.fixture(autouse=True)
def single_thread():
    """Tiny matmuls gain nothing from threads, and thread contention on a busy CI box costs 10x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """A tiny Qwen3 target per RoPE, built on first use: (dir, config dict, HF model fp32, our frozen head)."""
    built = {}

    def get(rope: dict):
        key = json.dumps(rope, sort_keys=True)
        if key not in built:
            path = tmp_path_factory.mktemp("target")
            save_tiny_qwen3(path, num_hidden_layers=8, rope_parameters=rope)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            built[key] = path, json.loads((path / "config.json").read_text()), model, load_target_head(path)
        return built[key]

    return get


@pytest.fixture(params=list(CASES))
def exported(request, targets, tmp_path):
    """(case, our fp32 drafter, its fp32 export dir, target dir, target config, HF target, our head)."""
    rope, layers = CASES[request.param]
    path, target_config, target, head = targets(rope)
    torch.manual_seed(3)
    cfg = DrafterConfig(block_size=BLOCK, loss_gamma=2.0, mask_token_id=MASK_ID, **layers)
    model = build_drafter(cfg, target_config).eval()
    with torch.no_grad():  # non-trivial norms, so a dropped or swapped norm weight would show
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    out = export_drafter(model, cfg, target_config, tmp_path / "drafter", dtype=torch.float32)
    return request.param, model, out, path, target_config, target, head


def load_zlab(zlab, out):
    module, version = zlab
    model, info = module.DFlashDraftModel.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), f"z-lab dflash {version} loading {out}: {info}"
    return model.eval()


def sequences(vocab_limit: int = MASK_ID, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_limit, (n,), generator=gen) for n in LENGTHS]


def zlab_features(zlab, target, ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """The target's features of a sequence as z-lab's generation loop selects them (extract_context_feature)."""
    with torch.no_grad():
        hidden = target(ids[None], output_hidden_states=True, use_cache=False).hidden_states
    return zlab[0].extract_context_feature(hidden, layer_ids)[0]


def zlab_draft(zlab_model, target, features: torch.Tensor, ids: torch.Tensor, anchor: int) -> torch.Tensor:
    """z-lab's draft hidden states [B, H] for the block anchored at `anchor` of one sequence, as dflash_generate
    calls it: the context's features before the anchor, the block embedded by the target, positions 0..a+B-1."""
    block = torch.full((1, zlab_model.block_size), zlab_model.mask_token_id)
    block[0, 0] = ids[anchor]
    with torch.no_grad():
        return zlab_model(position_ids=torch.arange(anchor + zlab_model.block_size)[None],
                          noise_embedding=target.get_input_embeddings()(block),
                          target_hidden=features[:anchor][None])[0]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def test_zlab_loads_every_weight_and_reads_our_layout(zlab, exported):
    case, model, out, *_ = exported
    theirs = load_zlab(zlab, out)
    assert (theirs.block_size, theirs.mask_token_id, theirs.target_layer_ids) == (
        model.block_size, model.mask_token_id, model.target_layer_ids)
    ours_sliding = [layer.self_attn.sliding_window for layer in model.layers]
    assert [layer.self_attn.sliding_window for layer in theirs.layers] == ours_sliding
    # z-lab's default (no is_causal key): a sliding layer is causal inside the block, a full one bidirectional
    assert [layer.self_attn.is_causal for layer in theirs.layers] == [w is not None for w in ours_sliding]
    for name, tensor in model.state_dict().items():
        assert torch.equal(theirs.state_dict()[name], tensor), name
    rope_ours = model._rope(torch.arange(40), torch.float32)
    rope_theirs = theirs.rotary_emb(torch.zeros(1), torch.arange(40)[None])
    for got, want in zip(rope_theirs, rope_ours):  # the export's RoPE keys read back as the same RoPE
        assert max_diff(got[0], want) <= TOLERANCE, case


def test_our_producer_selects_the_features_zlab_does(zlab, exported):
    """The context we train on is what z-lab's generation loop feeds its drafter: the same layers, same indexing."""
    _, model, _, path, _, target, _ = exported
    producer = TargetModel(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), model.target_layer_ids,
                           final_hidden=False, packed=False)
    for ids in sequences():
        ours = producer.forward_padded(ids[None], torch.ones(1, ids.numel(), dtype=torch.long),
                                       torch.arange(ids.numel())).features
        assert max_diff(ours, zlab_features(zlab, target, ids, model.target_layer_ids)) <= TOLERANCE


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_zlab_drafts_what_our_training_model_drafts(zlab, exported, attention):
    """Every block of a packed batch of two sequences, from our training forward, against z-lab's model run
    on that block alone; then our inference path (draft_block) on the last block."""
    case, model, out, _, _, target, head = exported
    theirs = load_zlab(zlab, out)
    seqs = sequences()
    features = [zlab_features(zlab, target, ids, model.target_layer_ids) for ids in seqs]
    anchors = anchors_from_local(LENGTHS, LOCAL_ANCHORS)
    with torch.no_grad():
        ours = model(torch.cat(features), torch.cat(seqs), anchors, head, attention=attention,
                     anchors_per_group=2)
    blocks = [(seq, a) for seq, local in enumerate(LOCAL_ANCHORS) for a in local]
    want = torch.stack([zlab_draft(theirs, target, features[seq], seqs[seq], a) for seq, a in blocks])
    with torch.no_grad():
        ours_logits, want_logits = head.logits(ours), theirs.compute_logits(want, target.lm_head)
        seq, a = blocks[-1]
        inference = model.draft_block(features[seq][:a], seqs[seq][:a + 1], head)
    diffs = {"hidden": max_diff(ours, want), "logits": max_diff(ours_logits, want_logits),
             "draft_block": max_diff(inference, want[-1])}
    assert max(diffs.values()) <= TOLERANCE, f"{case}/{attention} against z-lab dflash {zlab[1]}: {diffs}"
    assert want_logits.abs().max() > 0.1  # logits of some size: the tolerance means something


def test_what_zlab_would_serve_with_an_is_causal_key(zlab, targets, tmp_path):
    """Why the export writes no is_causal key (test_drafter_export.py checks that it writes none): written into
    config.json, z-lab's model takes it over the per-layer default. is_causal false serves our causal sliding layers bidirectional
    inside the block, is_causal true makes our bidirectional full layers causal; either gives other drafts. And the
    window cuts this context: served as full attention, the sliding layers would draft otherwise too."""
    rope, layers = CASES["sliding"]
    path, target_config, target, head = targets(rope)
    torch.manual_seed(3)
    cfg = DrafterConfig(block_size=BLOCK, loss_gamma=2.0, mask_token_id=MASK_ID, **layers)
    model = build_drafter(cfg, target_config).eval()
    out = export_drafter(model, cfg, target_config, tmp_path / "drafter", dtype=torch.float32)
    ids = sequences()[0]
    features = zlab_features(zlab, target, ids, model.target_layer_ids)
    anchor = LOCAL_ANCHORS[0][-1]
    with torch.no_grad():
        ours = model.draft_block(features[:anchor], ids[:anchor + 1], head)
    assert max_diff(zlab_draft(load_zlab(zlab, out), target, features, ids, anchor), ours) <= TOLERANCE
    for keys in ({"is_causal": False}, {"is_causal": True}, {"layer_types": ["full_attention"] * len(SLIDING)}):
        edited = shutil.copytree(out, tmp_path / f"edited-{len(list(tmp_path.iterdir()))}")
        config = json.loads((edited / "config.json").read_text())
        (edited / "config.json").write_text(json.dumps({**config, **keys}))
        served = zlab_draft(load_zlab(zlab, edited), target, features, ids, anchor)
        assert max_diff(served, ours) > 1e-3, keys
