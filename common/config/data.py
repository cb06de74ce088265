"""What a producer reads and how it cuts it into batches."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

from dflash_ring.common.config.paths import OutputDirectory, home_path, ReadPath
from dflash_ring.common.refusal import Refusal
from dflash_ring.common.config.ranges import AtLeastOne, Positive, Range, Share

DataFormat = Literal["auto", "json", "jsonl", "parquet", "arrow", "disk"]
FORMATS: tuple[str, ...] = ("auto", "json", "jsonl", "parquet", "arrow", "disk")
# Source names label Prometheus series and travel in every item's meta: their number and length stay bounded.
MAX_SOURCES, MAX_SOURCE_NAME = 16, 64
_NAME = re.compile(r"[A-Za-z0-9_.-]+")  # valid in a metric label, a tracker key and a file name alike


class DataError(Refusal, ValueError):
    """The data set (or its configuration) cannot be used; the message says what to fix."""


@dataclass(frozen=True)
class DataSource:
    """One data set of a weighted mixture (a `[[data.sources]]` entry), tokenized and cached on its own.

    `weight` is the source's share of an epoch's rows (weights are relative: 3 and 1 give 75% and 25%).
    """

    path: ReadPath = ""
    weight: Positive = 1.0
    # Shown in logs, `dflash-ring data stats` and metrics; empty: the file or directory name without suffix.
    name: str = ""
    # True: rows are cycled (each pass reshuffled) when the weight asks for more rows than the source has;
    # false: a row is used at most once per epoch, and the source bounds the epoch's size.
    repeat: bool = False
    format: DataFormat = "auto"
    split: str = "train"
    # True: a held-out source; every row of it is evaluated once an epoch and never trained (weight and
    # repeat do not apply to it).
    eval: bool = False

    def __post_init__(self) -> None:
        if not self.path:
            raise DataError("path is empty: every [[data.sources]] entry needs the data file or directory it reads")
        if self.format not in FORMATS:
            raise DataError(f"format = {self.format!r}: use one of {', '.join(FORMATS)}")
        if not self.name:
            object.__setattr__(self, "name", source_name(self.path))  # frozen: set once, here


def source_name(path: str) -> str:
    """A source's default name: its file or directory name without the suffix, other characters than
    letters, digits, '_', '.' and '-' as '_', cut to MAX_SOURCE_NAME."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", Path(path).stem)[:MAX_SOURCE_NAME] or "data"


