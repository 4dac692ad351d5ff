"""Wire-format round trips and rejection of malformed messages (no daemon needed)."""

from __future__ import annotations

import msgpack
import pytest

from engramd.client.errors import (
    BadIdsError,
    InternalError,
    NotReadyError,
    ProtocolError,
    UnknownOperationError,
    VersionError,
)
from engramd.client.shared import protocol
from engramd.client.shared.messages import REPLIES, REQUESTS, LookupReply, LookupRequest, StatsReply

LOOKUP_FIELDS = dict(client_id=3, slot=1, seq=9, tokens=2, ids_dtype="int32",
                     ids_shape=[2, 2, 24], inline=True)


def test_request_round_trip_keeps_fields_and_payload():
    payload = [b"\x01\x02" * 96]
    frames = protocol.encode_request("lookup", 41, payload, **LOOKUP_FIELDS)
    request = protocol.decode_request(frames)
    assert (request.op, request.rid) == ("lookup", 41)
    assert request.body == LookupRequest(**LOOKUP_FIELDS)
    assert request.payload == payload


def test_reply_round_trip_and_error_reply_raises_typed_error():
    sent = StatsReply(state="ready", uptime=1.5, lookups=12, errors={"bad_ids": 2})
    ok = protocol.decode_reply(protocol.encode_reply(5, "ep1", sent))
    assert (ok.op, ok.rid, ok.epoch, ok.body) == ("stats", 5, "ep1", sent)
    frames = protocol.encode_error("lookup", 6, "ep1", BadIdsError("ids shape [1] wrong"))
    assert protocol.reply_rid(frames) == 6
    with pytest.raises(BadIdsError, match=r"ids shape \[1\] wrong") as info:
        protocol.decode_reply(frames)
    assert info.value.epoch == "ep1"


def test_unknown_error_code_maps_to_internal():
    frames = [msgpack.packb({"v": protocol.PROTOCOL_VERSION, "op": "x", "rid": 1, "status": "error", "code": "weird",
                             "message": "m", "epoch": "e"})]
    with pytest.raises(InternalError, match="m") as info:
        protocol.decode_reply(frames)
    assert info.value.code == "internal" and type(info.value) is InternalError


@pytest.mark.parametrize("frames, error, text", [
    ([], ProtocolError, "empty"),
    ([b"\xc1\xff\x00"], ProtocolError, "not valid msgpack"),
    ([msgpack.packb([1, 2])], ProtocolError, "must be a msgpack map"),
    ([msgpack.packb({"op": "health", "rid": 1})], VersionError, "version None"),
    ([msgpack.packb({"v": 99, "op": "health", "rid": 1})], VersionError, "version 99"),
    ([msgpack.packb({"v": protocol.PROTOCOL_VERSION, "op": "explode", "rid": 1})], UnknownOperationError, "explode"),
    ([msgpack.packb({"v": protocol.PROTOCOL_VERSION, "op": "health", "rid": "x"})], ProtocolError, "rid"),
    ([msgpack.packb({"v": protocol.PROTOCOL_VERSION, "op": "release", "rid": 1})], ProtocolError, "client_id"),
    ([msgpack.packb({"v": protocol.PROTOCOL_VERSION, "op": "release", "rid": 1, "client_id": "7"})], ProtocolError, "wrong type"),
    ([msgpack.packb({"v": protocol.PROTOCOL_VERSION, "op": "lookup", "rid": 1, **{**LOOKUP_FIELDS, "inline": 1}})],
     ProtocolError, "inline"),
    ([msgpack.packb({"v": protocol.PROTOCOL_VERSION, "op": "health", "rid": 1}), b"a", b"b"], ProtocolError, "payload frames"),
    ([b"\x80" + b"\x00" * protocol.MAX_HEADER_BYTES], ProtocolError, "exceeds"),
])
def test_malformed_requests_raise_typed_errors(frames, error, text):
    with pytest.raises(error, match=text):
        protocol.decode_request(frames)


def test_bool_is_not_accepted_for_int_fields():
    frames = protocol.encode_request("release", 1, client_id=True)
    with pytest.raises(ProtocolError, match="client_id"):
        protocol.decode_request(frames)


def test_peek_rid_survives_garbage():
    assert protocol.peek_rid([b"garbage"]) == ("", 0)
    assert protocol.peek_rid([msgpack.packb({"op": 3, "rid": 8})]) == ("", 8)


def test_error_classes_have_distinct_codes():
    from engramd.client.errors import ERROR_CLASSES
    assert all(cls.code == code for code, cls in ERROR_CLASSES.items())
    assert NotReadyError("x").code == "not_ready"


