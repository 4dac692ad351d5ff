"""The service (server/service.py) driven in-process, without a socket: the operations a daemon
serves, on the CPU backend and the demo tables, with rows checked against the reference."""

from __future__ import annotations

import os
import shutil
import threading

import numpy as np
import pytest
from conftest import shm_tempdir
from reference import random_ids

from engramd.client import protocol
from engramd.client.errors import NotReadyError, NotRegisteredError, PermissionDeniedError
from engramd.client.handles import PeerCredentials
from engramd.server.config import build_config
from engramd.server.daemon import limits_of
from engramd.server.service import Service
from engramd.server.table_loader import load_tables

ME = PeerCredentials(os.getpid(), os.getuid(), os.getgid())
STRANGER = PeerCredentials(1, 4242, 4242)


@pytest.fixture
def service(demo_checkpoint):
    shm = shm_tempdir()
    config = build_config({"tables": str(demo_checkpoint), "shm_dir": str(shm), "instance": "svc",
                           "backend": "cpu", "workers": 1, "max_tokens": 64}, "test")
    service = Service("e" * 16, limits_of(config), {os.geteuid()})
    retired = []
    loaded = None
    try:
        assert service.stats()["state"] == "starting" and service.health()["ready"] is False
        with pytest.raises(NotReadyError, match="daemon is starting"):
            service.register(b"a", {})
        loaded = load_tables(config, lambda fraction: None)
        service.serve(loaded, on_retire=retired.append)
        service.retired = retired
        yield service
    finally:
        if loaded is not None:
            loaded.backend.close()
            service.registry.close()
            loaded.close()
        shutil.rmtree(shm, ignore_errors=True)


def lookup(service: Service, identity: bytes, client_id: int, ids: np.ndarray, seq: int) -> dict:
    """One inline lookup through the service; waits for the backend's completion."""
    finished = threading.Event()
    jobs = []

    def done(job):
        jobs.append(job)
        finished.set()

    fields = {"client_id": client_id, "slot": 0, "seq": seq, "tokens": ids.shape[0],
              "ids_dtype": "int64", "ids_shape": list(ids.shape), "inline": True, "ack": True}
    service.lookup(identity, fields, [ids.tobytes()], done, {})
    assert finished.wait(30), "the backend never completed the lookup"
    return service.finish_lookup(jobs[0])


def test_rows_through_the_service_equal_the_reference(service, reference):
    fields = service.register(b"a", {"pid": os.getpid(), "device": "cpu", "tp_rank": 0, "tp_size": 1,
                                     "max_tokens": 64, "slots": 1, "name": "in-process"})
    record = service.attach(fields["client_id"], fields["token"], ME)
    for seq in (1, 2):
        ids = random_ids(np.random.default_rng(seq), 64, reference.rows, reference.heads)
        reply = lookup(service, b"a", fields["client_id"], ids, seq)
        past = sum(int(((ids[:, layer] >= rows) | (ids[:, layer] < -1)).sum())
                   for layer, rows in enumerate(reference.rows))
        assert reply["seq"] == seq and reply["out_of_range"] == past > 0
        rows = record.slab.rows(0, 64).float().numpy().astype(np.float64)
        wrong = np.argwhere(rows != reference.expected(ids))
        assert wrong.size == 0, f"lookup {seq}: first wrong {wrong[:5].tolist()}"
    stats = service.stats()
    assert stats["lookups"] == 2 and stats["state"] == "ready"
    assert not {"pid", "name", "uid"} & stats["clients"][0].keys()
    assert service.clients(ME)["clients"] == [{"client_id": fields["client_id"], "pid": os.getpid(),
                                               "name": "in-process", "uid": os.getuid()}]
    with pytest.raises(PermissionDeniedError, match="uid 4242"):
        service.clients(STRANGER)
    assert service.admits(ME) and service.metrics()["lookups"] == 2
    for op, sent in (("register", fields), ("stats", stats), ("health", service.health()),
                     ("lookup", reply), ("heartbeat", {}), ("release", {})):
        decoded = protocol.decode_reply(protocol.encode_reply(op, 1, service.epoch, **sent))
        assert decoded.fields == sent, op  # and every declared reply field is there, typed


def test_release_retires_and_a_released_client_is_not_served(service):
    fields = service.register(b"a", {"pid": os.getpid(), "device": "cpu", "tp_rank": 0, "tp_size": 1,
                                     "max_tokens": 8, "slots": 1})
    service.attach(fields["client_id"], fields["token"], ME)
    assert service.release(b"a", {"client_id": fields["client_id"]}) == {}
    assert [r.client_id for r in service.retired] == [fields["client_id"]]
    with pytest.raises(NotRegisteredError):
        service.heartbeat(b"a", {"client_id": fields["client_id"], "token": fields["token"]})
    assert service.heartbeat(b"a", {"client_id": None, "token": ""}) == {}  # a bare one: alive
    assert service.in_flight() == 0 and service.stats()["clients"] == []
