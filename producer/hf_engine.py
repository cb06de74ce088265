"""The `hf` engine of `dflash-ring regenerate`: the target in this process, batched `generate` with a KV cache.

Prompts are sorted by length and cut into batches of at most `batch_size` prompts and `batch_tokens` padded
prompt tokens, left-padded so every row's next token lands in the same column. Sampling draws each prompt's
tokens from its own generator, seeded by `prompt_seed`: a prompt's reply does not depend on which prompts
share its batch, so a resumed shard draws the same replies (up to the rounding padding may change).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from dflash_ring.common.chat_encoding import eos_ids, render_chat
from dflash_ring.common.config.target import TargetConfig, TargetConfigError
from dflash_ring.common.tokenizer_loading import check_token_ids

from .generation import GenerationSettings, Prompt, Reply, prompt_seed
from .pretokenized import target_tokenizer
from .target import check_weights, load_causal_lm, resolve_device

log = logging.getLogger(__name__)


class SeededSampler(LogitsProcessor):
    """Temperature and nucleus (top_p) sampling, each row from its own generator; returns scores that leave only
    the drawn token, so greedy selection in `generate` takes it."""

    def __init__(self, seeds: Sequence[int], temperature: float, top_p: float):
        self.generators = [torch.Generator().manual_seed(s) for s in seeds]
        self.temperature = temperature
        self.top_p = top_p

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        probs = (scores.float() / self.temperature).softmax(-1)
        sorted_probs, order = probs.sort(-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always).
        kept = sorted_probs * ((sorted_probs.cumsum(-1) - sorted_probs) < self.top_p)
        cumulative = kept.cumsum(-1)
        # One uniform draw per row, on the CPU from the row's generator: the same numbers on any device.
        uniform = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in self.generators])
        targets = uniform.to(cumulative.device, cumulative.dtype)[:, None] * cumulative[:, -1:]
        picked = torch.searchsorted(cumulative, targets, right=True).clamp_(max=scores.shape[-1] - 1)
        tokens = order.gather(-1, picked)
        return torch.full_like(scores, float("-inf")).scatter_(-1, tokens, 0.0)


class HfEngine:
    """Generation with an in-process Hugging Face model and its tokenizer's chat template."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        batch_tokens: int,
        batch_size: int,
        on_batch: Callable[[], None] | None = None,
    ):
        self.eos = sorted(eos_ids(model, tokenizer))
        if not self.eos:
            raise TargetConfigError(
                "neither the target's generation_config.json nor its tokenizer names an EOS "
                "token: replies could not end"
            )
        pad = tokenizer.pad_token_id
        self.pad = self.eos[0] if pad is None else pad
        # Only our settings: a checkpoint's own generation defaults (Qwen3: top_k, temperature) never join in.
        model.generation_config = GenerationConfig(eos_token_id=self.eos, pad_token_id=self.pad)
        self.model = model
        self.tokenizer = tokenizer
        self.batch_tokens = batch_tokens
        self.batch_size = batch_size
        # Called once a batch's replies are all yielded (so the caller has counted them) and before the next batch
        # starts: only this engine knows where its batches end, and a batch may run for minutes; `regenerate` logs
        # its progress line here.
        self.on_batch = on_batch

    @classmethod
    def load(
        cls,
        cfg: TargetConfig,
        device: str,
        *,
        batch_tokens: int,
        batch_size: int,
        on_batch: Callable[[], None] | None = None,
    ) -> HfEngine:
        """The target with its LM head, and its tokenizer (first: it is refused without a chat template before
        the model is read), from local directories only."""
        check_weights(cfg)
        tokenizer = chat_tokenizer(cfg)
        model = load_causal_lm(cfg, resolve_device(device))
        engine = cls(model, tokenizer, batch_tokens=batch_tokens, batch_size=batch_size, on_batch=on_batch)
        log.info(
            "hf engine: %s (%s) on %s (%s), EOS ids %s",
            cfg.path,
            model.config.model_type,
            model.device,
            model.dtype,
            engine.eos,
        )
        return engine

    def generate(self, prompts: Sequence[Prompt], settings: GenerationSettings) -> Iterator[Reply]:
        encoded: list[tuple[Prompt, list[int]]] = []
        for prompt in prompts:
            try:
                encoded.append((prompt, self.encode(prompt, settings.enable_thinking)))
            except TargetConfigError as e:  # ids past the model's embedding: this prompt's, named as they are
                yield Reply(prompt.index, "", "error", 0, 0, str(e))
            except Exception as e:  # templates raise anything (jinja errors, raise_exception(...)): this prompt only
                yield Reply(prompt.index, "", "error", 0, 0, f"chat template failed: {type(e).__name__}: {e}")
        for batch in length_batches(encoded, self.batch_tokens, self.batch_size):
            yield from self._generate(batch, settings)
            if self.on_batch:
                self.on_batch()

    def encode(self, prompt: Prompt, enable_thinking: bool) -> list[int]:
        ids = rendered_ids(self.tokenizer, prompt, enable_thinking)
        vocab = self.model.config.get_text_config().vocab_size
        check_token_ids(max(ids, default=0), vocab, self.tokenizer.name_or_path, self.model.name_or_path, "the prompt")
        return ids

    @torch.inference_mode()
    def _generate(self, batch: list[tuple[Prompt, list[int]]], settings: GenerationSettings) -> Iterator[Reply]:
        width = max(len(ids) for _, ids in batch)
        input_ids = torch.full((len(batch), width), self.pad, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (_, ids) in enumerate(batch):  # left padding: every prompt ends in the last column
            input_ids[row, width - len(ids) :] = torch.tensor(ids)
            attention_mask[row, width - len(ids) :] = 1
        sampler = None
        if settings.temperature > 0:
            seeds = [prompt_seed(settings.seed, prompt.index) for prompt, _ in batch]
            sampler = LogitsProcessorList([SeededSampler(seeds, settings.temperature, settings.top_p)])
        out = self.model.generate(
            input_ids=input_ids.to(self.model.device),
            attention_mask=attention_mask.to(self.model.device),
            generation_config=GenerationConfig(
                max_new_tokens=settings.max_new_tokens,
                do_sample=False,
                eos_token_id=self.eos,
                pad_token_id=self.pad,
                use_cache=True,
            ),
            logits_processor=sampler,
        )
        eos = set(self.eos)
        for (prompt, ids), generated in zip(batch, out[:, width:].tolist(), strict=True):
            stop = next((i for i, token in enumerate(generated) if token in eos), None)
            tokens = generated if stop is None else generated[:stop]
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            yield Reply(
                index=prompt.index,
                # A reply cut off by max_new_tokens may end inside a character's bytes: drop that partial character.
                text=text if stop is not None else text.rstrip("\ufffd"),
                finish_reason="stop" if stop is not None else "length",
                prompt_tokens=len(ids),
                completion_tokens=len(tokens) + (stop is not None),  # the EOS is generated too
            )

    def close(self) -> None:
        del self.model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def chat_tokenizer(cfg: TargetConfig) -> PreTrainedTokenizerBase:
    """The target's tokenizer (the one its data is encoded with), refused in one line without a chat template:
    prompts could not be rendered."""
    tokenizer = target_tokenizer(cfg)
    if not tokenizer.chat_template:
        raise TargetConfigError(
            f"the target tokenizer {cfg.tokenizer or cfg.path} has no chat template, so prompts "
            "cannot be rendered: set target.tokenizer to a tokenizer directory that has one "
            "(chat_template in tokenizer_config.json, or chat_template.jinja)"
        )
    return tokenizer


def rendered_ids(tokenizer: PreTrainedTokenizerBase, prompt: Prompt, enable_thinking: bool) -> list[int]:
    """The prompt's token ids as the target reads them: the chat template with the generation prompt. One function
    for the engine and for `regenerate.max_prompt_tokens`, so the length a prompt is judged by is the one it runs at."""
    text = render_chat(  # bounded in time: a template that loops loses this prompt (BadRow), not the run
        tokenizer, list(prompt.messages), tokenize=False, add_generation_prompt=True, enable_thinking=enable_thinking
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def length_batches(
    encoded: list[tuple[Prompt, list[int]]], batch_tokens: int, batch_size: int
) -> Iterator[list[tuple[Prompt, list[int]]]]:
    """Prompts sorted by length (ties by row), cut into batches of at most batch_size prompts and batch_tokens
    padded tokens; a prompt longer than batch_tokens goes alone. Deterministic for the same prompts."""
    batch: list[tuple[Prompt, list[int]]] = []
    for item in sorted(encoded, key=lambda e: (len(e[1]), e[0].index)):
        # Sorted ascending, so this prompt sets the padded width of the batch it joins.
        if batch and (len(batch) == batch_size or (len(batch) + 1) * len(item[1]) > batch_tokens):
            yield batch
            batch = []
        batch.append(item)
    if batch:
        yield batch
