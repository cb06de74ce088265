"""consumer/drafter_import.released_drafter: a released drafter read into our model gives what its own code gives.

The oracle is vLLM's `speculators` (speculators.models.{dflash,dflash2,dspark}): a tiny drafter of each family is
built by its own from_training_args against a tiny Qwen3 target (YaRN RoPE, so the RoPE mapping is exercised), its
weights randomised, saved by its own save_pretrained, then imported. Our model built from the imported config and
loaded strict with the imported state (every tensor one-to-one, equal) drafts what speculators' model drafts in its
full training forward on a packed batch of two sequences, eager attention, fp32: the final-normed draft hidden states
and logits (DSpark: with the Markov bias, and its confidence logits; DFlash2: the candidate selector's scores of the
candidates their loss scores), to 1e-5 max abs. The imported config equals what drafter_hf_config writes for the same
drafter settings, less the keys a speculators config does not record. speculators' own converter (z-lab DFlash ->
speculators) checks the target-layer numbering: our export converted by it reads back as our model. Measured on CPU
(torch 2.13, transformers 5.24, speculators 0.9.0), max abs: hidden 1e-6 to 1.8e-6, logits 2.5e-7 to 1.3e-6, DFlash2's
selector scores 1e-6, DSpark's confidence logits 1.7e-6.

Sliding-window layers are refused; the measurement of why (their window counts from the anchor, ours from each slot)
is here too. Our own layouts read back as drafter_hf_config writes them, and a DFlash2 saved by z-lab's own model
(its codebooks named .weight) reads in our names. The oracles (speculators; z-lab's dflash for that one) install with
`make setup` (tests/test_peer_conformance.py's `oracle`: a skip without them, a failure under CI).
"""

from __future__ import annotations

import copy
import json
import shutil
from importlib import metadata

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Qwen3Config

