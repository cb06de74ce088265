"""The contract between `regenerate` and its engines: prompts in, one reply per prompt out.

An engine knows nothing of shards or resumption; `producer/regenerate.py` owns those, so every
engine gets exactly-once output for free.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

FinishReason = Literal["stop", "length", "error"]


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int
    temperature: float  # 0: greedy
    top_p: float
    seed: int
    # Passed to the chat template (Qwen3's thinking switch); ignored by templates without it.
    enable_thinking: bool


@dataclass(frozen=True)
class Prompt:
    index: int  # the row's index in the source data set: the key of exactly-once output
    messages: tuple[dict[str, str], ...]  # the chat up to the reply to regenerate, ending with a user turn


@dataclass(frozen=True)
class Reply:
    index: int
    text: str  # empty when finish_reason is "error"
    finish_reason: FinishReason  # "length": the reply hit max_new_tokens
    prompt_tokens: int
    completion_tokens: int
    error: str = ""  # why, when finish_reason is "error" (the row is counted and skipped, not retried forever)


class Engine(Protocol):
    def generate(self, prompts: Sequence[Prompt], settings: GenerationSettings) -> Iterator[Reply]:
        """One Reply per prompt, in any order, yielded as each is ready."""
        ...

    def close(self) -> None: ...


def prompt_seed(seed: int, index: int) -> int:
    """The sampling seed of one prompt: the same on a resumed run, whatever batch it lands in."""
    return (seed * 1_000_003 + index) % (2**31 - 1)
