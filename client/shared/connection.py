"""A request/reply channel to the daemon: one DEALER socket, replies routed to callers by rid.

Shared by the client library and the CLI. Every wait is bounded: a caller either gets its reply,
or a DaemonUnavailableError that says what it waited for and for how long. While waiting, a
registered client's lease is watched (client/shared/handles.py), so a daemon killed mid-request is
noticed within about POLL_S, not at the timeout.
"""

from __future__ import annotations

import itertools
import os
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import zmq

from engramd.client.errors import (
    DaemonUnavailableError,
    EngramError,
    PermissionDeniedError,
    ReplyTimeoutError,
)
from engramd.client.shared import protocol
from engramd.client.shared.handles import HANDLE_SOCKET_NAME, check_access, handle_socket_path

POLL_S = 0.1
LOCKED_POLL_MS = 5  # the longest one thread holds the connection while it waits for replies
_POLLIN = int(zmq.POLLIN)  # a plain int: `&` with pyzmq's enum costs a lookup a microsecond
# How long a wait whose daemon is gone still looks for its reply: a stopping daemon flushes its
# replies before it closes its leases, but ours may still be crossing this process's ZeroMQ I/O
# thread when the lease's end is seen.
GONE_GRACE_S = 0.5


SOCKET_ENV = "ENGRAMD_SOCKET"


def default_socket_path() -> str:
    """$ENGRAMD_SOCKET if set; else /run/engramd for root (systemd's RuntimeDirectory), else a
    per-user folder in the temp dir."""
    if os.environ.get(SOCKET_ENV):
        return os.environ[SOCKET_ENV]
    if os.geteuid() == 0:
        return "/run/engramd/engramd.sock"
    return str(Path(tempfile.gettempdir()) / f"engramd-{os.geteuid()}" / "engramd.sock")


def check_own_default_folder(socket_path: str | os.PathLike) -> None:
    """A non-root user's default folder (<tmp>/engramd-<uid>) may be made by anyone first, and
    a daemon of whoever made it would answer this user's health checks and serve its engines
    rows of its own. The daemon refuses such a folder; a client does too: DaemonUnavailableError
    naming its owner, unless it is a folder of this user's. Other paths are the operator's
    choice ($ENGRAMD_SOCKET, an explicit path), as is root's /run/engramd."""
    uid = os.geteuid()
    folder = Path(socket_path).parent
    if uid == 0 or folder != Path(tempfile.gettempdir()) / f"engramd-{uid}":
        return
    try:
        info = os.lstat(folder)
    except FileNotFoundError:
        return  # no daemon there: connecting says so
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid:
        what = "folder" if stat.S_ISDIR(info.st_mode) else "non-folder"
        raise DaemonUnavailableError(f"{folder} is a {what} of uid {info.st_uid}, not of this user "
                                     f"(uid {uid}): a daemon there is not yours; remove it, or "
                                     f"name your daemon's socket (${SOCKET_ENV})")