@pytest.mark.parametrize("frames, op, rid", [
    ([msgpack.packb({"v": 99, "op": "health", "rid": 12})], "health", 12),
    ([msgpack.packb({"v": protocol.PROTOCOL_VERSION, "op": "explode", "rid": 13})], "explode", 13),
    ([msgpack.packb({"v": protocol.PROTOCOL_VERSION, "op": "release", "rid": 14})], "release", 14),
    ([msgpack.packb({"v": protocol.PROTOCOL_VERSION, "op": 5, "rid": 15})], "", 15),
    ([msgpack.packb({"v": protocol.PROTOCOL_VERSION, "op": "health", "rid": 16, "pad": "x" * protocol.MAX_HEADER_BYTES})],
     "health", 16),
    ([b"\xc1\xff\x00"], "", 0),
    ([], "", 0),
])
def test_decode_errors_name_the_request_they_answer(frames, op, rid):
    """The daemon decodes a header once: a refused request's op and rid come with the error."""
    with pytest.raises(protocol.EngramError) as info:
        protocol.decode_request(frames)
    assert (info.value.request_op, info.value.request_rid) == (op, rid)


def test_lookup_ack_defaults_to_true_and_travels():
    frames = protocol.encode_request("lookup", 3, None, **{**LOOKUP_FIELDS, "inline": False})
    assert protocol.decode_request(frames).body.ack is True
    frames = protocol.encode_request("lookup", 4, None, **{**LOOKUP_FIELDS, "inline": False}, ack=False)
    assert protocol.decode_request(frames).body.ack is False


def test_lookup_ack_must_be_a_bool():
    frames = [msgpack.packb({"v": protocol.PROTOCOL_VERSION, "op": "lookup", "rid": 5, **LOOKUP_FIELDS, "ack": "no"})]
    with pytest.raises(ProtocolError, match="'ack' has wrong type"):
        protocol.decode_request(frames)


@pytest.mark.parametrize("fields, text", [
    ({"seq": 1}, "lookup reply: missing field 'slot'"),
    ({"slot": 0, "seq": "1"}, "lookup reply: field 'seq' has wrong type str"),
    ({"slot": True, "seq": 1}, "lookup reply: field 'slot' has wrong type bool"),
])
def test_a_reply_without_its_declared_fields_is_a_protocol_error(fields, text):
    """A daemon that answers otherwise than the client reads fails at decode, naming the field."""
    header = {"v": protocol.PROTOCOL_VERSION, "op": "lookup", "rid": 3, "status": "ok", "code": "ok", "message": "",
              "epoch": "ep"}
    with pytest.raises(ProtocolError, match=text):
        protocol.decode_reply([msgpack.packb({**header, **fields})])
    decoded = protocol.decode_reply([msgpack.packb({**header, "slot": 0, "seq": 1, "extra": "x"})])
    assert decoded.body == LookupReply(slot=0, seq=1, out_of_range=None)  # unknown fields ignored


def test_a_reply_to_an_operation_nobody_declared_is_a_protocol_error():
    header = {"v": protocol.PROTOCOL_VERSION, "op": "explode", "rid": 3, "status": "ok", "code": "ok", "epoch": "ep"}
    with pytest.raises(ProtocolError, match="unknown operation 'explode'"):
        protocol.decode_reply([msgpack.packb(header)])


def test_every_operation_has_one_declared_request_and_one_reply():
    assert set(REQUESTS) == set(protocol.OPERATIONS)
    assert set(REPLIES) - {"notice"} == set(REQUESTS) - {"drain"}  # drain is refused over ZeroMQ
    assert all(cls.OP == op for op, cls in {**REQUESTS, **REPLIES}.items())


def test_a_lookup_need_not_repeat_its_token_count():
    """`tokens` is the IDs' first dimension: a request without it decodes (the registry derives
    it and checks one that is sent, tests/test_registry.py)."""
    fields = {k: v for k, v in LOOKUP_FIELDS.items() if k != "tokens"}
    request = protocol.decode_request(protocol.encode_request("lookup", 8, [b"\0" * 384], **fields))
    assert request.body.tokens is None and request.body.ids_shape == [2, 2, 24]


