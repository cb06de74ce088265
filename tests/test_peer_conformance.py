"""Our DFlash and DSpark exports run through peers' own model code: the same drafts as our training model, in fp32.

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

DSpark drafters (the tests at the end) are checked three ways: our training model (packed forward and heads()),
our export in DeepSeek's flat Qwen3DSparkModel layout loaded by transformers' AutoModel through the dspark.py it
ships, and vLLM speculators' DSparkDraftModel (speculators.models.dspark: its full training forward on CPU, eager
attention and its eager losses, with our export's tensors, whose names it shares) give the same backbone output,
draft logits, Markov bias and confidence logits to 1e-5 for the vanilla, gated and rnn Markov heads.

DFlash2 (arch = "dflash2"): the export loads in z-lab's DFlash2DraftModel (codebooks mapped to its .weight names),
and our training model, that model and our export through trust_remote_code (dflash2.py) give the same draft hidden
states, logits, the selector's greedy path and candidates, and q over the candidates at T = 1 along z-lab's sampled
path; DFlash2 trains its sliding layers bidirectional in the block and its export writes is_causal: false, without
which z-lab would serve them causal (measured).

The oracles are test-only packages, installed by `make setup` with --no-deps (Makefile TEST_ORACLES, pins in
constraints.txt). Without them these tests skip, and fail when CI is set. By hand:
`.venv/bin/pip install --no-deps -c constraints.txt dflash speculators hs-connectors loguru`, then
`.venv/bin/python -m pytest -q tests/test_peer_conformance.py`.
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
from safetensors.torch import load_file
from transformers import AutoModel, AutoModelForCausalLM, Qwen3Config

from dflash_ring.common.config.drafter import DrafterConfig
from dflash_ring.consumer.layouts.export import WEIGHTS_NAME, export_drafter
from dflash_ring.consumer.modeling.model import load_target_head
from dflash_ring.consumer.families.build import build_drafter
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
    # The drafter's own attention geometry, not the target's 4 heads (2 K/V) of 16: 6 of 12 with 2 K/V.
    "own_heads": (
        DEFAULT_ROPE,
        {"num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 12},
    ),
}


def oracle(module: str, distribution: str):
    """A peer's module, imported; missing: a failure under CI (env CI set), a skip elsewhere, naming the install."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        reason = (
            f"test oracle {module} ({distribution}) does not import: {error!r}. `make setup` installs it; "
            f"by hand: .venv/bin/pip install --no-deps -c constraints.txt {distribution}"
        )
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
        return zlab_model(
            position_ids=torch.arange(anchor + zlab_model.block_size)[None],
            noise_embedding=target.get_input_embeddings()(block),
            target_hidden=features[:anchor][None],
        )[0]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def test_zlab_loads_every_weight_and_reads_our_layout(zlab, exported):
    case, model, out, *_ = exported
    theirs = load_zlab(zlab, out)
    assert (theirs.block_size, theirs.mask_token_id, theirs.target_layer_ids) == (
        model.block_size,
        model.mask_token_id,
        model.target_layer_ids,
    )
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
    producer = TargetModel(
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
        model.target_layer_ids,
        final_hidden=False,
        packed=False,
    )
    for ids in sequences():
        ours = producer.forward_padded(
            ids[None], torch.ones(1, ids.numel(), dtype=torch.long), torch.arange(ids.numel())
        ).features
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
        ours = model(torch.cat(features), torch.cat(seqs), anchors, head, attention=attention, anchors_per_group=2)
    blocks = [(seq, a) for seq, local in enumerate(LOCAL_ANCHORS) for a in local]
    want = torch.stack([zlab_draft(theirs, target, features[seq], seqs[seq], a) for seq, a in blocks])
    with torch.no_grad():
        ours_logits, want_logits = head.logits(ours), theirs.compute_logits(want, target.lm_head)
        seq, a = blocks[-1]
        inference = model.draft_block(features[seq][:a], seqs[seq][: a + 1], head)
    diffs = {
        "hidden": max_diff(ours, want),
        "logits": max_diff(ours_logits, want_logits),
        "draft_block": max_diff(inference, want[-1]),
    }
    assert max(diffs.values()) <= TOLERANCE, f"{case}/{attention} against z-lab dflash {zlab[1]}: {diffs}"
    assert want_logits.abs().max() > 0.1  # logits of some size: the tolerance means something


