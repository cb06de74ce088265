"""Reading a file back, by one rule for its kind and its size: a config, a cursor, a journal, a record or a model's
file is opened without blocking and must be a regular file (a directory, a FIFO whose read would wait for a writer
forever, a device such as /dev/zero that never ends, a socket or a symlink loop is never the file the caller meant),
then read with a size cap, so it never takes more memory than the cap however large the file on disk has grown (a
wrong path, a damaged copy). A file a user gave is refused in one line naming it (the caller's Refusal class); a
file a role wrote itself is kept aside by the damaged-file rule (`read_own`), so that neither a role nor the
supervisor's reaper nor `dflash-ring clean` ever blocks on one or crash-loops over it."""

from __future__ import annotations

import errno
import os
import stat

# Caps by kind: generous for any real file of that kind, small enough to read at once.
CONFIG_BYTES = 4 << 20  # a TOML config or a model's config.json
INDEX_BYTES = 64 << 20  # model.safetensors.index.json: one line per tensor (a large MoE has ~10^5)
RECORD_BYTES = 64 << 20  # a cursor file (its replay list) or a regenerate shard record (its skipped rows)
JOURNAL_BYTES = 1 << 30  # a drafter's journal segment: ~40 bytes a trained batch since its last checkpoint
SECRET_BYTES = 1 << 20  # group.secret_file: a few dozen random bytes
REPORT_BYTES = 1 << 30  # a drafter's record file: a line (~1 KiB with per-source keys) per logged step
PROMPTS_BYTES = 1 << 30  # `eval --data`: JSONL chat rows, read whole (an eval set is thousands of prompts, not GBs)


def open_regular(path: str | os.PathLike, error: type[Exception], what: str) -> int:
    """A blocking descriptor of the regular file at `path` (symlinks followed), or `error` naming the file and what
    it is instead. Opened with O_NONBLOCK and checked on the open file (fstat), so a FIFO is never waited on and
    what is checked is what is read. A missing file and a permission denied stay the OSErrors they are."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise error(
                f"{what} {path} is a symlink loop, not a regular file: give the path of the file itself"
            ) from None
        if e.errno == errno.ENXIO:  # a socket (or a device without its driver)
            raise error(
                f"{what} {path} is {_kind_at(path)}, not a regular file: give the path of the file itself"
            ) from None
        raise
    try:
        if not stat.S_ISREG(mode := os.fstat(fd).st_mode):
            raise error(f"{what} {path} is {_kind(mode)}, not a regular file: give the path of the file itself")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def regular_size(path: str | os.PathLike, error: type[Exception], what: str, cap: int | None = None) -> int:
    """The size of the regular file at `path`, or `error` as `open_regular` (and, with `cap`, when it is larger): the
    check before a path is handed to a library that opens it itself (transformers' config reading, safetensors'
    safe_open and load_file), where a FIFO would block and a device never end."""
    fd = open_regular(path, error, what)
    try:
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    if cap is not None and size > cap:
        raise _too_large(error, what, path, cap)
    return size


def read_bytes(path: str | os.PathLike, cap: int, error: type[Exception], what: str) -> bytes:
    """The file's bytes, or `error` naming the file when it holds more than `cap` bytes (read at most cap + 1), or when
    it is not a regular file (`open_regular`)."""
    with open(open_regular(path, error, what), "rb") as f:
        data = f.read(cap + 1)
    if len(data) > cap:
        raise _too_large(error, what, path, cap)
    return data


def _too_large(error: type[Exception], what: str, path: str | os.PathLike, cap: int) -> Exception:
    return error(
        f"{what} {path} is larger than {_size(cap)}: it is not the file it should be (check the path, or replace "
        "the file)"
    )


class _NotItsKind(Exception):
    """A role's own file that is not what it wrote: to be kept aside (`read_own`)."""


def read_own(path: str | os.PathLike, cap: int, what: str) -> bytes | None:
    """The bytes of a file a role wrote itself (a journal segment, the `latest` pointer, the head cache), or None
    when there is none. One that is not a regular file or holds more than `cap` bytes is nothing the role wrote: it
    is kept aside by the damaged-file rule (common/damaged_file.py, one warning naming it) and None returned, so the
    reader goes on as without it (and its writer can write the file again) instead of blocking on a FIFO or
    crash-looping over a directory. Another reader that kept it aside first is the same None."""
    from pathlib import Path

    from .damaged_file import keep_aside

    try:
        return read_bytes(path, cap, _NotItsKind, what)
    except FileNotFoundError:
        return None
    except (_NotItsKind, IsADirectoryError) as e:
        try:
            keep_aside(Path(path), str(e))
        except FileNotFoundError:
            pass  # kept aside meanwhile by another reader
        return None


def _kind_at(path: str | os.PathLike) -> str:
    try:
        return _kind(os.stat(path).st_mode)
    except OSError:
        return "not a regular file"


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file"


def _size(n: int) -> str:
    return f"{n >> 30} GiB" if n >= 1 << 30 else f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def read_text(path: str | os.PathLike, cap: int, error: type[Exception], what: str) -> str:
    """`read_bytes` decoded as UTF-8; bytes that are not UTF-8 are `error` too, with the file named."""
    try:
        return read_bytes(path, cap, error, what).decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{what} {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def check_output(path: str | os.PathLike, error: type[Exception], what: str) -> None:
    """A file a command is about to write: none yet or a regular file, else `error` naming it (a FIFO would block the
    write, a device such as /dev/full or /dev/null swallows or refuses it, a directory is not a file)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise error(f"{what} {path} is a symlink loop: give the path of a file to write") from None
        raise
    if not stat.S_ISREG(mode):
        raise error(f"{what} {path} is {_kind(mode)}, not a regular file: give the path of a file to write")
