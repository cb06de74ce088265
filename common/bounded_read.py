"""Reading a small file whole, with a size cap: a config, a cursor, a record or a model's JSON never takes
more memory than the cap, however large the file on disk has grown (a wrong path, a damaged copy)."""

from __future__ import annotations

import os
import stat

# Caps by kind: generous for any real file of that kind, small enough to read at once.
CONFIG_BYTES = 4 << 20  # a TOML config or a model's config.json
INDEX_BYTES = 64 << 20  # model.safetensors.index.json: one line per tensor (a large MoE has ~10^5)
RECORD_BYTES = 64 << 20  # a cursor file (its replay list) or a regenerate shard record (its skipped rows)


def read_bytes(path: str | os.PathLike, cap: int, error: type[Exception], what: str) -> bytes:
    """The file's bytes, or `error` naming the file when it holds more than `cap` bytes (read at most cap + 1), or when
    it is not a regular file: a directory, a FIFO (whose read would wait for a writer forever) or a device (/dev/zero
    is never done) is never the file the caller meant. Opened without blocking, then checked on the open file."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(mode := os.fstat(fd).st_mode):
            raise error(f"{what} {path} is {_kind(mode)}, not a regular file: give the path of the file itself")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    with open(fd, "rb") as f:
        data = f.read(cap + 1)
    if len(data) > cap:
        raise error(
            f"{what} {path} is larger than {cap >> 20} MiB: it is not the file it should be "
            "(check the path, or replace the file)"
        )
    return data


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file"


def read_text(path: str | os.PathLike, cap: int, error: type[Exception], what: str) -> str:
    """`read_bytes` decoded as UTF-8; bytes that are not UTF-8 are `error` too, with the file named."""
    try:
        return read_bytes(path, cap, error, what).decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{what} {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