def test_what_zlab_would_serve_with_an_is_causal_key(zlab, targets, tmp_path):
    """Why the export writes no is_causal key (test_drafter_export.py checks that it writes none): written into
    config.json, z-lab's model takes it over the per-layer default. is_causal false serves our causal sliding layers
    bidirectional inside the block, is_causal true makes our bidirectional full layers causal; either gives other
    drafts. And the
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
        ours = model.draft_block(features[:anchor], ids[: anchor + 1], head)
    assert max_diff(zlab_draft(load_zlab(zlab, out), target, features, ids, anchor), ours) <= TOLERANCE
    for keys in ({"is_causal": False}, {"is_causal": True}, {"layer_types": ["full_attention"] * len(SLIDING)}):
        edited = shutil.copytree(out, tmp_path / f"edited-{len(list(tmp_path.iterdir()))}")
        config = json.loads((edited / "config.json").read_text())
        (edited / "config.json").write_text(json.dumps({**config, **keys}))
        served = zlab_draft(load_zlab(zlab, edited), target, features, ids, anchor)
        assert max_diff(served, ours) > 1e-3, keys


# --- DSpark: our training model, our export through transformers' AutoModel, and vLLM's speculators ---------------

MARKOV_RANK = 8
MARKOV_KINDS = ["vanilla", "gated", "rnn"]


@pytest.fixture(scope="module")
def speculators_dspark():
    """vLLM speculators' DSpark model module (speculators.models.dspark.core), and its version for the messages."""
    return oracle("speculators.models.dspark.core", "speculators"), metadata.version("speculators")


