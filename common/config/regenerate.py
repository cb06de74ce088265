"""How `dflash-ring regenerate` replaces a data set's replies with the target's own.

A drafter learns to predict what the target says, so DFlash trains on replies the target
regenerated. Import-light (no torch): the CLI validates this section before loading anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from dflash_ring.common.config.paths import OutputDirectory
from dflash_ring.common.refusal import Refusal
from dflash_ring.common.config.ranges import AtLeastOne, PositiveSeconds, Range

EngineName = Literal["hf", "openai"]


class RegenerateConfigError(Refusal, ValueError):
    """The [regenerate] settings cannot be used; the message says which key and why."""


@dataclass(frozen=True)
class RegenerateConfig:
    # Prompts come from [data] (path, format, split): the same sources `data.path` accepts.
    # Output: a directory of jsonl shards plus a progress record; `data.path` reads it directly.
    output: OutputDirectory = ""
    # "hf": the target (target.path) in this process, batched generation with a KV cache.
    # "openai": any OpenAI-compatible server (vLLM, SGLang, `transformers serve`).
    engine: EngineName = "hf"
    max_new_tokens: AtLeastOne = 1024
    # 0: greedy. Sampling is seeded per prompt (seed, row index), so a resumed run draws the same.
    temperature: float = 0.0
    top_p: Annotated[float, Range(low_open=True, high=1)] = 1.0
    seed: int = 0
    # Replies that hit max_new_tokens: kept (a truncated reply is still the target's) or dropped; counted either way.
    keep_truncated: bool = True
    # Rows per output shard; a shard is written whole (temp file, fsync, rename) and then recorded as done.
    shard_rows: AtLeastOne = 256
    # 0: every source row. N: only the first N rows are answered (a trial run on a slice of the source); part of the
    # job's settings, so a resume with another value is refused rather than leave a data set of mixed limits.
    max_rows: Annotated[int, Range(low=0)] = 0
    # 0: no limit. N: a prompt whose rendered chat (template and generation prompt, as the target reads it) is over
    # N tokens is skipped and recorded with its length, never cut: a cut prompt would get a reply to another
    # question. Needs the target's tokenizer (target.path or target.tokenizer) with either engine.
    max_prompt_tokens: Annotated[int, Range(low=0)] = 0
    # hf engine: padded prompt tokens per generation batch (prompts are bucketed by length). Room for a full
    # batch_size of prompts is what makes bucketing pay (docs/benchmarks.md: x1.40 at 65536 vs x1.01 at 16384).
    batch_tokens: AtLeastOne = 65536
    # hf engine: most prompts per generation batch.
    batch_size: AtLeastOne = 64
    # openai engine: one or more base URLs (e.g. "http://127.0.0.1:8000/v1"); requests are spread over them.
    base_urls: list[str] = field(default_factory=list)
    # openai engine: the model name sent with each request (empty: the server's first listed model).
    model: str = ""
    # openai engine: name of the environment variable holding the API key (empty: none sent).
    api_key_env: str = ""
    # Requests in flight, a thread each: 1024 is past what one server (or a few) can take.
    concurrency: Annotated[int, Range(1, 1024)] = 16
    timeout_s: PositiveSeconds = 120.0
    # Attempts per request after the first, with exponential backoff (1 s, 2 s, 4 s, ... capped at 30 s): at most
    # 100, about 50 minutes on one request before the job gives up, past any server's restart.
    retries: Annotated[int, Range(0, 100)] = 4

    def __post_init__(self) -> None:
        for url in self.base_urls:
            if not url.startswith(("http://", "https://")):
                raise RegenerateConfigError(f"regenerate.base_urls: {url!r} is not an http(s) URL")
