"""Tokenize a data set once, cache it on disk, and serve it as flat numpy arrays.

The cache key covers everything that changes the tokens (tokenizer vocabulary and template,
max_length, enable_thinking, the data files), never how they are batched. The hot path reads
only memory-mapped .npy files: no Arrow row access, and T producers on one host share the
page cache.

meta.json holds the sha256 of each array (and of its own other fields): a token changed on disk would be trained on
in silence, so an entry whose bytes no longer match is damaged, kept aside and tokenized again (the key, and with it
every cursor's plan, stays the same). Every token is also held to the tokenizer's vocabulary, so an entry written
before the digests existed (read as it was, then given them) cannot hand the target a token it has no row for.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from dflash_ring.common.damaged_file import keep_aside
from dflash_ring.common.durable import exclusive
from dflash_ring.common.host_bounds import check_num_proc

from dflash_ring.common.chat_encoding import BadRow, ChatEncoder, decode_json_row
from dflash_ring.common.config.data import DataConfig, DataError
from dflash_ring.common.config.target import TargetConfig
from dflash_ring.common.tokenizer_loading import load_target_tokenizer
from .data_source import DataFiles, batch_rows, check_row_size, locate, max_row_bytes, open_dataset

if TYPE_CHECKING:
    import pyarrow as pa

logger = logging.getLogger(__name__)

# Bump when tokenization or the cache layout changes, so old caches are not reused.
CACHE_VERSION = 1
_ARRAYS = ("tokens", "loss_mask", "offsets", "row_ids")
_WARN_ROWS = 100  # rows warned about one by one; the rest are counted, and all are in meta.json


@dataclass(frozen=True)
class TokenizedData:
    """Every usable sample; sample i is tokens[offsets[i]:offsets[i + 1]]."""

    tokens: np.ndarray  # int32, all samples concatenated
    loss_mask: np.ndarray  # uint8, 1 on assistant tokens
    offsets: np.ndarray  # int64, num_samples + 1
    row_ids: np.ndarray  # int64, each sample's row index in the source data set
    num_rows: int
    bad_rows: tuple[tuple[int, str], ...]  # (row index, reason) of every skipped row
    directory: Path
    from_cache: bool

    def __len__(self) -> int:
        return len(self.row_ids)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def target_tokenizer(cfg: TargetConfig) -> PreTrainedTokenizerBase:
    """The tokenizer (and chat template) every sample is encoded with: the target's own, from disk only."""
    if not (cfg.tokenizer or cfg.path):
        raise DataError(
            "target.path is empty: the data is tokenized with the target's tokenizer and chat template; "
            "set target.path (or target.tokenizer) to its local directory"
        )
    return load_target_tokenizer(cfg.tokenizer or cfg.path)  # tokenizer files it cannot load: one line


@dataclass(frozen=True)
class SourceData:
    """One source of the data plan, tokenized: a single `data.path` is one source of weight 1."""

    name: str
    path: str
    weight: float
    repeat: bool
    data: TokenizedData
    eval: bool = False  # a held-out source: every row evaluated, none trained


def load_sources(
    cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, reserved_token: int | None = None
) -> list[SourceData]:
    """Every source of `cfg` (one for `data.path`), each tokenized and cached on its own as `load_tokenized` does;
    `reserved_token`: the drafter's mask token where it is a token of the tokenizer (rows holding it are bad rows)."""
    check_num_proc(cfg.num_proc)  # before any file is read: the host's bound (common/host_bounds.py)
    mixture = cfg.mixture()
    for _, sub in mixture:
        locate(sub)  # a missing or unreadable source fails now, not after tokenizing the ones before it
    return [
        SourceData(s.name, s.path, s.weight, s.repeat, load_tokenized(sub, tokenizer, reserved_token), s.eval)
        for s, sub in mixture
    ]