from dflash_ring.common.config.drafter import DrafterConfig
from dflash_ring.consumer.layouts.drafter_hf_config import drafter_hf_config, qwen3_config
from dflash_ring.consumer.layouts.drafter_import import ReleasedDrafterError, released_drafter
from dflash_ring.consumer.layouts.export import TARGET_HEAD_KEY, WEIGHTS_NAME, export_arch, export_drafter
from dflash_ring.consumer.modeling.model import load_target_head
from dflash_ring.consumer.families.build import build_drafter
from dflash_ring.consumer.families import family
from support import anchors_from_local, save_tiny_qwen3
from test_peer_conformance import (  # noqa: F401 (single_thread: the autouse fixture, for this module too)
    LENGTHS,
    LOCAL_ANCHORS,
    YARN_ROPE,
    dspark_features,
    max_diff,
    oracle,
    sequences,
    single_thread,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # speculators' default-layer and loading warnings

TOLERANCE = 1e-5
MASK_ID, BLOCK, WINDOW = 250, 4, 8
THEIR_LAYER_IDS = [2, 5, 7]  # speculators' aux_hidden_state_layer_ids: HF hidden_states indices (ours: 1, 4, 6)
# What each family's from_training_args takes beyond the shared arguments, and the same drafter as our DrafterConfig.
FAMILIES = {
    "dflash": ({}, {}),
    "dflash2": (
        {"conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4},
        {"arch": "dflash2", "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4},
    ),
    "dspark": (
        {"markov_rank": 8, "markov_head_type": "rnn"},
        {"recipe": "dspark", "markov_rank": 8, "markov_head": "rnn"},
    ),
}
# Keys of our export's config.json that record the target's depth or how the drafter trained: speculators' does not.
NOT_RECORDED = ("num_target_layers", "dflash_training", "num_anchors")
TARGET_ONLY = {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight"}


@pytest.fixture(scope="module")
def speculators():
    """speculators' three model modules by family, and its version for the messages."""
    modules = {family: oracle(f"speculators.models.{family}.core", "speculators") for family in FAMILIES}
    return modules, metadata.version("speculators")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """(dir, config dict, HF model fp32, our frozen head) of a tiny 8-layer Qwen3 with YaRN RoPE."""
    path = tmp_path_factory.mktemp("target")
    save_tiny_qwen3(path, num_hidden_layers=8, rope_parameters=YARN_ROPE)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, json.loads((path / "config.json").read_text()), model, load_target_head(path)


def layer_config(target_config: dict, **overrides) -> Qwen3Config:
    """The drafter's transformer config as speculators' trainer makes one: the verifier's, with the draft depth."""
    keep = {k: v for k, v in target_config.items() if k not in ("layer_types", "architectures", "num_hidden_layers")}
    return Qwen3Config(**{**keep, "num_hidden_layers": 2, **overrides})


def build_theirs(speculators, family: str, target, seed: int = 7, **overrides):
    """speculators' drafter of `family` from its from_training_args, eager attention, weights randomised."""
    path, target_config, *_ = target
    module = speculators[0][family]
    torch.manual_seed(seed)
    model_class = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel", "dspark": "DSparkDraftModel"}[family]
    model = getattr(module, model_class).from_training_args(
        layer_config(target_config, **overrides),
        verifier_name_or_path=str(path),
        draft_vocab_size=target_config["vocab_size"],
        block_size=BLOCK,
        mask_token_id=MASK_ID,
        target_layer_ids=THEIR_LAYER_IDS,
        draft_attn_impl="eager",
        **FAMILIES[family][0],
    )
    with torch.no_grad():  # norms off 1, convolutions off the identity, heads of some size: a swap would show
        for name, param in model.named_parameters():
            if name in TARGET_ONLY:
                continue
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith("base_kernel"):
                param.normal_(0.5, 0.5)
            elif "kernel_projection" in name:
                param.normal_(std=0.1)
            elif "codebook" in name:
                param.normal_(std=1.0)
            elif name.startswith(("markov_head.gate_proj", "markov_head.joint_proj")):
                param.normal_(0.0, 0.15)
            elif name.startswith(("markov_head.", "confidence_head.")):
                param.normal_(0.0, 0.5)
    return model.eval()


def saved(model, path):
    model.save_pretrained(path)
    return path


def ours_from(path):
    """Our model built from released_drafter's config, loaded strict with its state; and the config."""
    config, state = released_drafter(path)
    model = family(export_arch(config)).model(qwen3_config(config))
    model.load_state_dict(state, strict=True)
    return model.eval(), config


def theirs_forward(module, model, seqs, features, monkeypatch) -> dict[str, torch.Tensor]:
    """Their full training forward on the packed batch: the draft hidden states where their final norm emits them,
    the backbone logits where their lm_head does, and what reaches their loss (compute_metrics, replaced: the loss
    is not compared). Their anchors are drawn among loss_mask positions: with loss_mask set exactly at our anchors
    and as many anchors as those, they are ours, sorted."""
    seen: dict[str, object] = {}

    def capture(*args, **kwargs):
        seen["loss_args"], seen["loss_kwargs"] = args, kwargs
        return torch.zeros(()), {}

    monkeypatch.setattr(module, "compute_metrics", capture)
    hooks = [
        model.norm.register_forward_hook(lambda m, i, o: seen.__setitem__("hidden", o)),
        model.lm_head.register_forward_hook(lambda m, i, o: seen.__setitem__("backbone", o)),
    ]
    anchors = anchors_from_local(LENGTHS, LOCAL_ANCHORS).positions
    total = sum(LENGTHS)
    loss_mask = torch.zeros(1, total, dtype=torch.long)
    loss_mask[0, anchors] = 1
    try:
        with torch.no_grad():
            model(
                hidden_states=torch.cat(features)[None],
                input_ids=torch.cat(seqs)[None],
                loss_mask=loss_mask,
                verifier_last_hidden_states=torch.zeros(1, total, model.hidden_size),
                document_ids=torch.cat([torch.full((n,), i) for i, n in enumerate(LENGTHS)])[None],
                position_ids=torch.cat([torch.arange(n) for n in LENGTHS])[None],
                max_anchors=anchors.numel(),
            )
    finally:
        for hook in hooks:
            hook.remove()
    n = anchors.numel()
    out = {"hidden": seen["hidden"].view(n, BLOCK, -1), "logits": seen["backbone"].view(n, BLOCK, -1)}
    args, kwargs = seen["loss_args"], seen["loss_kwargs"]
    if kwargs.get("candidate_logits") is not None:  # DFlash2: the selector's scores of the candidates it trains on
        out["candidates"] = kwargs["training_candidate_ids"].view(n, BLOCK, -1)
        out["scores"] = kwargs["candidate_logits"].view(n, BLOCK, -1)
    elif getattr(model, "confidence_head", None) is not None:  # DSpark: logits with the Markov bias, confidences
        out["logits"], out["confidence"] = args[0].view(n, BLOCK, -1), args[2].view(n, BLOCK)
    return out


def ours_forward(model, head, seqs, features, candidates=None) -> dict[str, torch.Tensor]:
    """Our training forward on the same packed batch, and the family's heads on it."""
    anchors = anchors_from_local(LENGTHS, LOCAL_ANCHORS)
    ids = torch.cat(seqs)
    with torch.no_grad():
        hidden = model(torch.cat(features), ids, anchors, head, attention="sdpa", anchors_per_group=2)
        out = {"hidden": hidden, "logits": head.logits(hidden)}
        if model.sample_from_anchor:
            markov, confidence = model.heads(hidden, model.prev_ids(ids, anchors))
            out["logits"] = out["logits"] + model.markov_head.bias(markov)
            out["confidence"] = confidence
        elif candidates is not None:
            prev = model.prev_ids(ids, anchors)
            out["scores"] = model.candidate_selector.scores(
                hidden, prev, out["logits"].gather(-1, candidates), candidates
            )
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_speculators_drafter_imports_and_drafts_what_it_drafts(speculators, target, family, tmp_path, monkeypatch):
    path, target_config, hf_target, head = target
    theirs = build_theirs(speculators, family, target)
    model, config = ours_from(saved(theirs, tmp_path / family))
    # the config: what our export writes for the same drafter, less what speculators does not record
    ours_cfg = DrafterConfig(
        loss_gamma=2.0,
        block_size=BLOCK,
        mask_token_id=MASK_ID,
        num_hidden_layers=2,
        target_layer_ids=[1, 4, 6],
        layer_types=["full_attention"] * 2,
        **FAMILIES[family][1],
    )
    written = drafter_hf_config(ours_cfg, target_config, dtype=torch.float32)
    assert config == {k: v for k, v in written.items() if k not in NOT_RECORDED}
    # every tensor one-to-one and equal; what is left of theirs is the target's
    their_state = theirs.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(their_state[name], tensor), name
    assert set(their_state) - set(model.state_dict()) == TARGET_ONLY
    # the same drafts
    seqs = sequences()
    features = [dspark_features(hf_target, ids, model.target_layer_ids) for ids in seqs]
    got = theirs_forward(speculators[0][family], theirs, seqs, features, monkeypatch)
    ours = ours_forward(model, head, seqs, features, got.pop("candidates", None))
    assert set(got) == set(ours), (sorted(got), sorted(ours))
    diffs = {k: max_diff(ours[k].float(), got[k].float()) for k in ours}
    assert max(diffs.values()) <= TOLERANCE, f"{family} against speculators {speculators[1]}: {diffs}"
    assert ours["logits"].abs().max() > 0.1  # logits of some size: the tolerance means something


def test_speculators_converter_numbers_target_layers_as_we_read_them(speculators, target, tmp_path):
    """speculators' own z-lab DFlash converter turns our export into its layout (target layer i -> aux id i + 1):
    read back, it is our drafter again, the same target layers and every tensor."""
    converter = oracle("speculators.convert.dflash.converter", "speculators")
    path, target_config, *_ = target
    torch.manual_seed(3)
    cfg = DrafterConfig(loss_gamma=2.0, block_size=BLOCK, mask_token_id=MASK_ID, num_hidden_layers=2)
    model = build_drafter(cfg, target_config)
    out = export_drafter(model, cfg, target_config, tmp_path / "ours", dtype=torch.float32)
    converter.DFlashConverter().convert(out, tmp_path / "converted", base_model=str(path), validate=False)
    imported, config = ours_from(tmp_path / "converted")
    assert imported.target_layer_ids == model.target_layer_ids
    written = drafter_hf_config(cfg, target_config, dtype=torch.float32)
    assert config == {k: v for k, v in written.items() if k not in NOT_RECORDED}
    for name, tensor in model.state_dict().items():
        assert torch.equal(imported.state_dict()[name], tensor), name


@pytest.mark.parametrize("arch", ["dflash", "dspark", "dflash2"])
def test_our_own_exports_read_back_as_written(target, arch, tmp_path):
    """Ours (z-lab's DFlash and DFlash2, DeepSeek's flat DSpark): the config drafter_hf_config writes (and the target
    head's record), the drafter's own tensors (a DSpark export's embed_tokens and lm_head, the target's, dropped)."""
    _, target_config, _, head = target
    torch.manual_seed(4)
    extra = {"dspark": {"recipe": "dspark", "markov_rank": 8}, "dflash2": FAMILIES["dflash2"][1]}.get(arch, {})
    cfg = DrafterConfig(
        loss_gamma=2.0,
        block_size=BLOCK,
        mask_token_id=MASK_ID,
        num_hidden_layers=2,
        layer_types=["full_attention"] * 2,
        **extra,
    )
    model = build_drafter(cfg, target_config)
    out = export_drafter(model, cfg, target_config, tmp_path / arch, dtype=torch.float32, head=head)
    config, state = released_drafter(out)
    written = drafter_hf_config(cfg, target_config, dtype=torch.float32)
    assert {k: config[k] for k in written} == written and set(config) - set(written) <= {TARGET_HEAD_KEY}
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_a_zlab_dflash2_save_reads_with_our_codebook_names(target, tmp_path):
    """z-lab's DFlash2DraftModel.save_pretrained names its codebooks as its nn.Embedding does (.weight); the released
    files and ours store them without: both read as ours, and both spellings at once are refused."""
    zlab = oracle("dflash.model", "dflash")
    target_config = target[1]
    cfg = DrafterConfig(
        loss_gamma=2.0, block_size=BLOCK, mask_token_id=MASK_ID, num_hidden_layers=2, **FAMILIES["dflash2"][1]
    )
    torch.manual_seed(6)
    theirs = zlab.DFlash2DraftModel(Qwen3Config(**drafter_hf_config(cfg, target_config)))
    with torch.no_grad():  # its constructor leaves some tensors uninitialised
        for param in theirs.parameters():
            param.normal_(std=0.1)
    theirs.save_pretrained(tmp_path / "zlab")
    model, _ = ours_from(tmp_path / "zlab")
    for name, tensor in theirs.state_dict().items():
        assert torch.equal(model.state_dict()[name.removesuffix(".weight") if "codebook" in name else name], tensor)
    both = edited(
        tmp_path / "zlab",
        tmp_path,
        weights=lambda s: s | {k.removesuffix(".weight"): v.clone() for k, v in s.items() if "codebook" in k},
    )
    assert "holds both candidate_selector" in refusal(both)


@pytest.mark.parametrize("window, same", [(WINDOW, False), (64, True)])
def test_speculators_sliding_layers_draft_otherwise_and_are_refused(
    speculators, target, tmp_path, monkeypatch, window, same
):
    """Why sliding-window layers are refused: the same weights, a sliding layer of theirs against one of ours (both
    bidirectional in the block, DFlash2's default) agree while the window cuts no context (64 > every anchor) and
    draft otherwise once it does (8): their window keeps the W context tokens before the anchor for every slot, ours
    the last W keys of each slot's own position."""
    _, target_config, hf_target, head = target
    sliding = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": window}
    theirs = build_theirs(speculators, "dflash2", target, use_sliding_window=True, **sliding)
    assert "sliding window counts from the anchor" in refusal(saved(theirs, tmp_path / "sliding"))
    full = build_theirs(speculators, "dflash2", target)
    theirs.load_state_dict(full.state_dict(), strict=True)
    model, config = ours_from(saved(full, tmp_path / "full"))
    ours = family("dflash2").model(qwen3_config({**config, **sliding, "use_sliding_window": True})).eval()
    ours.load_state_dict(model.state_dict(), strict=True)
    seqs = sequences()
    features = [dspark_features(hf_target, ids, model.target_layer_ids) for ids in seqs]
    got = theirs_forward(speculators[0]["dflash2"], theirs, seqs, features, monkeypatch)
    diff = max_diff(ours_forward(ours, head, seqs, features)["hidden"], got["hidden"])
    assert diff <= TOLERANCE if same else diff > 1e-3, (window, diff)


# --- refusals: one line each, naming the file ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def speculators_dflash(speculators, target, tmp_path_factory):
    """A saved speculators DFlash drafter to edit."""
    return saved(build_theirs(speculators, "dflash", target), tmp_path_factory.mktemp("speculators") / "dflash")


def edited(source, tmp_path, config_changes=None, weights=None):
    """A copy of the drafter directory, its config.json updated, its tensors passed through `weights`."""
    out = shutil.copytree(source, tmp_path / "edited")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **(config_changes or {})}))
    if weights is not None:
        save_file(weights(load_file(out / WEIGHTS_NAME)), out / WEIGHTS_NAME)
    return out


def refusal(path) -> str:
    with pytest.raises(ReleasedDrafterError) as refused:
        released_drafter(path)
    message = str(refused.value)
    assert "\n" not in message
    return message


def layer_edit(speculators_dflash, **changes) -> dict:
    layer = json.loads((speculators_dflash / "config.json").read_text())["transformer_layer_config"]
    return {"transformer_layer_config": {**layer, **changes}}


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"draft_vocab_size": 128}, "reduced draft vocabulary"),
        ({"sample_from_anchor": True}, "sample_from_anchor True"),
        ({"aux_hidden_state_layer_ids": [0, 4, 7]}, "embedding output"),
        ({"target_hidden_size": 32}, "target_hidden_size 32"),
        ({"mask_token_id": None}, "no mask_token_id"),
        ({"speculators_model_type": "mlp_speculator"}, "'mlp_speculator' is not a drafter we train"),
        ({"speculators_model_type": "eagle3"}, "model_type 'qwen3'"),
        ({"transformer_layer_config": [1]}, "not a JSON object"),
    ],
)
def test_speculators_options_without_an_equivalent_are_refused(speculators_dflash, tmp_path, changes, words):
    message = refusal(edited(speculators_dflash, tmp_path, changes))
    assert words in message and "config.json" in message, message


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"attention_bias": True}, "attention_bias true"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 2.0}}, "'dynamic'"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}}, "partial"),
    ],
)
def test_speculators_layer_options_without_an_equivalent_are_refused(speculators_dflash, tmp_path, changes, words):
    message = refusal(edited(speculators_dflash, tmp_path, layer_edit(speculators_dflash, **changes)))
    assert words in message, message


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"markov_rank": 0}, "markov_rank 0"),
        ({"enable_confidence_head": False}, "no confidence head"),
        ({"confidence_head_with_markov": False}, "no confidence head"),
        ({"sample_from_anchor": False}, "sample_from_anchor False"),
    ],
)
def test_speculators_dspark_options_without_an_equivalent_are_refused(speculators, target, tmp_path, changes, words):
    source = saved(build_theirs(speculators, "dspark", target), tmp_path / "dspark")
    assert words in refusal(edited(source, tmp_path, changes))


