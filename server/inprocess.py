"""The service driven from this process: tables, backend and operations without a socket.

    with InProcessService(config) as service:          # loads (or re-attaches) the tables
        client = service.client(max_tokens=64)
        rows = client.lookup(ids)                       # [n_layers, T, local_heads, head_dim] bf16

For tests and benchmarks that want the daemon's own code path (validation, slots, the backend's
gather, accounting) without ZeroMQ, the handle socket or another process. CPU backend only: its
IDs travel inline and its slab is host memory (a served GPU slot is written by the client's own
stream, which is the socket client's business).
"""

from __future__ import annotations

import itertools
import os
import threading
import uuid
from typing import Any

import numpy as np
import torch

from engramd.client.errors import BadRequestError, ReplyTimeoutError
from engramd.client.shared.handles import PeerCredentials
from engramd.client.shared.messages import LookupRequest, RegisterRequest, ReleaseRequest
from engramd.server.backend import LookupJob
from engramd.server.config import DaemonConfig
from engramd.server.job_context import JobContext
from engramd.server.registry import ClientRecord
from engramd.server.selfcheck import run_self_check
from engramd.server.service import Service
from engramd.server.table_loader import load_tables

LOOKUP_TIMEOUT_S = 60.0


class InProcessService:
    def __init__(self, config: DaemonConfig):
        if config.backend != "cpu":  # "auto" picks a GPU where there is one
            raise BadRequestError(f"backend {config.backend!r}: the in-process service serves "
                                  "the CPU backend only (backend = cpu)")
        self.service = Service.from_config(config, uuid.uuid4().hex[:16])
        self.loaded = load_tables(config, lambda fraction: None)
        try:
            if config.self_check:
                run_self_check(self.loaded.checkpoint, self.loaded)
            self.service.serve(self.loaded, on_retire=lambda record: None)
        except BaseException:
            self.loaded.backend.close()
            self.loaded.close()
            raise
        self._identities = itertools.count(1)

    def client(self, max_tokens: int, slots: int = 1, tp_rank: int = 0, tp_size: int = 1,
               name: str = "in-process") -> InProcessClient:
        """Register and attach a client, with this process's credentials."""
        identity = f"in-process-{next(self._identities)}".encode()
        reply = self.service.register(identity, RegisterRequest(
            pid=os.getpid(), device="cpu", tp_rank=tp_rank, tp_size=tp_size,
            max_tokens=max_tokens, slots=slots, name=name))
        peer = PeerCredentials(os.getpid(), os.geteuid(), os.getegid())
        record = self.service.attach(reply.client_id, reply.token, peer)
        return InProcessClient(self.service, identity, record)

    def close(self) -> None:
        self.service.close()  # finishes queued gathers, frees the slabs, closes the tables

    def __enter__(self) -> InProcessService:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class InProcessClient:
    """One registered client: lookups through the service, one at a time, slot after slot."""

    def __init__(self, service: Service, identity: bytes, record: ClientRecord):
        self.service = service
        self.identity = identity
        self.record = record
        self.client_id = record.client_id
        self._seqs = itertools.count(1)
        self.out_of_range = 0  # of the last lookup

    def lookup(self, ids: np.ndarray, copy: bool = True) -> torch.Tensor:
        """`ids` [T, n_layers, heads] int32/int64 -> the rows the backend gathered: a copy, or
        with copy=False a view of the slot (valid until the slot's next lookup)."""
        ids = np.ascontiguousarray(ids)
        seq = next(self._seqs)
        slot = seq % self.record.slab.layout.slots
        finished = threading.Event()
        jobs: list[LookupJob] = []

        def done(job: LookupJob) -> None:
            jobs.append(job)
            finished.set()

        request = LookupRequest(client_id=self.client_id, slot=slot, seq=seq, ids_dtype=str(ids.dtype),
                                ids_shape=list(ids.shape), inline=True)
        self.service.lookup(self.identity, request, [ids.tobytes()], done, JobContext())
        if not finished.wait(LOOKUP_TIMEOUT_S):
            raise ReplyTimeoutError(f"in-process lookup {seq} not done within {LOOKUP_TIMEOUT_S} s")
        reply = self.service.finish_lookup(jobs[0])  # raises the lookup's typed error
        self.out_of_range = reply.out_of_range or 0
        rows = self.record.slab.rows(slot, ids.shape[0])
        return rows.clone() if copy else rows

    def release(self) -> None:
        self.service.release(self.identity, ReleaseRequest(client_id=self.client_id))
