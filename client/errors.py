"""Typed errors shared by the daemon and its clients.

Every error reply on the wire carries one of the codes below; the client turns it back into the
matching exception class, with the daemon's message, so a caller never has to read the daemon's log
to learn why a call failed. This module holds no transport logic.
"""

from __future__ import annotations


class EngramError(Exception):
    """Base of every engramd error. `code` is the wire error code; `epoch` the daemon's, if known."""

    code = "internal"
    # Set only on an error raised while decoding a request: what could be read of it, so that
    # its error reply can be matched (client/shared/protocol.py). Absent otherwise.
    request_op: str
    request_rid: int
    # True on an error the handle socket answered without handing the request on (it never came
    # whole, or the daemon could not take it yet): nothing was done, so asking again is safe.
    not_taken = False

    def __init__(self, message: str, *, epoch: str | None = None):
        super().__init__(message)
        self.message = message
        self.epoch = epoch

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}"


class ProtocolError(EngramError):
    """A message could not be decoded: bad msgpack, wrong frame count, missing or mistyped field."""

    code = "bad_message"


class VersionError(EngramError):
    """The peer speaks another protocol version."""

    code = "bad_version"


class UnknownOperationError(EngramError):
    code = "unknown_op"


class BadRequestError(EngramError):
    """A well-formed request with a bad value (device, TP rank, slot count, ...)."""

    code = "bad_request"


class CudaUnavailableError(BadRequestError):
    """A CUDA device was asked for where this process cannot use one: no driver on the machine,
    no GPU visible to the process, or a torch built without CUDA. Raised by the client before it
    contacts the daemon, so it never goes over the wire (its code is its parent's)."""


class BadIdsError(EngramError):
    """Hash IDs of the wrong dtype or shape, or more tokens than the client registered."""

    code = "bad_ids"


class NotRegisteredError(EngramError):
    """The client is unknown to this daemon (never registered, released, reaped, or an old epoch)."""

    code = "not_registered"


class SlotBusyError(EngramError):
    """A lookup named a slot that still has a lookup in flight."""

    code = "slot_busy"


class NotReadyError(EngramError):
    """The daemon is alive but not serving yet (tables loading) or is shutting down."""

    code = "not_ready"


class ResourceError(EngramError):
    """The daemon could not allocate what a request needs (memory, slab, client limit)."""

    code = "resource"


class PermissionDeniedError(EngramError):
    """The daemon refused this process by its credentials (config: allowed_uids, allowed_gids)."""

    code = "permission_denied"


class TablesChangedError(EngramError):
    """A client that pinned its tables (pin_tables) met a daemon that serves other ones now (a
    reload, or a restart on another checkpoint): its rows would no longer be the ones it expects."""

    code = "tables_changed"


class InternalError(EngramError):
    code = "internal"


class DaemonUnavailableError(EngramError):
    """No answer from the daemon: not running, died, or did not reply within the timeout."""

    code = "unavailable"


class LookupFailedError(EngramError):
    """Lookups whose rows the daemon did not write, found out after their wait() had returned:
    it died, retired this client, or refused them. Their rows are NaN (or, where even that could
    not be written, stale) and must not be used; `seqs` names them (LookupFuture.seq). Raised
    once, by the client's next lookup(), wait() or result(), and by the failed lookup's own
    wait() and result(). Made by the client, never sent over the wire."""

    code = "lookup_failed"

    def __init__(self, message: str, seqs: tuple[int, ...] = (), *, epoch: str | None = None):
        super().__init__(message, epoch=epoch)
        self.seqs = tuple(seqs)


class CaptureUnsupportedError(BadRequestError):
    """A lookup a CUDA graph could record was asked of a client that cannot make one: only a
    mapped GPU client gathers on the caller's stream with nothing on the host per step. Made by
    the client, never sent over the wire (its code is its parent's)."""


class ReplayFailedError(LookupFailedError):
    """Replays of a captured lookup wrote NaN rows instead of table rows: its tables were
    unmapped (the daemon went away, the client closed), or changed in a way a captured graph
    cannot follow (another geometry, another mode). `replays` counts them (`seqs` is empty: a
    replay has none). Raised by the captured lookup's check(). Made by the client, never sent
    over the wire."""

    def __init__(self, message: str, replays: int, *, epoch: str | None = None):
        super().__init__(message, epoch=epoch)
        self.replays = replays


class ReplyTimeoutError(DaemonUnavailableError):
    """The daemon did not answer within the caller's timeout; it may still be alive and busy."""

    code = "timeout"


class ConfigError(EngramError):
    """A daemon config with a bad field; the message names file, key and value."""

    code = "config"


ERROR_CLASSES: dict[str, type[EngramError]] = {
    cls.code: cls
    for cls in (
        ProtocolError,
        VersionError,
        UnknownOperationError,
        BadRequestError,
        BadIdsError,
        NotRegisteredError,
        SlotBusyError,
        NotReadyError,
        ResourceError,
        PermissionDeniedError,
        TablesChangedError,
        InternalError,
        DaemonUnavailableError,
        ReplyTimeoutError,
        ConfigError,
    )
}


def error_for_code(code: str, message: str, epoch: str | None = None) -> EngramError:
    """The exception a reply with this error code stands for (InternalError for unknown codes)."""
    cls = ERROR_CLASSES.get(code, InternalError)
    return cls(message, epoch=epoch)
