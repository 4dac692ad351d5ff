"""The engramd wire format: the one place that knows how messages look on the socket.

Transport: ZeroMQ, daemon ROUTER / client DEALER, over ``ipc://<runtime dir>/engramd.sock``.
Every message is a multipart message; msgpack is the only encoding (never pickle)::

    client -> daemon   [ header ][ payload ... ]            (ROUTER prepends the peer identity)
    daemon -> client   [ header ][ payload ... ]

    header   msgpack map, at most MAX_HEADER_BYTES (a reply's: MAX_REPLY_HEADER_BYTES)
             request: {"v": PROTOCOL_VERSION, "op": <op>, "rid": <int>, <op fields>}
             reply:   {"v", "op", "rid", "status": "ok"|"error", "code", "message", "epoch",
                       <result fields>}
    payload  raw binary frames, at most MAX_PAYLOAD_FRAMES of at most MAX_PAYLOAD_BYTES each;
             only `lookup` uses one: the hash IDs inline (C-contiguous, little-endian,
             dtype and shape declared in the header).

Operations and their request fields (each request and reply is one declared type of
client/shared/messages.py, decoded and type-checked once by `decode_request` / `decode_reply`):

    register   pid, device ("cpu" or "cuda:GPU-<uuid>"), tp_rank, tp_size, max_tokens, slots,
               optional: name, mode ("auto"|"served"|"mapped", default served), mps (GPU: the
               client's MPS state), pin_tables (rows only from the tables served now), tables
               (a re-registration of a pinned client: the ones it pinned; refused elsewhere)
               -> client_id, token, mode (the one granted), heartbeat_interval, attach_within
                  (seconds), geometry (config.json fields), shard, layout (of the slots), gather
                  (mapped: the daemon's sort policy), mps, tables (the served tables' id). The client then attaches over the
                  handle socket (client/shared/handles.py) with its token: that passes the slab or the
                  tables as descriptors, and the connection becomes the registration's lease.
    lookup     client_id, slot, seq, ids_dtype ("int32"|"int64"), ids_shape [T, L, H],
               inline (IDs in payload frame 0, else already in the slot), ack (optional, default
               true; false: no reply unless the lookup fails, for GPU clients whose completion is
               the slot's counter)  -> slot, seq, and out_of_range where the backend counts per
               lookup (CPU; a GPU counts on the device, see stats)
    release    client_id, counts (optional; mapped clients: the final cumulative counts)  -> {}
    heartbeat  client_id (or None for a plain liveness probe), token (from register; lets a
               second connection of the client vouch for it), counts (mapped clients: cumulative
               lookups, rows, out_of_range; tables, the ones they map)  -> tables (served now)
    stats      -                                          -> clients, lookups, rows, errors, ...
    health     -                                -> live, ready, state, progress, tables, reload
    drain      -   refused (permission_denied): admin operations (drain, reload) go over the
                   handle socket (client/shared/handles.py), where the daemon can tell who asks

Besides replies, the daemon may send every registered client an unsolicited notice (rid 0, op
"notice", status "ok"): `event` "stopping" before it goes away, "tables" (with `tables`, the
new ones' id) once a reload has replaced the tables.

`rid` is chosen by the client and echoed, so replies may arrive out of order (lookups run on
worker threads). `epoch` identifies one daemon run: client ids and slabs belong to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

from engramd.client.errors import (
    EngramError,
    ProtocolError,
    UnknownOperationError,
    VersionError,
    error_for_code,
)
from engramd.client.shared.messages import REPLIES, REQUESTS, Message

PROTOCOL_VERSION = 3  # 2: slab rows at a fixed place per layer; 3: GPU counters in host memory (client/shared/slab.py)
MAX_HEADER_BYTES = 64 * 1024
# A reply is the daemon's, and `stats` carries a summary of every client: about 200 bytes each,
# so 64 KiB held some 300 and max_clients may be 4,096 (as the admins' `clients`, handles.py).
MAX_REPLY_HEADER_BYTES = 4 << 20
MAX_PAYLOAD_FRAMES = 1
MAX_PAYLOAD_BYTES = 64 * 1024 * 1024
SOCKET_NAME = "engramd.sock"
NOTICE_RID = 0  # requests use rids >= 1

OPERATIONS = tuple(REQUESTS)


def _with_origin(error: EngramError, op: str, rid: int) -> EngramError:
    """Attach what was decoded of the failed request, so its error reply can be matched."""
    error.request_op, error.request_rid = op, rid
    return error


@dataclass
class Request:
    op: str
    rid: int
    body: Any  # the operation's declared request (client/shared/messages.py)
    payload: list[bytes] = field(default_factory=list)
    received: float = 0.0  # perf_counter() when the daemon read it


@dataclass
class Reply:
    op: str
    rid: int
    epoch: str
    body: Any  # the operation's declared reply (client/shared/messages.py)
    payload: list[bytes] = field(default_factory=list)


def _pack(header: dict[str, Any]) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def _unpack_header(frame: bytes, limit: int = MAX_HEADER_BYTES) -> dict[str, Any]:
    if len(frame) > limit:
        raise ProtocolError(f"header frame of {len(frame)} bytes exceeds {limit}")
    try:
        header = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(f"header frame is not valid msgpack: {type(exc).__name__}: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header must be a msgpack map, got {type(header).__name__}")
    return header


def _check_payload(frames: list[bytes]) -> None:
    if len(frames) > MAX_PAYLOAD_FRAMES:
        raise ProtocolError(f"{len(frames)} payload frames; at most {MAX_PAYLOAD_FRAMES} allowed")
    for frame in frames:
        if len(frame) > MAX_PAYLOAD_BYTES:
            raise ProtocolError(f"payload frame of {len(frame)} bytes exceeds {MAX_PAYLOAD_BYTES}")


def encode_request(op: str, rid: int, payload: list[bytes] | None = None, **fields: Any) -> list[bytes]:
    return [_pack({"v": PROTOCOL_VERSION, "op": op, "rid": rid, **fields}), *(payload or [])]


def peek_rid(frames: list[bytes]) -> tuple[str, int]:
    """Best-effort (op, rid) of a message that failed to decode, so its error reply can be matched."""
    try:
        header = msgpack.unpackb(frames[0], raw=False)
        op, rid = header.get("op", ""), header.get("rid", 0)
        return (op if isinstance(op, str) else "", rid if isinstance(rid, int) else 0)
    except Exception:
        return "", 0


def decode_request(frames: list[bytes]) -> Request:
    """Decode (once) and type-check a request. Raises a typed EngramError naming what was wrong,
    with `request_op` and `request_rid` set to what could be read of them ("" and 0 if nothing)."""
    if not frames:
        raise _with_origin(ProtocolError("empty message"), "", 0)
    try:
        header = _unpack_header(frames[0])
    except EngramError as exc:  # a header too large to decode is still read for its rid
        raise _with_origin(exc, *peek_rid(frames)) from None
    op, rid = header.get("op"), header.get("rid")
    origin = (op if isinstance(op, str) else "", rid if isinstance(rid, int) else 0)
    try:
        return _typed_request(header, op, rid, frames)
    except EngramError as exc:
        raise _with_origin(exc, *origin) from None


def _typed_request(header: dict[str, Any], op: Any, rid: Any, frames: list[bytes]) -> Request:
    _check_payload(frames[1:])
    version = header.get("v")
    if version != PROTOCOL_VERSION:
        raise VersionError(f"protocol version {version!r} not supported; this daemon speaks {PROTOCOL_VERSION}")
    if not isinstance(rid, int) or isinstance(rid, bool):
        raise ProtocolError(f"field 'rid' must be an int, got {rid!r}")
    if not isinstance(op, str) or op not in REQUESTS:
        raise UnknownOperationError(f"unknown operation {op!r}; known: {', '.join(OPERATIONS)}")
    return Request(op=op, rid=rid, body=REQUESTS[op].decode(header, op), payload=list(frames[1:]))


def encode_reply(rid: int, epoch: str, body: Message, payload: list[bytes] | None = None) -> list[bytes]:
    header = {"v": PROTOCOL_VERSION, "op": body.OP, "rid": rid, "status": "ok", "code": "ok",
              "message": "", "epoch": epoch, **body.encode()}
    return [_pack(header), *(payload or [])]


def encode_error(request_op: str, rid: int, epoch: str, error: EngramError) -> list[bytes]:
    header = {"v": PROTOCOL_VERSION, "op": request_op, "rid": rid, "status": "error",
              "code": error.code, "message": error.message, "epoch": epoch}
    return [_pack(header)]


def encode_notice(epoch: str, event: str, message: str, **fields: Any) -> list[bytes]:
    """A notice (client/shared/messages.py Notice): `event`, and its fields (`tables` for "tables")."""
    return [_pack({"v": PROTOCOL_VERSION, "op": "notice", "rid": NOTICE_RID, "status": "ok",
                   "code": "ok", "message": message, "epoch": epoch, "event": event, **fields})]


def decode_reply(frames: list[bytes]) -> Reply:
    """Decode a reply; an error reply is raised as its typed exception."""
    if not frames:
        raise ProtocolError("empty reply")
    header = _unpack_header(frames[0], MAX_REPLY_HEADER_BYTES)
    if header.get("v") != PROTOCOL_VERSION:
        raise VersionError(f"daemon speaks protocol {header.get('v')!r}, this client {PROTOCOL_VERSION}")
    epoch = str(header.get("epoch", ""))
    if header.get("status") != "ok":
        raise error_for_code(str(header.get("code")), str(header.get("message")), epoch)
    op = header.get("op")
    if not isinstance(op, str) or op not in REPLIES:
        raise ProtocolError(f"reply to unknown operation {op!r}")
    rid = header.get("rid", 0)
    return Reply(op=op, rid=rid if isinstance(rid, int) else 0, epoch=epoch,
                 body=REPLIES[op].decode(header, f"{op} reply"), payload=list(frames[1:]))


def reply_rid(frames: list[bytes]) -> int:
    """The rid of a reply without raising for error replies (used to route replies to futures)."""
    return peek_rid(frames)[1]
