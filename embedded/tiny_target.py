"""The embedded default target: a small Qwen3 trained on the tiny corpus, built once and cached.

A random target makes every drafter look alike (nothing is predictable), so the demo target is
genuinely trained, on CPU in a few minutes, on replies a drafter can learn to guess. It is saved
as an ordinary HF checkpoint (safetensors) so producers load it through the same code as a real
target. The cache entry is trusted only if its marker, written last, names this exact recipe and
every file still has the checksum recorded there; anything else is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase, Qwen3Config, Qwen3ForCausalLM

from dflash_ring.common.durable import cache_entry

from dflash_ring.common.chat_encoding import ChatEncoder
from .tiny_corpus import CorpusSpec, Row, corpus_texts, generate_corpus, write_jsonl
from .tiny_tokenizer import QWEN_SPLIT_PATTERN, tiny_chat_tokenizer

logger = logging.getLogger(__name__)

# Bump whenever the build changes what it writes for the same recipe fields.
RECIPE_VERSION = 2
MARKER_NAME = "dflash_ring_tiny.json"
TRAIN_FILE = "train.jsonl"
HELDOUT_FILE = "heldout.jsonl"
_VOCAB_MULTIPLE = 64  # embedding rows rounded up, leaving unused rows (the drafter's mask token) as in Qwen3


@dataclass(frozen=True)
class TinyTargetRecipe:
    """Everything the built target depends on; the cache key is a hash of all of it."""

    corpus: CorpusSpec = field(default_factory=CorpusSpec)
    tokenizer_vocab_size: int = 640
    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 384
    max_position_embeddings: int = 512
    steps: int = 600
    batch_size: int = 16
    learning_rate: float = 3e-3
    warmup_steps: int = 30
    seed: int = 0
    # Held-out prompts answered greedily after training, to check the target really learned the tasks.
    generation_checks: int = 100
    version: int = RECIPE_VERSION

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class TargetQuality:
    heldout_token_accuracy: float  # teacher-forced next-token top-1 on held-out assistant tokens
    # Mean entropy (nats) of the next-token distribution there: what a drafter and its KL terms face. A corpus with
    # one wording per reply gave a near one-hot target (most tokens near 0); three phrasings give ~ln 3 at a phrase.
    heldout_mean_entropy: float
    heldout_exact_match: float  # greedy replies equal to the reference, over generation_checks prompts
    final_train_loss: float


def ensure_tiny_target(cache_dir: str | Path, recipe: TinyTargetRecipe = TinyTargetRecipe()) -> Path:
    """Path of the trained tiny target (HF dir with tokenizer, TRAIN_FILE, HELDOUT_FILE), built on first use."""
    final = Path(cache_dir).expanduser() / f"tiny-target-v{recipe.version}-{recipe.key()}"
    # Producers may start together: one builds, the others wait and then reuse its result.
    return cache_entry(final, lambda d: _is_intact(d, recipe), lambda tmp: _build(recipe, tmp))


def read_marker(target_dir: str | Path) -> dict[str, Any]:
    """The build record: recipe, mask_token_id (first unused embedding row), quality, checksums."""
    return json.loads((Path(target_dir) / MARKER_NAME).read_text())


def _build(recipe: TinyTargetRecipe, out: Path) -> None:
    started = time.monotonic()
    corpus = generate_corpus(recipe.corpus)
    write_jsonl(corpus.train, out / TRAIN_FILE)
    write_jsonl(corpus.heldout, out / HELDOUT_FILE)
    tokenizer = tiny_chat_tokenizer(
        out, vocab_size=recipe.tokenizer_vocab_size, corpus=corpus_texts(corpus), split_pattern=QWEN_SPLIT_PATTERN
    )
    encoder = ChatEncoder(tokenizer, max_length=recipe.max_position_embeddings, enable_thinking=False)
    train = [encoder.encode(row) for row in corpus.train]
    heldout = [encoder.encode(row) for row in corpus.heldout]

    previous_threads = torch.get_num_threads()
    # One thread: the same weights whatever the core count (reduction order follows it), and a
    # model this small gains little from more while losing badly when the cores are shared (spinning
    # OpenMP workers made steps 30x slower next to a running ring in our measurements).
    torch.set_num_threads(1)
    try:
        torch.manual_seed(recipe.seed)  # the initial weights are part of the recipe too
        model = Qwen3ForCausalLM(_model_config(recipe, tokenizer))
        final_loss = _train(model, train, recipe)
        accuracy, entropy = _heldout_scores(model, heldout)
        quality = TargetQuality(
            heldout_token_accuracy=accuracy,
            heldout_mean_entropy=entropy,
            heldout_exact_match=_exact_match(model, tokenizer, corpus.heldout[: recipe.generation_checks]),
            final_train_loss=final_loss,
        )
    finally:
        torch.set_num_threads(previous_threads)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    seconds = time.monotonic() - started
    logger.info(
        "built tiny target in %.0f s: held-out token accuracy %.3f, mean entropy %.2f nats, greedy exact match %.2f",
        seconds,
        quality.heldout_token_accuracy,
        quality.heldout_mean_entropy,
        quality.heldout_exact_match,
    )
    marker = {
        "recipe_version": recipe.version,
        "recipe": asdict(recipe),
        "mask_token_id": len(tokenizer),
        "quality": asdict(quality),
        "build_seconds": round(seconds, 1),
        "files": _checksums(out),
    }
    (out / MARKER_NAME).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")


def _model_config(recipe: TinyTargetRecipe, tokenizer: PreTrainedTokenizerBase) -> Qwen3Config:
    vocab = math.ceil((len(tokenizer) + 1) / _VOCAB_MULTIPLE) * _VOCAB_MULTIPLE
    return Qwen3Config(
        vocab_size=vocab,
        hidden_size=recipe.hidden_size,
        num_hidden_layers=recipe.num_hidden_layers,
        num_attention_heads=recipe.num_attention_heads,
        num_key_value_heads=recipe.num_key_value_heads,
        head_dim=recipe.hidden_size // recipe.num_attention_heads,
        intermediate_size=recipe.intermediate_size,
        max_position_embeddings=recipe.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


Sample = tuple[np.ndarray, np.ndarray]  # (input_ids, assistant loss mask), as ChatEncoder.encode returns


def _padded_batch(samples: Sequence[Sample]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) right-padded; labels are -100 outside assistant tokens.

    No attention mask: under causal attention no real token sees the padding after it, and without a
    mask SDPA takes its faster causal path.
    """
    width = max(len(ids) for ids, _ in samples)
    input_ids = torch.zeros(len(samples), width, dtype=torch.long)
    labels = torch.full((len(samples), width), -100, dtype=torch.long)
    for i, (ids, mask) in enumerate(samples):
        row = torch.from_numpy(ids.astype(np.int64))
        input_ids[i, : len(ids)] = row
        labels[i, : len(ids)] = torch.where(torch.from_numpy(mask.astype(bool)), row, -100)
    return input_ids, labels


