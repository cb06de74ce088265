"""What a producer reads and how it cuts it into batches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

DataFormat = Literal["auto", "json", "jsonl", "parquet", "arrow", "disk"]
FORMATS: tuple[str, ...] = ("auto", "json", "jsonl", "parquet", "arrow", "disk")


class DataError(ValueError):
    """The data set (or its configuration) cannot be used; the message says what to fix."""


@dataclass(frozen=True)
class DataConfig:
    """Settings for loading, tokenizing and batching one data set.

    Only `path`, `format`, `split`, `max_length` and `enable_thinking` change the tokenized
    cache; the rest only change how batches are cut and ordered.
    """

    path: str = ""
    # "auto" guesses from the file suffix; "disk" is a directory written by `save_to_disk`.
    format: DataFormat = "auto"
    # A DatasetDict directory's split; for files, "train" (slices such as "train[:1000]" work).
    split: str = "train"
    max_length: int = 3072
    # Token budget of one batch; padding counts against it when batches are padded (target.packing).
    max_tokens_per_batch: int = 32768
    # Passed to the chat template (Qwen3: False pre-fills an empty <think> block in the prompt).
    enable_thinking: bool = False
    seed: int = 0
    epochs: int = 1
    num_proc: int = 1
    cache_dir: str = "~/.cache/dflash_ring/data"
    # Samples sorted by length together; larger packs tighter, smaller keeps the order random.
    bucket_window: int = 1024

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise DataError(f"DataConfig.format={self.format!r}: use one of {', '.join(FORMATS)}")
        for name in ("max_length", "max_tokens_per_batch", "epochs", "num_proc", "bucket_window"):
            if getattr(self, name) < 1:
                raise DataError(f"DataConfig.{name}={getattr(self, name)}: must be at least 1")
        if self.seed < 0:
            raise DataError(f"DataConfig.seed={self.seed}: must be non-negative")
        if self.max_tokens_per_batch < self.max_length:
            raise DataError(
                f"DataConfig.max_tokens_per_batch={self.max_tokens_per_batch} is below "
                f"max_length={self.max_length}: a full-length sample would fit no batch"
            )
