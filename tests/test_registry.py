"""The lookup store in-process: registration and attach, slot lifecycle, refused lookups, release,
reaping, credentials and budgets."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys

import numpy as np
import pytest

from engramd.client.errors import (
    BadIdsError,
    BadRequestError,
    NotRegisteredError,
    PermissionDeniedError,
    ResourceError,
    SlotBusyError,
    TablesChangedError,
)
from engramd.client.geometry import TableGeometry
from engramd.client.shared.handles import PeerCredentials
from engramd.client.shared.messages import LookupReply, LookupRequest, RegisterRequest
from engramd.server.job_context import JobContext
from engramd.server.registry import ATTACH_TIMEOUT_S, HUNG_AFTER_S, ClientRegistry, Limits


class FakeSlab:
    def __init__(self, layout):
        self.layout = layout
        self.closed = False
        self.handed_over: set[tuple[int, int]] | None = None  # (slot, seq) handed over; None: all

    def ids_handed_over(self, slot, seq):
        return self.handed_over is None or (slot, seq) in self.handed_over

    def wire(self):
        return {"kind": "fake", "layout": self.layout.to_wire()}

    def close(self):
        assert not self.closed, "a slab freed twice"
        self.closed = True


class FakeBackend:
    """Records submitted jobs; the test completes them by hand."""

    name = "fake"
    counts_per_job = True

    def __init__(self, orders_slots: bool):
        self.orders_slots = orders_slots
        self.mps = {}  # GPU UUID -> MpsState, as a CUDA backend reports it
        self.jobs = []
        self.slabs = []
        self.overdue = []  # jobs overdue_lookups hands out next
        self.overdue_limits = []
        self.dropped_for = []  # clients whose queued lookups the registry had dropped
        self.queued = []  # jobs drop_queued finishes (as the CPU backend does, on the caller's thread)
        self.finish = None  # how: the registry's finish_lookup

    def check_device(self, device):
        if device != "cpu" and device.removeprefix("cuda:") not in self.mps:
            raise BadRequestError(f"device {device!r} not served")

    def allocate_slab(self, device, layout, client_id, shard):
        self.slabs.append(FakeSlab(layout))
        return self.slabs[-1]

    def submit(self, job, done):
        self.jobs.append(job)

    def drop_queued(self, client_id):
        self.dropped_for.append(client_id)
        dropped = [job for job in self.queued if job.client_id == client_id]
        for job in dropped:
            job.skip = True
            self.finish(job)
        return len(dropped)

    def overdue_lookups(self, limit_s):
        self.overdue_limits.append(limit_s)
        overdue, self.overdue = self.overdue, []
        return overdue

    def mps_states(self):
        return self.mps

    def cache_stats(self):
        return {}

    def out_of_range(self, slabs):
        return 0

    def close(self):
        pass


def make_store(orders_slots: bool = False, **limits) -> tuple[ClientRegistry, FakeBackend]:
    backend = FakeBackend(orders_slots)
    return ClientRegistry(TableGeometry.named("demo"), backend, Limits(2, 64, 4, **limits)), backend


def me(pid: int | None = None) -> PeerCredentials:
    return PeerCredentials(pid if pid is not None else os.getpid(), os.getuid(), os.getgid())


def register(store: ClientRegistry, identity: bytes = b"a", pid: int | None = None, **over) -> int:
    """Register and attach, as the daemon does over its two sockets."""
    req = {"pid": os.getpid(), "device": "cpu", "tp_rank": 0, "tp_size": 1, "max_tokens": 8,
           "slots": 2, **over}
    reply = store.register(identity, RegisterRequest(**req))
    store.attach(reply.client_id, reply.token, me(pid))
    return reply.client_id


def lookup_req(client_id: int, slot: int = 0, seq: int = 1, tokens: int = 2, **over) -> LookupRequest:
    return LookupRequest(**{"client_id": client_id, "slot": slot, "seq": seq, "tokens": tokens,
                            "ids_dtype": "int32", "ids_shape": [tokens, 2, 24], "inline": True, **over})


def ids_frame(tokens: int = 2) -> list[bytes]:
    return [np.zeros((tokens, 2, 24), dtype=np.int32).tobytes()]


def start(store, client_id, identity=b"a", **over):
    req = lookup_req(client_id, **over)
    return store.start_lookup(identity, req, ids_frame(req.tokens), lambda job: None, JobContext())


def test_register_limits_and_identity():
    store, backend = make_store()
    client_id = register(store)
    with pytest.raises(BadRequestError, match="slots 9"):
        register(store, slots=9)
    with pytest.raises(BadRequestError, match="rank 2"):
        register(store, tp_rank=2, tp_size=2)
    register(store, identity=b"b")
    with pytest.raises(ResourceError, match="client limit"):
        register(store, identity=b"c")
    with pytest.raises(NotRegisteredError, match="another connection"):
        store.client(b"b", client_id)


def test_unordered_backend_refuses_a_busy_slot_until_it_completes():
    store, backend = make_store(orders_slots=False)
    client_id = register(store)
    start(store, client_id, slot=0)
    with pytest.raises(SlotBusyError):
        start(store, client_id, slot=0, seq=2)
    start(store, client_id, slot=1, seq=2)  # other slots are free
    assert store.finish_lookup(backend.jobs[0]) == LookupReply(slot=0, seq=1, out_of_range=0)
    start(store, client_id, slot=0, seq=3)
    assert store.stats()["lookups"] == 1 and store.stats()["rows"] == 2 * 2 * 24


def test_ordered_backend_queues_one_slot_and_releases_refused_lookups():
    store, backend = make_store(orders_slots=True)
    client_id = register(store)
    start(store, client_id, slot=0, seq=1)
    start(store, client_id, slot=0, seq=3)  # the device queue orders them: no SlotBusyError
    with pytest.raises(BadIdsError, match="registered 1..8"):
        start(store, client_id, slot=1, seq=4, tokens=9)
    skip = backend.jobs[-1]
    assert skip.skip and skip.slot == 1 and skip.seq == 4 and skip.context == JobContext(silent=True)
    for job in backend.jobs:
        store.finish_lookup(job)
    stats = store.stats()
    assert stats["lookups"] == 2 and stats["clients"][0]["errors"] == 1
    assert stats["clients"][0]["in_flight"] == 0


def test_a_slot_takes_its_next_lookup_only_once_the_last_ones_ids_are_handed_over():
    store, backend = make_store(orders_slots=True)
    client_id = register(store)
    slab = backend.slabs[0]
    slab.handed_over = set()
    start(store, client_id, slot=0, seq=1)
    start(store, client_id, slot=1, seq=2)  # another slot: its first lookup
    with pytest.raises(SlotBusyError, match="IDs of lookup 1 are not handed over"):
        start(store, client_id, slot=0, seq=3)
    assert [(j.slot, j.seq, j.skip) for j in backend.jobs] == [(0, 1, False), (1, 2, False)], \
        "a refusal of this kind queues no release behind the unsatisfied wait"
    slab.handed_over.add((0, 1))
    with pytest.raises(BadIdsError):  # a refusal of another kind is released, and counts as the
        start(store, client_id, slot=0, seq=4, tokens=9)  # slot's last lookup
    assert (backend.jobs[-1].seq, backend.jobs[-1].skip) == (4, True)
    with pytest.raises(SlotBusyError, match="lookup 4"):
        start(store, client_id, slot=0, seq=5)
    slab.handed_over.add((0, 4))
    start(store, client_id, slot=0, seq=6)
    assert store.stats()["clients"][0]["errors"] == 3


def test_overdue_lookups_are_described_with_their_client_and_cost_it_nothing():
    store, backend = make_store(orders_slots=True, ids_wait_s=7.5)
    client_id = register(store)
    start(store, client_id, slot=1, seq=9)
    assert store.overdue_lookups() == [] and backend.overdue_limits == [7.5]
    backend.overdue = [backend.jobs[0]]
    [said] = store.overdue_lookups()
    assert said.startswith(f"client {client_id} (pid {os.getpid()}): lookup 9 (slot 1) has waited over 7.5 s")
    stats = store.stats()
    assert stats["errors"] == {} and stats["clients"][0]["errors"] == 0


def test_refused_lookup_with_a_bad_slot_submits_nothing():
    store, backend = make_store(orders_slots=True)
    client_id = register(store)
    with pytest.raises(BadRequestError, match="slot 5"):
        start(store, client_id, slot=5)
    assert backend.jobs == []


def test_release_waits_for_in_flight_lookups_before_freeing():
    store, backend = make_store()
    client_id = register(store)
    start(store, client_id)
    store.release(b"a", client_id)
    assert backend.dropped_for == [client_id], "what no gather has begun is dropped at once"
    assert not backend.slabs[0].closed, "a gather may still write the slab"
    with pytest.raises(NotRegisteredError):
        start(store, client_id, slot=1)
    store.finish_lookup(backend.jobs[0])
    assert backend.slabs[0].closed and client_id not in store.clients


def test_lookups_the_backend_drops_at_retirement_free_the_slab_once(caplog):
    store, backend = make_store()
    client_id = register(store)
    start(store, client_id)
    start(store, client_id, slot=1)
    backend.queued, backend.finish = list(backend.jobs), store.finish_lookup
    with caplog.at_level(logging.INFO, logger="engramd.registry"):
        store.release(b"a", client_id)
    assert backend.slabs[0].closed and client_id not in store.clients
    assert "2 of its lookups cut short" in caplog.text


def test_dead_clients_are_reaped_and_idle_live_ones_are_not():
    store, backend = make_store()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    live = register(store)
    dead = register(store, identity=b"d", pid=child.pid)
    child.wait()
    assert store.reap_dead() == [dead]
    assert backend.slabs[1].closed and dead not in store.clients
    assert store.reap_dead() == [] and live in store.clients
    assert store.stats()["reaped"] == 1


def test_registration_reports_whether_daemon_and_gpu_client_share_mps(caplog):
    from engramd.client.shared.mps import MpsState

    store, backend = make_store(orders_slots=True)
    backend.mps = {"GPU-a": MpsState(True, "7:42"), "GPU-b": MpsState(False, "")}
    shared = {"enabled": True, "server": "7:42"}
    cases = [("cuda:GPU-a", shared, True), ("cuda:GPU-a", {"enabled": True, "server": "7:43"}, False),
             ("cuda:GPU-a", None, False), ("cuda:GPU-a", {"enabled": "yes"}, False),
             ("cuda:GPU-b", {"enabled": False, "server": ""}, False)]
    for device, reported, expected in cases:
        reply = store.register(b"x", RegisterRequest(**{"pid": os.getpid(), "device": device, "tp_rank": 0,
                                      "tp_size": 1, "max_tokens": 8, "slots": 2, "mps": reported}))
        assert reply.mps["shared"] is expected, (device, reported, reply.mps)
        record = store.clients[reply.client_id]
        assert record.summary()["mps_shared"] is expected
        store.release(b"x", reply.client_id)
    assert sum("without a shared MPS server" in m for m in caplog.messages) == 4
    cpu = store.register(b"y", RegisterRequest(**{"pid": os.getpid(), "device": "cpu", "tp_rank": 0, "tp_size": 1,
                                "max_tokens": 8, "slots": 2}))
    assert cpu.mps is None


def test_mps_state_identity_follows_the_folder_not_its_name(tmp_path, monkeypatch):
    from engramd.client.shared.mps import MpsState, pipe_directory, server_identity

    (tmp_path / "pipe").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "pipe")
    assert server_identity(str(tmp_path / "pipe")) == server_identity(str(tmp_path / "alias")) != ""
    assert server_identity(str(tmp_path / "pipe")) != server_identity(str(tmp_path / "other"))
    assert server_identity(str(tmp_path / "missing")) == ""
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "alias"))
    assert pipe_directory() == str(tmp_path / "alias")
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY")
    assert pipe_directory() == "/tmp/nvidia-mps"
    on = MpsState(True, "1:2")
    assert on.shares_with(MpsState(True, "1:2")) and not on.shares_with(MpsState(True, "1:3"))
    assert not MpsState(False, "").shares_with(MpsState(False, ""))
    assert not MpsState(True, "").shares_with(MpsState(True, ""))
    assert MpsState.from_wire(on.to_wire()) == on
    assert MpsState.from_wire({"enabled": True, "server": "x" * 65}) is None
    assert MpsState.from_wire([True]) is None


def test_auto_mode_maps_gpu_clients_with_or_without_mps_and_serves_cpu_ones():
    from engramd.client.shared.mps import MpsState

    store, backend = make_store(orders_slots=True)
    backend.mps = {"GPU-a": MpsState(True, "1:1")}

    def mode_of(reported_server: str, device: str = "cuda:GPU-a") -> str:
        reply = store.register(b"x", RegisterRequest(**{"pid": os.getpid(), "device": device, "tp_rank": 0,
                                      "tp_size": 1, "max_tokens": 8, "slots": 2, "mode": "auto",
                                      "mps": {"enabled": True, "server": reported_server}}))
        record = store.attach(reply.client_id, reply.token, me())
        store.release(b"x", reply.client_id)
        assert (record.slab is None) == (reply.mode == "mapped")
        return reply.mode

    assert mode_of("1:1") == "mapped"  # the daemon's MPS server shared
    assert mode_of("9:9") == "mapped"
    assert mode_of("1:1", device="cpu") == "served"
    assert len(backend.slabs) == 1  # the CPU client's: a mapped client gets no slab
    store.limits = Limits(2, 64, 4, modes=("served",))
    assert mode_of("9:9") == "served"  # auto takes what the daemon allows


def test_a_token_attaches_once_and_mapped_clients_are_refused_served_lookups():
    store, backend = make_store()
    reply = store.register(b"m", RegisterRequest(**{"pid": os.getpid(), "device": "cpu", "tp_rank": 0, "tp_size": 1,
                                  "max_tokens": 8, "slots": 2, "mode": "mapped"}))
    client_id, token = reply.client_id, reply.token
    with pytest.raises(NotRegisteredError):
        store.attach(client_id, token[::-1], me())
    with pytest.raises(NotRegisteredError):
        store.attach(client_id + 1, token, me())
    assert store.attach(client_id, token, me()).client_id == client_id
    with pytest.raises(BadRequestError, match="attaches once"):
        store.attach(client_id, token, me())
    lookup = {"client_id": client_id, "slot": 0, "seq": 1, "tokens": 1, "ids_dtype": "int64",
              "ids_shape": [1, 2, 24], "inline": True}
    with pytest.raises(BadRequestError, match="mapped mode"):
        store.start_lookup(b"m", LookupRequest(**lookup), [np.zeros((1, 2, 24)).tobytes()], lambda job: None, JobContext())
    assert backend.jobs == [] and backend.slabs == []


def test_mapped_counts_from_heartbeats_only_grow_and_survive_the_client():
    store, _ = make_store()
    reply = store.register(b"m", RegisterRequest(**{"pid": os.getpid(), "device": "cpu", "tp_rank": 0, "tp_size": 1,
                                  "max_tokens": 8, "slots": 2, "mode": "mapped"}))
    client_id, token = reply.client_id, reply.token
    store.heartbeat(b"other-connection", client_id, token, {"lookups": 4, "rows": 40, "out_of_range": 1})
    with pytest.raises(BadRequestError, match="cumulative"):  # stale: refused, nothing counted
        store.heartbeat(b"m", client_id, "", {"lookups": 3, "rows": 40, "out_of_range": 1})
    with pytest.raises(BadRequestError, match=r"an int in \[0, 2\*\*53\]"):
        store.heartbeat(b"m", client_id, "", {"lookups": 5, "rows": "lots", "out_of_range": 1})
    stats = store.stats()
    assert (stats["lookups"], stats["rows"], stats["out_of_range"]) == (4, 40, 1)
    assert stats["clients"][0]["lookups"] == 4
    store.heartbeat(b"m", client_id, token, {"lookups": 6, "rows": 60, "out_of_range": 1})
    store.release(b"m", client_id)
    stats = store.stats()
    assert (stats["lookups"], stats["rows"], stats["clients"]) == (6, 60, [])


def test_a_peer_outside_the_allowed_ids_is_refused_with_nothing_allocated():
    uid, gid = os.getuid(), os.getgid()
    store, backend = make_store(allowed_uids=frozenset({uid + 1}), allowed_gids=frozenset({gid + 1}))
    reply = store.register(b"a", RegisterRequest(**{"pid": os.getpid(), "device": "cpu", "tp_rank": 0, "tp_size": 1,
                                  "max_tokens": 8, "slots": 2}))
    with pytest.raises(PermissionDeniedError, match=f"uid {uid} / gid {gid}"):
        store.attach(reply.client_id, reply.token, me())
    assert backend.slabs == [] and store.clients == {}
    for allowed in ({"allowed_uids": frozenset({uid})}, {"allowed_gids": frozenset({gid})},
                    {"allowed_uids": frozenset({uid + 1}), "allowed_gids": frozenset({gid})}):
        store, backend = make_store(**allowed)
        register(store)
        assert len(backend.slabs) == 1, allowed


def test_unattached_and_silent_invisible_clients_are_reaped_after_the_silence(monkeypatch):
    from engramd.server import registry as registry_module

    now = [1000.0]
    monkeypatch.setattr(registry_module.time, "monotonic", lambda: now[0])
    store, backend = make_store(heartbeat_interval=1.0)
    pending = store.register(b"p", RegisterRequest(**{"pid": os.getpid(), "device": "cpu", "tp_rank": 0,
                                    "tp_size": 1, "max_tokens": 8, "slots": 2})).client_id
    invisible = register(store, identity=b"i", pid=0)  # SO_PEERCRED says 0: not visible here
    assert ATTACH_TIMEOUT_S < HUNG_AFTER_S == store.limits.silence_s  # the floor, at 1 s beats
    now[0] += ATTACH_TIMEOUT_S - 0.01
    assert store.reap_dead() == []
    now[0] += 0.02
    assert store.reap_dead() == [pending] and list(store.clients) == [invisible]
    now[0] += HUNG_AFTER_S - ATTACH_TIMEOUT_S - 0.02  # just before the silence runs out
    assert store.reap_dead() == []
    now[0] += 0.02
    assert store.reap_dead() == [invisible]
    assert backend.slabs[0].closed and store.clients == {}


def test_slabs_are_reserved_against_one_budget_at_registration():
    store, backend = make_store(slab_budget=5 << 20)
    store.limits = Limits(3, 64, 4, slab_budget=5 << 20)
    first = register(store)  # 8 tokens x 2 slots: one 2 MiB granule
    register(store, identity=b"b")
    with pytest.raises(ResourceError, match="slab budget"):
        store.register(b"c", RegisterRequest(**{"pid": os.getpid(), "device": "cpu", "tp_rank": 0, "tp_size": 1,
                              "max_tokens": 8, "slots": 2}))
    store.release(b"a", first)
    register(store, identity=b"c")  # the released slab's bytes are free again
    assert len(backend.slabs) == 3


def test_registrations_never_attached_give_their_places_to_new_ones(monkeypatch):
    """Peers that register over many connections and never attach held every place for 10 s
    at a time. When every place is taken, the oldest registration unattached for longer than
    PENDING_GRACE_S gives its place up; attached clients and fresh registrations never do."""
    from engramd.server import registry as registry_module

    now = [500.0]
    monkeypatch.setattr(registry_module.time, "monotonic", lambda: now[0])
    store, backend = make_store()  # two places
    attached = register(store, identity=b"good")
    hostile = store.register(b"h1", RegisterRequest(**{"pid": 1, "device": "cpu", "tp_rank": 0, "tp_size": 1,
                                     "max_tokens": 8, "slots": 2})).client_id
    fresh = RegisterRequest(**{"pid": os.getpid(), "device": "cpu", "tp_rank": 0, "tp_size": 1, "max_tokens": 8, "slots": 2})
    with pytest.raises(ResourceError, match="client limit"):
        store.register(b"new", fresh)  # the unattached one is still within its grace
    now[0] += registry_module.PENDING_GRACE_S + 0.01
    newcomer = store.register(b"new", fresh).client_id
    assert sorted(store.clients) == sorted([attached, newcomer]) and hostile not in store.clients
    with pytest.raises(ResourceError, match="client limit"):
        store.register(b"later", fresh)  # the newcomer is fresh and the other one attached


def test_tokens_come_from_the_ids_shape_and_a_sent_count_must_agree():
    store, backend = make_store()
    client_id = register(store)
    unsent = LookupRequest(client_id, slot=0, seq=1, ids_dtype="int32", ids_shape=[2, 2, 24], inline=True)
    assert unsent.tokens is None
    store.start_lookup(b"a", unsent, ids_frame(2), lambda job: None, JobContext())
    assert backend.jobs[-1].tokens == 2
    with pytest.raises(BadIdsError, match=r"tokens 3 but ids shape \[2, 2, 24\]"):
        store.start_lookup(b"a", dataclasses.replace(lookup_req(client_id, slot=1), tokens=3),
                           ids_frame(2), lambda job: None, JobContext())


def test_a_device_counting_backend_reports_no_per_lookup_count():
    """A GPU counts out-of-range IDs on the device (stats reads them): its lookups' replies do
    not claim a count of zero."""
    for per_job in (True, False):
        store, backend = make_store()
        backend.counts_per_job = per_job
        client_id = register(store)
        store.start_lookup(b"a", lookup_req(client_id), ids_frame(2), lambda job: None, JobContext())
        job = backend.jobs[-1]
        job.out_of_range = 5
        reply = store.finish_lookup(job)
        assert reply == LookupReply(slot=0, seq=1, out_of_range=5 if per_job else None)


def test_pinned_clients_are_refused_once_the_tables_change_and_others_follow():
    store, backend = make_store(orders_slots=True)
    store.tables_id = "aaaa"
    free, pinned = register(store), register(store, identity=b"b", pin_tables=True)
    start(store, free, seq=1)
    start(store, pinned, identity=b"b", seq=1)
    store.tables_changed("bbbb")
    start(store, free, seq=2)  # follows: the backend reads the new tables for it
    with pytest.raises(TablesChangedError, match="pinned tables aaaa"):
        start(store, pinned, identity=b"b", seq=2)
    skip = backend.jobs[-1]  # its GPU waits on the slot are still released, in order
    assert skip.skip and skip.client_id == pinned and skip.seq == 2
    by_id = {c["client_id"]: c for c in store.stats()["clients"]}
    assert (by_id[free]["tables"], by_id[pinned]["tables"], by_id[pinned]["pinned"]) == ("bbbb", "aaaa", True)
    # A re-registration that names the tables it pinned is refused elsewhere, taken here.
    for job in backend.jobs:
        store.finish_lookup(job)
    store.release(b"a", free)
    with pytest.raises(TablesChangedError):
        store.register(b"c", RegisterRequest(os.getpid(), "cpu", 0, 1, 8, 2, tables="aaaa"))
    again = store.register(b"c", RegisterRequest(os.getpid(), "cpu", 0, 1, 8, 2, tables="bbbb"))
    assert store.clients[again.client_id].pinned_tables == "bbbb" and again.tables == "bbbb"


def test_mapped_clients_get_the_tables_again_by_token_and_by_the_same_user():
    store, _ = make_store()
    store.tables_id = "aaaa"
    req = RegisterRequest(os.getpid(), "cpu", 0, 1, 8, 2, mode="mapped")
    reply = store.register(b"m", req)
    with pytest.raises(PermissionDeniedError, match="not attached"):
        store.grant_tables(reply.client_id, reply.token, me())
    store.attach(reply.client_id, reply.token, me())
    with pytest.raises(NotRegisteredError):
        store.grant_tables(reply.client_id, reply.token[::-1], me())
    with pytest.raises(PermissionDeniedError, match="uid"):
        store.grant_tables(reply.client_id, reply.token, PeerCredentials(os.getpid(), os.getuid() + 1, 0))
    store.tables_changed("bbbb")
    assert store.clients[reply.client_id].tables == "aaaa"  # until it maps the new ones
    assert store.grant_tables(reply.client_id, reply.token, me()).tables == "bbbb"
    served = register(store, identity=b"s")
    with pytest.raises(BadRequestError, match="served"):
        store.grant_tables(served, store.clients[served].token, me())
    store.release(b"s", served)
    pinned = store.register(b"p", RegisterRequest(os.getpid(), "cpu", 0, 1, 8, 2, mode="mapped",
                                                  pin_tables=True))
    store.attach(pinned.client_id, pinned.token, me())
    store.tables_changed("cccc")
    with pytest.raises(TablesChangedError):
        store.grant_tables(pinned.client_id, pinned.token, me())


def test_a_reload_between_register_and_attach_is_caught_at_attach():
    store, _ = make_store()
    store.tables_id = "aaaa"
    free = store.register(b"m", RegisterRequest(os.getpid(), "cpu", 0, 1, 8, 2, mode="mapped"))
    pinned = store.register(b"p", RegisterRequest(os.getpid(), "cpu", 0, 1, 8, 2, mode="mapped",
                                                  pin_tables=True))
    assert free.tables == pinned.tables == "aaaa"
    store.tables_changed("bbbb")
    assert store.attach(free.client_id, free.token, me()).tables == "bbbb"  # it maps these
    with pytest.raises(TablesChangedError, match="replaced"):
        store.attach(pinned.client_id, pinned.token, me())
    assert pinned.client_id not in store.clients  # retired, nothing granted
