"""Every kind of bad input gets a typed error reply, and the daemon keeps serving the others."""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
import zmq
from helpers import attach_raw
from reference import random_ids

from engramd.client import EngramClient
from engramd.client.errors import BadIdsError, BadRequestError, DaemonUnavailableError
from engramd.client.shared.protocol import PROTOCOL_VERSION

LOOKUP = dict(slot=0, seq=1, tokens=2, ids_dtype="int32", ids_shape=[2, 2, 24], inline=True)
IDS_FRAME = np.zeros((2, 2, 24), dtype=np.int32).tobytes()


@pytest.fixture
def served(daemon_factory):
    daemon = daemon_factory()
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.setsockopt(zmq.RCVTIMEO, 5000)
    raw.connect(f"ipc://{daemon.socket}")
    yield daemon, raw
    raw.close(0)
    while _LEASES:
        _LEASES.pop().close()


def roundtrip(raw: zmq.Socket, frames: list[bytes]) -> dict:
    raw.send_multipart(frames)
    return msgpack.unpackb(raw.recv_multipart()[0])


_LEASES = []  # attached raw registrations live as long as their lease


def register(raw: zmq.Socket, **over) -> dict:
    """A raw registration, attached when the daemon accepted it (as the client library does)."""
    fields = {**dict(v=PROTOCOL_VERSION, op="register", rid=1, pid=os.getpid(), device="cpu", tp_rank=0,
                     tp_size=1, max_tokens=4, slots=2), **over}
    reply = roundtrip(raw, [msgpack.packb(fields)])
    if reply["status"] == "ok":
        endpoint = raw.getsockopt_string(zmq.LAST_ENDPOINT).removeprefix("ipc://")
        reply["attached"] = attach_raw(Path(endpoint), reply, keep_descriptors=True)
        _LEASES.append(reply["attached"].lease)
    return reply


def header(**fields) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, "rid": 9, **fields})


BAD_MESSAGES = [
    ("garbage msgpack", [b"\xc1\xc1\xc1"], "bad_message"),
    ("not a map", [msgpack.packb([1, 2, 3])], "bad_message"),
    ("wrong version", [msgpack.packb({"v": 7, "op": "health", "rid": 1})], "bad_version"),
    ("no version", [msgpack.packb({"op": "health", "rid": 1})], "bad_version"),
    ("unknown op", [header(op="format_disk")], "unknown_op"),
    ("missing field", [header(op="register", pid=1)], "bad_message"),
    ("mistyped field", [header(op="release", client_id="one")], "bad_message"),
    ("too many frames", [header(op="health"), b"a", b"b", b"c"], "bad_message"),
    ("lookup unregistered", [header(op="lookup", client_id=999, **LOOKUP), IDS_FRAME], "not_registered"),
    ("release unregistered", [header(op="release", client_id=12345)], "not_registered"),
]


@pytest.mark.parametrize("name, frames, code", BAD_MESSAGES, ids=[b[0] for b in BAD_MESSAGES])
def test_malformed_messages_get_typed_errors(served, name, frames, code):
    _, raw = served
    reply = roundtrip(raw, frames)
    assert reply["status"] == "error" and reply["code"] == code, reply
    assert reply["message"] and reply["epoch"]


def test_bad_lookups_get_typed_errors(served):
    _, raw = served
    client_id = register(raw)["client_id"]
    cases = [
        (dict(LOOKUP, ids_dtype="float32"), [IDS_FRAME], "bad_ids", "dtype"),
        (dict(LOOKUP, ids_shape=[2, 24]), [IDS_FRAME], "bad_ids", "shape"),
        (dict(LOOKUP, ids_shape=[2, 2, 23]), [IDS_FRAME], "bad_ids", "shape"),
        (dict(LOOKUP, tokens=5, ids_shape=[5, 2, 24]), [IDS_FRAME * 3], "bad_ids", "registered 1..4"),
        (dict(LOOKUP, tokens=0, ids_shape=[0, 2, 24]), [b""], "bad_ids", "registered 1..4"),
        (LOOKUP, [IDS_FRAME[:-4]], "bad_ids", "bytes"),
        (LOOKUP, [], "bad_ids", "frame"),
        (dict(LOOKUP, slot=2), [IDS_FRAME], "bad_request", "slot 2"),
        (dict(LOOKUP, slot=-1), [IDS_FRAME], "bad_request", "slot -1"),
        (dict(LOOKUP, inline=False), [IDS_FRAME], "bad_ids", "inline=false"),
    ]
    for fields, payload, code, text in cases:
        reply = roundtrip(raw, [header(op="lookup", client_id=client_id, **fields), *payload])
        assert (reply["status"], reply["code"]) == ("error", code), (fields, reply)
        assert text in reply["message"], (fields, reply["message"])
    ok = roundtrip(raw, [header(op="lookup", client_id=client_id, **LOOKUP), IDS_FRAME])
    assert ok["status"] == "ok", ok


def test_bad_registrations(served):
    _, raw = served
    for over, text in [(dict(device="cuda:GPU-nope"), "cpu backend"), (dict(tp_rank=4, tp_size=4), "rank 4"),
                       (dict(tp_size=0), "tp_size 0"), (dict(slots=0), "slots 0"),
                       (dict(max_tokens=10**9), "max_tokens")]:
        reply = register(raw, **over)
        assert reply["status"] == "error" and reply["code"] == "bad_request", (over, reply)
        assert text in reply["message"], (over, reply["message"])


@pytest.mark.parametrize("setting, value", [
    ("timeout", 0), ("timeout", -1.0), ("timeout", float("nan")), ("timeout", "5"),
    ("reconnect_timeout", -1), ("reconnect_timeout", float("nan")), ("timeout", float("inf")),
    pytest.param("timeout", 10**400, id="timeout-too-large-for-a-float")])
