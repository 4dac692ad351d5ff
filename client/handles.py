"""The handle socket: file descriptors from the daemon to its registered clients.

Beside the ZeroMQ socket, in the same runtime folder, a plain Unix stream socket carries what
ZeroMQ cannot: open file descriptors (SCM_RIGHTS). A client never opens a path in the daemon's
shared-memory folder; it asks here, proving who it is with the token of its registration, and
gets read-only descriptors of the tables it may read. One request per connection::

    client -> daemon   [u32 length][msgpack map]  {"v", "op": "tables", "client_id", "token"}
    daemon -> client   [u32 length][msgpack map]  + SCM_RIGHTS, one descriptor per table
                       ok:    {"v", "status": "ok", "epoch", "tables": [{layer_id, rows,
                               row_bytes, data_offset, file_bytes}, ...]}   (descriptor i = table i)
                       error: {"v", "status": "error", "code", "message", "epoch"}

A token is good for one grant: a replayed or forged one gets a typed error and no descriptor.
The daemon reads each request within HANDLE_TIMEOUT_S of the connection (however slowly a peer
sends it) and answers it, or closes the connection.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from engramd.client.errors import DaemonUnavailableError, EngramError, ProtocolError, error_for_code
from engramd.client.protocol import PROTOCOL_VERSION

HANDLE_SOCKET_NAME = "engramd.handles"
HANDLE_TIMEOUT_S = 5.0
MAX_MESSAGE_BYTES = 64 * 1024
MAX_FDS = 64
_LENGTH = struct.Struct("<I")
_GRANT_FIELDS = ("layer_id", "rows", "row_bytes", "data_offset", "file_bytes")


@dataclass(frozen=True)
class TableGrant:
    """One table a client may map: its file descriptor and where its rows are in the file."""

    fd: int
    layer_id: int
    rows: int
    row_bytes: int
    data_offset: int
    file_bytes: int

    def wire(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in _GRANT_FIELDS}


def handle_socket_path(zmq_socket: str | os.PathLike) -> Path:
    return Path(zmq_socket).with_name(HANDLE_SOCKET_NAME)


def send_message(sock: socket.socket, header: dict[str, Any], fds: list[int] | None = None) -> None:
    body = msgpack.packb({"v": PROTOCOL_VERSION, **header}, use_bin_type=True)
    data = _LENGTH.pack(len(body)) + body
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.sendall(data)


def recv_message(sock: socket.socket, max_fds: int = 0,
                 deadline: float | None = None) -> tuple[dict[str, Any], list[int]]:
    """One framed message and the descriptors that came with it (the caller owns them), read
    before `deadline` (time.monotonic()) if given: TimeoutError past it, however slowly the
    peer trickles its bytes."""
    fds: list[int] = []
    try:
        (length,) = _LENGTH.unpack(_recv_exactly(sock, _LENGTH.size, max_fds, fds, deadline))
        if length > MAX_MESSAGE_BYTES:
            raise ProtocolError(f"handle message of {length} bytes exceeds {MAX_MESSAGE_BYTES}")
        body = _recv_exactly(sock, length, max_fds, fds, deadline)
        try:
            header = msgpack.unpackb(body, raw=False)
        except Exception as exc:  # msgpack raises several unrelated types for bad input
            raise ProtocolError(f"handle message is not valid msgpack: {type(exc).__name__}") from None
        if not isinstance(header, dict) or header.get("v") != PROTOCOL_VERSION:
            raise ProtocolError(f"handle message must be a version {PROTOCOL_VERSION} msgpack map")
    except BaseException:
        _close_all(fds)
        raise
    return header, fds


def _recv_exactly(sock: socket.socket, size: int, max_fds: int, fds: list[int],
                  deadline: float | None) -> bytes:
    data = b""
    while len(data) < size:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"handle message not complete in time ({len(data)} of {size} bytes)")
            sock.settimeout(left)
        chunk, got, _, _ = socket.recv_fds(sock, size - len(data), max_fds)
        fds.extend(got)
        if not chunk:
            raise ProtocolError(f"handle socket closed after {len(data)} of {size} bytes")
        data += chunk
    return data


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def fetch_tables(path: str | os.PathLike, client_id: int, token: str,
                 timeout: float = HANDLE_TIMEOUT_S) -> list[TableGrant]:
    """Ask the daemon for the tables of a mapped registration; raises its typed error."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(path))
        send_message(sock, {"op": "tables", "client_id": client_id, "token": token})
        reply, fds = recv_message(sock, MAX_FDS, deadline=time.monotonic() + timeout)
    except TimeoutError:
        raise DaemonUnavailableError(f"no answer on {path} within {timeout:.1f} s") from None
    except OSError as exc:  # no socket, or the daemon went away mid-request
        raise DaemonUnavailableError(f"handle socket {path}: {exc.strerror or exc}") from None
    except ProtocolError as exc:
        raise DaemonUnavailableError(f"handle socket {path}: {exc.message}") from None
    finally:
        sock.close()
    if reply.get("status") != "ok":
        _close_all(fds)
        raise error_for_code(str(reply.get("code")), str(reply.get("message")), reply.get("epoch"))
    tables = reply.get("tables")
    if not isinstance(tables, list) or len(tables) != len(fds):
        _close_all(fds)
        raise ProtocolError(f"handle reply names {len(tables) if isinstance(tables, list) else '?'} "
                            f"tables but carried {len(fds)} descriptors")
    try:
        return [TableGrant(fd, **{k: int(t[k]) for k in _GRANT_FIELDS})
                for fd, t in zip(fds, tables, strict=True)]
    except (KeyError, TypeError, ValueError):
        _close_all(fds)
        raise ProtocolError(f"malformed table descriptions in the handle reply: {tables!r:.200}") from None


def error_reply(error: EngramError, epoch: str) -> dict[str, Any]:
    return {"status": "error", "code": error.code, "message": error.message, "epoch": epoch}

