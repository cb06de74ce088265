"""What a run trains on, per source and in total: `dflash-ring data stats`, and the producer's start-up log.

Counted after tokenization with the target's tokenizer and chat template (the producer's own cache), so
the numbers are the samples the drafter sees: rows the producer skips are counted as bad, replies cut
at max_length count only their kept tokens. A mix is easy to get wrong by a lot (a 77% coding skew
hid in the pipeline this project replaces), so the shares are shown under the weights, per epoch.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from .batching import split_sources, training_counts
from .pretokenized import SourceData, TokenizedData

# Upper edges (inclusive) of the reply-length buckets: trained (loss-mask) tokens per row; the last
# bucket holds everything above the last edge. Fixed, so reports of two data sets line up.
HISTOGRAM_EDGES = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
_CHUNK_TOKENS = 1 << 24  # loss-mask bytes summed at once: memory stays flat on large data sets


@dataclass(frozen=True)
class SourceStats:
    name: str
    path: str
    weight: float
    repeat: bool
    rows: int  # rows in the data set, bad ones included
    bad_rows: int  # skipped: unusable, or no reply token within max_length
    tokens: int  # of the usable rows, after truncation to max_length
    trained_tokens: int  # loss-mask tokens of the usable rows
    histogram: tuple[int, ...]  # usable rows per bucket of trained tokens (HISTOGRAM_EDGES)
    epoch_rows: int  # rows this source gives every epoch under the weights
    epoch_trained_tokens: int  # their trained tokens (expected: exact when the source gives whole passes)
    epoch_row_share: float
    epoch_trained_share: float
    eval_rows: int = 0  # held out (data.eval_fraction, or an eval = true source): evaluated every epoch, never trained


@dataclass(frozen=True)
class DataStats:
    sources: tuple[SourceStats, ...]
    total: SourceStats

    def to_json(self) -> str:
        return json.dumps(
            {
                "histogram_edges": list(HISTOGRAM_EDGES),
                "sources": [asdict(s) for s in self.sources],
                "total": asdict(self.total),
            },
            indent=2,
        )


def trained_per_row(data: TokenizedData) -> np.ndarray:
    """Loss-mask tokens of every usable row, summed chunk by chunk over the memory-mapped mask."""
    out = np.empty(len(data), np.int64)
    offsets = np.asarray(data.offsets)
    i = 0
    while i < len(data):
        j = max(i + 1, int(np.searchsorted(offsets, offsets[i] + _CHUNK_TOKENS, side="right")) - 1)
        j = min(j, len(data))
        mask = np.asarray(data.loss_mask[offsets[i] : offsets[j]])
        out[i:j] = np.add.reduceat(mask, offsets[i:j] - offsets[i], dtype=np.int64)
        i = j
    return out


def histogram(trained: np.ndarray) -> tuple[int, ...]:
    return tuple(
        np.bincount(np.searchsorted(HISTOGRAM_EDGES, trained, side="left"), minlength=len(HISTOGRAM_EDGES) + 1).tolist()
    )


def bucket_labels() -> list[str]:
    lows = (1, *(e + 1 for e in HISTOGRAM_EDGES))
    return [f"{lo}-{hi}" for lo, hi in zip(lows, HISTOGRAM_EDGES)] + [f">{HISTOGRAM_EDGES[-1]}"]


def data_stats(sources: Sequence[SourceData], eval_fraction: float = 0.0, seed: int = 0) -> DataStats:
    """Per-source and total composition, with each source's share of an epoch under the weights; the epoch's
    rows are training rows (the held-out split, `data.eval_fraction` under `data.seed`, is counted apart)."""
    held = split_sources(sources, eval_fraction, seed)
    trained = [trained_per_row(s.data) for s in sources]
    counts = training_counts(sources, held)
    epoch_trained = [
        round(int(t[~h].sum()) * c / max(int((~h).sum()), 1)) for t, h, c in zip(trained, held, counts, strict=True)
    ]
    rows_total, trained_total = sum(counts), sum(epoch_trained)
    stats = tuple(
        SourceStats(
            name=s.name,
            path=s.path,
            weight=s.weight,
            repeat=s.repeat,
            rows=s.data.num_rows,
            bad_rows=len(s.data.bad_rows),
            tokens=int(s.data.offsets[-1]),
            trained_tokens=int(t.sum()),
            histogram=histogram(t),
            epoch_rows=c,
            epoch_trained_tokens=et,
            epoch_row_share=c / rows_total,
            epoch_trained_share=et / trained_total if trained_total else 0.0,
            eval_rows=int(h.sum()),
        )
        for s, t, h, c, et in zip(sources, trained, held, counts, epoch_trained, strict=True)
    )
    total = SourceStats(
        name="total",
        path="",
        weight=sum(s.weight for s in sources),
        repeat=any(s.repeat for s in sources),
        rows=sum(s.rows for s in stats),
        bad_rows=sum(s.bad_rows for s in stats),
        tokens=sum(s.tokens for s in stats),
        trained_tokens=sum(s.trained_tokens for s in stats),
        histogram=tuple(int(x) for x in np.sum([s.histogram for s in stats], axis=0)),
        epoch_rows=rows_total,
        epoch_trained_tokens=trained_total,
        epoch_row_share=1.0,
        epoch_trained_share=1.0,
        eval_rows=sum(s.eval_rows for s in stats),
    )
    return DataStats(stats, total)


def log_lines(stats: DataStats) -> list[str]:
    """One line per source, as the producer logs its composition before it publishes."""
    return [
        f"data source {s.name} ({s.path}): {s.rows} rows, {s.bad_rows} bad skipped, {s.tokens} tokens, "
        f"{s.trained_tokens} trained; weight {s.weight:g}{' repeat' if s.repeat else ''}: {s.epoch_rows} rows "
        f"per epoch ({100 * s.epoch_row_share:.1f}% of rows, {100 * s.epoch_trained_share:.1f}% of trained "
        f"tokens){f'; {s.eval_rows} rows held out for evaluation' if s.eval_rows else ''}"
        for s in stats.sources
    ]


def print_table(stats: DataStats) -> None:
    """Two rich tables on stdout: the composition and shares, then the reply-length histogram."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title="data composition (per epoch: under the weights, after tokenization)")
    for col in (
        "source",
        "weight",
        "repeat",
        "rows",
        "bad",
        "tokens",
        "trained",
        "epoch rows",
        "% rows",
        "% trained",
        "held out",
    ):
        t.add_column(col, justify="left" if col == "source" else "right")
    for s in (*stats.sources, stats.total):
        if s is stats.total:
            t.add_section()
        t.add_row(
            s.name,
            f"{s.weight:g}",
            "yes" if s.repeat else "",
            f"{s.rows:,}",
            f"{s.bad_rows:,}",
            f"{s.tokens:,}",
            f"{s.trained_tokens:,}",
            f"{s.epoch_rows:,}",
            f"{100 * s.epoch_row_share:.1f}",
            f"{100 * s.epoch_trained_share:.1f}",
            f"{s.eval_rows:,}",
        )
    h = Table(title="rows by trained tokens per row")
    h.add_column("trained tokens", justify="right")
    for s in (*stats.sources, stats.total):
        h.add_column(s.name, justify="right")
    for i, label in enumerate(bucket_labels()):
        h.add_row(label, *(f"{s.histogram[i]:,}" for s in (*stats.sources, stats.total)))
    console = Console(width=200)
    console.print(t)
    console.print(h)
