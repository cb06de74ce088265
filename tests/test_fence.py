"""Fencing signals only a process that holds the lock file open: never pid 0 (a holder /proc/locks cannot name in
our pid namespace, where os.kill(0, ...) would hit our own process group), never a pid that has the file closed."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from dflash_ring.supervisor.fence import fence, has_open, lock_holders
from support import wait_for

HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(600)
"""


@pytest.mark.processes
def test_fence_kills_the_process_holding_the_lock_and_nothing_else(tmp_path):
    lock = tmp_path / "consumer-0.lock"
    other = tmp_path / "other.lock"
    other.write_text("")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert wait_for(lambda: lock_holders(lock) == {holder.pid}, what="the flock in /proc/locks")
        assert has_open(holder.pid, lock)
        assert not has_open(holder.pid, other)  # alive, but not this file: a reused pid is left alone
        assert not has_open(0, lock) and not has_open(-1, lock)
        assert fence(tmp_path, ["consumer-0.lock"], wait_s=30) == []
        assert holder.wait(30) == -signal.SIGKILL
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
