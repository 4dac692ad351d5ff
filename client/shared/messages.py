"""The messages engramd's sockets carry, one declared type each: the ZeroMQ socket's
(protocol.py frames them) and the handle socket's (handles.py).

A request is decoded once, by the daemon, into its operation's type; a reply once, by the client,
into its type. Decoding checks every declared field's type and fills the defaults, so a bad peer
fails with a ProtocolError naming the field, never with a KeyError or a wrong value deep inside.
Fields a message does not declare are ignored (a newer peer may send more).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from functools import cache
from typing import Any, ClassVar, TypeVar, Union

from engramd.client.errors import ProtocolError

M = TypeVar("M", bound="Message")


class Message:
    """Base of every declared message: `OP` names its operation."""

    OP: ClassVar[str]

    @classmethod
    def decode(cls: type[M], fields: dict[str, Any], what: str) -> M:
        """The message from a decoded header's fields; ProtocolError naming a missing or
        mistyped field (`what`: "register", "lookup reply", ...)."""
        values = {}
        for name, allowed, required, _ in _spec(cls):
            if name not in fields:
                if required:
                    raise ProtocolError(f"{what}: missing field {name!r}")
                continue
            value = fields[name]
            if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
                raise ProtocolError(f"{what}: field {name!r} has wrong type {type(value).__name__}")
            values[name] = value
        return cls(**values)

    def encode(self) -> dict[str, Any]:
        """The fields as they go into a header. An optional field left at None is left out, as
        a peer that does not know it expects (e.g. a GPU lookup's out_of_range)."""
        return {name: value for name, _, _, optional in _spec(type(self))
                if (value := getattr(self, name)) is not None or not optional}


@cache
def _spec(cls: type) -> tuple[tuple[str, tuple[type, ...], bool, bool], ...]:
    """(name, accepted runtime types, required, optional: its default is None) of each field."""
    hints = typing.get_type_hints(cls)
    return tuple((f.name, _runtime_types(hints[f.name]),
                  f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
                  f.default is None)
                 for f in dataclasses.fields(cls))


def _fieldless(name: str, op: str, doc: str) -> type[Message]:
    """A message with no fields: its operation is all it says."""
    cls = dataclasses.make_dataclass(name, [], bases=(Message,), slots=True,
                                     namespace={"OP": op, "__doc__": doc})
    cls.__module__ = __name__
    return cls


def _runtime_types(hint: Any) -> tuple[type, ...]:
    """What msgpack may hand over for a declared type: a float field takes an int too."""
    if typing.get_origin(hint) in (Union, types.UnionType):
        return tuple(t for arg in typing.get_args(hint) for t in _runtime_types(arg))
    if hint is type(None):
        return (type(None),)
    if hint is Any:
        return (object,)
    base = typing.get_origin(hint) or hint
    return (int, float) if base is float else (base,)


# -- requests (client -> daemon) --------------------------------------------------------------------


@dataclass(slots=True)
class RegisterRequest(Message):
    OP = "register"
    pid: int
    device: str  # "cpu" or "cuda:GPU-<uuid>"
    tp_rank: int
    tp_size: int
    max_tokens: int
    slots: int
    name: str = ""
    mode: str | None = None  # "auto" | "served" | "mapped"; absent: served (older clients)
    mps: dict | None = None  # a GPU client's MPS state (client/shared/mps.py)
    # Rows only from the tables served now (the reply names them), never from others after a
    # reload; a re-registration names the ones it pinned in `tables`, and is refused elsewhere.
    pin_tables: bool = False
    tables: str | None = None
    # Mapped GPU clients that keep a hot-row cache: pass the warm-up trace's descriptor at attach
    # (asked for, so that a client predating it is not sent a descriptor it does not count).
    warm_file: bool = False


@dataclass(slots=True)
class LookupRequest(Message):
    OP = "lookup"
    client_id: int
    slot: int
    seq: int
    ids_dtype: str  # "int32" | "int64"
    ids_shape: list  # [T, n_layers, heads]
    inline: bool  # the IDs are payload frame 0 (else already in the slot)
    ack: bool = True  # False: no reply unless the lookup fails (the slot's counter completes it)
    tokens: int | None = None  # ids_shape[0]; checked against it if sent


@dataclass(slots=True)
class ReleaseRequest(Message):
    OP = "release"  # lookups of the client still queued on a CPU daemon are dropped, unanswered
    client_id: int
    counts: dict | None = None  # a mapped client's final cumulative counts


@dataclass(slots=True)
class HeartbeatRequest(Message):
    OP = "heartbeat"
    client_id: int | None = None  # None: a plain liveness probe
    token: str = ""  # from register: lets a second connection of the client vouch for it
    counts: dict | None = None  # a mapped client's cumulative lookups, rows, out_of_range
    tables: str | None = None  # a mapped client: the tables it maps now


StatsRequest = _fieldless("StatsRequest", "stats", "Counts anyone who may connect may see.")
HealthRequest = _fieldless("HealthRequest", "health", "Live, ready, and how far the tables are.")
DrainRequest = _fieldless("DrainRequest", "drain", "Admin, over the handle socket (refused over "
                          "ZeroMQ, which cannot say who asks): finish in-flight lookups and exit.")

REQUESTS: dict[str, type[Message]] = {m.OP: m for m in (
    RegisterRequest, LookupRequest, ReleaseRequest, HeartbeatRequest, StatsRequest, HealthRequest,
    DrainRequest)}


# -- replies (daemon -> client) ---------------------------------------------------------------------

# `tables_seq` beside a tables id counts the reloads that had switched tables in this daemon
# (0 at its start): news of the tables is new only if its seq is higher than the client's, so a
# late reply never moves a client back, and a reload back to earlier tables (A, B, A) still does.


@dataclass(slots=True)
class RegisterReply(Message):
    OP = "register"
    client_id: int
    token: str
    mode: str  # the one granted
    layout: dict  # of the slots (client/shared/slab.py SlabLayout.to_wire)
    gather: dict  # mapped clients: the daemon's sort policy
    heartbeat_interval: float
    attach_within: float  # seconds to attach over the handle socket
    geometry: dict  # config.json fields
    shard: dict
    mps: dict | None
    tables: str | None = None  # the served tables' identity (the checkpoint's fingerprint)
    tables_seq: int = 0  # see above


@dataclass(slots=True)
class LookupReply(Message):
    OP = "lookup"
    slot: int
    seq: int
    out_of_range: int | None = None  # where the backend counts per lookup (a GPU counts on the device)


ReleaseReply = _fieldless("ReleaseReply", "release", "The registration is released.")


@dataclass(slots=True)
class HeartbeatReply(Message):
    """The daemon is here and knows the client; `tables` are the ones it serves now."""

    OP = "heartbeat"
    tables: str | None = None
    tables_seq: int = 0


@dataclass(slots=True)
class StatsReply(Message):
    """Counts anyone who may connect may see (the service's stats)."""

    OP = "stats"
    state: str
    uptime: float
    hot_cache: dict = field(default_factory=dict)  # per GPU UUID
    mps: dict = field(default_factory=dict)  # per GPU UUID
    clients: list = field(default_factory=list)  # summaries by client id (no pid, name or uid)
    slabs: int = 0
    slab_bytes: int = 0
    lookups: int = 0
    rows: int = 0
    out_of_range: int = 0
    registrations: int = 0
    reaped: int = 0
    errors: dict = field(default_factory=dict)  # code -> count
    dispatch_us: dict = field(default_factory=dict)  # request received -> work enqueued, percentiles
    tables: str | None = None  # the served tables' identity
    reload: dict = field(default_factory=dict)  # the last reload's state (server/reload.py)
    # Unregisters a GPU backend holds until the daemon has nothing queued (server/quiet_gate.py).
    deferred: list = field(default_factory=list)


@dataclass(slots=True)
class HealthReply(Message):
    OP = "health"
    live: bool
    ready: bool
    state: str
    progress: float
    pid: int
    uptime: float
    backend: str | None
    mps: dict
    tables: str | None = None  # the served tables' identity
    reload: dict = field(default_factory=dict)  # the last reload's state (server/reload.py)


@dataclass(slots=True)
class Notice(Message):
    """Unsolicited, to every registered client (rid 0): "stopping" before the daemon goes,
    "tables" when a reload has replaced the tables (`tables` names the new ones)."""

    OP = "notice"
    event: str
    tables: str | None = None
    tables_seq: int = 0


REPLIES: dict[str, type[Message]] = {m.OP: m for m in (
    RegisterReply, LookupReply, ReleaseReply, HeartbeatReply, StatsReply, HealthReply, Notice)}


# -- the handle socket (client/shared/handles.py): attach, and the admin operations -----------------------


@dataclass(slots=True)
class AttachRequest(Message):
    OP = "attach"
    client_id: int
    token: str  # from the register reply: good for one attach


@dataclass(slots=True)
class AttachReply(Message):
    """Served: `slab` says how to map descriptor 0 (and descriptor 1, a GPU slab's counter
    block, when slab["fds"] is 2). Mapped: descriptor i is table i, and when `warm` is true
    one more follows the tables: the daemon's hot-row cache warm-up trace (a .npy), for the
    client's own cache (only to a client whose registration asked for it: `warm_file`)."""

    OP = "attach"
    slab: dict | None = None
    tables: list = field(default_factory=list)  # {layer_id, rows, row_bytes, data_offset, file_bytes}
    version: str | None = None  # mapped: the granted tables' id (a reload may come between)
    tables_seq: int = 0
    warm: bool = False


@dataclass(slots=True)
class DrainReply(Message):
    OP = "drain"
    in_flight: int  # lookups the daemon finishes before it exits


@dataclass(slots=True)
class ClientsReply(Message):
    OP = "clients"
    clients: list  # {client_id, pid (in the daemon's namespace), name, uid} of each live client


@dataclass(slots=True)
class TablesRequest(Message):
    """A mapped client, after a reload: the descriptors of the tables served now."""

    OP = "tables"
    client_id: int
    token: str  # of its registration (which must be attached, by the same user)


@dataclass(slots=True)
class TablesReply(Message):
    """Descriptor i is table i, as in AttachReply; `version` is the tables' identity."""

    OP = "tables"
    version: str
    tables: list  # {layer_id, rows, row_bytes, data_offset, file_bytes}
    tables_seq: int = 0


@dataclass(slots=True)
class ReloadReply(Message):
    OP = "reload"
    state: str  # "loading" (started now or earlier): follow it with `engramd health --json`
    tables: str | None  # the tables served now


HelloRequest = _fieldless("HelloRequest", "hello", "An access check: being admitted is the answer.")
ClientsRequest = _fieldless("ClientsRequest", "clients", "Admin: who each client is.")
ReloadRequest = _fieldless("ReloadRequest", "reload", "Admin: load the configured checkpoint's "
                           "tables beside the served ones, then serve them instead.")
HelloReply = _fieldless("HelloReply", "hello", "This peer is admitted.")

HANDLE_REQUESTS: dict[str, type[Message]] = {m.OP: m for m in (
    AttachRequest, HelloRequest, DrainRequest, ClientsRequest, ReloadRequest, TablesRequest)}
HANDLE_REPLIES: dict[str, type[Message]] = {m.OP: m for m in (
    AttachReply, HelloReply, DrainReply, ClientsReply, ReloadReply, TablesReply)}
