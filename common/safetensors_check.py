"""A cheap check that safetensors files parse, before a loader reads them: a truncated or damaged file is then
one line naming the file and what is wrong, not a `SafetensorError` traceback from deep inside a loader.

Only the header is read (8 bytes of length, then the JSON header), and every tensor's byte range is checked
against the file's size, which is what a truncated copy gets wrong.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from .bounded_read import INDEX_BYTES, open_regular, read_text
from .refusal import Refusal

_HEADER_BYTES = 100 << 20  # the format's own limit on the JSON header
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
# Bits per element of every dtype the safetensors format names (its Dtype enum).
DTYPE_BITS = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "I64": 64,
    "U64": 64,
    "F64": 64,
    "C64": 64,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
}  # what a target's floating-point tensors are stored as, unquantized


class DamagedWeightsError(Refusal, ValueError):
    """A safetensors file (or its index) that does not parse; the message names the file and what is wrong (a
    Refusal, so every command prints it as its one error line)."""


def check_safetensors_file(path: Path) -> dict:
    """Raise DamagedWeightsError unless `path` has a readable header whose tensors all lie within the file; return
    the header. Opened by the one rule for a file's kind (common/bounded_read.py): a FIFO, a directory or a device
    (/dev/zero) in its place is refused naming it, before a loader would block on it or map it."""
    fd = open_regular(path, DamagedWeightsError, "safetensors file")
    size = os.fstat(fd).st_size
    with open(fd, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _damaged(path, f"{size} bytes, shorter than the 8-byte header length")
        n = int.from_bytes(head, "little")
        if n > min(_HEADER_BYTES, size - 8):
            raise _damaged(path, f"its header claims {n} bytes but the file has {size - 8} after the length")
        try:
            header = json.loads(f.read(n))
        except (ValueError, RecursionError) as e:
            raise _damaged(path, f"its header is not valid JSON ({type(e).__name__})") from None
    if not isinstance(header, dict):
        raise _damaged(path, "its header is not a JSON object")
    data = size - 8 - n
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise _damaged(path, "its __metadata__ is not an object of strings")
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            start, stop = (int(x) for x in info["data_offsets"])
            shape = [int(x) for x in info["shape"]]
            width = DTYPE_BITS[info["dtype"]]
        except (KeyError, TypeError, ValueError):
            raise _damaged(path, f"tensor {name!r} has no valid data_offsets, shape and dtype") from None
        if not 0 <= start <= stop <= data:
            raise _damaged(
                path,
                f"tensor {name!r} lies at bytes {start}-{stop} but the file holds {data} bytes of data (truncated?)",
            )
        if min(shape, default=0) < 0 or (math.prod(shape) * width + 7) // 8 != stop - start:
            raise _damaged(
                path, f"tensor {name!r} of shape {shape} in {info['dtype']} does not take {stop - start} bytes"
            )
        spans.append((start, stop, name))
    # The format's own rule: the tensors tile the data, in order, no byte shared or left over.
    end = 0
    for start, stop, name in sorted(spans):
        if start != end:
            raise _damaged(path, f"tensor {name!r} starts at byte {start} where the one before it ends at {end}")
        end = stop
    if end != data:
        raise _damaged(path, f"its tensors end at byte {end} of {data} bytes of data")
    return header


def weight_shapes(root: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape as the model directory's safetensors headers give it (none without weights)."""
    if not any(_there(root / name) for name in ("model.safetensors", "model.safetensors.index.json")):
        return {}
    shapes = {}
    for f in weight_files(root):
        for name, info in check_safetensors_file(f).items():
            if name != "__metadata__":
                try:
                    shapes[name] = tuple(int(x) for x in info["shape"])
                except (KeyError, TypeError, ValueError):
                    raise _damaged(f, f"tensor {name!r} has no valid shape") from None
    return shapes


def weight_dtypes(root: Path) -> dict[str, str]:
    """Every tensor's safetensors dtype (F32, BF16, I8, F8_E4M3, ...) as the model directory's headers give it."""
    if not any(_there(root / name) for name in ("model.safetensors", "model.safetensors.index.json")):
        return {}
    return {
        name: str(info.get("dtype")) if isinstance(info, dict) else "?"
        for f in weight_files(root)
        for name, info in check_safetensors_file(f).items()
        if name != "__metadata__"
    }


def _there(path: Path) -> bool:
    """Whether a name is there, of any kind: a FIFO or a directory in a weights file's place is refused by the kind
    rule when it is read (check_safetensors_file), never passed over as absent (check-config then said OK to a target
    whose loading blocked on the FIFO)."""
    return os.path.lexists(path)


def weight_files(root: Path) -> list[Path]:
    """The safetensors files of a model directory (each shard its index names, or model.safetensors), checked."""
    index = root / "model.safetensors.index.json"
    if _there(index):
        try:
            weight_map = json.loads(read_text(index, INDEX_BYTES, DamagedWeightsError, "safetensors index"))[
                "weight_map"
            ]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            if isinstance(e, DamagedWeightsError):
                raise
            raise DamagedWeightsError(
                f"{index} is not a safetensors index ({type(e).__name__}: {e}): replace it with the model's own"
            ) from None
        if not names:
            raise DamagedWeightsError(f"{index} maps no tensor to a shard: replace it with the model's own")
        if bad := [n for n in names if not isinstance(n, str) or Path(n).name != n or n in ("", ".", "..")]:
            raise DamagedWeightsError(
                f"{index} maps tensors to {bad[0]!r}, not the file name of a shard beside it: replace it with the "
                "model's own"
            )
        files = [root / name for name in names]
        if missing := [f.name for f in files if not _there(f)]:
            raise DamagedWeightsError(
                f"{index} names {missing[0]}, which is not in {root}"
                f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}"
            )
    else:
        files = [root / "model.safetensors"]
    for f in files:
        check_safetensors_file(f)
    return files


def _damaged(path: Path, what: str) -> DamagedWeightsError:
    return DamagedWeightsError(f"{path} is not a readable safetensors file: {what}; copy or download it again")
