"""The cross-host drafter group's rendezvous store: served by one host's supervisor, joined by every
host's drafter leader (consumer/replica_group.py). Here so that the supervisor needs only common/."""

from __future__ import annotations

from datetime import timedelta

from torch.distributed import TCPStore


def parse_rendezvous(address: str) -> tuple[str, int]:
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    return host.strip("[]"), int(port)


def serve_rendezvous(address: str) -> TCPStore:
    """The store every host's leader meets at; keep the object alive as long as the group may form."""
    _, port = parse_rendezvous(address)
    return TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