class Connection:
    def __init__(self, socket_path: str | os.PathLike, context: zmq.Context | None = None):
        check_own_default_folder(socket_path)
        self.socket_path = Path(socket_path)
        self._own_ctx = context is None
        self._ctx = context or zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(f"ipc://{self.socket_path}")
        # A ZeroMQ socket is not thread-safe: one thread at a time sends or reads on it (a
        # client's callers and its own threads share the connection).
        self._lock = threading.RLock()
        self._closed = False  # another thread may still wait on it: it is told, not zmq's error
        self._waited: set[int] = set()  # rids a caller waits for: take_stale_errors leaves them
        self._rids = itertools.count(1)
        self._replies: dict[int, list[bytes]] = {}
        self._gone: Callable[[], str | None] | None = None
        self.epoch: str | None = None
        self.notice: str | None = None  # last unsolicited event from the daemon ("stopping")
        self.tables_notice: tuple[str, int] | None = None  # (tables, seq) the last "tables" notice named

    def watch_daemon(self, gone: Callable[[], str | None]) -> None:
        """While waiting, ask `gone()`: why the daemon can no longer answer, or None."""
        self._gone = gone

    def send(self, op: str, payload: list[Any] | None = None, **fields: Any) -> int:
        """Send a request; returns its rid. Payload frames are sent without copying."""
        rid = next(self._rids)
        frames = protocol.encode_request(op, rid, payload, **fields)
        with self._lock:
            self._check_open()
            if len(frames) == 1:
                self._sock.send(frames[0])  # a small header alone: one call, no multipart bookkeeping
            else:
                self._sock.send_multipart(frames, copy=False)
        return rid

    def wait(self, rid: int, timeout: float | None, what: str) -> protocol.Reply:
        """The reply to `rid`; raises its typed error, or DaemonUnavailableError."""
        frames = self._wait_frames(rid, timeout, what)
        reply = protocol.decode_reply(frames)
        self.epoch = reply.epoch
        return reply

    def call(self, op: str, timeout: float | None, payload: list[Any] | None = None,
             **fields: Any) -> protocol.Reply:
        return self.wait(self.send(op, payload, **fields), timeout, op)

    def poll_reply(self, rid: int) -> bool:
        """Collect whatever replies have arrived; True when the one for `rid` is among them."""
        self._collect(0)
        return rid in self._replies

    def collect(self) -> None:
        """Take in the replies that have arrived, without waiting."""
        self._collect(0)

    def take_replies(self) -> list[protocol.Reply]:
        """Whatever replies arrived, decoded, in no order; error replies left out (a heartbeat
        connection does not wait for its answers, it only reads what they say)."""
        with self._lock:
            self._collect(0)
            frames, self._replies = list(self._replies.values()), {}
        replies = []
        for reply in frames:
            try:
                replies.append(protocol.decode_reply(reply))
            except EngramError:
                pass
        return replies

    def has_reply(self, rid: int) -> bool:
        return rid in self._replies

    def has_replies(self) -> bool:
        return bool(self._replies)

    def take_stale_errors(self) -> list[tuple[int, EngramError]]:
        """Remove the replies nobody waits for any more (all of them), returning their errors."""
        with self._lock:
            stale = {rid: self._replies.pop(rid) for rid in list(self._replies) if rid not in self._waited}
        errors = []
        for rid, frames in stale.items():
            try:
                protocol.decode_reply(frames)
            except EngramError as exc:
                errors.append((rid, exc))
        return errors

    def _wait_frames(self, rid: int, timeout: float | None, what: str) -> list[bytes]:
        with self._lock:
            self._waited.add(rid)
        try:
            self._wait_for(rid, timeout, what)
            with self._lock:
                return self._replies.pop(rid)
        finally:
            with self._lock:
                self._waited.discard(rid)

    def _wait_for(self, rid: int, timeout: float | None, what: str) -> None:
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        self._collect(0)
        while rid not in self._replies:  # replies already queued win over a daemon that has exited
            if deadline is not None and time.monotonic() >= deadline:
                raise ReplyTimeoutError(
                    f"no reply to {what} from {self.socket_path} within {timeout:.1f} s "
                    "(is the daemon running? raise the client's timeout if it is busy)")
            gone = self._gone() if self._gone is not None else None
            if gone is not None:
                self._collect_for(rid, GONE_GRACE_S)
                if rid in self._replies:
                    break
                raise DaemonUnavailableError(f"{gone} while waiting for {what}", epoch=self.epoch)
            left = POLL_S if deadline is None else max(0.0, min(POLL_S, deadline - time.monotonic()))
            self._collect(int(left * 1000))

    def _collect_for(self, rid: int, seconds: float) -> None:
        """Collect replies until the one for `rid` is in, or `seconds` have passed."""
        deadline = time.monotonic() + seconds
        self._collect(0)
        while rid not in self._replies and (left := deadline - time.monotonic()) > 0:
            self._collect(max(1, int(min(left, POLL_S) * 1000)))

    def _collect(self, timeout_ms: int) -> None:
        """Take in what has arrived, waiting up to `timeout_ms` for something: in slices of
        LOCKED_POLL_MS, so that another thread's send or read waits no longer than one."""
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            with self._lock:
                self._check_open()
                left_ms = int((deadline - time.monotonic()) * 1000)
                if self._collect_locked(min(left_ms, LOCKED_POLL_MS)) or left_ms <= LOCKED_POLL_MS:
                    return

    def _check_open(self) -> None:
        if self._closed:
            raise DaemonUnavailableError(f"the connection to {self.socket_path} was closed (the "
                                         "client closed, or registered again)", epoch=self.epoch)

    def _collect_locked(self, timeout_ms: int) -> bool:
        """Whether anything arrived (a reply or a notice)."""
        # Without waiting, ask the socket's event flags: Socket.poll builds a Poller per call.
        if timeout_ms <= 0:
            if not cast(int, self._sock.getsockopt(zmq.EVENTS)) & _POLLIN:
                return False
        elif not self._sock.poll(timeout_ms, zmq.POLLIN):
            return False
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return True
            rid = protocol.reply_rid(frames)
            if rid == protocol.NOTICE_RID:
                notice = protocol.decode_reply(frames).body
                if notice.event == "tables":  # news, not a state of the daemon
                    self.tables_notice = (notice.tables, notice.tables_seq)
                else:
                    self.notice = notice.event
            else:
                self._replies[rid] = frames

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._sock.close(0)
        if self._own_ctx:
            self._ctx.term()


