"""Open a data set from disk as a `datasets.Dataset`, plus a fingerprint of its files.

JSON input is read one line (one row) as plain text and parsed later, row by row: Arrow's
JSON reader infers one schema for the whole file, so a single wrong-typed row would abort
the load instead of being skipped.

Every row has a size bound, `max_row_bytes` (ROW_BYTES_PER_TOKEN bytes per token of data.max_length): a row
larger than that holds far more than the max_length tokens a sample keeps, and parsing and tokenizing it whole
costs hundreds of times its size in memory (one 50 MB line took `data stats` past 13 GB). A JSON line over
the bound is never held whole: the reader streams the file and puts a short marker in its place (a copy in
the cache, written only when a file has such a line), which becomes a skipped row with its reason, so row
indices stay those of the source. Other formats' rows are measured before they are parsed or tokenized.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_ring.common.chat_encoding import BadRow
from dflash_ring.common.config.data import DataConfig, DataError
from dflash_ring.common.refusal import Refusal

if TYPE_CHECKING:  # imported where a data set is opened: a producer whose tokenized cache is there never needs it
    import datasets

_SUFFIXES = {".json": "json", ".jsonl": "jsonl", ".parquet": "parquet", ".arrow": "arrow"}
ROW_COLUMNS = ("messages", "prompt", "response")
# Bytes of row per token of data.max_length before a row is skipped unread: a token of text is a few bytes (JSON
# escapes of non-ASCII text: up to ~12 per character), so this keeps every row the tokenizer could fill.
ROW_BYTES_PER_TOKEN = 256
JSON_ARRAY_BYTES = 1 << 30  # a JSON-array file is parsed whole: larger ones are refused (write .jsonl instead)
_OVERSIZED = "\x00oversized row of "  # the line that stands for one over the bound (NUL: never valid JSON)
_CHUNK = 1 << 20


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
    if not (root.is_file() or root.is_dir()):  # a FIFO or a device: read to its end, it may never end
        raise DataError(
            f"data path {root} is neither a regular file nor a directory; point data.path at a data file or a "
            "directory of them"
        )
    fmt = _detect_format(root) if cfg.format == "auto" else cfg.format
    if fmt == "disk":
        if not root.is_dir():
            raise DataError(f"format 'disk' needs a directory written by save_to_disk, got file {root}")
        files = sorted(p for p in root.rglob("*") if p.is_file())
    else:
        files = _data_files(root, fmt)
    return DataFiles(root, fmt, tuple(files), _fingerprint(files))


def max_row_bytes(max_length: int) -> int:
    """The largest row (bytes of its JSON line, or of its text fields) read and tokenized: see the module doc."""
    return ROW_BYTES_PER_TOKEN * max_length


def check_row_size(raw: Any, cap: int) -> None:
    """BadRow for a row over the bound, before it is parsed or tokenized: a JSON line's marker or length, a row
    dict's total text."""
    size = len(raw) if isinstance(raw, str) else _text_size(raw, cap)
    if isinstance(raw, str) and raw.startswith(_OVERSIZED):
        size = int(raw[len(_OVERSIZED) :].split()[0])
    if size > cap:
        raise BadRow(
            f"row of {size} bytes, over the {cap}-byte bound ({ROW_BYTES_PER_TOKEN} per token of "
            "data.max_length): skipped unread, as it holds far more than a sample keeps"
        )


def _text_size(value: Any, cap: int) -> int:
    """Characters of text in a row (strings, through lists and dicts), counted until past `cap`."""
    if isinstance(value, str):
        return len(value)
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    total = 0
    for item in items:
        total += _text_size(item, cap)
        if total > cap:
            break
    return total


def open_dataset(data: DataFiles, cfg: DataConfig) -> tuple[datasets.Dataset, bool]:
    """The rows, and whether they are JSON texts (a "text" column) still to be parsed one by one."""
    with reading(data, cfg.split):
        return _open_dataset(data, cfg)


@contextmanager
def reading(data: DataFiles, split: str) -> Iterator[None]:
    """While `datasets` reads the user's data files: whatever it raises there but our own refusals, running out of
    memory and the system's own errors (a real errno: a full disk, a permission) is the data set's fault (a
    truncated or foreign parquet/arrow file, a format that is not the files', a split they do not have), so it
    becomes one DataError naming the data set, the library's exception and its message. The rule for the reading
    phase, at every place a data set is opened; rows are judged one by one after it (BadRow). The readers log each
    such error before they raise it ("Failed to read schema ..."): those records are held back, as the refusal is
    the one line that says it."""
    held = [logging.getLogger(f"datasets.packaged_modules.{m}.{m}") for m in ("json", "text", "parquet", "arrow")]
    for logger in held:
        logger.addFilter(_not_an_error)
    try:
        yield
    except (Refusal, MemoryError):
        raise
    except OSError as e:
        if e.errno is not None:
            raise
        raise _unreadable(data, split, e) from None
    except Exception as e:  # noqa: BLE001 (the phase's rule, see above)
        raise _unreadable(data, split, e) from None
    finally:
        for logger in held:
            logger.removeFilter(_not_an_error)


def _not_an_error(record: logging.LogRecord) -> bool:
    return record.levelno < logging.ERROR


