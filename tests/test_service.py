"""The service (server/service.py) driven in-process (server/inprocess.py), without a socket: the
operations a daemon serves, on the CPU backend and the demo tables, with rows checked against
the reference."""

from __future__ import annotations

import dataclasses
import os
import shutil

import numpy as np
import pytest
from helpers import shm_tempdir
from reference import random_ids

from engramd.client.errors import (
    BadIdsError,
    BadRequestError,
    NotReadyError,
    NotRegisteredError,
    PermissionDeniedError,
)
from engramd.client.shared import protocol
from engramd.client.shared.handles import PeerCredentials
from engramd.client.shared.messages import (
    HeartbeatReply,
    HeartbeatRequest,
    LookupRequest,
    RegisterRequest,
    ReleaseReply,
)
from engramd.server.config import build_config
from engramd.server.inprocess import InProcessService
from engramd.server.job_context import JobContext
from engramd.server.service import Service

ME = PeerCredentials(os.getpid(), os.getuid(), os.getgid())
STRANGER = PeerCredentials(1, 4242, 4242)


@pytest.fixture
def config(demo_checkpoint):
    shm = shm_tempdir()
    yield build_config({"tables": str(demo_checkpoint), "shm_dir": str(shm), "instance": "svc",
                        "backend": "cpu", "workers": 1, "max_tokens": 64}, "test")
    shutil.rmtree(shm, ignore_errors=True)


@pytest.fixture
def served(config):
    with InProcessService(config) as served:
        yield served


def test_the_in_process_service_is_for_the_cpu_backend(config):
    with pytest.raises(BadRequestError, match="backend 'auto'"):
        InProcessService(dataclasses.replace(config, backend="auto"))


def test_before_its_tables_the_service_serves_nobody(config):
    service = Service.from_config(config, "e" * 16)
    assert service.report.stats().state == "starting" and service.report.health().ready is False
    with pytest.raises(NotReadyError, match="daemon is starting"):
        service.register(b"a", RegisterRequest(1, "cpu", 0, 1, 8, 1))
    with pytest.raises(NotReadyError, match="lookup: daemon is starting"):
        service.lookup(b"a", LookupRequest(1, 0, 1, "int32", [1, 2, 24], True), [], lambda job: None, JobContext())


def test_rows_through_the_service_equal_the_reference(served, reference):
    client = served.client(max_tokens=64, slots=2)
    for seed in (1, 2, 3):
        ids = random_ids(np.random.default_rng(seed), 64, reference.rows, reference.heads)
        rows = client.lookup(ids).float().numpy().astype(np.float64)
        wrong = np.argwhere(rows != reference.expected(ids))
        assert wrong.size == 0, f"lookup {seed}: first wrong {wrong[:5].tolist()}"
        past = sum(int(((ids[:, layer] >= rows) | (ids[:, layer] < -1)).sum())
                   for layer, rows in enumerate(reference.rows))
        assert client.out_of_range == past > 0
    with pytest.raises(BadIdsError, match="registered 1..64"):
        client.lookup(np.zeros((65, 2, reference.heads), dtype=np.int64))
    assert served.service.report.stats().lookups == 3


def test_counts_are_for_all_and_who_the_clients_are_for_admins(served, reference):
    service = served.service
    client = served.client(max_tokens=8, name="in-process")
    client.lookup(random_ids(np.random.default_rng(4), 8, reference.rows, reference.heads))
    stats = service.report.stats()
    assert stats.lookups == 1 and stats.state == "ready"
    assert not {"pid", "name", "uid"} & stats.clients[0].keys()
    assert service.clients(ME).clients == [{"client_id": client.client_id, "pid": os.getpid(),
                                               "name": "in-process", "uid": os.geteuid()}]
    with pytest.raises(PermissionDeniedError, match="uid 4242"):
        service.clients(STRANGER)
    assert service.admits(ME) and service.admits(STRANGER)  # no allowed ids: whom the modes let in
    assert service.report.metrics()["lookups"] == 1
    registered = service.register(b"z", RegisterRequest(pid=1, device="cpu", tp_rank=0, tp_size=1,
                                                        max_tokens=8, slots=1))
    for sent in (registered, stats, service.report.health(), HeartbeatReply(), ReleaseReply()):
        decoded = protocol.decode_reply(protocol.encode_reply(1, service.epoch, sent))
        assert decoded.body == sent, sent.OP  # every declared field travels, typed


def test_release_retires_and_a_released_client_is_not_served(served):
    client = served.client(max_tokens=8)
    client.release()
    with pytest.raises(NotRegisteredError):
        served.service.heartbeat(client.identity, HeartbeatRequest(client.client_id, "x"))
    tables = served.service.tables_id  # a bare heartbeat: the daemon is here, serving these
    assert tables and served.service.heartbeat(b"a", HeartbeatRequest()) == HeartbeatReply(tables)
    assert served.service.in_flight() == 0 and served.service.report.stats().clients == []