def load_tokenized(
    cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, reserved_token: int | None = None
) -> TokenizedData:
    """Tokenized samples for `cfg`, built on first use and reused while nothing that matters changes."""
    if reserved_token is not None and reserved_token >= len(tokenizer):
        reserved_token = None  # an unused embedding row: no text tokenizes to it
    # Built even on a cache hit: it checks the tokenizer can do the job before anything is trusted.
    encoder = ChatEncoder(
        tokenizer, max_length=cfg.max_length, enable_thinking=cfg.enable_thinking, reserved_token=reserved_token
    )
    data = locate(cfg)
    key = cache_key(cfg, tokenizer, data, reserved_token)
    root = Path(cfg.cache_dir).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"tokenized-{key}"
    # Producers start together; one tokenizes while the others wait for its result.
    with exclusive(root / f"tokenized-{key}.lock"):
        loaded = None
        if final.exists():
            try:
                loaded = _open(final, True, vocabulary=len(tokenizer))
            except DamagedCache as e:  # the one rule (common/damaged_file.py): kept aside, rebuilt from the data
                keep_aside(final, f"{e}; tokenized again from {data.root}")
        if loaded is None:
            _build(cfg, encoder, data, key, final)
            loaded = _open(final, False)
    from_cache = loaded.from_cache
    if from_cache:
        logger.info(
            "reusing tokenized %s from %s: %d samples, %d bad rows skipped (listed in meta.json)",
            data.root,
            final,
            len(loaded),
            len(loaded.bad_rows),
        )
    return loaded


def cache_key(
    cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, data: DataFiles, reserved_token: int | None = None
) -> str:
    settings = {
        "version": CACHE_VERSION,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "max_length": cfg.max_length,
        "enable_thinking": cfg.enable_thinking,
        "split": cfg.split,
        "format": data.format,
        "data": data.fingerprint,
        **({"reserved_token": reserved_token} if reserved_token is not None else {}),  # old keys stay valid
    }
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:24]


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """The full serialized tokenizer (vocab, merges, normalizer, added tokens) and its chat template."""
    digest = hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode())
    digest.update(str(tokenizer.chat_template).encode())
    return digest.hexdigest()


def _encode_batch(batch: dict[str, list[Any]], *, encoder: ChatEncoder, json_rows: bool) -> dict[str, list[Any]]:
    """datasets.map body: a bad row becomes an empty sample carrying its reason, never an exception."""
    rows = batch_rows(batch, json_rows)
    cap = max_row_bytes(encoder.max_length)
    out: dict[str, list[Any]] = {"input_ids": [], "loss_mask": [], "bad": []}
    for raw in rows:
        try:
            check_row_size(raw, cap)  # before it is parsed or tokenized: memory grows many times a row's size
            ids, mask = encoder.encode(decode_json_row(raw) if json_rows else raw)
            reason = ""
        except BadRow as e:
            ids, mask, reason = np.zeros(0, np.int32), np.zeros(0, np.uint8), str(e)
        out["input_ids"].append(ids)
        out["loss_mask"].append(mask)
        out["bad"].append(reason)
    return out


def _build(cfg: DataConfig, encoder: ChatEncoder, data: DataFiles, key: str, final: Path) -> None:
    # datasets and pyarrow only here: a start that finds its data tokenized (every restart) never loads them.
    import datasets

    ds, json_rows = open_dataset(data, cfg)
    if len(ds) == 0:
        raise DataError(f"data set {data.root} has no rows")
    # Under the lock, so a fixed name is safe and a crashed build's leftovers are cleared here.
    tmp = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        mapped = ds.map(
            _encode_batch,
            fn_kwargs={"encoder": encoder, "json_rows": json_rows},
            batched=True,
            batch_size=256,
            num_proc=min(cfg.num_proc, len(ds)) if cfg.num_proc > 1 else None,
            remove_columns=ds.column_names,
            features=datasets.Features(
                {
                    "input_ids": datasets.List(datasets.Value("int32")),
                    "loss_mask": datasets.List(datasets.Value("uint8")),
                    "bad": datasets.Value("string"),
                }
            ),
            cache_file_name=str(tmp / "map.arrow"),
            load_from_cache_file=False,
            new_fingerprint=key,
            desc="tokenizing",
        )
        bad_rows = _materialize(mapped.with_format("arrow")[:], tmp)
        del mapped
        _report(bad_rows, len(ds), data.root)
        num_samples = len(ds) - len(bad_rows)
        meta = {
            "key": key,
            "source": str(data.root),
            "num_rows": len(ds),
            "num_samples": num_samples,
            "bad_rows": bad_rows,
        }
        (tmp / "meta.json").write_text(json.dumps(meta | {"digests": _digests(tmp, meta)}))
        for f in tmp.glob("map*.arrow"):
            f.unlink()
        tmp.rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("tokenized %s into %s: %d rows -> %d samples", data.root, final, len(ds), num_samples)


