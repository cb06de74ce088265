"""Who uses a run's ring right now, whatever the caller's config says.

Segment names are per host, lock directories per config: a caller that judged liveness from
its own lock directory alone called a ring stale (and removed it) while another config's
processes were training on it. So a ring counts as in use while a lock is held in the lock
directory recorded in its header (`run.lock_dir`, where its processes hold their locks) or
in the caller's, or while any process maps its segment (found by inode in /proc/*/maps: this
also covers a process that has attached but not joined yet, e.g. while it loads its model).
"""

from __future__ import annotations

import os
from pathlib import Path

from dflash_ring.common.lifecycle.liveness import live_lock_files
from dflash_ring.common.ring.segment import segment_files


def mapping_pids(paths: list[Path]) -> dict[int, str]:
    """Processes other than this one that map any of these files, with their command lines."""
    keys = set()
    for p in paths:
        try:
            st = os.stat(p)
        except FileNotFoundError:
            continue
        keys.add((f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}", str(st.st_ino)))
    if not keys:
        return {}
    inodes = {ino for _, ino in keys}
    found: dict[int, str] = {}
    me = os.getpid()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            with open(f"/proc/{entry.name}/maps") as f:
                hit = any(
                    (fields := line.split(maxsplit=5))[4:5] and fields[4] in inodes and (fields[3], fields[4]) in keys
                    for line in f
                )
            if hit:
                with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                    found[int(entry.name)] = f.read(200).replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile, or another user's process we may not read
            continue
    return found


def ring_users(run: str, lock_dirs: list[Path], ignore: set[Path] = frozenset()) -> list[str]:
    """Everything that shows the run's ring in use: live lock files, then pids that map it."""
    users, seen = [], set()
    for d in lock_dirs:
        d = Path(os.path.abspath(d))
        if d in seen:
            continue
        seen.add(d)
        users += [str(p) for p in live_lock_files(d) if p not in ignore]
    users += [f"pid {pid} ({cmd[:80]})" for pid, cmd in sorted(mapping_pids(segment_files(run)).items())]
    return users
