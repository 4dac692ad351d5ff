"""Hostile input: a hypothesis-driven fuzzer against the real daemon on a raw ZeroMQ DEALER.

At least MIN_MESSAGES malformed, truncated, oversized and wrong-typed messages, built by mutating
valid requests of client/shared/protocol.py (`encode_request`), go to one `engramd serve` process in
batches. After every batch:

- every message got exactly one reply (the raw socket's replies are drained and counted), each a
  msgpack map with status "ok" or "error", an error with a known code and the daemon's epoch;
  never "internal" (an unexpected exception in the daemon);
  messages whose rid survived the mutation and that cannot be valid get the code they must get;
- `health` answered within HEALTH_TIMEOUT_S while the batch was being processed;
- a well-behaved EngramClient on its own connection got rows equal to the reference.

Hypothesis draws the structure of each message (which operation, which mutation, which field,
which replacement value); bulk bytes (random frames, multi-MB frames) come from a numpy
generator seeded by a drawn integer, which keeps hypothesis' own buffers small. The run is
derandomized, so it is the same on every machine.

What this is not: a test of the error messages' wording (tests/integration/test_bad_input.py).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import msgpack
import numpy as np
import pytest
import torch
import zmq
from helpers import attach_raw
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from reference import random_ids

from engramd.client import EngramClient
from engramd.client.errors import ERROR_CLASSES
from engramd.client.shared import protocol
from engramd.client.shared.connection import probe

MIN_MESSAGES = 10_000
EXAMPLES = 200
BATCH = (50, 60)  # messages per example (a burst recipe may add a few)
HEALTH_TIMEOUT_S = 3.0  # a stall, not a slow scheduler on a loaded 2-core CI machine
DRAIN_TIMEOUT_S = 10.0  # a batch holds up to a few multi-MB frames
KNOWN_CODES = set(ERROR_CLASSES) - {"internal"}
# Operations the fuzzer starts from. Admin operations (drain, ...) are left out on purpose: a
# valid one would stop the daemon under test.
BASE_OPS = ("register", "lookup", "release", "heartbeat", "stats", "health")
RAW_MAX_TOKENS, RAW_SLOTS = 8, 2  # the raw socket's own registration
DAEMON_FLAGS = ["--max-tokens", "64", "--max-slots", "4", "--max-clients", "16"]
FIRST_RID = 10**9  # rids the fuzzer assigns; replies to mangled headers carry rid 0
BIG_SIZES = (64 << 10, 1 << 20, 3 << 20)

KINDS = ("valid", "drop_field", "retype_field", "extra_fields", "bad_version", "bad_op",
         "bad_rid", "truncated", "bitflip", "random_bytes", "random_msgpack", "extra_frames",
         "empty_frames", "huge_frame", "huge_header", "lookup_values", "burst")
# Mutations after which the message cannot be valid, with the code its (rid-carrying) reply
# must have.
CERTAIN_CODES = {"bad_version": "bad_version", "bad_op": "unknown_op",
                 "huge_header": "bad_message", "extra_frames": "bad_message"}
BOUNDARY_INTS = (-2**63, -2**31, -1, 0, 1, 2, 3, RAW_SLOTS, RAW_MAX_TOKENS, RAW_MAX_TOKENS + 1,
                 64, 65, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**64 - 1)

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1),
                    st.sampled_from(BOUNDARY_INTS), st.floats(), st.text(max_size=12),
                    st.binary(max_size=12))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=6)
odd_keys = st.dictionaries(st.one_of(st.integers(-2**63, 2**64 - 1), st.binary(max_size=4), st.none()), values,
                           min_size=1, max_size=3)


@dataclass(frozen=True)
class Recipe:
    """What one fuzz message is made of; turned into frames by `build` (needs the client id)."""

    kind: str
    op: str
    pick: int  # selects a field, a cut position, a size, ...
    value: object  # a replacement value
    seed: int  # for bulk bytes
    count: int  # frames to add, messages in a burst


@st.composite
def recipes(draw) -> Recipe:
    kind = draw(st.sampled_from(KINDS))
    op = "lookup" if kind in ("lookup_values", "burst") else draw(st.sampled_from(BASE_OPS))
    value: object
    if kind == "bad_op":
        value = draw(st.one_of(st.text(max_size=16), values).filter(lambda v: v not in protocol.OPERATIONS))
    elif kind == "bad_version":
        value = draw(values.filter(lambda v: v != protocol.PROTOCOL_VERSION))
    elif kind == "random_msgpack":
        value = draw(st.one_of(values, odd_keys))
    elif kind == "extra_fields":
        value = draw(st.dictionaries(st.text(max_size=10), values, min_size=1, max_size=4))
    elif kind == "lookup_values":
        value = draw(st.one_of(st.sampled_from(BOUNDARY_INTS), values,
                               st.sampled_from(("int32", "int64", "float32", "int8", ""))))
    else:
        value = draw(values)
    return Recipe(kind, op, draw(st.integers(0, 2**16)), value, draw(st.integers(0, 2**32 - 1)),
                  draw(st.integers(1, 5)))


@dataclass
class Context:
    """The fuzz session's state: the raw socket's client id and the next rid to hand out."""

    client_id: int
    next_rid: int = FIRST_RID
    expected: dict[int, tuple[str, str]] = field(default_factory=dict)  # rid -> (code, op)
    # rids that more than one message of the batch carries: a mutation (a bit flip, random
    # msgpack) can turn one message's rid into another's, so neither reply can be told apart.
    ambiguous: set[int] = field(default_factory=set)
    carried: set[int] = field(default_factory=set)  # rids the batch's messages carry so far
    dirty: bool = False  # an example failed half-way: replies may still be on their way

    def rid(self) -> int:
        self.next_rid += 1
        return self.next_rid

    def start_batch(self) -> None:
        """Each example starts from the same rids, so a failure replays exactly when shrunk."""
        self.next_rid = FIRST_RID
        self.expected.clear()
        self.ambiguous.clear()
        self.carried.clear()

    def sent(self, frames: list[bytes]) -> None:
        """Note the rid the daemon will read from `frames` (as it reads it: protocol.peek_rid)."""
        rid = protocol.peek_rid(frames)[1] if frames else 0
        if rid in self.carried:
            self.ambiguous.add(rid)
        self.carried.add(rid)


def ids_frame(rng: np.random.Generator, tokens: int, dtype: str = "int32") -> bytes:
    return rng.integers(-1, 20_000, size=(tokens, 2, 24)).astype(dtype).tobytes()


def base_request(op: str, ctx: Context, rng: np.random.Generator) -> tuple[dict, list[bytes]]:
    """A valid request's fields and payload (release names no live client of ours)."""
    if op == "register":
        return dict(pid=os.getpid(), device="cpu", tp_rank=0, tp_size=1, max_tokens=4, slots=1), []
    if op == "lookup":
        return (dict(client_id=ctx.client_id, slot=0, seq=1, tokens=2, ids_dtype="int32",
                     ids_shape=[2, 2, 24], inline=True), [ids_frame(rng, 2)])
    if op == "release":
        return dict(client_id=ctx.client_id + 10**6), []
    if op == "heartbeat":
        return dict(client_id=ctx.client_id), []
    return {}, []


