"""Tiny random-init targets saved as real HF model directories, a chat data set, and reference features."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_ring.bench.target_shapes import FAMILIES, model_class, tiny_config
from dflash_ring.producer.conformance import relative_error
from dflash_ring.embedded.tiny_tokenizer import tiny_chat_tokenizer

ARCHS = tuple(FAMILIES)
WORDS = ("the quick brown fox jumps over the lazy dog drafter target hidden state ring shared memory "
         "capital France Paris explain speculative decoding numbers hello world thanks sure okay").split()


# Packed (or padded) against per-sequence features in float32: the largest relative RMS error of a
# sequence allowed (the probe's measure). A CPU GEMM rounds a row differently depending on how many
# rows share the call (measured on the tiny targets: up to ~2e-7 here; ~1e-7 to 1e-5 on other
# processors and BLAS builds), while a leak across sequences, a dropped attention sink or a missed
# window gives 1e-2 and more.
FEATURE_TOLERANCE = 1e-4


def assert_same_features(got: list[torch.Tensor], want: list[torch.Tensor], tolerance: float = FEATURE_TOLERANCE):
    errors = [relative_error(g, w) for g, w in zip(got, want, strict=True)]
    bad = [i for i, e in enumerate(errors) if not e <= tolerance]
    assert not bad, f"sequences {bad} differ from their own forward: errors {[f'{errors[i]:.1e}' for i in bad]}"


def build_target(path: Path, arch: str, layers: int = 6, hidden: int = 64, seed: int = 0,
                 init: Callable[[torch.nn.Module], None] | None = None, **extra) -> Path:
    """A random-weight target with the tiny tokenizer beside it, as `save_pretrained` writes a real one;
    `init` may change the weights before saving (e.g. make a mechanism's effect large)."""
    tokenizer = tiny_chat_tokenizer(path)
    config = tiny_config(
        arch, vocab_size=len(tokenizer) + 8,  # spare rows, like Qwen3's: the first one can be the mask token
        hidden_size=hidden, num_hidden_layers=layers, pad_token_id=tokenizer.pad_token_id, **extra,
    )
    torch.manual_seed(seed)
    model = model_class(arch)(config)
    if init is not None:
        with torch.no_grad():
            init(model)
    model.save_pretrained(path)
    return path


def write_chat_rows(path: Path, rows: int, seed: int = 0) -> Path:
    """Chat rows of varied length (a few dozen to ~150 tokens), some multi-turn, one per line."""
    rng = random.Random(seed)

    def text(lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    out = []
    for i in range(rows):
        messages = [{"role": "user", "content": text(3, 30)}, {"role": "assistant", "content": text(3, 60)}]
        if i % 4 == 0:
            messages += [{"role": "user", "content": text(2, 10)}, {"role": "assistant", "content": text(2, 20)}]
        out.append({"messages": messages})
    path.write_text("".join(json.dumps(r) + "\n" for r in out))
    return path


def reference_features(model_dir: Path, sequences: list[torch.Tensor], layer_ids: list[int]) -> list[torch.Tensor]:
    """Each sequence alone through a plain HF forward with output_hidden_states: concat of hidden_states[l + 1]."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for ids in sequences:
            hs = model(ids.long()[None], output_hidden_states=True).hidden_states
            out.append(torch.cat([hs[i + 1][0] for i in layer_ids], dim=-1))
    return out


def reference_final_hidden(model_dir: Path, sequences: list[torch.Tensor]) -> list[torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [model.model(ids.long()[None]).last_hidden_state[0] for ids in sequences]


def load_tokenizer(model_dir: Path):
    return AutoTokenizer.from_pretrained(model_dir)
