"""The handle socket: file descriptors from the daemon to its clients, and their lease.

Beside the ZeroMQ socket, in the same runtime folder, a plain Unix stream socket carries what
ZeroMQ cannot: open file descriptors (SCM_RIGHTS), and the peer's credentials (SO_PEERCRED). A
client registers over ZeroMQ, then attaches here, proving who it is with the token of its
registration; the daemon checks the peer's credentials, allocates what the registration needs
and passes it as descriptors, so a client never opens a path in a shared folder and needs
neither the host's IPC nor its PID namespace::

    client -> daemon   [u32 length][msgpack map]  {"v", "op": "attach", "client_id", "token"}
                                                  or {"v", "op": "tables", "client_id", "token"}
                                                  or {"v", "op": "hello" | "drain" | "clients"
                                                             | "reload"}
    daemon -> client   [u32 length][msgpack map]  + SCM_RIGHTS
                       attach: {"v", "status": "ok", "epoch",
                               "slab": {kind, layout[, device_uuid]} | None,   served: fd 0
                               "tables": [{layer_id, rows, row_bytes, data_offset, file_bytes}]}
                                                                               mapped: fd i = table i
                       tables: {"v", "status": "ok", "epoch", "version", "tables": [...]}
                                                                               fd i = table i
                       error: {"v", "status": "error", "code", "message", "epoch"}

Each request and reply is a declared type of client/shared/messages.py (AttachRequest, AttachReply, ...).

After an ok reply the connection stays open and nothing more is sent on it: it is the
registration's lease. When the client's process dies, in whatever namespace, the kernel closes
it and the daemon frees the registration at once; when the daemon retires the registration (or
dies), it closes its end and the client sees end-of-file. A token is good for one attach.
A mapped client asks for the tables again after a reload ("tables", with its token): the reply
is the served tables' descriptors, and the connection then closes. Admin operations (drain,
reload, clients) come here too, so that the daemon can tell who asks: its own
user and `admin_uids` may, others get a `permission_denied` error. The
daemon reads each request within HANDLE_TIMEOUT_S of the connection (however slowly a peer
sends it) and answers it, or closes the connection.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from engramd.client.errors import (
    DaemonUnavailableError,
    EngramError,
    ProtocolError,
    UnknownOperationError,
    error_for_code,
)
from engramd.client.shared.messages import (
    HANDLE_REPLIES,
    HANDLE_REQUESTS,
    AttachReply,
    AttachRequest,
    M,
    Message,
    TablesReply,
    TablesRequest,
)
from engramd.client.shared.protocol import PROTOCOL_VERSION

HANDLE_SOCKET_NAME = "engramd.handles"
HANDLE_TIMEOUT_S = 5.0
ATTACH_FIRST_PAUSE_S, ATTACH_LONGEST_PAUSE_S = 0.05, 0.2  # between attaches the daemon did not take
CONNECT_FIRST_PAUSE_S, CONNECT_LONGEST_PAUSE_S = 0.001, 0.05  # between connects to a full queue
MAX_MESSAGE_BYTES = 64 * 1024  # requests, and replies to attach
MAX_ADMIN_REPLY_BYTES = 4 << 20  # `clients` of a full daemon (4,096 places)
MAX_FDS = 64
_LENGTH = struct.Struct("<I")
_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid
_GRANT_FIELDS = ("layer_id", "rows", "row_bytes", "data_offset", "file_bytes")


@dataclass(frozen=True)
class PeerCredentials:
    """Who is at the other end of a Unix socket, as the kernel says (SO_PEERCRED), in this
    process's namespaces: pid 0 when the peer's process is not visible here."""

    pid: int
    uid: int
    gid: int

    @classmethod
    def of(cls, sock: socket.socket) -> PeerCredentials:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size)
        return cls(*_CREDENTIALS.unpack(raw))


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
        """Its description in a reply; the descriptor travels beside it (SCM_RIGHTS)."""
        return {name: getattr(self, name) for name in _GRANT_FIELDS}

    @classmethod
    def from_wire(cls, fd: int, description: dict[str, Any]) -> TableGrant:
        """The grant `description` (a reply's, from wire()) and its descriptor `fd` make;
        KeyError, TypeError or ValueError where the description is malformed."""
        return cls(fd, **{name: int(description[name]) for name in _GRANT_FIELDS})


def handle_socket_path(zmq_socket: str | os.PathLike) -> Path:
    return Path(zmq_socket).with_name(HANDLE_SOCKET_NAME)


def send_message(sock: socket.socket, header: dict[str, Any], fds: list[int] | None = None) -> None:
    body = msgpack.packb({"v": PROTOCOL_VERSION, **header}, use_bin_type=True)
    data = _LENGTH.pack(len(body)) + body
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.sendall(data)


def recv_message(sock: socket.socket, max_fds: int = 0, deadline: float | None = None,
                 max_bytes: int = MAX_MESSAGE_BYTES) -> tuple[dict[str, Any], list[int]]:
    """One framed message and the descriptors that came with it (the caller owns them), read
    before `deadline` (time.monotonic()) if given: TimeoutError past it, however slowly the
    peer trickles its bytes."""
    fds: list[int] = []
    try:
        (length,) = _LENGTH.unpack(_recv_exactly(sock, _LENGTH.size, max_fds, fds, deadline))
        if length > max_bytes:
            raise ProtocolError(f"handle message of {length} bytes exceeds {max_bytes}")
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


@dataclass
class Attachment:
    """What an attach brought: the lease (an open socket), and a slab or the tables."""

    lease: socket.socket
    epoch: str
    slab: dict[str, Any] | None  # served: how the slab descriptor is to be mapped
    slab_fd: int | None
    tables: list[TableGrant]
    version: str | None = None  # mapped: the granted tables' id
    tables_seq: int = 0  # and their seq (client/shared/messages.py)
    counters_fd: int | None = None  # a GPU slab's counter block (client/shared/host_counters.py)
    warm_fd: int | None = None  # mapped: the hot-row cache's warm-up trace (.npy)

    def close_descriptors(self) -> None:
        """Close the descriptors not taken over by their users (the lease stays)."""
        _close_all([fd for fd in (self.slab_fd, self.counters_fd, self.warm_fd) if fd is not None])
        _close_all([t.fd for t in self.tables])
        self.slab_fd, self.counters_fd, self.warm_fd, self.tables = None, None, None, []


def attach(path: str | os.PathLike, client_id: int, token: str,
           timeout: float = HANDLE_TIMEOUT_S) -> Attachment:
    """Attach a registration (its lease begins); raises the daemon's typed error. An error the
    handle socket answered without handing the request on (`not_taken`: a connection it closed
    before the request came whole, as when this process stalled between its connect and its
    send, or a request the daemon could not take yet) is asked again, with backoff, until
    `timeout` has passed; any other error, a stopping daemon's included, is raised at once."""
    deadline, pauses = time.monotonic() + timeout, _pauses(ATTACH_FIRST_PAUSE_S, ATTACH_LONGEST_PAUSE_S)
    while True:
        try:
            return _attach_once(path, client_id, token, max(0.1, deadline - time.monotonic()))
        except EngramError as exc:
            pause = next(pauses)
            if not exc.not_taken or time.monotonic() + pause >= deadline:
                raise
            time.sleep(pause)


def _attach_once(path: str | os.PathLike, client_id: int, token: str, timeout: float) -> Attachment:
    sock, reply, fds = _ask_for_descriptors(path, AttachRequest(client_id, token), timeout)
    try:
        return _attachment(sock, reply, fds)
    except BaseException:
        sock.close()
        _close_all(fds)
        raise


def fetch_tables(path: str | os.PathLike, client_id: int, token: str,
                 timeout: float = HANDLE_TIMEOUT_S) -> tuple[str, int, list[TableGrant]]:
    """A mapped client after a reload: (the tables' id, their seq, a grant of each table served
    now; the caller closes their descriptors). Raises the daemon's typed error."""
    sock, header, fds = _ask_for_descriptors(path, TablesRequest(client_id, token), timeout)
    sock.close()
    try:
        _, reply = read_reply(header, TablesReply)
        return reply.version, reply.tables_seq, _grants(reply.tables, fds, "tables")
    except BaseException:
        _close_all(fds)
        raise


def _ask_for_descriptors(path: str | os.PathLike, request: Message,
                         timeout: float) -> tuple[socket.socket, dict[str, Any], list[int]]:
    """Send `request`; (the connection, the reply's header, the descriptors it carried)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    deadline = time.monotonic() + timeout  # the whole request's: connect, send and answer
    try:
        connect(sock, path, deadline)
        _send_request(sock, request)
        header, fds = recv_message(sock, MAX_FDS, deadline=deadline)
    except BaseException as exc:
        sock.close()
        if isinstance(exc, TimeoutError):
            raise DaemonUnavailableError(f"no answer on {path} within {timeout:.1f} s") from None
        if isinstance(exc, OSError):  # no socket, or the daemon went away mid-request
            raise DaemonUnavailableError(f"handle socket {path}: {exc.strerror or exc}") from None
        if isinstance(exc, ProtocolError):
            raise DaemonUnavailableError(f"handle socket {path}: {exc.message}") from None
        raise
    return sock, header, fds


def connect(sock: socket.socket, path: str | os.PathLike, deadline: float) -> None:
    """Connect `sock` to the handle socket at `path` (leaving it with the time to `deadline` as
    its timeout), waiting, until `deadline`, while its queue of connections not yet accepted is
    full: a Unix socket refuses a connect then at once (EAGAIN), and a burst of clients, or a
    peer that floods the socket with connections, must delay a client, not fail it.
    DaemonUnavailableError once the deadline has passed."""
    for pause in _pauses(CONNECT_FIRST_PAUSE_S, CONNECT_LONGEST_PAUSE_S):
        left = deadline - time.monotonic()
        sock.settimeout(max(left, 1e-3))  # a blocking connect would wait for room without end
        try:
            sock.connect(str(path))
            return
        except BlockingIOError:
            if left <= 0:
                raise DaemonUnavailableError(
                    f"handle socket {path}: its queue of connections stayed full until this "
                    "connection's deadline (a burst or a flood of connections)") from None
            time.sleep(min(pause, left))  # then once more, at the deadline at the latest


def _pauses(first: float, longest: float) -> Iterator[float]:
    """Backoff between tries: `first`, doubling up to `longest`, without end (the caller's
    deadline ends it)."""
    pause = first
    while True:
        yield pause
        pause = min(2 * pause, longest)


def _grants(tables: list[Any], fds: list[int], what: str) -> list[TableGrant]:
    """The table grants of a reply: descriptor i with description i."""
    if len(fds) != len(tables):
        raise ProtocolError(f"{what} reply describes {len(tables)} tables but carried {len(fds)} descriptors")
    try:
        return [TableGrant.from_wire(fd, t) for fd, t in zip(fds, tables, strict=True)]
    except (KeyError, TypeError, ValueError):
        raise ProtocolError(f"malformed table descriptions in the {what} reply: {tables!r:.200}") from None


def _attachment(sock: socket.socket, header: dict[str, Any], fds: list[int]) -> Attachment:
    epoch, reply = read_reply(header, AttachReply)
    slab, tables = reply.slab, reply.tables
    slab_fds = _slab_descriptors(slab)
    warm = reply.warm
    wanted = slab_fds + len(tables) + warm
    if len(fds) != wanted:
        raise ProtocolError(f"attach reply describes {wanted} descriptors but carried {len(fds)}")
    slab_fd = fds[0] if slab_fds else None
    counters_fd = fds[1] if slab_fds == 2 else None
    grants = _grants(tables, fds[slab_fds:slab_fds + len(tables)], "attach")
    sock.settimeout(None)
    return Attachment(sock, epoch, slab, slab_fd, grants, version=reply.version,
                      tables_seq=reply.tables_seq, counters_fd=counters_fd,
                      warm_fd=fds[-1] if warm else None)


def _slab_descriptors(slab: dict[str, Any] | None) -> int:
    """How many descriptors a slab comes with: its memory, and a GPU slab's counter block."""
    if slab is None:
        return 0
    count = slab.get("fds", 1)
    if type(count) is not int or count not in (1, 2):
        raise ProtocolError(f"attach reply: a slab of {count!r} descriptors (1 or 2)")
    return count


def _send_request(sock: socket.socket, request: Message) -> None:
    """Send a request; a daemon that refuses this peer answers before reading it and closes, so
    the send may find the connection shut (EPIPE): its answer is still there to be read."""
    try:
        send_message(sock, {"op": request.OP, **request.encode()})
    except (BrokenPipeError, ConnectionResetError):
        pass


def decode_request(header: dict[str, Any]) -> Message:
    """The daemon's side: a request header as its declared type; a typed error naming what is
    wrong (an unknown operation, a missing or mistyped field)."""
    op = header.get("op")
    if not isinstance(op, str) or op not in HANDLE_REQUESTS:
        raise UnknownOperationError(f"handle socket: unknown operation {op!r}; known: "
                                    f"{', '.join(HANDLE_REQUESTS)}")
    return HANDLE_REQUESTS[op].decode(header, f"handle socket: {op}")


def ok_reply(epoch: str, reply: Message) -> dict[str, Any]:
    return {"status": "ok", "epoch": epoch, **reply.encode()}


def read_reply(header: dict[str, Any], expected: type[M]) -> tuple[str, M]:
    """The client's side: (epoch, the reply as its declared type), or the daemon's typed error."""
    epoch = header.get("epoch")
    if header.get("status") != "ok":
        error = error_for_code(str(header.get("code")), str(header.get("message")),
                               epoch if isinstance(epoch, str) else None)
        error.not_taken = header.get("not_taken") is True
        raise error
    return str(epoch), expected.decode(header, f"handle socket: {expected.OP} reply")


def check_access(path: str | os.PathLike, timeout: float = HANDLE_TIMEOUT_S) -> None:
    """Whether the daemon admits this process (by its kernel credentials): returns if it does,
    raises PermissionDeniedError if not. With allowed ids configured, the ZeroMQ socket drops a
    refused peer's connection without a word, so this is how such a peer learns why."""
    try:
        admin_request(path, "hello", timeout)
    except UnknownOperationError:
        pass  # a daemon older than the access check: it admitted us, or attach will say not


def admin_request(path: str | os.PathLike, op: str, timeout: float = HANDLE_TIMEOUT_S) -> Message:
    """An admin operation ("drain", "clients"; "hello" asks only whether this process is
    admitted): the daemon decides by this process's kernel credentials. Returns the declared
    reply; raises the daemon's typed error."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    deadline = time.monotonic() + timeout  # the whole request's: connect, send and answer
    try:
        connect(sock, path, deadline)
        _send_request(sock, HANDLE_REQUESTS[op]())
        header, _ = recv_message(sock, 0, deadline=deadline, max_bytes=MAX_ADMIN_REPLY_BYTES)
    except TimeoutError:
        raise DaemonUnavailableError(f"no answer on {path} within {timeout:.1f} s") from None
    except OSError as exc:
        raise DaemonUnavailableError(f"handle socket {path}: {exc.strerror or exc}") from None
    except ProtocolError as exc:
        raise DaemonUnavailableError(f"handle socket {path}: {exc.message}") from None
    finally:
        sock.close()
    return read_reply(header, HANDLE_REPLIES[op])[1]


def lease_closed(lease: socket.socket) -> bool:
    """Without waiting: has the daemon closed its end of the lease (retired us, or died)?"""
    try:
        return lease.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def error_reply(error: EngramError, epoch: str) -> dict[str, Any]:
    reply: dict[str, Any] = {"status": "error", "code": error.code, "message": error.message,
                             "epoch": epoch}
    if error.not_taken:
        reply["not_taken"] = True
    return reply