def _unreadable(data: DataFiles, split: str, e: BaseException) -> DataError:
    while e.__cause__ is not None:  # datasets wraps the reader's error in a generic DatasetGenerationError
        e = e.__cause__
    why = " ".join(str(e).split())[:500] or "no message"
    return DataError(
        f"data set {data.root} cannot be read as format {data.format!r}, split {split!r} ({type(e).__name__}: "
        f"{why}); check data.format and data.split against its files, or replace a damaged file"
    )


def _open_dataset(data: DataFiles, cfg: DataConfig) -> tuple[datasets.Dataset, bool]:
    import datasets

    hf_cache = Path(cfg.cache_dir).expanduser() / "hf"
    if data.format == "disk":
        return _load_disk(data.root, cfg.split), False
    if data.format in ("json", "jsonl"):
        cap = max_row_bytes(cfg.max_length)
        paths = [
            _bounded_lines(_as_json_lines(f, hf_cache / "json-lines"), hf_cache / "json-lines", cap) for f in data.files
        ]
        if all(_no_text(p) for p in paths):  # the text reader fails on empty input (an empty JSON array: none)
            raise DataError(f"data set {data.root} has no rows")
        lines = [str(p) for p in paths]
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
    named = sorted(p for p in root.iterdir() if p.suffix in suffixes)
    # A data file the directory names but that cannot be read as one (a dangling symlink, a FIFO) is not skipped
    # in silence: the data set would be smaller than the directory says.
    if odd := [p for p in named if not p.is_file() and not p.is_dir()]:
        raise DataError(f"{odd[0]} is not a readable regular file (a dangling symlink, a FIFO?): fix or remove it")
    files = [p for p in named if p.is_file()]
    if not files:
        raise DataError(f"no {'/'.join(suffixes)} files in directory {root}")
    return files


def _fingerprint(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for f in files:
        st = f.stat()
        digest.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def _no_text(path: Path) -> bool:
    """No character in the file: empty, or a UTF-8 byte-order mark alone."""
    size = path.stat().st_size
    if size > len(codecs.BOM_UTF8):
        return False
    with open(path, "rb") as f:
        return f.read() in (b"", codecs.BOM_UTF8)


def _as_json_lines(path: Path, cache: Path) -> Path:
    """A JSON-array file rewritten as one row per line, so every input is read the same way. A pretty-printed
    object is refused in one line (read line by line, every line of it was a bad row)."""
    with open(path, "rb") as f:
        head = f.read(4096).removeprefix(codecs.BOM_UTF8).lstrip()
    if head.split(b"\n", 1)[0].strip() == b"{":  # no JSON Lines row is a lone brace: rows spread over lines
        raise DataError(
            f"{path} holds pretty-printed JSON (a row over several lines), which is read one line per row: write "
            f"one JSON object per line (e.g. jq -c . {path} > rows.jsonl), or a JSON array of rows"
        )
    if not head.startswith(b"["):
        return path
    out = cache / f"{_fingerprint([path])}.jsonl"
    if out.exists():
        return out
    if (size := path.stat().st_size) > JSON_ARRAY_BYTES:
        raise DataError(
            f"{path} is a JSON array of {size >> 20} MiB, parsed whole only up to "
            f"{JSON_ARRAY_BYTES >> 20} MiB: write it as one JSON object per line (.jsonl), which is "
            "read a row at a time"
        )
    try:
        rows = json.loads(path.read_text(encoding="utf-8-sig"))
    except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, too deep, an integer past the digit limit
        why = "nested deeper than the JSON parser recurses" if isinstance(e, RecursionError) else e
        raise DataError(
            f"{path} is not a valid JSON array ({why}); fix it, or write one JSON object per line (.jsonl) "
            "so that a broken row only skips that row"
        ) from e
    cache.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    # ensure_ascii keeps lone surrogates escaped, so they reach the row check instead of breaking Arrow.
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    tmp.replace(out)
    return out


def _bounded_lines(path: Path, cache: Path, cap: int) -> Path:
    """`path`, or when a line of it is over `cap` bytes a cached copy with a marker line in its place; both
    passes stream the file, holding at most one chunk and `cap` bytes of a line."""
    if not any(n > cap for n in _line_sizes(path)):
        return path
    out = cache / f"{_fingerprint([path])}-bounded-{cap}.jsonl"
    if out.exists():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    with open(path, "rb") as src, open(tmp, "wb") as dst:
        line: list[bytes] = []
        size = 0
        while chunk := src.read(_CHUNK):
            start = 0
            while (end := chunk.find(b"\n", start)) >= 0 or start < len(chunk):
                piece = chunk[start:] if end < 0 else chunk[start:end]
                size += len(piece)
                if size <= cap:
                    line.append(piece)
                if end < 0:
                    break
                dst.write(b"".join(line) if size <= cap else f"{_OVERSIZED}{size} bytes".encode())
                dst.write(b"\n")
                line, size, start = [], 0, end + 1
        if size or line:
            dst.write(b"".join(line) if size <= cap else f"{_OVERSIZED}{size} bytes".encode())
            dst.write(b"\n")
    tmp.replace(out)
    return out


def _line_sizes(path: Path) -> Iterator[int]:
    """The byte length of every line of `path` (its newline not counted), a chunk at a time."""
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            start = 0
            while (end := chunk.find(b"\n", start)) >= 0:
                yield size + end - start
                size, start = 0, end + 1
            size += len(chunk) - start
    if size:
        yield size


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
