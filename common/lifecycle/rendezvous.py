"""The cross-host drafter group's rendezvous store: served by one host's supervisor, joined by every
host's drafter leader (consumer/training/replica_group.py). Here so that the supervisor needs only common/."""

from __future__ import annotations

import socket
from datetime import timedelta

from dflash_ring.common.config.schema import ConfigError


def parse_rendezvous(address: str) -> tuple[str, int]:
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    return host.strip("[]"), int(port)


class Rendezvous:
    """The store every host's leader meets at, listening on the configured address only.

    TCPStore's own listener binds every interface whatever host it is given, so we bind
    the socket ourselves and hand it over (`master_listen_fd`). The libuv server takes
    that descriptor over (it closes it when the store goes), so the socket is detached.
    """

    def __init__(self, address: str):
        from torch.distributed import TCPStore  # here: a supervisor that serves no group starts without torch

        host, port = parse_rendezvous(address)
        try:
            family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
            self.sock = socket.socket(family, kind, proto)
            self.sock.set_inheritable(False)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind(addr)
            self.sock.listen(128)
        except OSError as e:
            raise ConfigError(
                f"group.rendezvous = {address!r}: cannot listen there ({e.strerror or e}); "
                "use an address of this host and a free port"
            ) from None
        self.address = self.sock.getsockname()
        try:
            self.store = TCPStore(
                host,
                port,
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=30),
                master_listen_fd=self.sock.fileno(),
                use_libuv=True,
            )
        except BaseException:
            self.sock.close()
            raise
        self.sock.detach()

    def close(self) -> None:
        """Stop serving: the store's destructor closes the listening socket."""
        self.store = None


def serve_rendezvous(address: str) -> Rendezvous:
    """Serve the group's store at `address`; keep the object alive as long as the group may form."""
    return Rendezvous(address)
