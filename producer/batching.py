"""Deterministic, resumable, token-budgeted batches for producer `rank` of `world_size`.

Every producer computes the same global plan for an epoch from (seed, epoch) alone and takes
every world_size-th batch of it, so the shards need no coordination, cover each sample exactly
once per epoch, and a (epoch, position) cursor is enough to resume. A weighted mixture draws each
source's rows for the epoch (`epoch_counts`, `epoch_samples`) from (seed, epoch) too, then plans
them as one data set.

A held-out split (`data.eval_fraction`, `eval = true` sources) takes fixed rows out of training: which rows
is a pure function of (seed, source name, row index) (`held_out`), so every producer, epoch and restart
agrees without coordination. Those rows are batched on their own every epoch, as evaluation batches
spread evenly through the epoch's plan; a cursor counts both kinds, so resuming needs nothing new.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from dflash_ring.common.config.data import DataConfig, DataError
from .pretokenized import SourceData, TokenizedData


@dataclass(frozen=True, order=True)
class Cursor:
    """The next batch a producer will emit: commit `Batch.cursor` once a batch is consumed,
    restart with `batches(from_cursor=committed)`."""

    epoch: int = 0
    position: int = 0


@dataclass(frozen=True)
class Batch:
    input_ids: np.ndarray  # int32, the batch's sequences concatenated
    loss_mask: np.ndarray  # uint8, aligned with input_ids
    lengths: np.ndarray  # int32, per sequence
    cu_seqlens: np.ndarray  # int32, len(lengths) + 1, starts with 0 (flash-attention varlen layout)
    sample_ids: np.ndarray  # int64, row index of each sequence in its source data set
    source_ids: np.ndarray  # int32, each sequence's source: an index into ShardBatcher.sources
    epoch: int
    position: int  # index of this batch in this producer's list for the epoch
    cursor: Cursor  # where to resume once this batch is consumed
    # Share of padding if the batch were laid out as len(lengths) x max(lengths); 0 when packed.
    padding_fraction: float
    # Entries of the producer's replay list published once this batch is (it commits with `cursor`).
    replayed: int = 0
    is_replay: bool = False  # produced again: a stopped run's ring held it untrained
    eval: bool = False  # held-out rows only: evaluated by the drafters, never trained

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def trained_by_source(self, sources: int) -> np.ndarray:
        """Loss-mask tokens of each source (index into ShardBatcher.sources) in this batch."""
        return np.bincount(np.repeat(self.source_ids, self.lengths), weights=self.loss_mask, minlength=sources).astype(
            np.int64
        )

    def padded(self, pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(input_ids, attention_mask, loss_mask), each [num_sequences, max_length], right-padded."""
        rows, width = len(self.lengths), int(self.lengths.max())
        inside = np.arange(width) < self.lengths[:, None]
        ids = np.full((rows, width), pad_id, dtype=self.input_ids.dtype)
        loss = np.zeros((rows, width), dtype=np.uint8)
        ids[inside], loss[inside] = self.input_ids, self.loss_mask
        return ids, inside.astype(np.uint8), loss


def _permutation(n: int, entropy: list[int]) -> np.ndarray:
    """A permutation that depends on `entropy` only (e.g. [seed, epoch]).

    Sorting raw PCG64 output rather than calling Generator.permutation: NumPy keeps bit-generator
    streams stable across releases but not Generator methods, and a resume must replay the order.
    """
    keys = np.random.PCG64(np.random.SeedSequence(entropy)).random_raw(n)
    return np.argsort(keys, kind="stable")


def epoch_counts(
    sizes: Sequence[int], weights: Sequence[float], repeat: Sequence[bool], names: Sequence[str]
) -> list[int]:
    """Rows each source gives every epoch, by the epoch-size rule in DataConfig's docstring."""
    total = sum(weights)
    limits = [n * total / w for n, w, r in zip(sizes, weights, repeat, strict=True) if not r]
    size = min(limits) if limits else sum(sizes)
    # The epsilon keeps float error from costing the limiting source its last row (n * total / w * w / total).
    counts = [math.floor(size * w / total + 1e-9) for w in weights]
    counts = [c if r else min(c, n) for c, n, r in zip(counts, sizes, repeat, strict=True)]
    for c, n, w, name in zip(counts, sizes, weights, names, strict=True):
        if c == 0:
            raise DataError(
                f"data source {name!r} (weight {w:g}, {n} usable rows) gets no row in an epoch of "
                f"{sum(counts)} rows: raise its weight, or set repeat = true on the sources that "
                "limit the epoch"
            )
    return counts