def check_daemon_socket(socket_path: Path) -> None:
    """DaemonUnavailableError, at once, unless something is at `socket_path` that may be the
    daemon's request socket: not the handle socket beside it (whose peer waits 30 s for a
    request it never reads), not a folder."""
    if socket_path.name == HANDLE_SOCKET_NAME:
        raise DaemonUnavailableError(
            f"{socket_path} is the daemon's handle socket: name its request socket, the socket "
            "the daemon was started with (beside it; engramd.sock by default)")
    if socket_path.is_dir():
        raise DaemonUnavailableError(f"{socket_path} is a folder, not the daemon's socket: name "
                                     "the socket in it (engramd.sock by default)")
    try:  # one look: a daemon binding or closing may make or remove the socket meanwhile
        mode = socket_path.stat().st_mode
    except FileNotFoundError:
        raise DaemonUnavailableError(f"no daemon socket at {socket_path}") from None
    if not stat.S_ISSOCK(mode):
        raise DaemonUnavailableError(f"{socket_path} is no socket: name the daemon's request socket "
                                     "(engramd.sock by default)")


def check_listening(socket_path: Path) -> None:
    """DaemonUnavailableError, at once, where nothing listens at `socket_path` (a socket its
    killed daemon left): the one-shot requests would wait out their whole timeout for a reply
    that cannot come, as long as a probe's deadline. A connection that is accepted is closed
    unused: the daemon drops one that never speaks."""
    probe_socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe_socket.settimeout(1.0)  # a daemon whose backlog is full still answers below
        probe_socket.connect(str(socket_path))
    except ConnectionRefusedError:
        raise DaemonUnavailableError(f"nothing listens at {socket_path}: the daemon that made it "
                                     "is gone (is the daemon running?)") from None
    except PermissionError as exc:  # ZeroMQ would retry its connect unseen until the timeout
        raise PermissionDeniedError(f"{socket_path}: {exc.strerror}: this user may not connect "
                                    "to the daemon (run as its user or a member of the socket's "
                                    "group)") from None
    except OSError:
        pass  # whatever else: the request's own timeout says what there is to say
    finally:
        probe_socket.close()


def probe(socket_path: str | os.PathLike, op: str, timeout: float) -> protocol.Reply:
    """One-shot request without registration (health, stats). Waits `timeout` for the answer;
    without one, up to 2 s more to ask the handle socket whether this process is refused (a
    daemon that admits only some users drops the others unanswered), then raises the timeout."""
    check_daemon_socket(Path(socket_path))
    check_listening(Path(socket_path))
    conn = Connection(socket_path)
    try:
        return conn.call(op, timeout)
    except ReplyTimeoutError:
        try:  # a daemon that admits only some users drops the others' connections unanswered
            check_access(handle_socket_path(socket_path), min(timeout, 2.0))
        except PermissionDeniedError:
            raise
        except EngramError:
            pass  # no clearer answer there: the timeout stands
        raise
    finally:
        conn.close()