def test_handle_socket_messages_are_declared_and_checked_on_both_sides():
    from engramd.client.errors import PermissionDeniedError
    from engramd.client.shared.handles import decode_request, error_reply, ok_reply, read_reply
    from engramd.client.shared.messages import AttachReply, AttachRequest, ClientsReply

    assert decode_request({"v": protocol.PROTOCOL_VERSION, "op": "attach", "client_id": 4, "token": "t"}) == AttachRequest(4, "t")
    with pytest.raises(ProtocolError, match="handle socket: attach: missing field 'token'"):
        decode_request({"op": "attach", "client_id": 4})
    with pytest.raises(ProtocolError, match="'client_id' has wrong type str"):
        decode_request({"op": "attach", "client_id": "4", "token": "t"})
    with pytest.raises(UnknownOperationError, match="unknown operation 'format'"):
        decode_request({"op": "format"})
    sent = AttachReply(tables=[{"layer_id": 1, "rows": 2, "row_bytes": 264, "data_offset": 4096,
                                "file_bytes": 8192}])
    assert read_reply(ok_reply("ep", sent), AttachReply) == ("ep", sent)
    assert read_reply(ok_reply("ep", AttachReply()), AttachReply)[1].slab is None
    with pytest.raises(ProtocolError, match="clients reply: missing field 'clients'"):
        read_reply({"status": "ok", "epoch": "ep"}, ClientsReply)
    with pytest.raises(PermissionDeniedError, match="no") as info:
        read_reply(error_reply(PermissionDeniedError("no"), "ep"), ClientsReply)
    assert info.value.epoch == "ep"


def test_a_mapped_attach_reply_passes_the_warm_up_trace_after_the_tables():
    import os
    import socket

    from engramd.client.shared.handles import _attachment, ok_reply
    from engramd.client.shared.messages import AttachReply

    table = {"layer_id": 0, "rows": 4, "row_bytes": 8, "data_offset": 0, "file_bytes": 4096}
    lease, other = socket.socketpair()
    fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(3)]
    try:
        got = _attachment(lease, ok_reply("ep", AttachReply(tables=[table, table], warm=True)), fds)
        assert [t.fd for t in got.tables] == fds[:2] and got.warm_fd == fds[2]
        plain = _attachment(lease, ok_reply("ep", AttachReply(tables=[table, table])), fds[:2])
        assert plain.warm_fd is None
        with pytest.raises(ProtocolError, match="describes 3 descriptors but carried 2"):
            _attachment(lease, ok_reply("ep", AttachReply(tables=[table, table], warm=True)), fds[:2])
    finally:
        for fd in fds:
            os.close(fd)
        lease.close()
        other.close()


def test_an_attach_reply_passes_a_gpu_slabs_counter_block_as_its_second_descriptor():
    import os
    import socket

    from engramd.client.shared.handles import _attachment, ok_reply
    from engramd.client.shared.messages import AttachReply

    lease, other = socket.socketpair()
    fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(3)]
    try:
        gpu = _attachment(lease, ok_reply("ep", AttachReply(slab={"kind": "cuda_vmm", "fds": 2})), fds[:2])
        assert (gpu.slab_fd, gpu.counters_fd, gpu.tables) == (fds[0], fds[1], [])
        cpu = _attachment(lease, ok_reply("ep", AttachReply(slab={"kind": "memfd"})), fds[:1])
        assert (cpu.slab_fd, cpu.counters_fd) == (fds[0], None)
        with pytest.raises(ProtocolError, match="describes 2 descriptors but carried 1"):
            _attachment(lease, ok_reply("ep", AttachReply(slab={"kind": "cuda_vmm", "fds": 2})), fds[:1])
        for count in (3, 0, "2", True):
            with pytest.raises(ProtocolError, match="a slab of .* descriptors"):
                _attachment(lease, ok_reply("ep", AttachReply(slab={"kind": "x", "fds": count})), fds)
    finally:
        for fd in fds:
            os.close(fd)
        lease.close()
        other.close()


def test_declared_types_take_what_msgpack_may_send_and_nothing_else():
    from engramd.client.shared.messages import HealthReply, HeartbeatRequest

    health = {"live": True, "ready": False, "state": "loading", "progress": 1, "pid": 7,
              "uptime": 0, "backend": None, "mps": {}}
    assert HealthReply.decode(health, "health reply").progress == 1  # a float field takes an int
    for name, value in (("progress", True), ("state", None), ("pid", 7.0), ("mps", [])):
        with pytest.raises(ProtocolError, match=f"'{name}' has wrong type"):
            HealthReply.decode({**health, name: value}, "health reply")
    assert HeartbeatRequest.decode({}, "heartbeat") == HeartbeatRequest(None, "", None)
    assert LookupReply(slot=1, seq=2).encode() == {"slot": 1, "seq": 2}  # an unset optional stays out
    assert LookupReply(slot=1, seq=2, out_of_range=0).encode()["out_of_range"] == 0
    assert HealthReply.decode(health, "h").encode()["backend"] is None  # a required None travels
