"""Keeping drafter replicas of one host in step: parameter averaging through host shared memory.

Every K steps a replica publishes its fp32 parameters into its own region of a
per-run segment, then replaces them with the mean of its own and every live
peer's latest published copy. No barrier and no collective: a replica that
dies or restarts never stalls the others, and a restarted replica starts from
the mean of the live peers ("catches up") before its first step. The mean is
taken one parameter at a time on the training device, so the extra device
memory is one parameter tensor, never a copy of the model (the old pipeline's
on-GPU averaging ran out of memory).

Caveats, by design: optimizer moments are not averaged (each replica keeps its
own AdamW state, as the in-process pipeline did when it averaged every 50
steps), and a peer caught mid-publish contributes a mix of two of its recent
versions; both are within what periodic model averaging tolerates. Replicas
on other hosts are not reached by this; they need a torch.distributed group (consumer/training/replica_group.py), which
`Averaging` runs beside it.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import posix_ipc
import torch
from torch import nn

from dflash_ring.common.config.schema import GroupConfig
from dflash_ring.common.layout import Role
from dflash_ring.common.lifecycle.liveness import is_alive, lock_path
from dflash_ring.common.ownership import ForeignObjectError, check_private_fd
from dflash_ring.common.pinning import HostRegistration
from dflash_ring.common.ring import replica_segment_name
from dflash_ring.consumer.training.replica_group import ReplicaGroup

log = logging.getLogger(__name__)

SLOT_HEADER = 64  # seq (u64, odd while writing), step (u64), n_params (u64)


class ReplicaAverager:
    def __init__(self, run: str, index: int, replicas: int, model: nn.Module, lock_dir: Path):
        self.index, self.replicas, self.lock_dir = index, replicas, lock_dir
        self.params = [p for p in model.parameters()]
        self.n = sum(p.numel() for p in self.params)
        stride = SLOT_HEADER + (self.n * 4 + 4095) // 4096 * 4096
        size = replicas * stride
        try:
            shm = posix_ipc.SharedMemory(replica_segment_name(run), posix_ipc.O_CREX, mode=0o600, size=size)
        except posix_ipc.ExistentialError:  # a peer made it; never resize what it uses
            shm = posix_ipc.SharedMemory(replica_segment_name(run))
        try:  # a peer's, so ours: anyone else's would read and steer our weights
            check_private_fd(
                shm.fd,
                f"replica segment {replica_segment_name(run)}",
                f"Remove it as its owner with `dflash-ring clean {run}`, or choose another run.name",
            )
        except ForeignObjectError:
            shm.close_fd()
            raise
        if shm.size != size:
            shm.close_fd()
            raise RuntimeError(
                f"replica segment {replica_segment_name(run)} is {shm.size} bytes, this drafter needs {size}: "
                f"the replicas of a run must share one drafter config (or clean the run)"
            )
        self._mm = mmap.mmap(shm.fd, size)
        shm.close_fd()
        self._headers = [np.frombuffer(self._mm, dtype="<u8", count=3, offset=i * stride) for i in range(replicas)]
        host = torch.frombuffer(self._mm, dtype=torch.uint8)
        self._flat = [
            host[i * stride + SLOT_HEADER : i * stride + SLOT_HEADER + self.n * 4].view(torch.float32)
            for i in range(replicas)
        ]
        self._pin = HostRegistration(host) if self.params[0].is_cuda else None
        del host
        self._headers[index][1] = 0  # what a predecessor published is stale until we publish

    def live_peers(self) -> list[int]:
        """Peers alive now with a complete published copy."""
        return [
            j
            for j in range(self.replicas)
            if j != self.index
            and is_alive(lock_path(self.lock_dir, Role.CONSUMER, j))
            and self._headers[j][1] > 0
            and self._headers[j][0] % 2 == 0
        ]

    def publish(self, step: int) -> None:
        header, flat = self._headers[self.index], self._flat[self.index]
        header[0] += 1  # odd: writing
        offset = 0
        for p in self.params:
            flat[offset : offset + p.numel()].view_as(p).copy_(p.detach(), non_blocking=True)
            offset += p.numel()
        if self.params[0].is_cuda:
            torch.cuda.current_stream(self.params[0].device).synchronize()
        header[1], header[2] = step, self.n
        header[0] += 1

    @torch.no_grad()
    def average(self, include_self: bool = True) -> int:
        """Replace the parameters by the mean over live peers (and self); returns how many were averaged."""
        peers = self.live_peers()
        if not peers:
            return 1
        offset = 0
        for p in self.params:
            acc = p.detach().float() if include_self else torch.zeros_like(p, dtype=torch.float32)
            for j in peers:
                acc += self._flat[j][offset : offset + p.numel()].view_as(p).to(p.device, non_blocking=True)
            p.copy_(acc / (len(peers) + include_self))
            offset += p.numel()
        return len(peers) + include_self

    def catch_up(self) -> int:
        """Start from the live peers' mean instead of stale or fresh weights; returns the peers used."""
        peers = self.live_peers()
        if peers:
            self.average(include_self=False)
            log.info(
                "caught up with live replica(s) %s (their steps %s)", peers, [int(self._headers[j][1]) for j in peers]
            )
        return len(peers)

    def close(self) -> None:
        if self._pin is not None:
            self._pin.close()
        del self._headers, self._flat
        try:
            self._mm.close()
        except BufferError:
            pass


class Averaging:
    """Replica averaging every train.average_every_steps (`every`; 0: never): with this host's replicas through
    shared memory (`replicas`), then (this host's leader) with the other hosts' leaders through the group (`group`).
    Either may be None: one drafter on this host, one host."""

    def __init__(self, every: int, replicas: ReplicaAverager | None = None, group: ReplicaGroup | None = None):
        self.every, self.replicas, self.group = every, replicas, group

    @classmethod
    def join(
        cls,
        every: int,
        consumers: int,
        group: GroupConfig,
        run_name: str,
        lock_dir: Path,
        index: int,
        model: nn.Module,
        group_fields: Callable[[], dict[str, Any]],
    ) -> Averaging:
        """Drafter `index`'s averaging (train.average_every_steps, topology.consumers, the group section), joined:
        it catches up with the live replicas' weights, and a host in a group with the live hosts', before the
        first step. `group_fields`: what every host must agree on (replica_group.fingerprint_fields)."""
        replicas, member, caught = None, None, 0
        if consumers > 1 and every:
            replicas = ReplicaAverager(run_name, index, consumers, model, lock_dir)
            caught = replicas.catch_up()
        if group.rendezvous and every:  # other hosts: this host's leader meets them
            member = ReplicaGroup.named(group, run_name, index, model, lock_dir, group_fields(), fresh=caught == 0)
            member.start()  # a restarted host takes the live hosts' weights before its first step
        return cls(every, replicas, member)

    def after_step(self, step: int) -> None:
        if not self.every or step % self.every:
            return
        if self.replicas is not None:
            self.replicas.publish(step)
            self.replicas.average()
        if self.group is not None and self.group.sync(step) and self.replicas is not None:
            self.replicas.publish(step)  # this host's other replicas take the group mean from here

    def leave_group(self) -> None:
        """At once on stop: a peer waiting on this host in a collective re-forms without it."""
        if self.group is not None:
            self.group.close()
            self.group = None

    def close(self, step: int) -> None:
        self.leave_group()
        if self.replicas is not None:
            self.replicas.publish(step)  # a restarted or late peer catches up from here
            self.replicas.close()
