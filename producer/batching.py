"""Deterministic, resumable, token-budgeted batches for producer `rank` of `world_size`.

Every producer computes the same global plan for an epoch from (seed, epoch) alone and takes
every world_size-th batch of it, so the shards need no coordination, cover each sample exactly
once per epoch, and a (epoch, position) cursor is enough to resume.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from dflash_ring.common.data_config import DataConfig
from .pretokenized import TokenizedData


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
    sample_ids: np.ndarray  # int64, row index of each sequence in the source data set
    epoch: int
    position: int  # index of this batch in this producer's list for the epoch
    cursor: Cursor  # where to resume once this batch is consumed
    # Share of padding if the batch were laid out as len(lengths) x max(lengths); 0 when packed.
    padding_fraction: float
    # Entries of the producer's replay list published once this batch is (it commits with `cursor`).
    replayed: int = 0
    is_replay: bool = False  # produced again: a stopped run's ring held it untrained

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def padded(self, pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(input_ids, attention_mask, loss_mask), each [num_sequences, max_length], right-padded."""
        rows, width = len(self.lengths), int(self.lengths.max())
        inside = np.arange(width) < self.lengths[:, None]
        ids = np.full((rows, width), pad_id, dtype=self.input_ids.dtype)
        loss = np.zeros((rows, width), dtype=np.uint8)
        ids[inside], loss[inside] = self.input_ids, self.loss_mask
        return ids, inside.astype(np.uint8), loss


def epoch_order(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """A permutation that depends on (seed, epoch) only.

    Sorting raw PCG64 output rather than calling Generator.permutation: NumPy keeps bit-generator
    streams stable across releases but not Generator methods, and a resume must replay the order.
    """
    keys = np.random.PCG64(np.random.SeedSequence([seed, epoch])).random_raw(num_samples)
    return np.argsort(keys, kind="stable")


def plan_epoch(
    lengths: np.ndarray, *, seed: int, epoch: int, max_tokens: int, packing: bool, bucket_window: int
) -> list[np.ndarray]:
    """All batches of one epoch as arrays of sample indices, in the order they are dealt out.

    Sorting by length within windows of the shuffled order packs similar lengths together
    while keeping the epoch random; shuffling the batches afterwards undoes the short-to-long
    sawtooth that the windows leave.
    """
    order = epoch_order(len(lengths), seed, epoch)
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
    shuffle = np.random.PCG64(np.random.SeedSequence([seed, epoch, 1])).random_raw(len(batches))
    return [batches[i] for i in np.argsort(shuffle, kind="stable")]


class ShardBatcher:
    """Producer `rank` of `world_size`: its share of every epoch, as ready-to-send batches."""

    def __init__(
        self,
        data: TokenizedData,
        *,
        rank: int,
        world_size: int,
        max_tokens_per_batch: int,
        epochs: int,
        seed: int = 0,
        packing: bool = True,
        bucket_window: int = 1024,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
        self._lengths = data.lengths
        longest = int(self._lengths.max())
        if longest > max_tokens_per_batch:
            raise ValueError(f"a {longest}-token sample exceeds max_tokens_per_batch={max_tokens_per_batch}")
        self.data = data
        self.rank, self.world_size = rank, world_size
        self.max_tokens, self.epochs, self.seed = max_tokens_per_batch, epochs, seed
        self.packing, self.bucket_window = packing, bucket_window
        self._plan: tuple[int, list[np.ndarray]] | None = None

    @classmethod
    def from_config(cls, data: TokenizedData, cfg: DataConfig, *, rank: int, world_size: int,
                    packing: bool = True) -> ShardBatcher:
        return cls(
            data,
            rank=rank,
            world_size=world_size,
            max_tokens_per_batch=cfg.max_tokens_per_batch,
            epochs=cfg.epochs,
            seed=cfg.seed,
            packing=packing,
            bucket_window=cfg.bucket_window,
        )

    def epoch_plan(self, epoch: int) -> list[np.ndarray]:
        """This shard's batches for `epoch`, as sample indices into `data`."""
        if self._plan is None or self._plan[0] != epoch:
            plan = plan_epoch(
                self._lengths,
                seed=self.seed,
                epoch=epoch,
                max_tokens=self.max_tokens,
                packing=self.packing,
                bucket_window=self.bucket_window,
            )
            self._plan = (epoch, plan[self.rank :: self.world_size])
        return self._plan[1]

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
            raise ValueError(f"batch (epoch {epoch}, position {position}) is not in this shard's plan "
                             f"({len(plan)} batches in that epoch)")
        following = Cursor(epoch, position + 1) if position + 1 < len(plan) else Cursor(epoch + 1, 0)
        return self._batch(plan[position], epoch, position, following)

    def _batch(self, samples: np.ndarray, epoch: int, position: int, cursor: Cursor) -> Batch:
        starts = self.data.offsets[samples]
        lengths = (self.data.offsets[samples + 1] - starts).astype(np.int32)
        cu_seqlens = np.zeros(len(samples) + 1, dtype=np.int32)
        np.cumsum(lengths, out=cu_seqlens[1:])
        # One fancy index per array instead of a per-sample slice loop.
        gather = np.repeat(starts - cu_seqlens[:-1], lengths) + np.arange(cu_seqlens[-1])
        padded = len(samples) * int(lengths.max())
        return Batch(
            input_ids=np.asarray(self.data.tokens[gather], dtype=np.int32),
            loss_mask=np.asarray(self.data.loss_mask[gather], dtype=np.uint8),
            lengths=lengths,
            cu_seqlens=cu_seqlens,
            sample_ids=self.data.row_ids[samples].astype(np.int64),
            epoch=epoch,
            position=position,
            cursor=cursor,
            padding_fraction=0.0 if self.packing else 1.0 - int(cu_seqlens[-1]) / padded,
        )
