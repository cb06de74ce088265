"""Open a data set from disk as a `datasets.Dataset`, plus a fingerprint of its files.

JSON input is read one line (one row) as plain text and parsed later, row by row: Arrow's
JSON reader infers one schema for the whole file, so a single wrong-typed row would abort
the load instead of being skipped.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_ring.common.data_config import DataConfig, DataError

if TYPE_CHECKING:  # imported where a data set is opened: a producer whose tokenized cache is there never needs it
    import datasets

_SUFFIXES = {".json": "json", ".jsonl": "jsonl", ".parquet": "parquet", ".arrow": "arrow"}
ROW_COLUMNS = ("messages", "prompt", "response")


@dataclass(frozen=True)
class DataFiles:
    """Where the data is and what it looks like; cheap, so a cache hit never opens the data set."""

    root: Path
    format: str
    files: tuple[Path, ...]
    # Changes whenever a file of the data set changes (path, size or modification time).
    fingerprint: str


def locate(cfg: DataConfig) -> DataFiles:
    if not cfg.path:
        raise DataError("DataConfig.path is empty: set it to a data file or directory")
    root = Path(cfg.path).expanduser().resolve()
    if not root.exists():
        raise DataError(f"data path {root} does not exist")
    fmt = _detect_format(root) if cfg.format == "auto" else cfg.format
    if fmt == "disk":
        if not root.is_dir():
            raise DataError(f"format 'disk' needs a directory written by save_to_disk, got file {root}")
        files = sorted(p for p in root.rglob("*") if p.is_file())
    else:
        files = _data_files(root, fmt)
    return DataFiles(root, fmt, tuple(files), _fingerprint(files))


def open_dataset(data: DataFiles, cfg: DataConfig) -> tuple[datasets.Dataset, bool]:
    """The rows, and whether they are JSON texts (a "text" column) still to be parsed one by one."""
    import datasets

    hf_cache = Path(cfg.cache_dir).expanduser() / "hf"
    if data.format == "disk":
        return _load_disk(data.root, cfg.split), False
    if data.format in ("json", "jsonl"):
        if not any(f.stat().st_size for f in data.files):
            raise DataError(f"data set {data.root} has no rows")  # the text reader fails on empty input
        lines = [str(_as_json_lines(f, hf_cache / "json-lines")) for f in data.files]
        ds = datasets.load_dataset(
            "text",
            data_files=lines,
            split=cfg.split,
            cache_dir=str(hf_cache),
            encoding="utf-8-sig",
            encoding_errors="replace",
        )
        return ds, True
    files = [str(f) for f in data.files]
    ds = datasets.load_dataset(data.format, data_files=files, split=cfg.split, cache_dir=str(hf_cache))
    return _row_columns(ds, data.root), False


def batch_rows(batch: dict[str, list[Any]], json_rows: bool) -> list[Any]:
    """The rows of a slice of `open_dataset`'s data set: JSON texts still to be decoded, or row dicts."""
    return batch["text"] if json_rows else [dict(zip(batch, vals, strict=True)) for vals in zip(*batch.values())]


def _detect_format(root: Path) -> str:
    if root.is_dir():
        if (root / "state.json").exists() or (root / "dataset_dict.json").exists():
            return "disk"
        found = {_SUFFIXES[p.suffix] for p in root.iterdir() if p.is_file() and p.suffix in _SUFFIXES}
        if len(found) != 1:
            raise DataError(
                f"cannot tell the format of directory {root} (data file kinds found: {sorted(found) or 'none'}); "
                "keep one kind of file in it or set DataConfig.format"
            )
        return found.pop()
    if root.suffix not in _SUFFIXES:
        raise DataError(f"cannot tell the format of {root} from its suffix; set DataConfig.format")
    return _SUFFIXES[root.suffix]


def _data_files(root: Path, fmt: str) -> list[Path]:
    if root.is_file():
        return [root]
    suffixes = (".json", ".jsonl") if fmt in ("json", "jsonl") else (f".{fmt}",)
    files = sorted(p for p in root.iterdir() if p.is_file() and p.suffix in suffixes)
    if not files:
        raise DataError(f"no {'/'.join(suffixes)} files in directory {root}")
    return files


def _fingerprint(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for f in files:
        st = f.stat()
        digest.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def _as_json_lines(path: Path, cache: Path) -> Path:
    """A JSON-array file rewritten as one row per line, so every input is read the same way."""
    with open(path, "rb") as f:
        head = f.read(4096).removeprefix(codecs.BOM_UTF8).lstrip()
    if not head.startswith(b"["):
        return path
    out = cache / f"{_fingerprint([path])}.jsonl"
    if out.exists():
        return out
    try:
        rows = json.loads(path.read_text(encoding="utf-8-sig"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(
            f"{path} is not a valid JSON array ({e}); fix it, or write one JSON object per line (.jsonl) "
            "so that a broken row only skips that row"
        ) from e
    cache.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    # ensure_ascii keeps lone surrogates escaped, so they reach the row check instead of breaking Arrow.
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    tmp.replace(out)
    return out


def _load_disk(root: Path, split: str) -> datasets.Dataset:
    import datasets

    loaded = datasets.load_from_disk(str(root))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataError(f"{root} has no split {split!r} (it has {sorted(loaded)}); set DataConfig.split")
        loaded = loaded[split]
    return _row_columns(loaded, root)


def _row_columns(ds: datasets.Dataset, root: Path) -> datasets.Dataset:
    """Keep only the columns rows are built from, so unrelated (maybe heavy) columns are never decoded."""
    keep = [c for c in ROW_COLUMNS if c in ds.column_names]
    if not keep:
        raise DataError(
            f"{root} has none of the columns {list(ROW_COLUMNS)} (it has {ds.column_names}); rows need "
            "'messages' (a list of {role, content}) or 'prompt' and 'response'"
        )
    return ds.select_columns(keep)