def epoch_samples(sizes: Sequence[int], counts: Sequence[int], *, seed: int, epoch: int) -> np.ndarray:
    """The epoch's samples as indices into the sources laid end to end: every row of a source that gives
    all of them (so a single source plans exactly as before mixtures), else a random subset from
    (seed, epoch, source), after as many whole passes as a repeating source needs."""
    parts, base = [], 0
    for k, (n, count) in enumerate(zip(sizes, counts, strict=True)):
        passes, rest = divmod(count, n) if count else (0, 0)  # 0: a held-out source gives no training row
        parts += [base + np.arange(n)] * passes
        if rest:
            parts.append(base + np.sort(_permutation(n, [seed, epoch, 2, k])[:rest]))
        base += n
    return np.concatenate(parts)


_MIX = np.uint64(0x9E3779B97F4A7C15)


def held_out(name: str, row_ids: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """Which rows of source `name` are evaluation rows: a pure function of (seed, name, row index).

    Each row's index goes through splitmix64 keyed by a hash of (seed, name); the row is held out when
    the result, as a number in [0, 1), is below `fraction`. Row indices are those of the data set, not
    of the tokenized samples, so skipped rows or another max_length never move a row across the split.
    """
    if fraction <= 0:
        return np.zeros(len(row_ids), bool)
    key = np.uint64(int.from_bytes(hashlib.blake2b(f"{seed}\0{name}".encode(), digest_size=8).digest(), "little"))
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps, as splitmix64 means it to
        z = (np.asarray(row_ids, dtype=np.uint64) ^ key) + _MIX
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return (z >> np.uint64(11)).astype(np.float64) * 2.0**-53 < fraction


def split_sources(sources: Sequence[SourceData], fraction: float, seed: int) -> list[np.ndarray]:
    """Per source, a mask of its evaluation samples: every one of an `eval` source, else `held_out`'s."""
    return [np.ones(len(s.data), bool) if s.eval else held_out(s.name, s.data.row_ids, fraction, seed) for s in sources]


def training_counts(sources: Sequence[SourceData], held: Sequence[np.ndarray]) -> list[int]:
    """Training rows each source gives every epoch (`epoch_counts` over its rows not held out; 0 for an
    `eval` source)."""
    train = [(k, s) for k, s in enumerate(sources) if not s.eval]
    counts = epoch_counts(
        [int((~held[k]).sum()) for k, _ in train],
        [s.weight for _, s in train],
        [s.repeat for _, s in train],
        [s.name for _, s in train],
    )
    out = [0] * len(sources)
    for (k, _), c in zip(train, counts, strict=True):
        out[k] = c
    return out


def interleave(train: list[np.ndarray], evals: list[np.ndarray]) -> list[np.ndarray]:
    """Evaluation batches spread evenly among the training batches (training first on a tie)."""
    if not evals:
        return train
    keys = np.concatenate(
        [(np.arange(len(train)) + 0.5) / max(len(train), 1), (np.arange(len(evals)) + 0.5) / len(evals)]
    )
    both = train + evals
    return [both[i] for i in np.argsort(keys, kind="stable")]


def plan_epoch(
    lengths: np.ndarray,
    *,
    seed: int,
    epoch: int,
    max_tokens: int,
    packing: bool,
    bucket_window: int,
    salt: tuple[int, ...] = (),
) -> list[np.ndarray]:
    """All batches of one epoch as arrays of sample indices, in the order they are dealt out.

    Sorting by length within windows of the shuffled order packs similar lengths together
    while keeping the epoch random; shuffling the batches afterwards undoes the short-to-long
    sawtooth that the windows leave. `salt` draws other random streams (the evaluation batches').
    """
    order = _permutation(len(lengths), [seed, epoch, *salt])
    if not len(order):
        return []
    window = np.arange(len(order)) // bucket_window
    order = order[np.lexsort((lengths[order], window))]
    cuts: list[int] = []
    count = longest = total = 0
    for i, length in enumerate(lengths[order].tolist()):
        cost = total + length if packing else (count + 1) * max(longest, length)
        if count and cost > max_tokens:
            cuts.append(i)
            count = longest = total = 0
        count, longest, total = count + 1, max(longest, length), total + length
    batches = np.split(order, cuts)
    shuffle = np.random.PCG64(np.random.SeedSequence([seed, epoch, 1, *salt])).random_raw(len(batches))
    return [batches[i] for i in np.argsort(shuffle, kind="stable")]


class ShardBatcher:
    """Producer `rank` of `world_size`: its share of every epoch, as ready-to-send batches."""

    def __init__(
        self,
        data: TokenizedData | Sequence[SourceData],
        *,
        rank: int,
        world_size: int,
        max_tokens_per_batch: int,
        epochs: int,
        seed: int = 0,
        packing: bool = True,
        bucket_window: int = 1024,
        eval_fraction: float = 0.0,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
        if isinstance(data, TokenizedData):  # one data set, as the benchmarks and tests build it
            data = [SourceData("data", str(data.directory), 1.0, False, data)]
        self.sources = sources = tuple(data)
        if not sources:
            raise ValueError("no data source")
        sizes = [len(s.data) for s in sources]
        self.eval_fraction = eval_fraction
        held = split_sources(sources, eval_fraction, seed)
        self.counts = training_counts(sources, held)  # training rows per source and epoch
        self._bases = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self._eval = np.concatenate(held)  # per sample of the sources laid end to end
        # Training samples of each source, laid end to end (all of them without a held-out split).
        self._train = [self._bases[k] + np.flatnonzero(~held[k]) for k in range(len(sources))]
        self._eval_samples = np.flatnonzero(self._eval)
        self._lengths = np.concatenate([s.data.lengths for s in sources])
        longest = int(self._lengths.max())
        if longest > max_tokens_per_batch:
            raise ValueError(f"a {longest}-token sample exceeds max_tokens_per_batch={max_tokens_per_batch}")
        self.rank, self.world_size = rank, world_size
        self.max_tokens, self.epochs, self.seed = max_tokens_per_batch, epochs, seed
        self.packing, self.bucket_window = packing, bucket_window
        self._plan: tuple[int, list[np.ndarray]] | None = None

    @classmethod
    def from_config(
        cls,
        data: TokenizedData | Sequence[SourceData],
        cfg: DataConfig,
        *,
        rank: int,
        world_size: int,
        packing: bool = True,
    ) -> ShardBatcher:
        return cls(
            data,
            rank=rank,
            world_size=world_size,
            max_tokens_per_batch=cfg.max_tokens_per_batch,
            epochs=cfg.epochs,
            seed=cfg.seed,
            packing=packing,
            bucket_window=cfg.bucket_window,
            eval_fraction=cfg.eval_fraction,
        )

    def plan_key(self) -> str:
        """Everything that fixes which batches a cursor position means (not the epoch count: runs may grow).

        One source keeps the key it had before mixtures (its weight and repeat flag change nothing); a mixture's
        key holds each source's tokenized data, weight and repeat flag, in order. A held-out split joins the key
        only when there is one (data.eval_fraction, and each source's name and eval flag: they pick the rows), so
        a run without one keeps its key."""
        if len(self.sources) == 1:
            data: object = self.sources[0].data.directory.name
        else:
            data = [[s.data.directory.name, s.weight, s.repeat] for s in self.sources]
        settings = [data, self.seed, self.max_tokens, self.packing, self.bucket_window, self.rank, self.world_size]
        if self.eval_fraction > 0 or any(s.eval for s in self.sources):
            settings.append(["eval", self.eval_fraction, [[s.name, s.eval] for s in self.sources]])
        return hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:24]

    def plan_description(self) -> str:
        """`plan_key`'s plan in words, for the refusal of a resume across plans."""
        if len(self.sources) == 1:
            s = self.sources[0]
            data = f"data {s.path} (tokenized {s.data.directory.name})"
        else:
            data = "data mixture " + ", ".join(
                f"{s.name} = {s.path} {'eval' if s.eval else f'weight {s.weight:g}'}{' repeat' if s.repeat else ''} "
                f"(tokenized {s.data.directory.name})"
                for s in self.sources
            )
        if self.eval_fraction > 0:
            data += f", eval_fraction {self.eval_fraction:g}"
        return (
            f"{data}, seed {self.seed}, max_tokens_per_batch "
            f"{self.max_tokens}, {'packed' if self.packing else 'padded'}, bucket_window {self.bucket_window}, "
            f"shard {self.rank} of {self.world_size}"
        )

    def epoch_plan(self, epoch: int) -> list[np.ndarray]:
        """This shard's batches for `epoch`, as sample indices into the sources laid end to end."""
        if self._plan is None or self._plan[0] != epoch:
            picked = epoch_samples([len(t) for t in self._train], self.counts, seed=self.seed, epoch=epoch)
            chosen = np.concatenate(self._train)[picked]
            train = [chosen[b] for b in self._plan_of(chosen, epoch)]
            evals = [self._eval_samples[b] for b in self._plan_of(self._eval_samples, epoch, salt=(3,))]
            self._plan = (epoch, interleave(train, evals)[self.rank :: self.world_size])
        return self._plan[1]

    def _plan_of(self, samples: np.ndarray, epoch: int, salt: tuple[int, ...] = ()) -> list[np.ndarray]:
        return plan_epoch(
            self._lengths[samples],
            seed=self.seed,
            epoch=epoch,
            max_tokens=self.max_tokens,
            packing=self.packing,
            bucket_window=self.bucket_window,
            salt=salt,
        )

    def is_eval(self, samples: np.ndarray) -> bool:
        """Whether a planned batch (sample indices, as `epoch_plan` gives them) is an evaluation batch."""
        return bool(len(samples)) and bool(self._eval[samples[0]])

    def eval_positions(self, epoch: int) -> list[int]:
        """Positions of this shard's evaluation batches in `epoch`."""
        return [i for i, b in enumerate(self.epoch_plan(epoch)) if self.is_eval(b)]

    def batches(self, from_cursor: Cursor = Cursor()) -> Iterator[Batch]:
        """Every batch from `from_cursor` on, through the last epoch."""
        if from_cursor.epoch < 0 or from_cursor.position < 0:
            raise ValueError(f"invalid {from_cursor}")
        position = from_cursor.position
        for epoch in range(from_cursor.epoch, self.epochs):
            plan = self.epoch_plan(epoch)
            if position > len(plan):
                raise ValueError(f"{from_cursor} is past the {len(plan)} batches of epoch {epoch} for this shard")
            for index in range(position, len(plan)):
                following = Cursor(epoch, index + 1) if index + 1 < len(plan) else Cursor(epoch + 1, 0)
                yield self._batch(plan[index], epoch, index, following)
            position = 0

    def batch_at(self, epoch: int, position: int) -> Batch:
        """One batch of the plan by its coordinates: a batch a stopped run left untrained, produced again."""
        plan = self.epoch_plan(epoch) if epoch >= 0 else []
        if not 0 <= position < len(plan):
            raise ValueError(
                f"batch (epoch {epoch}, position {position}) is not in this shard's plan "
                f"({len(plan)} batches in that epoch)"
            )
        following = Cursor(epoch, position + 1) if position + 1 < len(plan) else Cursor(epoch + 1, 0)
        return self._batch(plan[position], epoch, position, following)

    def _batch(self, samples: np.ndarray, epoch: int, position: int, cursor: Cursor) -> Batch:
        source_ids = (np.searchsorted(self._bases, samples, side="right") - 1).astype(np.int32)
        local = samples - self._bases[source_ids]
        present = np.unique(source_ids)
        starts, row_ids = np.empty(len(samples), np.int64), np.empty(len(samples), np.int64)
        for k in present:
            mine, data = source_ids == k, self.sources[k].data
            starts[mine], row_ids[mine] = data.offsets[local[mine]], data.row_ids[local[mine]]
        lengths = self._lengths[samples].astype(np.int32)
        cu_seqlens = np.zeros(len(samples) + 1, dtype=np.int32)
        np.cumsum(lengths, out=cu_seqlens[1:])
        # One fancy index per array and source instead of a per-sample slice loop.
        gather = np.repeat(starts - cu_seqlens[:-1], lengths) + np.arange(cu_seqlens[-1])
        if len(present) == 1:
            data = self.sources[present[0]].data
            input_ids, loss_mask = data.tokens[gather], data.loss_mask[gather]
        else:
            input_ids, loss_mask = np.empty(len(gather), np.int32), np.empty(len(gather), np.uint8)
            token_source = np.repeat(source_ids, lengths)
            for k in present:
                mine, data = token_source == k, self.sources[k].data
                input_ids[mine], loss_mask[mine] = data.tokens[gather[mine]], data.loss_mask[gather[mine]]
        padded = len(samples) * int(lengths.max())
        return Batch(
            input_ids=np.asarray(input_ids, dtype=np.int32),
            loss_mask=np.asarray(loss_mask, dtype=np.uint8),
            lengths=lengths,
            cu_seqlens=cu_seqlens,
            sample_ids=row_ids,
            source_ids=source_ids,
            epoch=epoch,
            position=position,
            cursor=cursor,
            padding_fraction=0.0 if self.packing else 1.0 - int(cu_seqlens[-1]) / padded,
            eval=self.is_eval(samples),
        )