def test_a_bad_time_setting_is_named_before_anything_is_asked(served, setting, value):
    daemon, _ = served
    with pytest.raises(BadRequestError, match=rf"\] {setting} .*: seconds"):
        EngramClient(daemon.socket, **{setting: value})


@pytest.mark.parametrize("setting, value", [("tp_rank", 2**70), ("max_tokens", 8.0), ("slots", "2"),
                                            ("tp_size", True)])
def test_a_setting_that_is_no_whole_number_is_named(served, setting, value):
    """msgpack's TypeError or OverflowError came out of the register call before."""
    daemon, _ = served
    with pytest.raises(BadRequestError, match=rf"\] {setting} .*: a whole number expected"):
        EngramClient(daemon.socket, **{setting: value})


def test_numpys_integers_are_whole_numbers_and_a_waits_timeout_is_checked(served, reference):
    daemon, _ = served
    ids = random_ids(np.random.default_rng(8), 4, reference.rows, reference.heads)
    with EngramClient(daemon.socket, max_tokens=np.int64(8), slots=np.int32(3)) as client:
        assert (client.max_tokens, client.slots) == (8, 3)
        future = client.lookup(torch.from_numpy(ids))
        for bad in (float("nan"), -1, "1", True):
            with pytest.raises(BadRequestError, match=r"\] timeout .*: seconds, >= 0"):
                future.result(timeout=bad)
        rows = future.result(timeout=float("inf"))  # for ever: allowed, as in the settings
        assert np.array_equal(rows.double().numpy(), reference.expected(ids))


def test_a_closed_client_and_ids_without_values_get_typed_errors(served):
    daemon, _ = served
    EngramClient(daemon.socket, reconnect_timeout=float("inf")).close()  # for ever: allowed
    client = EngramClient(daemon.socket, max_tokens=4, reconnect_timeout=0)
    with pytest.raises(BadIdsError, match="meta"):
        client.lookup(torch.zeros((1, 2, 24), dtype=torch.int64, device="meta"))
    client.close()
    for call in (client.stats, client.health):
        with pytest.raises(DaemonUnavailableError, match="client is closed"):
            call()


def test_another_connection_cannot_use_my_client_id(served):
    daemon, raw = served
    with EngramClient(daemon.socket) as client:
        reply = roundtrip(raw, [header(op="release", client_id=client.client_id)])
        assert reply["code"] == "not_registered" and "another connection" in reply["message"]
        assert client.lookup(torch.full((1, 2, 24), -1)).result().abs().sum() == 0


def test_daemon_keeps_serving_a_good_client_through_a_flood_of_bad_input(served, reference):
    daemon, raw = served
    rng = np.random.default_rng(3)
    with EngramClient(daemon.socket) as client:
        for i in range(20):
            for _, frames, _ in BAD_MESSAGES:
                raw.send_multipart(frames)
            raw.send_multipart([b""])  # empty header frame
            ids = random_ids(rng, 8, reference.rows, reference.heads)
            rows = client.lookup(torch.from_numpy(ids)).result()
            assert np.array_equal(rows.double().numpy(), reference.expected(ids)), f"round {i}"
        # The daemon interleaves peers: let it finish the raw socket's backlog (per-peer FIFO)
        # before counting.
        raw.send_multipart([msgpack.packb({"v": PROTOCOL_VERSION, "op": "health", "rid": 777})])
        while msgpack.unpackb(raw.recv_multipart()[0]).get("rid") != 777:
            pass
        errors = client.stats()["errors"]
    assert errors.get("bad_message", 0) >= 20 * 4
    assert errors.get("unknown_op", 0) == 20
    assert daemon.proc.poll() is None


def test_lookup_without_ack_is_answered_only_when_it_fails(served, reference):
    """`ack=false` (what GPU clients send): a served lookup gets no reply, its rows are written
    all the same; a refused one still gets its typed error, matched by rid."""
    daemon, raw = served
    reply = register(raw, max_tokens=2)
    client_id, attached = reply["client_id"], reply["attached"]
    ids = random_ids(np.random.default_rng(5), 2, reference.rows, reference.heads).astype(np.int32)
    raw.send_multipart([header(op="lookup", client_id=client_id, **{**LOOKUP, "rid": 21}, ack=False),
                        ids.tobytes()])
    bad = {**LOOKUP, "rid": 22, "slot": 5}
    assert roundtrip(raw, [header(op="lookup", client_id=client_id, **bad, ack=False),
                           IDS_FRAME])["rid"] == 22  # the only reply: the silent one sent none
    stats, deadline = {}, time.monotonic() + 30  # no hang, whatever the machine's load
    while time.monotonic() < deadline:  # the silent lookup is done once stats count it
        raw.send_multipart([header(op="stats", rid=23)])
        stats = msgpack.unpackb(raw.recv_multipart()[0])
        if stats["lookups"] == 1:
            break
        time.sleep(0.01)
    assert stats["lookups"] == 1 and stats["errors"] == {"bad_request": 1}, stats
    from engramd.client.shared.slab import SlabLayout
    layout = SlabLayout.from_wire(attached.slab["layout"])
    with mmap.mmap(attached.slab_fd, layout.size, mmap.MAP_SHARED, mmap.PROT_READ) as view:
        slab = torch.frombuffer(bytearray(view), dtype=torch.uint8)
    attached.close_descriptors()
    rows = layout.rows_view(slab, 0, 2).double().numpy()
    assert np.array_equal(rows, reference.expected(ids)), "rows of the unacknowledged lookup"
    raw.setsockopt(zmq.RCVTIMEO, 300)
    with pytest.raises(zmq.Again):
        raw.recv_multipart()  # and no late acknowledgement either
