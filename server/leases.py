"""Each attached client's lease: the daemon's end of its handle-socket connection, polled by the loop.

A client is alive as long as its lease is open: end-of-file on it means the client's process let
go (exit, kill -9, close) in whatever namespace it runs, and its registration is retired. This
module keeps the descriptors and their registration with the loop's poller; it is not the
registration (server/registry.py) nor the handle socket that hands the connections over
(server/handle_server.py, server/handle_requests.py). Every method runs on the loop's thread.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import zmq

log = logging.getLogger("engramd.daemon")


class Leases:
    def __init__(self, poller: zmq.Poller, retire: Callable[[int, str], None]):
        """`retire(client_id, why)`: a lease closed (or was misused); its registration goes."""
        self._poller = poller
        self._retire = retire
        self._leases: dict[int, int] = {}  # client_id -> descriptor
        self._lease_clients: dict[int, int] = {}  # descriptor -> client_id

    def __contains__(self, fd: object) -> bool:
        """Whether `fd` (one of the poller's ready entries) is a lease."""
        return fd in self._lease_clients

    def begin(self, client_id: int, fd: int) -> None:
        os.set_blocking(fd, False)
        self._leases[client_id] = fd
        self._lease_clients[fd] = client_id
        self._poller.register(fd, zmq.POLLIN)

    def end(self, record: Any) -> None:
        """The registry retired a registration: close our end of its lease (the client sees EOF)."""
        fd = self._leases.pop(record.client_id, None)
        if fd is None:
            return
        del self._lease_clients[fd]
        self._poller.unregister(fd)
        os.close(fd)

    def event(self, fd: int) -> None:
        """The lease is readable: end-of-file means the client's process let go of it (exit,
        kill -9, close) in whatever namespace it runs. Clients send nothing else on it."""
        try:
            data = os.read(fd, 4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        client_id = self._lease_clients[fd]
        if data:
            log.warning("client %d sent %d bytes on its lease; dropping the client", client_id, len(data))
        self._retire(client_id, "reaped (its lease closed)" if not data
                     else "retired (it broke the lease protocol)")

    def close(self) -> None:
        for fd in self._lease_clients:
            os.close(fd)
        self._leases, self._lease_clients = {}, {}