def test_a_reduced_vocabulary_drafter_is_refused(speculators, target, tmp_path):
    """A real reduced-vocabulary save (d2t/t2d and its own lm_head in the file), from speculators' own class."""
    path, target_config, *_ = target
    t2d = torch.zeros(target_config["vocab_size"], dtype=torch.bool)
    t2d[::2] = True
    d2t = t2d.nonzero()[:, 0] - torch.arange(int(t2d.sum()))
    theirs = speculators[0]["dflash"].DFlashDraftModel.from_training_args(
        layer_config(target_config),
        t2d=t2d,
        d2t=d2t,
        verifier_name_or_path=str(path),
        draft_vocab_size=int(t2d.sum()),
        block_size=BLOCK,
        mask_token_id=MASK_ID,
        target_layer_ids=THEIR_LAYER_IDS,
        draft_attn_impl="eager",
    )
    assert "reduced draft vocabulary" in refusal(saved(theirs, tmp_path / "reduced"))


@pytest.mark.parametrize(
    "weights, words",
    [
        (lambda s: {k: v for k, v in s.items() if k != "fc.weight"}, "missing ['fc.weight']"),
        (lambda s: s | {"d2t": torch.zeros(4), "t2d": torch.zeros(4)}, "reduced draft vocabulary"),
        (lambda s: s | {"lm_head.weight": torch.zeros(128, 64)}, "lm_head.weight is not [256, 64]"),
        (lambda s: s | {"extra.weight": torch.zeros(2)}, "unexpected ['extra.weight']"),
        (lambda s: s | {"fc.weight": s["fc.weight"].to(torch.float8_e4m3fn)}, "float8_e4m3fn"),
    ],
)
def test_weights_that_do_not_match_are_refused(speculators_dflash, tmp_path, weights, words):
    message = refusal(edited(speculators_dflash, tmp_path, weights=weights))
    assert words in message and WEIGHTS_NAME in message, message


