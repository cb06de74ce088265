"""EAGLE-3's [drafter] keys (Li et al., arXiv 2503.01840): the drafter every peer trains (SpecForge, speculators,
ModelOpt, NeMo Automodel) and every engine serves. One decoder layer reads the token's embedding beside the target's
low, middle and high layers fused by `fc`; training-time test unrolls ttt_steps draft steps, each feeding the
drafter's own hidden state forward, with the forward KL to the target's distribution over the draft vocabulary
decayed by ttt_step_loss_decay per step. Model and objective: consumer/families/eagle3/ (shared/reference/eagle3.md).
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from dflash_ring.common.bounded_read import read_bytes
from dflash_ring.common.config.families.family import FamilyConfig
from dflash_ring.common.config.ranges import Range
from dflash_ring.common.refusal import Refusal
from dflash_ring.common.safetensors_check import check_safetensors_file

# How a run builds the file drafter.draft_vocab names (tools/draft_vocab.py), for the refusals that need one.
DRAFT_VOCAB_COMMAND = "dflash-ring draft-vocab --config RUN.toml"
# d2t, t2d and the counts: 17 bytes per target token (~2.6 MB at Qwen3's 151936); the cap only stops a wrong path.
DRAFT_VOCAB_BYTES = 1 << 30


class DraftVocabError(Refusal, ValueError):
    """drafter.draft_vocab names a file that is not the draft vocabulary of this drafter and target."""


@dataclass
class Eagle3Keys:
    """The [drafter] keys only EAGLE-3 has (None: the family's default, below)."""

    # Unrolled draft steps of training-time test; each drafts one token, so a serving round drafts this many.
    ttt_steps: Annotated[int, Range(0, 64)] | None = None  # default 7
    # Step k's loss weighs ttt_step_loss_decay ** k.
    ttt_step_loss_decay: Annotated[float, Range(0, 1)] | None = None  # default 0.8
    # Rows of the drafter's lm_head: the draft vocabulary (d2t/t2d map it into the target's); 0: the target's own.
    draft_vocab_size: Annotated[int, Range(0, 1 << 24)] | None = None  # default 0
    # The attention's residual is the normed hidden state (speculators' CLI), not the raw one (EAGLE, SpecForge).
    norm_before_residual: bool | None = None  # default False
    # The draft vocabulary's d2t/t2d maps, built from the run's training data by DRAFT_VOCAB_COMMAND: a fresh
    # drafter with draft_vocab_size > 0 loads them (a resume keeps its checkpoint's, a warm start its release's).
    # The file's digest, not its path, is part of the model (model_fields).
    draft_vocab: str | None = None


def eagle3_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Low, middle and high: the outputs of layers 1, L//2 - 1 and L - 4 (SpecForge's ids). Our ids name a layer's
    output, HF's hidden_states[i + 1]: these are EAGLE's hidden_states[2, L//2, L-3], which vLLM and SGLang capture
    by default (shared/reference/eagle3.md 1.1). The drafter's own depth does not change them."""
    ids = [1, num_target_layers // 2 - 1, num_target_layers - 4]
    if len(set(ids)) < 3 or min(ids) < 1:
        raise ValueError(
            f"a {num_target_layers}-layer target has no distinct low, middle and high layers for EAGLE-3's default "
            "(outputs of layers 1, L//2 - 1, L - 4): set target.layer_ids"
        )
    return ids


def _check(cfg: Any) -> None:
    if cfg.ttt_steps < 1:
        raise ValueError(f"ttt_steps {cfg.ttt_steps}: arch 'eagle3' drafts at least one step (ttt_steps >= 1)")
    if cfg.block_size != cfg.ttt_steps + 1:
        raise ValueError(
            f"block_size {cfg.block_size} with ttt_steps {cfg.ttt_steps}: an EAGLE-3 round drafts ttt_steps tokens "
            f"after the last committed one, so block_size must be ttt_steps + 1 = {cfg.ttt_steps + 1}"
        )
    if cfg.kl_weight <= 0 or cfg.ce_weight or cfg.tv_weight or cfg.cap_weight or cfg.loss != "ce":
        raise ValueError(
            "arch 'eagle3' trains the forward KL to the target alone: kl_weight > 0, ce_weight, tv_weight and "
            "cap_weight 0, loss 'ce' (its decay is ttt_step_loss_decay)"
        )
    if cfg.label != "data":
        raise ValueError("arch 'eagle3' takes label 'data': its KL reads the target's distribution, not a label")
    if cfg.draft_vocab is not None:
        if not cfg.draft_vocab.strip():
            raise ValueError("draft_vocab is empty: name the file `dflash-ring draft-vocab` wrote, or remove the key")
        if not cfg.draft_vocab_size:
            raise ValueError(
                f"draft_vocab {cfg.draft_vocab!r} maps a reduced draft vocabulary, but draft_vocab_size is 0 (the "
                "target's whole vocabulary): set draft_vocab_size to the file's, or remove draft_vocab"
            )
        if cfg.init_from is not None:
            raise ValueError(
                f"draft_vocab {cfg.draft_vocab!r} and init_from {cfg.init_from!r}: a warm start takes its release's "
                "d2t/t2d (its lm_head rows are those tokens); remove one of the two"
            )
    elif cfg.draft_vocab_size and cfg.init_from is None:
        raise ValueError(
            f"draft_vocab_size {cfg.draft_vocab_size} needs the d2t/t2d maps of its draft vocabulary: set "
            f'draft_vocab = "PATH" and build that file from the run\'s training data with `{DRAFT_VOCAB_COMMAND}`, '
            "start from a drafter that has them (init_from), or set draft_vocab_size 0"
        )
    if "sliding_attention" in cfg.layer_types:
        raise ValueError("arch 'eagle3' takes full_attention layers only (the EAGLE-3 layouts carry no window)")


def _check_target(cfg: Any, geometry: Any) -> None:
    if cfg.draft_vocab_size > geometry.vocab_size:
        raise ValueError(
            f"drafter.draft_vocab_size {cfg.draft_vocab_size} exceeds the target's vocabulary of "
            f"{geometry.vocab_size}: set it to at most that (0: the target's whole vocabulary)"
        )
    if cfg.draft_vocab is not None:
        check_draft_vocab(cfg.draft_vocab, cfg.draft_vocab_size, geometry.vocab_size)
    if len(geometry.layer_ids) != 3:
        try:
            hint = f" ({eagle3_layer_ids(geometry.num_hidden_layers, 1)} for this target)"
        except ValueError:
            hint = ""
        raise ValueError(
            f"target.layer_ids {list(geometry.layer_ids)}: an EAGLE-3 drafter reads three target layers, low, middle "
            f"and high (vLLM's EAGLE-3 takes three): set target.layer_ids to the outputs of layers 1, L//2 - 1 and "
            f"L - 4{hint}"
        )


def draft_vocab_digest(path: str) -> str:
    """The sha256 of the draft vocabulary's file: what the run's fingerprint holds for drafter.draft_vocab."""
    return "sha256:" + hashlib.sha256(read_draft_vocab(path)).hexdigest()


def check_draft_vocab(path: str, draft_vocab_size: int, vocab_size: int) -> None:
    """Refuse, in one line naming the file, a draft vocabulary that is not d2t [draft_vocab_size] int64 offsets,
    t2d bool [vocab_size] marking exactly the ids i + d2t[i] (ascending, inside the target's vocabulary) and
    counts int64 [vocab_size]: read without torch, before any drafter is built."""
    data = read_draft_vocab(path)  # a missing file: refused naming the command that builds it
    header = check_safetensors_file(Path(path))  # a FIFO, a directory, a damaged file: refused naming it
    want = {"d2t": ("I64", [draft_vocab_size]), "t2d": ("BOOL", [vocab_size]), "counts": ("I64", [vocab_size])}
    found = {k: (v["dtype"], v["shape"]) for k, v in header.items() if k != "__metadata__"}
    rebuild = f"build it for this run with `{DRAFT_VOCAB_COMMAND}`"
    if found.keys() != want.keys():
        raise DraftVocabError(
            f"drafter.draft_vocab {path} holds tensors {sorted(found)}, not d2t, t2d and counts: {rebuild}"
        )
    meta = header.get("__metadata__", {})
    if meta.get("vocab_size", str(vocab_size)) != str(vocab_size) or found["t2d"][1] != [vocab_size]:
        raise DraftVocabError(
            f"drafter.draft_vocab {path} maps a vocabulary of {meta.get('vocab_size', found['t2d'][1])} tokens, the "
            f"target's has {vocab_size}: {rebuild}"
        )
    if found != want:
        raise DraftVocabError(
            f"drafter.draft_vocab {path} holds "
            f"{', '.join(f'{k} {dtype} {shape}' for k, (dtype, shape) in found.items())}; drafter.draft_vocab_size "
            f"{draft_vocab_size} needs d2t I64 [{draft_vocab_size}], t2d BOOL and counts I64 [{vocab_size}]: {rebuild}"
        )
    start = 8 + int.from_bytes(data[:8], "little")
    d2t_at, t2d_at = (header[k]["data_offsets"] for k in ("d2t", "t2d"))
    d2t = array("q", data[start + d2t_at[0] : start + d2t_at[1]])  # little-endian, as safetensors and every host
    selected = [i + d for i, d in enumerate(d2t)]
    marked = [i for i, b in enumerate(data[start + t2d_at[0] : start + t2d_at[1]]) if b]
    if selected != marked or any(b <= a for a, b in zip(selected, selected[1:])):
        raise DraftVocabError(
            f"drafter.draft_vocab {path}: its t2d does not mark exactly the ids i + d2t[i] in ascending order (the "
            f"maps disagree): {rebuild}"
        )


def read_draft_vocab(path: str) -> bytes:
    """The file's bytes by the one rule for a file a user gave (a regular file, under the cap); a missing one is
    refused naming the command that builds it."""
    try:
        return read_bytes(path, DRAFT_VOCAB_BYTES, DraftVocabError, "drafter.draft_vocab")
    except FileNotFoundError:
        raise DraftVocabError(
            f"drafter.draft_vocab {path} does not exist: build it from the run's training data with "
            f"`{DRAFT_VOCAB_COMMAND}`"
        ) from None


EAGLE3 = FamilyConfig(
    name="eagle3",
    display="EAGLE-3",
    own_keys={
        "ttt_steps": 0,
        "ttt_step_loss_decay": 0.0,
        "draft_vocab_size": 0,
        "norm_before_residual": False,
        "draft_vocab": None,
    },
    defaults={
        "ttt_steps": 7,
        "ttt_step_loss_decay": 0.8,
        "draft_vocab_size": 0,
        "norm_before_residual": False,
        "block_size": 8,
        "kl_weight": 1.0,
        "ce_weight": 0.0,
        # Read by no EAGLE-3 objective (its decay is ttt_step_loss_decay); set so that a block size the DFlash paper
        # gives no gamma for is not refused.
        "loss_gamma": 1.0,
    },
    # The EAGLE-3 paper's drafter as EAGLE's traineagle3 and SpecForge train it (shared/reference/eagle3.md 5): one
    # layer, K = 7 unrolled steps, step decay 0.8, the target's low/mid/high layers (eagle3_layer_ids), the
    # target's whole vocabulary (draft_vocab_size 0: DeepSpec's choice; EAGLE/SpecForge use 32000) and the
    # residual from the raw hidden state (norm_before_residual false, as EAGLE, SpecForge and SGLang). The loss is
    # speculators' form of it: the forward KL per step over the supervised rows' mean.
    recipes={
        "eagle3": {
            "arch": "eagle3",
            "num_hidden_layers": 1,
            "block_size": 8,
            "ttt_steps": 7,
            "ttt_step_loss_decay": 0.8,
            "draft_vocab_size": 0,
            "norm_before_residual": False,
            "kl_weight": 1.0,
            "ce_weight": 0.0,
            "cap_weight": 0.0,
        }
    },
    target_layer_ids=eagle3_layer_ids,
    check=_check,
    check_target=_check_target,
    digests={"draft_vocab": draft_vocab_digest},
)
