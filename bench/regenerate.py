"""`dflash-ring bench regenerate`: generated tokens/s of the `hf` engine against plain `model.generate`.

One process, one random-weight target of a named shape (bench/target_shapes.py; Qwen3-8B by default) made on
the device, the embedded tiny tokenizer (its chat template), and synthetic chat prompts with a long-tailed
length distribution. Random weights would never stop at an end token, and would write ids the tokenizer does
not have: the LM head rows of every id past the tokenizer's vocabulary, and of its end tokens, are zeroed, so
every reply is exactly max_new_tokens long and the head's matmul keeps its full size.

  (a) engine: HfEngine.generate (prompts sorted by length, batches of at most batch_size prompts and
      batch_tokens padded prompt tokens, left padding, KV cache);
  (b) baseline: `model.generate` over the same prompts in data order, batch_size at a time, left-padded:
      what a script without length bucketing does.

engine / baseline is the ratio; both generate the same number of tokens. Each path's figures also go to stderr
as soon as they are measured (bench/progress.py).
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, GenerationConfig

from dflash_ring.common.arguments import at_least_one
from dflash_ring.common.device import checked_device
from dflash_ring.embedded.tiny_tokenizer import tiny_chat_tokenizer
from dflash_ring.producer.generation import GenerationSettings, Prompt
from dflash_ring.producer.hf_engine import HfEngine

from .progress import progress
from .target_shapes import SHAPES, shape_config

WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
    "quebec romeo sierra tango uniform victor whiskey xray yankee zulu one two three four five six seven "
    "eight nine ten plus minus count sort reverse words numbers"
).split()


def synthetic_prompts(n: int, median_words: int, max_words: int, seed: int = 0) -> list[Prompt]:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(median_words), 0.8, n), 4, max_words).astype(int)
    return [Prompt(i, ({"role": "user", "content": " ".join(rng.choice(WORDS, k))},)) for i, k in enumerate(lengths)]


def build_model(shape: str, device: torch.device, dtype: torch.dtype) -> transformers.PreTrainedModel:
    config = shape_config(shape)
    config.tie_word_embeddings = False
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def silence(model: transformers.PreTrainedModel, vocab_kept: int, stop_ids: list[int]) -> None:
    """Zero the head rows of ids the tokenizer lacks (they never beat the kept rows' positive maxima) and of
    the end tokens (every reply runs to max_new_tokens)."""
    head = model.get_output_embeddings().weight
    with torch.no_grad():
        head[vocab_kept:].zero_()
        head[stop_ids] = 0  # (indexing with a list copies: assign, do not zero_() the copy)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_regenerate_bench(
    *,
    shape: str = "qwen3-8b",
    device: str | None = None,
    prompts: int = 256,
    max_new_tokens: int = 128,
    batch_size: int = 64,
    batch_tokens: int = 65536,
    median_words: int = 150,
    max_words: int = 1500,
) -> dict[str, Any]:
    dev = checked_device(device or ("cuda" if torch.cuda.is_available() else "cpu"))  # one line if not here
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = tiny_chat_tokenizer(Path(tmp) / "tokenizer", corpus=[" ".join(WORDS)] * 4)
    model = build_model(shape, dev, dtype)
    engine = HfEngine(model, tokenizer, batch_tokens=batch_tokens, batch_size=batch_size)
    stop = engine.eos
    silence(model, len(tokenizer), stop)
    settings = GenerationSettings(
        max_new_tokens=max_new_tokens, temperature=0.0, top_p=1.0, seed=0, enable_thinking=False
    )
    batch = synthetic_prompts(prompts, median_words, max_words)
    encoded = [engine.encode(p, False) for p in batch]
    prompt_lengths = [len(ids) for ids in encoded]

    # Warm-up: kernels and the allocator, on a few prompts, both paths.
    list(engine.generate(batch[:4], settings))
    _baseline(model, encoded[:4], engine.pad, stop, max_new_tokens, batch_size)
    _sync(dev)

    t0 = time.perf_counter()
    replies = list(engine.generate(batch, settings))
    _sync(dev)
    engine_s = time.perf_counter() - t0
    engine_tokens = sum(r.completion_tokens for r in replies)
    engine_figures = {
        "seconds": round(engine_s, 2),
        "generated_tokens": engine_tokens,
        "tokens_per_s": round(engine_tokens / engine_s, 1),
        "finish_length": sum(r.finish_reason == "length" for r in replies),
    }
    progress("regenerate", "engine", engine_figures)

    t0 = time.perf_counter()
    baseline_tokens = _baseline(model, encoded, engine.pad, stop, max_new_tokens, batch_size)
    _sync(dev)
    baseline_s = time.perf_counter() - t0
    baseline_figures = {
        "seconds": round(baseline_s, 2),
        "generated_tokens": baseline_tokens,
        "tokens_per_s": round(baseline_tokens / baseline_s, 1),
    }
    progress("regenerate", "baseline_model_generate", baseline_figures)

    return {
        "benchmark": "regenerate",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({platform.machine()})",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "shape": shape,
        "dtype": str(dtype).removeprefix("torch."),
        "prompts": prompts,
        "max_new_tokens": max_new_tokens,
        "batch_size": batch_size,
        "batch_tokens": batch_tokens,
        "prompt_tokens": {
            "mean": round(float(np.mean(prompt_lengths)), 1),
            "max": int(max(prompt_lengths)),
            "total": int(sum(prompt_lengths)),
        },
        "engine": engine_figures,
        "baseline_model_generate": baseline_figures,
        "all_replies_full_length": all(r.finish_reason == "length" for r in replies),
        "ratio_engine_over_baseline": round((engine_tokens / engine_s) / (baseline_tokens / baseline_s), 3),
        "peak_memory_gib": round(torch.cuda.max_memory_allocated(dev) / 2**30, 1) if dev.type == "cuda" else None,
    }


@torch.inference_mode()
def _baseline(model, encoded: list[list[int]], pad: int, stop: list[int], max_new_tokens: int, batch_size: int) -> int:
    """`model.generate`, prompts in data order, batch_size at a time, left-padded; returns tokens generated."""
    generated = 0
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stop, pad_token_id=pad)
    for start in range(0, len(encoded), batch_size):
        rows = encoded[start : start + batch_size]
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - len(r) :] = torch.tensor(r)
            mask[i, width - len(r) :] = 1
        out = model.generate(
            input_ids=ids.to(model.device), attention_mask=mask.to(model.device), generation_config=config
        )
        generated += (out.shape[1] - width) * len(rows)
    return generated


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`dflash-ring bench regenerate`'s own options (cli.py registers every bench by name, and hands it the rest)."""
    parser.add_argument("--json", action="store_true", help="print the JSON report (the default output)")
    parser.add_argument(
        "--shape",
        default="qwen3-8b",
        choices=sorted(SHAPES),
        help="random-weight target of this shape (tiny: a CPU smoke run)",
    )
    parser.add_argument("--device", help="default: cuda if available, else cpu")
    parser.add_argument("--prompts", type=at_least_one, default=256)
    parser.add_argument("--max-new-tokens", type=at_least_one, default=128)
    parser.add_argument("--batch-size", type=at_least_one, default=64)
    parser.add_argument("--batch-tokens", type=at_least_one, default=65536)


def main(args: argparse.Namespace) -> int:
    print(
        json.dumps(
            run_regenerate_bench(
                shape=args.shape,
                device=args.device,
                prompts=args.prompts,
                max_new_tokens=args.max_new_tokens,
                batch_size=args.batch_size,
                batch_tokens=args.batch_tokens,
            ),
            indent=2,
        )
    )
    return 0