def test_a_speculators_drafter_may_carry_the_targets_tensors(speculators_dflash, target, tmp_path):
    """Older saves kept the verifier's copies: dropped, the drafter's own tensors as without them."""
    head = target[3]
    extra = {
        "embed_tokens.weight": head.embed_weight,
        "lm_head.weight": head.lm_head_weight,
        "verifier_lm_head.weight": head.lm_head_weight.clone(),
        "verifier_norm.weight": torch.ones(64),
    }
    with_target = edited(speculators_dflash, tmp_path, weights=lambda s: s | {k: v.clone() for k, v in extra.items()})
    config, state = released_drafter(with_target)
    plain_config, plain_state = released_drafter(speculators_dflash)
    assert config == plain_config and state.keys() == plain_state.keys()
    assert all(torch.equal(state[k], v) for k, v in plain_state.items())


def test_directories_that_hold_no_drafter_are_refused(speculators_dflash, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "config.json does not exist" in refusal(empty)
    (empty / "config.json").write_text("{not json")
    assert "is not a JSON config" in refusal(empty)
    (empty / "config.json").write_text("[1]")
    assert "is not a JSON object" in refusal(empty)
    (empty / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert "not a drafter layout we read" in refusal(empty)
    no_weights = edited(speculators_dflash, tmp_path)
    (no_weights / WEIGHTS_NAME).unlink()
    assert f"{WEIGHTS_NAME} does not exist" in refusal(no_weights)
    (no_weights / f"{WEIGHTS_NAME}.index.json").write_text("{}")
    assert "sharded weights" in refusal(no_weights)
    (no_weights / "pytorch_model.bin").write_bytes(b"pickle")
    assert "pytorch_model.bin" in refusal(no_weights) and "never read" in refusal(no_weights)
