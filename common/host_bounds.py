"""What this host has, and the one rule for counts and sizes that scale with it: a setting that starts processes or
threads, or allocates memory in proportion to a number, is checked against the host before anything starts, and
refused in one line naming the setting, its value and what the host has. Past the host it never works: 1024
tokenizer processes on 2 cores thrash for hours, 100000 torch threads segfault, a block of 10^9 positions allocates
until the kernel kills the process. The config's own ranges (common/config/ranges.py) cannot say this: the same
config runs on hosts of every size, so the check is here, where the host is known (check-config runs it too).

Import-light (os only): every role and the CLI import it at their start.
"""

from __future__ import annotations

import os

from dflash_ring.common.refusal import Refusal


class HostBoundError(Refusal, ValueError):
    """A count or size past what this host has; the message names the setting, the host's figure and the fix."""


def cores() -> int:
    """The CPU cores this process may run on (its affinity: a container's or taskset's share, not the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def check_cores(count: int, what: str, fix: str = "lower it") -> None:
    """`count` processes or threads of one kind, at most one per core: more only share the cores, slower."""
    if count > (n := cores()):
        raise HostBoundError(
            f"{what} = {count}: this host has {n} CPU core{'s' if n != 1 else ''} for this process, so at most {n} "
            f"run at once; {fix}"
        )


def check_num_proc(num_proc: int) -> None:
    """data.num_proc: tokenizer processes, at most one per core (the producer's start, check-config, data-stats)."""
    check_cores(num_proc, "data.num_proc", "lower it (tokenizer processes past the cores only thrash)")


def available_memory(device: str | object = "cpu") -> int | None:
    """Bytes that can still be allocated on `device` without swapping: the kernel's MemAvailable for the CPU, the
    free memory of a CUDA device; None where it cannot be told (then nothing is refused by it)."""
    kind = getattr(device, "type", None) or str(device).split(":")[0]
    if kind == "cuda":
        try:
            import torch

            return int(torch.cuda.mem_get_info(device)[0])
        except (ImportError, RuntimeError, ValueError):
            return None
    try:
        with open("/proc/meminfo", "rb") as f:  # a kernel file: regular, small, never blocks
            for line in f.read(1 << 16).decode("ascii", "replace").splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_memory(need: int | float, what: str, device: str | object = "cpu", fix: str = "lower it") -> None:
    """`need` bytes about to be allocated on `device` for `what`: refused when more than the device has free."""
    have = available_memory(device)
    if have is not None and need > have:
        raise HostBoundError(
            f"{what} needs about {_bytes(need)} of memory, and {device} has {_bytes(have)} available; {fix}"
        )


def _bytes(n: int | float) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20)):
        if n >= size:
            return f"{n / size:.3g} {unit}" if n < 1e6 * size else f"{n / size:.2e} {unit}"
    return f"{int(n)} bytes"
