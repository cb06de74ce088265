"""Trust only what this user owns: the ring's segment and semaphores, the lock directory, and the replica
group's secret file (`group_secret`).

POSIX IPC names and the /tmp fallback are shared by every local user. Whoever creates a
run's segment first owns it: if another user did (mode 0666), this run's workers would train
on that user's data and write target features where that user can read them. So every
segment and semaphore a process opens must belong to its effective uid with no group or
other bits, and every directory on the way to the lock directory must be one nobody else
can swap (ours or root's, and not writable by others unless sticky, like /tmp).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from dflash_ring.common.bounded_read import SECRET_BYTES
from dflash_ring.common.refusal import Refusal

SHM_DIR = Path("/dev/shm")


class ForeignObjectError(RuntimeError):
    """An IPC object or directory that another user owns or may change."""


class SecretFileError(Refusal, ValueError):
    """group.secret_file unset, unreadable, too short, or a file others may read or change; the message names it."""


def semaphore_path(name: str) -> Path:
    """Where glibc keeps a named POSIX semaphore ("/x" -> /dev/shm/sem.x)."""
    return SHM_DIR / f"sem.{name.lstrip('/')}"


def check_private(st: os.stat_result, what: str, fix: str) -> None:
    """Refuse an object not owned by this user, or one that group or others may read or write."""
    me = os.geteuid()
    if st.st_uid != me:
        raise ForeignObjectError(
            f"{what} belongs to uid {st.st_uid}, not to this user (uid {me}): "
            f"someone else created it, so it is not used. {fix}"
        )
    if st.st_mode & 0o077:
        raise ForeignObjectError(
            f"{what} has mode {stat.S_IMODE(st.st_mode):04o}, wider than 0600: "
            f"other users could read or change it, so it is not used. {fix}"
        )


def check_private_fd(fd: int, what: str, fix: str) -> None:
    check_private(os.fstat(fd), what, fix)


def check_semaphore(name: str, fix: str) -> None:
    """After opening a semaphore: it must be ours and private (it lives as a file in /dev/shm)."""
    try:
        st = os.stat(semaphore_path(name))
    except FileNotFoundError:
        return  # not a file-backed implementation, or removed meanwhile: opening it again fails clearly
    check_private(st, f"semaphore {name}", fix)


def ensure_private_dir(path: Path, what: str = "lock directory", setting: str = "run.run_dir") -> None:
    """Create path and its missing parents mode 0700; refuse it if anyone else could swap or read it.

    Every existing ancestor must belong to root or to this user and, unless sticky, not be
    writable by group or others; the directory itself and every parent created here must be ours.
    """
    path = Path(os.path.abspath(path))
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    fix = f"Remove it (it may need root) or set {setting} to a directory of your own"
    for ancestor in reversed(path.parents):
        if ancestor in missing:
            break
        _check_ancestor(ancestor, what, fix)
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass
        _check_own_dir(d, f"{what} parent" if d != path else what, fix)
    _check_own_dir(path, what, fix)


def _check_ancestor(d: Path, what: str, fix: str) -> None:
    st = os.stat(d)
    if st.st_uid not in (0, os.geteuid()):
        raise ForeignObjectError(
            f"{what} parent {d} belongs to uid {st.st_uid}, not to this user "
            f"(uid {os.geteuid()}) or root: its owner could replace the {what}. {fix}"
        )
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise ForeignObjectError(
            f"{what} parent {d} has mode {stat.S_IMODE(st.st_mode):04o}: others may "
            f"write to it and it is not sticky, so they could replace the {what}. {fix}"
        )


def _check_own_dir(d: Path, what: str, fix: str) -> None:
    st = os.stat(d)
    if not stat.S_ISDIR(st.st_mode):
        raise ForeignObjectError(f"{what} {d} is not a directory. {fix}")
    if st.st_uid != os.geteuid():
        raise ForeignObjectError(
            f"{what} {d} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}): "
            f"someone else created it. {fix}"
        )
    if st.st_mode & 0o022:
        raise ForeignObjectError(
            f"{what} {d} has mode {stat.S_IMODE(st.st_mode):04o}: others may write to it. chmod 700 {d}"
        )


def group_secret(secret_file: str) -> bytes:
    """The replica group's secret, from group.secret_file; refused unless a regular file of ours no one else can
    read or write (why: it is the group's only credential)."""
    if not secret_file:
        raise SecretFileError(
            "group.secret_file is not set: the replica group needs a shared secret file "
            "(same content on every host), e.g. `head -c 32 /dev/urandom > F && chmod 600 F`"
        )
    try:
        # O_NONBLOCK: a FIFO in its place must not wait for a writer forever before the regular-file check below.
        fd = os.open(secret_file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise SecretFileError(
            f"group.secret_file = {secret_file!r}: cannot open it ({e.strerror}); "
            "create it with `head -c 32 /dev/urandom > F && chmod 600 F`"
        ) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # on the fd, before fdopen (which refuses a directory itself)
        os.close(fd)
        raise SecretFileError(f"group.secret_file = {secret_file!r} is not a regular file")
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.geteuid():
            raise SecretFileError(
                f"group.secret_file = {secret_file!r} belongs to uid {st.st_uid}, not to "
                f"this user ({os.geteuid()}): use a file of your own"
            )
        if st.st_mode & 0o077:
            raise SecretFileError(
                f"group.secret_file = {secret_file!r} has mode "
                f"{stat.S_IMODE(st.st_mode):04o}: others can read or write it; "
                f"`chmod 600 {secret_file}`"
            )
        os.set_blocking(fd, True)
        secret = f.read(SECRET_BYTES + 1)  # a size cap (common/bounded_read.py): a 4 GB file is not read whole
    if len(secret) > SECRET_BYTES:
        raise SecretFileError(
            f"group.secret_file = {secret_file!r} is larger than {SECRET_BYTES >> 20} MiB: not a secret file; "
            "create one with `head -c 32 /dev/urandom > F && chmod 600 F`"
        )
    if len(secret.strip()) < 16:
        raise SecretFileError(
            f"group.secret_file = {secret_file!r} holds {len(secret.strip())} bytes: "
            "need at least 16, e.g. `head -c 32 /dev/urandom > F`"
        )
    return secret