def dspark_features(target, ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """The target's features of a sequence: hidden_states[l + 1] of each layer l, concatenated (what the producer
    ships, checked against z-lab's selection above)."""
    with torch.no_grad():
        hidden = target(ids[None], output_hidden_states=True, use_cache=False).hidden_states
    return torch.cat([hidden[i + 1][0] for i in layer_ids], dim=-1)


@pytest.fixture(scope="module", params=MARKOV_KINDS)
def dspark_exported(request, targets, tmp_path_factory):
    """(kind, our fp32 DSpark drafter, its fp32 export dir, target dir, HF target, our head, DrafterConfig)."""
    path, target_config, target, head = targets(DEFAULT_ROPE)
    torch.manual_seed(5)
    cfg = DrafterConfig(
        recipe="dspark",
        num_hidden_layers=2,
        block_size=BLOCK,
        markov_rank=MARKOV_RANK,
        markov_head=request.param,
        mask_token_id=MASK_ID,
    )
    model = build_drafter(cfg, target_config).eval()
    with torch.no_grad():  # norms off 1 and heads of some size: a dropped weight or a swapped input would show
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.startswith(("markov_head.gate_proj", "markov_head.joint_proj")):
                param.normal_(0.0, 0.15)  # pre-activations of order 1: the gates neither saturate nor amplify
            elif name.startswith(("markov_head.", "confidence_head.")):
                param.normal_(0.0, 0.5)
    out = export_drafter(
        model, cfg, target_config, tmp_path_factory.mktemp("dspark") / "drafter", dtype=torch.float32, head=head
    )
    return request.param, model, out, path, target, head, cfg


def dspark_blocks():
    """The blocks of the packed batch as (sequence, local anchor): each leaves room for its B previous tokens."""
    return [(seq, a) for seq, local in enumerate(LOCAL_ANCHORS) for a in local]


def ours_dspark(model, head, seqs, features):
    """Our training forward on the packed batch, then heads(): (hidden, logits, Markov bias, confidence) per block."""
    anchors = anchors_from_local(LENGTHS, LOCAL_ANCHORS)
    ids = torch.cat(seqs)
    with torch.no_grad():
        hidden = model(torch.cat(features), ids, anchors, head, attention="sdpa", anchors_per_group=2)
        markov, confidence = model.heads(hidden, model.prev_ids(ids, anchors))
        bias = model.markov_head.bias(markov)
        return {"hidden": hidden, "logits": head.logits(hidden) + bias, "bias": bias, "confidence": confidence}


def hf_dspark(hf, seqs, features):
    """The export through transformers (its dspark.py), one block at a time as a server would draft it: the context's
    features before the anchor, the block [anchor, MASK...] embedded by the export's own embed_tokens, positions
    0..a+B-1, the previous tokens teacher-forced (prev_k = token a + k)."""
    rows = {"hidden": [], "logits": [], "bias": [], "confidence": []}
    for seq, a in dspark_blocks():
        ids = seqs[seq]
        block = torch.full((1, hf.block_size), hf.mask_token_id)
        block[0, 0] = ids[a]
        prev = ids[a : a + hf.block_size][None]
        with torch.no_grad():
            hidden = hf(
                hf.embed_tokens(block), features[seq][:a][None], position_ids=torch.arange(a + hf.block_size)[None]
            )
            rows["hidden"].append(hidden[0])
            rows["logits"].append(hf.draft_logits(prev, hidden)[0])
            rows["bias"].append(hf.markov_bias(prev, hidden)[0])
            rows["confidence"].append(hf.confidence_logits(prev, hidden)[0])
    return {k: torch.stack(v) for k, v in rows.items()}


def build_speculators_dspark(module, out, target_dir):
    """speculators' DSparkDraftModel as its from_training_args builds one (the verifier's embed, lm_head and final
    norm read from the tiny target), its transformer config our export's, eager attention, then our export's tensors
    loaded by name: their names are ours, only the verifier's own copies (targets of their loss) are not in the file."""
    config = json.loads((out / "config.json").read_text())
    layer_config = Qwen3Config(
        **{
            k: config[k]
            for k in (
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "intermediate_size",
                "hidden_act",
                "rms_norm_eps",
                "rope_parameters",
                "max_position_embeddings",
                "vocab_size",
                "layer_types",
                "attention_bias",
                "attention_dropout",
                "tie_word_embeddings",
            )
        }
    )
    model = module.DSparkDraftModel.from_training_args(
        layer_config,
        verifier_name_or_path=str(target_dir),
        draft_vocab_size=config["vocab_size"],
        block_size=config["block_size"],
        mask_token_id=config["mask_token_id"],
        target_layer_ids=[i + 1 for i in config["target_layer_ids"]],  # theirs count HF hidden_states indices
        markov_rank=config["markov_rank"],
        markov_head_type=config["markov_head_type"],
        draft_attn_impl="eager",
    )
    assert model.config.sample_from_anchor
    loaded = model.load_state_dict(load_file(out / WEIGHTS_NAME), strict=False)
    assert (sorted(loaded.missing_keys), loaded.unexpected_keys) == (
        ["verifier_lm_head.weight", "verifier_norm.weight"],
        [],
    )
    return model.eval()


def speculators_dspark_forward(module, model, seqs, features, monkeypatch):
    """Their full training forward on the packed batch, its logits (Markov bias included) and confidence logits taken
    where it hands them to its loss, the backbone's output and logits where its norm and lm_head emit them. Their
    anchors are drawn at random among loss_mask positions: with loss_mask set exactly at our anchors and as many
    anchors as those, they are ours, sorted."""
    seen = {}
    original = module.compute_metrics

    def capture(logits, targets, confidence_logits, *args, **kwargs):
        seen["logits"], seen["confidence"] = logits, confidence_logits
        return original(logits, targets, confidence_logits, *args, **kwargs)

    monkeypatch.setattr(module, "compute_metrics", capture)
    hooks = [
        model.norm.register_forward_hook(lambda m, i, o: seen.__setitem__("hidden", o)),
        model.lm_head.register_forward_hook(lambda m, i, o: seen.__setitem__("backbone", o)),
    ]
    anchors = anchors_from_local(LENGTHS, LOCAL_ANCHORS).positions
    total = sum(LENGTHS)
    loss_mask = torch.zeros(1, total, dtype=torch.long)
    loss_mask[0, anchors] = 1
    document_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(LENGTHS)])[None]
    position_ids = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    # Their DSpark objective in its eager implementation (the fused one needs Triton): the loss is not compared.
    loss_kwargs, _ = module.DSparkDraftModel.get_trainer_kwargs(
        loss_fn='{"ce": 0.1, "tv": 0.9}', loss_implementation="eager", max_anchors=anchors.numel()
    )
    try:
        with torch.no_grad():
            model(
                hidden_states=torch.cat(features)[None],
                input_ids=torch.cat(seqs)[None],
                loss_mask=loss_mask,
                verifier_last_hidden_states=torch.zeros(1, total, model.hidden_size),
                document_ids=document_ids,
                position_ids=position_ids,
                **loss_kwargs,
            )
    finally:
        for hook in hooks:
            hook.remove()
    n, block = anchors.numel(), model.block_size
    logits = seen["logits"].view(n, block, -1)
    return {
        "hidden": seen["hidden"].view(n, block, -1),
        "logits": logits,
        "bias": logits - seen["backbone"].view(n, block, -1),
        "confidence": seen["confidence"].view(n, block),
    }