def build(recipe: Recipe, ctx: Context) -> list[list[bytes]]:
    """The messages of one recipe (one, or several for a burst)."""
    rng = np.random.default_rng(recipe.seed)
    rid = ctx.rid()
    fields, payload = base_request(recipe.op, ctx, rng)
    header = {"v": protocol.PROTOCOL_VERSION, "op": recipe.op, "rid": rid, **fields}
    if recipe.kind in CERTAIN_CODES:
        ctx.expected[rid] = (CERTAIN_CODES[recipe.kind], recipe.op)
    messages = MUTATIONS[recipe.kind](recipe, header, payload, rng)
    return messages


def _packed(header: dict) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def _valid(r: Recipe, h: dict, p: list[bytes], rng) -> list[list[bytes]]:
    return [[_packed(h), *p]]


def _drop_field(r: Recipe, h: dict, p: list[bytes], rng) -> list[list[bytes]]:
    keys = list(h)
    del h[keys[r.pick % len(keys)]]
    return [[_packed(h), *p]]


def _retype_field(r: Recipe, h: dict, p: list[bytes], rng) -> list[list[bytes]]:
    keys = list(h)
    h[keys[r.pick % len(keys)]] = r.value
    return [[_packed(h), *p]]


def _extra_fields(r: Recipe, h: dict, p: list[bytes], rng) -> list[list[bytes]]:
    return [[_packed({**h, **r.value}), *p]]


def _bad_version(r: Recipe, h: dict, p: list[bytes], rng) -> list[list[bytes]]:
    return [[_packed({**h, "v": r.value}), *p]]


def _bad_op(r: Recipe, h: dict, p: list[bytes], rng) -> list[list[bytes]]:
    return [[_packed({**h, "op": r.value}), *p]]