def _materialize(table: pa.Table, out: Path) -> list[tuple[int, str]]:
    """Stream the mapped columns into flat .npy files chunk by chunk, so peak memory stays one chunk."""
    import pyarrow.compute as pc

    lengths = pc.list_value_length(table.column("input_ids")).to_numpy()
    # Every kept sample has at least one assistant token, so empty means skipped.
    good = lengths > 0
    bad = np.flatnonzero(~good)
    bad_rows = list(zip(bad.tolist(), pc.take(table.column("bad"), bad).to_pylist(), strict=True))
    if good.any():
        np.save(out / "offsets.npy", np.concatenate([[0], np.cumsum(lengths[good], dtype=np.int64)]))
        np.save(out / "row_ids.npy", np.flatnonzero(good).astype(np.int64))
        for column, name, dtype in (("input_ids", "tokens", np.int32), ("loss_mask", "loss_mask", np.uint8)):
            flat = np.lib.format.open_memmap(out / f"{name}.npy", mode="w+", dtype=dtype, shape=(int(lengths.sum()),))
            pos = 0
            for chunk in table.column(column).chunks:
                values = pc.list_flatten(chunk).to_numpy()
                flat[pos : pos + len(values)] = values
                pos += len(values)
            flat.flush()
            del flat
    return bad_rows


def _report(bad_rows: list[tuple[int, str]], num_rows: int, source: Path) -> None:
    if len(bad_rows) == num_rows:  # one error line, its examples in it: not a warning per row before it
        examples = "; ".join(f"row {i}: {r}" for i, r in bad_rows[:3])
        raise DataError(
            f"no usable row in {source}: all {num_rows} rows were skipped ({examples}). Each row needs "
            "'messages' (a list of {role, content} with at least one assistant turn) or non-empty "
            "'prompt' and 'response' strings, and an assistant reply starting within max_length tokens"
        )
    for index, reason in bad_rows[:_WARN_ROWS]:
        logger.warning("skipping row %d of %s: %s", index, source, reason)
    if len(bad_rows) > _WARN_ROWS:
        logger.warning("... and %d more bad rows (all listed in the cache's meta.json)", len(bad_rows) - _WARN_ROWS)
    if bad_rows:
        logger.warning("skipped %d of %d rows of %s", len(bad_rows), num_rows, source)


class DamagedCache(Exception):
    """A tokenized cache entry that does not hold what _build writes; the message says what is wrong."""


CHUNK_BYTES = 64 << 20
_DTYPES = {"tokens": np.int32, "loss_mask": np.uint8, "offsets": np.int64, "row_ids": np.int64}


def _file_digest(path: Path) -> str:
    """sha256 over the sha256 of each CHUNK_BYTES of `path`, one thread per core (pread and hashlib release the
    GIL): a start verifies a few GB of tokens in about a second instead of several on one core."""
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        with ThreadPoolExecutor(max_workers=min(os.cpu_count() or 1, 16)) as pool:
            chunks = pool.map(
                lambda offset: hashlib.sha256(os.pread(fd, CHUNK_BYTES, offset)).digest(),
                range(0, max(size, 1), CHUNK_BYTES),
            )
            return hashlib.sha256(b"".join(chunks)).hexdigest()
    finally:
        os.close(fd)