@dataclass(frozen=True)
class DataConfig:
    """Settings for loading, tokenizing and batching one data set (`path`) or a weighted mixture (`sources`).

    Only the data files, `format`, `split`, `max_length` and `enable_thinking` change the tokenized
    cache; the rest only change how batches are cut and ordered.

    Epoch size of a mixture: the largest epoch in which no source with `repeat = false` runs out of rows at
    its weight, i.e. min over those sources of rows / share (share = weight / sum of weights); if every
    source repeats, the total number of rows. Each source gives floor(epoch x share) rows (a non-repeating
    source at most all of its rows: the one that sets the size gives all of them); a source given no row
    is an error, as is a source with no usable row. A source that gives fewer rows than it has gives a new
    random subset each epoch; a repeating source asked for more gives whole passes plus a random subset.
    Rows are counted after tokenization (bad and unreachable rows skipped). A single `path` is one source
    and is batched exactly as before mixtures existed.
    """

    path: ReadPath = ""
    # A weighted mixture instead of `path`: a list of DataSource tables ([[data.sources]] in TOML).
    sources: list[DataSource] = field(default_factory=list)
    # "auto" guesses from the file suffix; "disk" is a directory written by `save_to_disk`.
    format: DataFormat = "auto"
    # A DatasetDict directory's split; for files, "train" (slices such as "train[:1000]" work).
    split: str = "train"
    max_length: AtLeastOne = 3072
    # Token budget of one batch; padding counts against it when batches are padded (target.packing).
    max_tokens_per_batch: AtLeastOne = 32768
    # Passed to the chat template (Qwen3: False pre-fills an empty <think> block in the prompt).
    enable_thinking: bool = False
    seed: int = 0
    # Every producer plans every epoch when it starts (producer/process.py counts the run's batches): a trillion
    # epochs was a producer that never published and never heard SIGTERM. Real runs train 1 to 10 epochs, a tiny
    # data set a few hundred; 10_000 plans in seconds on small data.
    epochs: Annotated[int, Range(1, 10_000)] = 1
    # Tokenizer worker processes (datasets' num_proc), one process each: 1024 is past any host's cores.
    num_proc: Annotated[int, Range(1, 1024)] = 1
    cache_dir: OutputDirectory = field(default_factory=lambda: home_path("~/.cache/dflash_ring/data"))
    # Samples sorted by length together; larger packs tighter, smaller keeps the order random.
    bucket_window: AtLeastOne = 1024
    # Share of every training source's rows held out for evaluation (0: none). Which rows is a pure function of
    # (seed, source name, row index): the same rows every epoch, on every producer and after any restart, and
    # never trained. Held-out rows (and every row of an `eval = true` source) are batched apart, as evaluation
    # items spread evenly through each epoch, each evaluated once an epoch.
    eval_fraction: Share = 0.0

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise DataError(f"DataConfig.format={self.format!r}: use one of {', '.join(FORMATS)}")
        if self.max_tokens_per_batch < self.max_length:
            raise DataError(
                f"data.max_tokens_per_batch = {self.max_tokens_per_batch} is below data.max_length = "
                f"{self.max_length}: a full-length sample would fit no batch; raise the one or lower "
                "the other"
            )
        if self.sources:
            self._check_sources()

    def _check_sources(self) -> None:
        if self.path:
            raise DataError(
                f"data.path = {self.path!r} and [[data.sources]] are both set: use one, data.path for "
                "a single data set or [[data.sources]] for a weighted mixture"
            )
        if self.format != "auto" or self.split != "train":
            raise DataError(
                "data.format and data.split apply to data.path: with [[data.sources]] set them in each source's entry"
            )
        if len(self.sources) > MAX_SOURCES:
            raise DataError(
                f"{len(self.sources)} [[data.sources]] entries: at most {MAX_SOURCES} (each labels its own "
                "metrics series); merge some sources into one file"
            )
        if all(s.eval for s in self.sources):
            raise DataError(
                "every [[data.sources]] entry has eval = true: nothing is left to train on; give at "
                "least one source eval = false"
            )
        seen: dict[str, int] = {}
        for i, s in enumerate(self.sources):
            if not _NAME.fullmatch(s.name) or len(s.name) > MAX_SOURCE_NAME:
                raise DataError(
                    f"data.sources[{i}] name = {s.name[:MAX_SOURCE_NAME]!r}: a source name labels metrics "
                    f"and tracker series and travels with every item, so it is 1 to {MAX_SOURCE_NAME} "
                    "letters, digits, '_', '.' or '-'; set another name"
                )
            if s.eval and s.repeat:
                raise DataError(
                    f"data.sources[{i}] ({s.name}) has eval = true and repeat = true: a held-out source "
                    "gives each of its rows once an epoch; drop repeat"
                )
            if s.name in seen:
                raise DataError(
                    f"data.sources[{seen[s.name]}] and data.sources[{i}] are both named {s.name!r}: "
                    "give each [[data.sources]] entry its own name"
                )
            seen[s.name] = i

    def source_names(self) -> tuple[str, ...]:
        """The names items are labelled with, in source order: what a drafter reports per source."""
        return tuple(s.name for s in self.sources) if self.sources else (source_name(self.path),)

    @property
    def holds_out(self) -> bool:
        """Some rows are evaluation rows: the producers publish evaluation items."""
        return self.eval_fraction > 0 or any(s.eval for s in self.sources)

    def mixture(self) -> list[tuple[DataSource, DataConfig]]:
        """Each source with the settings it is tokenized under; a single `path` is one source of weight 1,
        tokenized under this very config (so its cache is the one it always had)."""
        if not self.sources:
            if not self.path:
                raise DataError(
                    "data.path is empty: set it to a data file or directory, or list the sources of "
                    "a mixture in [[data.sources]]"
                )
            return [(DataSource(path=self.path, format=self.format, split=self.split), self)]
        return [
            (s, dataclasses.replace(self, path=s.path, format=s.format, split=s.split, sources=[]))
            for s in self.sources
        ]