def _bad_rid(r: Recipe, h: dict, p: list[bytes], rng) -> list[list[bytes]]:
    return [[_packed({**h, "rid": r.value}), *p]]


def _truncated(r: Recipe, h: dict, p: list[bytes], rng) -> list[list[bytes]]:
    raw = _packed(h)
    return [[raw[:r.pick % len(raw)], *p]]


def _bitflip(r: Recipe, h: dict, p: list[bytes], rng) -> list[list[bytes]]:
    raw = bytearray(_packed(h))
    for pos in rng.integers(0, len(raw), size=r.count):
        raw[pos] ^= 1 << int(rng.integers(0, 8))
    return [[bytes(raw), *p]]


def _random_bytes(r: Recipe, h: dict, p: list[bytes], rng) -> list[list[bytes]]:
    return [[rng.bytes(int(rng.integers(0, 512))) for _ in range(r.count)]]


def _random_msgpack(r: Recipe, h: dict, p: list[bytes], rng) -> list[list[bytes]]:
    return [[msgpack.packb(r.value, use_bin_type=True), *p]]


def _extra_frames(r: Recipe, h: dict, p: list[bytes], rng) -> list[list[bytes]]:
    # Two payload frames at least: one more than MAX_PAYLOAD_FRAMES allows.
    extra = [rng.bytes(int(rng.integers(0, 64))) for _ in range(r.count + 1)]
    return [[_packed(h), *(p or [b""]), *extra]]


def _empty_frames(r: Recipe, h: dict, p: list[bytes], rng) -> list[list[bytes]]:
    return [[b""] * r.count] if r.pick % 2 else [[_packed(h), *([b""] * r.count)]]


def _huge_frame(r: Recipe, h: dict, p: list[bytes], rng) -> list[list[bytes]]:
    return [[_packed(h), rng.bytes(BIG_SIZES[r.pick % len(BIG_SIZES)])]]


def _huge_header(r: Recipe, h: dict, p: list[bytes], rng) -> list[list[bytes]]:
    size = protocol.MAX_HEADER_BYTES + 1 + r.pick * 16  # up to about 1 MB
    return [[_packed({**h, "pad": "x" * size}), *p]]


LOOKUP_FIELDS = ("slot", "seq", "tokens", "ids_dtype", "ids_shape", "inline", "client_id", "payload")


def _lookup_values(r: Recipe, h: dict, p: list[bytes], rng) -> list[list[bytes]]:
    name = LOOKUP_FIELDS[r.pick % len(LOOKUP_FIELDS)]
    if name == "payload":  # a frame one element short, long, or of the other dtype
        tokens = h["tokens"]
        p = [[ids_frame(rng, tokens)[:-4], ids_frame(rng, tokens) + b"\0" * 4,
              ids_frame(rng, tokens, "int64"), b""][r.count % 4]]
    elif name == "tokens" and type(r.value) is int and 0 < r.value <= 64:
        # A consistent request for that many tokens: past the registration, or valid.
        h.update(tokens=r.value, ids_shape=[r.value, 2, 24])
        p = [ids_frame(rng, r.value)]
    else:
        h[name] = r.value
    return [[_packed(h), *p]]


def _burst(r: Recipe, h: dict, p: list[bytes], rng) -> list[list[bytes]]:
    # Back-to-back lookups on one slot: the first is served, overlapping ones are slot_busy.
    return [[_packed({**h, "seq": i}), *p] for i in range(r.count + 1)]


MUTATIONS = {"valid": _valid, "drop_field": _drop_field, "retype_field": _retype_field,
             "extra_fields": _extra_fields, "bad_version": _bad_version, "bad_op": _bad_op,
             "bad_rid": _bad_rid, "truncated": _truncated, "bitflip": _bitflip,
             "random_bytes": _random_bytes, "random_msgpack": _random_msgpack,
             "extra_frames": _extra_frames, "empty_frames": _empty_frames,
             "huge_frame": _huge_frame, "huge_header": _huge_header,
             "lookup_values": _lookup_values, "burst": _burst}
assert set(MUTATIONS) == set(KINDS)


# -- the raw connection -----------------------------------------------------------------------