def _digests(directory: Path, meta: dict[str, Any]) -> dict[str, str]:
    """What meta.json's `digests` holds: each array's `_file_digest`, and the sha256 of meta's other fields."""
    fields = {k: v for k, v in meta.items() if k != "digests"}
    out = {name: _file_digest(directory / f"{name}.npy") for name in _ARRAYS if (directory / f"{name}.npy").exists()}
    return out | {"meta": hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()}


def _open(directory: Path, from_cache: bool, vocabulary: int | None = None) -> TokenizedData:
    """The cache entry, checked to be what _build writes (meta.json's fields, each array's dtype and length, the
    offsets spanning the tokens, and, read from the cache, each file's digest and every token within `vocabulary`,
    the tokenizer's size): a damaged entry (a file cut short, edited or removed, a token changed) is DamagedCache,
    never an approximate read, a token trained on that the data never had, or a traceback from deep in the batching
    or the target's embedding. An entry without digests (an earlier version's) is read as it was and given them."""
    try:
        meta = json.loads((directory / "meta.json").read_text())
        arrays = {name: np.load(directory / f"{name}.npy", mmap_mode="r") for name in _ARRAYS}
    except (FileNotFoundError, ValueError, EOFError, RecursionError) as e:  # missing, not JSON/npy, cut short
        raise DamagedCache(f"{type(e).__name__}: {e}") from None
    if (
        not isinstance(meta, dict)
        or type(meta.get("num_rows")) is not int
        or not isinstance(meta.get("bad_rows"), list)
    ):
        raise DamagedCache("meta.json is not the cache's record (num_rows, bad_rows)")
    if not all(isinstance(b, list) and len(b) == 2 and type(b[0]) is int for b in meta["bad_rows"]):  # noqa: E721
        raise DamagedCache("meta.json's bad_rows are not [row, reason] pairs")
    for name, dtype in _DTYPES.items():
        if arrays[name].dtype != dtype or arrays[name].ndim != 1:
            raise DamagedCache(
                f"{name}.npy holds {arrays[name].dtype} of {arrays[name].ndim} dimensions, not 1-D {dtype.__name__}"
            )
    offsets, row_ids, tokens = arrays["offsets"], arrays["row_ids"], arrays["tokens"]
    samples = meta["num_rows"] - len(meta["bad_rows"])
    if len(offsets) != samples + 1 or len(row_ids) != samples or len(arrays["loss_mask"]) != len(tokens):
        raise DamagedCache(f"its arrays' lengths do not fit {samples} samples of {len(tokens)} tokens")
    if offsets[0] != 0 or offsets[-1] != len(tokens) or (np.diff(offsets) <= 0).any():
        raise DamagedCache("offsets.npy does not split the tokens into non-empty samples")
    if samples and (row_ids[0] < 0 or row_ids[-1] >= meta["num_rows"] or (np.diff(row_ids) <= 0).any()):
        raise DamagedCache("row_ids.npy does not name distinct rows of the data set in order")
    if from_cache:
        digests = meta.pop("digests", None)
        if digests is not None and digests != (now := _digests(directory, meta)):
            changed = [k for k in now if not isinstance(digests, dict) or digests.get(k) != now[k]] or ["digests"]
            raise DamagedCache(f"{', '.join(changed)} no longer match(es) the digests in meta.json (bytes changed)")
        if vocabulary is not None and len(tokens) and (int(tokens.min()) < 0 or int(tokens.max()) >= vocabulary):
            raise DamagedCache(
                f"tokens.npy holds token ids from {int(tokens.min())} to {int(tokens.max())}, outside the "
                f"tokenizer's {vocabulary}"
            )
        if digests is None:  # an earlier version's entry: from now on, its bytes are checked too
            tmp = directory / ".meta.json.tmp"
            tmp.write_text(json.dumps(meta | {"digests": _digests(directory, meta)}))
            os.replace(tmp, directory / "meta.json")
            logger.info("tokenized cache %s written before digests: its digests added to meta.json", directory)
    return TokenizedData(
        **arrays,
        num_rows=meta["num_rows"],
        bad_rows=tuple((int(i), str(r)) for i, r in meta["bad_rows"]),
        directory=directory,
        from_cache=from_cache,
    )
