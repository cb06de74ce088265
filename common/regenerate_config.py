"""How `dflash-ring regenerate` replaces a data set's replies with the target's own.

A drafter learns to predict what the target says, so DFlash trains on replies the target
regenerated. Import-light (no torch): the CLI validates this section before loading anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

EngineName = Literal["hf", "openai"]


class RegenerateConfigError(ValueError):
    """The [regenerate] settings cannot be used; the message says which key and why."""


@dataclass(frozen=True)
class RegenerateConfig:
    # Prompts come from [data] (path, format, split): the same sources `data.path` accepts.
    # Output: a directory of jsonl shards plus a progress record; `data.path` reads it directly.
    output: str = ""
    # "hf": the target (target.path) in this process, batched generation with a KV cache.
    # "openai": any OpenAI-compatible server (vLLM, SGLang, `transformers serve`).
    engine: EngineName = "hf"
    max_new_tokens: int = 1024
    # 0: greedy. Sampling is seeded per prompt (seed, row index), so a resumed run draws the same.
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    # Replies that hit max_new_tokens: kept (a truncated reply is still the target's) or dropped; counted either way.
    keep_truncated: bool = True
    # Rows per output shard; a shard is written whole (temp file, fsync, rename) and then recorded as done.
    shard_rows: int = 256
    # hf engine: padded prompt tokens per generation batch (prompts are bucketed by length). Room for a full
    # batch_size of prompts is what makes bucketing pay (docs/benchmarks.md: x1.40 at 65536 vs x1.01 at 16384).
    batch_tokens: int = 65536
    # hf engine: most prompts per generation batch.
    batch_size: int = 64
    # openai engine: one or more base URLs (e.g. "http://127.0.0.1:8000/v1"); requests are spread over them.
    base_urls: list[str] = field(default_factory=list)
    # openai engine: the model name sent with each request (empty: the server's first listed model).
    model: str = ""
    # openai engine: name of the environment variable holding the API key (empty: none sent).
    api_key_env: str = ""
    concurrency: int = 16
    timeout_s: float = 120.0
    # Attempts per request after the first, with exponential backoff (1 s, 2 s, 4 s, ... capped at 30 s).
    retries: int = 4

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "shard_rows", "batch_tokens", "batch_size", "concurrency"):
            if getattr(self, name) < 1:
                raise RegenerateConfigError(f"regenerate.{name} = {getattr(self, name)}: must be at least 1")
        if self.temperature < 0:
            raise RegenerateConfigError(f"regenerate.temperature = {self.temperature}: must be >= 0 (0 is greedy)")
        if not 0 < self.top_p <= 1:
            raise RegenerateConfigError(f"regenerate.top_p = {self.top_p}: must be in (0, 1]")
        if self.timeout_s <= 0 or self.retries < 0 or self.seed < 0:
            raise RegenerateConfigError(
                f"regenerate: timeout_s = {self.timeout_s}, retries = {self.retries}, seed = {self.seed}: "
                "need a positive timeout and non-negative retries and seed")
        for url in self.base_urls:
            if not url.startswith(("http://", "https://")):
                raise RegenerateConfigError(f"regenerate.base_urls: {url!r} is not an http(s) URL")