def test_a_dspark_export_loads_in_transformers_with_every_weight(dspark_exported):
    kind, model, out, _, _, head, _ = dspark_exported
    hf, info = AutoModel.from_pretrained(out, trust_remote_code=True, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    assert type(hf).__name__ == "Qwen3DSparkModel"
    assert (hf.block_size, hf.mask_token_id, hf.target_layer_ids) == (
        model.block_size,
        model.mask_token_id,
        model.target_layer_ids,
    )
    theirs = hf.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(theirs[name], tensor), name
    assert torch.equal(theirs["embed_tokens.weight"], head.embed_weight)
    assert torch.equal(theirs["lm_head.weight"], head.lm_head_weight)


def test_dspark_training_model_export_and_speculators_agree(dspark_exported, speculators_dspark, monkeypatch):
    """The same weights and inputs through (a) our training model (packed forward + heads()), (b) our export loaded
    by transformers' AutoModel (dspark.py, block by block) and (c) speculators' DSparkDraftModel (its full training
    forward, our export's tensors): the backbone's output, the draft logits (backbone logits + Markov bias), the
    Markov bias alone and the confidence logits agree in fp32 to 1e-5 max abs, for the vanilla, gated and rnn heads.
    Measured on CPU (torch 2.13, transformers 5.24, speculators 0.9.0), max abs against (a), with |hidden| up to ~4,
    |logits| and |bias| up to ~3.5, |confidence logit| up to ~13:
        (b) export:      hidden 1.2e-6, logits/bias 3e-7 (vanilla 0 on the bias; rnn 1.8e-6), confidence 2.9e-6
        (c) speculators: hidden 9.5e-7, logits/bias 3e-7 (rnn 1.5e-6), confidence 1.9e-6"""
    kind, model, out, target_dir, target, head, _ = dspark_exported
    module, version = speculators_dspark
    seqs = sequences()
    features = [dspark_features(target, ids, model.target_layer_ids) for ids in seqs]
    ours = ours_dspark(model, head, seqs, features)
    hf = AutoModel.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    exported = hf_dspark(hf, seqs, features)
    theirs = speculators_dspark_forward(
        module, build_speculators_dspark(module, out, target_dir), seqs, features, monkeypatch
    )
    diffs = {
        f"{who}/{k}": max_diff(got[k], ours[k])
        for who, got in (("export", exported), ("speculators", theirs))
        for k in ours
    }
    assert max(diffs.values()) <= TOLERANCE, f"{kind} against speculators {version}: {diffs}"
    assert ours["bias"].abs().max() > 0.1 and ours["confidence"].abs().max() > 0.1  # heads of some size
    assert max_diff(ours["logits"], head.logits(ours["hidden"])) > 0.1  # the bias changes the logits


# --- DFlash2 -------------------------------------------------------------------------------------------------------

DFLASH2 = {
    "arch": "dflash2",
    "num_hidden_layers": 3,
    "layer_types": SLIDING,
    "sliding_window": WINDOW,
    "conv_group_size": 16,
    "selector_rank": 8,
    "selector_top_k": 4,
}


@pytest.fixture(scope="module")
def dflash2_exported(targets, tmp_path_factory):
    """(our fp32 DFlash2 drafter with non-trivial convolutions, its fp32 export, HF target, our head)."""
    path, target_config, target, head = targets(DEFAULT_ROPE)
    torch.manual_seed(5)
    cfg = DrafterConfig(block_size=BLOCK, loss_gamma=2.0, mask_token_id=MASK_ID, **DFLASH2)
    model = build_drafter(cfg, target_config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith("base_kernel"):
                param.normal_(0.5, 0.5)
            elif "kernel_projection" in name:
                param.normal_(std=0.1)
            elif "codebook" in name:
                param.normal_(std=1.0)  # a bilinear term that changes the selector's choices
    out = export_drafter(model, cfg, target_config, tmp_path_factory.mktemp("dflash2") / "drafter", dtype=torch.float32)
    return model, out, target, head


def load_zlab_dflash2(zlab, out):
    module, version = zlab
    model, info = module.DFlash2DraftModel.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), f"z-lab dflash {version} loading {out}: {info}"
    return model.eval()


def test_zlab_loads_every_dflash2_weight_and_reads_our_layout(zlab, dflash2_exported):
    model, out, *_ = dflash2_exported
    theirs = load_zlab_dflash2(zlab, out)
    assert (theirs.block_size, theirs.mask_token_id, theirs.target_layer_ids) == (
        model.block_size,
        model.mask_token_id,
        model.target_layer_ids,
    )
    assert theirs.candidate_selector.top_k == model.candidate_selector.top_k
    # is_causal false: every layer bidirectional inside the block, as DFlash2 trains; the windows kept
    assert [layer.self_attn.is_causal for layer in theirs.layers] == [False] * len(SLIDING)
    assert [layer.self_attn.sliding_window for layer in theirs.layers] == [
        layer.self_attn.sliding_window for layer in model.layers
    ]
    mapped = {
        "candidate_selector.predecessor_codebook": "candidate_selector.predecessor_codebook.weight",
        "candidate_selector.successor_codebook": "candidate_selector.successor_codebook.weight",
    }
    theirs_state = theirs.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(theirs_state[mapped.get(name, name)], tensor), name


def test_without_is_causal_zlab_would_serve_dflash2_sliding_layers_causal(zlab, dflash2_exported, tmp_path):
    """Why the DFlash2 export writes is_causal: false: without it z-lab's model (and vLLM's rule) serves a sliding
    layer causal inside the block, which DFlash2 did not train."""
    model, out, target, head = dflash2_exported
    ids = sequences()[0]
    features = zlab_features(zlab, target, ids, model.target_layer_ids)
    anchor = LOCAL_ANCHORS[0][-1]
    with torch.no_grad():
        ours = model.draft_block(features[:anchor], ids[: anchor + 1], head)
    assert max_diff(zlab_draft(load_zlab_dflash2(zlab, out), target, features, ids, anchor), ours) <= TOLERANCE
    edited = shutil.copytree(out, tmp_path / "no-is-causal")
    config = json.loads((edited / "config.json").read_text())
    del config["is_causal"]
    (edited / "config.json").write_text(json.dumps(config))
    assert max_diff(zlab_draft(load_zlab_dflash2(zlab, edited), target, features, ids, anchor), ours) > 1e-3


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_zlab_and_our_remote_code_draft_and_select_what_our_dflash2_training_model_does(
    zlab, dflash2_exported, attention
):
    """Every block of a packed batch: draft hidden states and logits of our training forward, of z-lab's
    DFlash2DraftModel and of our export through trust_remote_code; then the selector: the greedy path and its
    candidates from the anchor, and at T = 1 q over the candidates along z-lab's sampled path against our scores."""
    model, out, target, head = dflash2_exported
    theirs = load_zlab_dflash2(zlab, out)
    remote = AutoModel.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    assert type(remote).__name__ == "DFlash2DraftModel"
    seqs = sequences()
    features = [zlab_features(zlab, target, ids, model.target_layer_ids) for ids in seqs]
    anchors = anchors_from_local(LENGTHS, LOCAL_ANCHORS)
    blocks = [(seq, a) for seq, local in enumerate(LOCAL_ANCHORS) for a in local]
    with torch.no_grad():
        ours = model(torch.cat(features), torch.cat(seqs), anchors, head, attention=attention, anchors_per_group=2)
        want = torch.stack([zlab_draft(theirs, target, features[seq], seqs[seq], a) for seq, a in blocks])
        served = []
        for seq, a in blocks:
            block = torch.full((1, BLOCK), MASK_ID)
            block[0, 0] = seqs[seq][a]
            served.append(remote(target.get_input_embeddings()(block), features[seq][:a][None])[0])
        served = torch.stack(served)
        anchor_ids = torch.stack([seqs[seq][a] for seq, a in blocks])
        ours_logits = head.logits(ours)
        path, candidates, scores = model.candidate_selector.walk(ours[:, 1:], ours_logits[:, 1:], anchor_ids)
        z_path, z_candidates, _ = theirs.propose(want[:, 1:], anchor_ids, target.lm_head, 0.0)
        r_path, r_candidates, r_scores = remote.propose(served[:, 1:], anchor_ids, target.lm_head)
        torch.manual_seed(11)
        s_path, s_candidates, s_q = theirs.propose(want[:, 1:], anchor_ids, target.lm_head, 1.0)
        prev = torch.cat([anchor_ids[:, None], s_path[:, :-1]], 1)
        along = model.candidate_selector.scores(
            ours[:, 1:], prev, ours_logits[:, 1:].gather(-1, s_candidates), s_candidates
        )
    diffs = {
        "hidden": max_diff(ours, want),
        "remote_hidden": max_diff(served, want),
        "logits": max_diff(ours_logits, theirs.compute_logits(want, target.lm_head)),
        "remote_scores": max_diff(r_scores, scores),
        "q_along_sampled_path": max_diff(along.softmax(-1), s_q),
    }
    assert max(diffs.values()) <= TOLERANCE, f"dflash2/{attention} against z-lab dflash {zlab[1]}: {diffs}"
    assert torch.equal(path, z_path) and torch.equal(path, r_path), (path, z_path, r_path)
    assert torch.equal(candidates.sort(-1).values, z_candidates.sort(-1).values)
    assert torch.equal(candidates, r_candidates)
    # the bilinear term matters here: the selector's greedy path is not the unary argmax everywhere
    assert not torch.equal(path, ours_logits[:, 1:].argmax(-1))