class RawPeer:
    """The fuzzer's DEALER: sends batches and drains exactly one reply per message."""

    def __init__(self, socket_path):
        self.socket_path = socket_path
        self.leases = []  # of its attached registrations
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"ipc://{socket_path}")

    def call(self, op: str, rid: int, **fields) -> dict:
        self.sock.send_multipart(protocol.encode_request(op, rid, **fields))
        (reply,) = self.drain(1)
        return reply

    def drain(self, count: int, timeout: float = DRAIN_TIMEOUT_S) -> list[dict]:
        replies = []
        deadline = time.monotonic() + timeout
        while len(replies) < count:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000)):
                raise AssertionError(f"daemon stalled: {len(replies)} of {count} replies within "
                                     f"{timeout} s")
            frames = self.sock.recv_multipart()
            assert len(frames) == 1, f"a reply of {len(frames)} frames"
            reply = msgpack.unpackb(frames[0])
            assert isinstance(reply, dict), reply
            replies.append(reply)
        return replies

    def assert_drained(self, wait_ms: int = 0) -> None:
        assert not self.sock.poll(wait_ms), "more replies than messages"

    def discard_stale(self) -> None:
        while self.sock.poll(50):
            self.sock.recv_multipart()

    def close(self) -> None:
        self.sock.close(0)
        for lease in self.leases:
            lease.close()


def check_reply(reply: dict, epoch: str, ctx: Context) -> None:
    assert reply.get("v") == protocol.PROTOCOL_VERSION and reply.get("epoch") == epoch, reply
    assert reply.get("op") != "notice", f"unsolicited notice: {reply}"
    status, code = reply.get("status"), reply.get("code")
    if status == "ok":
        assert code == "ok", reply
    else:
        assert status == "error" and code in KNOWN_CODES, reply
        assert isinstance(reply.get("message"), str) and reply["message"], reply
    rid = reply.get("rid")
    must = ctx.expected.pop(rid, None)
    if must is not None and rid not in ctx.ambiguous:
        assert code == must[0], (must, reply)


def assert_rows_equal(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    wrong = np.argwhere(actual != expected)
    assert wrong.size == 0, f"{what}: {len(wrong)} wrong values, first at {wrong[:5].tolist()}"


@pytest.fixture
def fuzz_target(daemon_factory):
    daemon = daemon_factory(extra=DAEMON_FLAGS)
    raw = RawPeer(daemon.socket)
    yield daemon, raw
    raw.close()


def register_raw(raw: RawPeer) -> tuple[int, str]:
    """The raw peer's own registration, attached (its lease kept on the peer)."""
    reply = raw.call("register", 1, pid=os.getpid(), device="cpu", tp_rank=0, tp_size=1,
                     max_tokens=RAW_MAX_TOKENS, slots=RAW_SLOTS)
    assert reply["status"] == "ok", reply
    raw.leases.append(attach_raw(raw.socket_path, reply).lease)
    return reply["client_id"], reply["epoch"]


def test_fuzzed_messages_get_typed_replies_and_never_disturb_a_good_client(fuzz_target, reference):
    daemon, raw = fuzz_target
    client_id, epoch = register_raw(raw)
    ctx = Context(client_id)
    totals = {"messages": 0, "ok": 0, "error": 0, "checked_lookups": 0}
    rng = np.random.default_rng(11)

    with EngramClient(daemon.socket, max_tokens=16, timeout=10, name="well-behaved") as good:

        @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
                  phases=[Phase.generate, Phase.shrink], suppress_health_check=list(HealthCheck))
        @given(st.lists(recipes(), min_size=BATCH[0], max_size=BATCH[1]))
        def batch(plan: list[Recipe]) -> None:
            if ctx.dirty:  # an earlier example failed half-way (hypothesis then shrinks)
                raw.discard_stale()
            ctx.start_batch()
            ctx.dirty = True
            messages = [m for recipe in plan for m in build(recipe, ctx)]
            for frames in messages:
                ctx.sent(frames)
                raw.sock.send_multipart(frames)
            started = time.monotonic()
            health = probe(daemon.socket, "health", HEALTH_TIMEOUT_S).body.encode()
            assert health["ready"] and time.monotonic() - started < HEALTH_TIMEOUT_S
            replies = raw.drain(len(messages))
            for reply in replies:
                check_reply(reply, epoch, ctx)
                totals[reply["status"]] += 1
            assert not ctx.expected, f"no reply for rids {sorted(ctx.expected)}"
            totals["messages"] += len(messages)
            release_fuzz_registrations(raw, replies, ctx)
            check_good_client(good, reference, rng)
            totals["checked_lookups"] += 1
            assert daemon.proc.poll() is None, daemon.log()
            raw.assert_drained()
            ctx.dirty = False

        batch()
        raw.assert_drained(200)
        stats = good.stats()
    assert totals["messages"] >= MIN_MESSAGES, totals
    assert totals["ok"] > 0 and totals["error"] > 0.5 * totals["messages"], totals
    assert stats["errors"].get("internal", 0) == 0, (stats["errors"], totals)
    assert len(stats["clients"]) == 2, stats["clients"]  # the good client and the raw one