def _batches(samples: Sequence[Sample], batch_size: int, generator: torch.Generator) -> Iterator[list[Sample]]:
    """Endless batches from a fresh shuffle each epoch. Not grouped by length: that would also group by
    task (each has its own length), and single-task batches trained far worse in our runs."""
    while True:
        order = torch.randperm(len(samples), generator=generator).tolist()
        for start in range(0, len(order) - batch_size + 1, batch_size):
            yield [samples[i] for i in order[start : start + batch_size]]


def _train(model: Qwen3ForCausalLM, samples: Sequence[Sample], recipe: TinyTargetRecipe) -> float:
    """AdamW, linear warm-up then cosine decay to 10%; loss on assistant tokens only. Returns the last loss."""
    generator = torch.Generator().manual_seed(recipe.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.learning_rate, betas=(0.9, 0.95), weight_decay=0.0)

    def lr_factor(step: int) -> float:
        if step < recipe.warmup_steps:
            return (step + 1) / recipe.warmup_steps
        progress = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    batches = _batches(samples, recipe.batch_size, generator)
    loss_value = float("nan")
    model.train()
    for step in range(recipe.steps):
        input_ids, labels = _padded_batch(next(batches))
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()
        if step % 100 == 0 or step == recipe.steps - 1:
            logger.info("tiny target step %d/%d: loss %.4f", step + 1, recipe.steps, loss_value)
    model.eval()
    return loss_value


@torch.no_grad()
def _heldout_scores(model: Qwen3ForCausalLM, samples: Sequence[Sample], batch_size: int = 64) -> tuple[float, float]:
    """(top-1 accuracy, mean entropy in nats) of the next-token distribution over held-out assistant tokens."""
    correct = total = 0
    entropy = 0.0
    for start in range(0, len(samples), batch_size):
        input_ids, labels = _padded_batch(samples[start : start + batch_size])
        logits = model(input_ids=input_ids).logits[:, :-1].float()
        targets = labels[:, 1:]
        scored = targets != -100
        correct += int((logits.argmax(-1) == targets)[scored].sum())
        log_p = torch.log_softmax(logits[scored], dim=-1)
        entropy += float(-(log_p.exp() * log_p).sum())
        total += int(scored.sum())
    return correct / max(total, 1), entropy / max(total, 1)


@torch.no_grad()
def _exact_match(model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerBase, rows: Sequence[Row]) -> float:
    """Share of prompts whose greedy reply is exactly the reference reply."""
    hits = 0
    for row in rows:
        *history, reply = row["messages"]
        prompt = tokenizer.apply_chat_template(
            history, add_generation_prompt=True, enable_thinking=False, return_tensors="pt", return_dict=True
        )
        budget = len(tokenizer(reply["content"], add_special_tokens=False)["input_ids"]) + 8
        out = model.generate(**prompt, max_new_tokens=budget, do_sample=False)
        text = tokenizer.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
        hits += text.strip() == reply["content"]
    return hits / max(len(rows), 1)


def _checksums(directory: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name != MARKER_NAME
    }


def _is_intact(directory: Path, recipe: TinyTargetRecipe) -> bool:
    try:
        marker = read_marker(directory)
        return marker["recipe"] == asdict(recipe) and marker["files"] == _checksums(directory)
    except (OSError, ValueError, KeyError, TypeError):
        return False