def release_fuzz_registrations(raw: RawPeer, replies: list[dict], ctx: Context) -> None:
    """Release what valid fuzzed registrations created, and re-register if ours was released."""
    created = [r["client_id"] for r in replies if r["op"] == "register" and r["status"] == "ok"]
    for client_id in created:
        assert raw.call("release", ctx.rid(), client_id=client_id)["status"] == "ok"
    if raw.call("heartbeat", ctx.rid(), client_id=ctx.client_id)["status"] != "ok":
        ctx.client_id, _ = register_raw(raw)


def check_good_client(good: EngramClient, reference, rng: np.random.Generator) -> None:
    ids = random_ids(rng, int(rng.integers(1, 17)), reference.rows, reference.heads)
    rows = good.lookup(torch.from_numpy(ids)).result().double().numpy()
    assert_rows_equal(rows, reference.expected(ids), "well-behaved client")


def header_of_size(size: int, **fields) -> bytes:
    """A valid request header padded to exactly `size` bytes."""
    pad = size
    while True:
        packed = msgpack.packb({"v": protocol.PROTOCOL_VERSION, **fields, "pad": "x" * pad})
        if len(packed) == size:
            return packed
        pad -= len(packed) - size


def test_frames_at_and_past_the_limits(fuzz_target, reference):
    """The largest frames: a payload of exactly the daemon's frame bound (server/daemon.py
    largest_frame: what its clients send at max_tokens) and a header one byte over
    MAX_HEADER_BYTES are answered; a payload one byte over the bound is refused by libzmq
    (MAXMSGSIZE), which drops that connection. No stall, and other clients are served."""
    from engramd.server.config import build_config
    from engramd.server.daemon import largest_frame

    bound = largest_frame(build_config({"max_tokens": 64}, "the fuzzed daemon's flags"))
    daemon, raw = fuzz_target
    client_id, _ = register_raw(raw)
    lookup = dict(client_id=client_id, slot=0, seq=1, tokens=2, ids_dtype="int32",
                  ids_shape=[2, 2, 24], inline=True)
    at_limit = bytes(bound)
    raw.sock.send_multipart(protocol.encode_request("lookup", 7, [at_limit], **lookup))
    raw.sock.send_multipart([header_of_size(protocol.MAX_HEADER_BYTES + 1, op="health", rid=8)])
    replies = {r["rid"]: r for r in raw.drain(2, timeout=30)}
    assert replies[7]["code"] == "bad_ids" and "bytes" in replies[7]["message"], replies[7]
    assert replies[8]["code"] == "bad_message" and "exceeds" in replies[8]["message"], replies[8]

    over = RawPeer(daemon.socket)
    try:
        started = time.monotonic()
        over.sock.send_multipart(protocol.encode_request(
            "health", 9, [bytes(bound + 1)]))
        if over.sock.poll(2000):  # answered, if the daemon reads it at all: then it is typed
            reply = msgpack.unpackb(over.sock.recv_multipart()[0])
            assert reply["code"] == "bad_message", reply
        health = probe(daemon.socket, "health", HEALTH_TIMEOUT_S).body.encode()
        assert health["ready"] and daemon.proc.poll() is None
    finally:
        over.close()
    assert time.monotonic() - started < 10
    ids = random_ids(np.random.default_rng(3), 2, reference.rows, reference.heads)
    with EngramClient(daemon.socket, max_tokens=2) as good:
        rows = good.lookup(torch.from_numpy(ids)).result().double().numpy()
    assert_rows_equal(rows, reference.expected(ids), "after the large frames")


def test_unhashable_op_gets_a_typed_error(fuzz_target):
    """An operation name that is a msgpack array or map is a malformed message, not a bug."""
    _, raw = fuzz_target
    for rid, op in ((21, ["lookup"]), (22, {"op": "health"})):
        raw.sock.send_multipart([msgpack.packb({"v": protocol.PROTOCOL_VERSION, "op": op, "rid": rid})])
        (reply,) = raw.drain(1)
        assert reply["status"] == "error" and reply["code"] in ("bad_message", "unknown_op"), reply
