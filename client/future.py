"""The pending rows of one lookup, as the client's lookup() returns them, and what it asks of
the path that made it (LookupPath: served GPU and CPU in client/served.py, mapped in
client/mapped_path.py). Not here: how rows are gathered or released, which is each path's."""

from __future__ import annotations

import math
import threading
from typing import Any, Protocol

import torch

from engramd.client import process
from engramd.client.checks import check_wait
from engramd.client.errors import (
    BadRequestError,
    DaemonUnavailableError,
    EngramError,
    InternalError,
    LookupFailedError,
    ReplyTimeoutError,
)
from engramd.client.failures import FailedLookups
from engramd.client.shared.mapped import DeferredGather


class LookupPath(Protocol):
    """What a LookupFuture asks of the path that made it."""

    device: torch.device
    failures: FailedLookups  # the client's failed lookups not reported yet (client/failures.py)

    @property
    def slots_epoch(self) -> int:
        """The client's registrations that took its slots over (a lookup of an older one is lost)."""

    def check_current(self, lookup: LookupFuture) -> None:
        """Raise DaemonUnavailableError if the lookup's rows are gone (closed, re-registered),
        BadRequestError if a later lookup took its slot."""

    def rows(self, lookup: LookupFuture) -> torch.Tensor:
        """The view of the lookup's rows in its slot."""

    def rows_written(self, lookup: LookupFuture) -> bool:
        """Whether the rows are known written, without waiting."""

    def poll_failure(self, lookup: LookupFuture) -> None:
        """Record a failure the path can see without waiting (LookupFuture.failed)."""

    def before_wait(self, lookup: LookupFuture) -> None:
        """GPU: what the path learns, or raises, before a stream waits for the rows."""

    def stream_wait(self, lookup: LookupFuture, stream: torch.cuda.Stream) -> None:
        """GPU: make `stream` wait for the rows."""

    def after_sync(self, lookup: LookupFuture) -> None:
        """GPU: once result() synchronised on the rows, what says they are not the lookup's."""

    def reply_ready(self, lookup: LookupFuture) -> bool:
        """Acknowledged lookups: whether the daemon's reply is in, without waiting."""

    def wait_reply(self, lookup: LookupFuture, timeout: float | None) -> Any:
        """Acknowledged lookups: the daemon's reply (its error raised)."""

    @property
    def lock(self) -> threading.RLock:
        """Held by lookup(): while it is held, no lookup takes a slot."""


class ClientPath:
    """What every path of one client answers alike, from the client's registration and slot
    memory (which outlive a path's lookups); the rest of LookupPath is each path's own."""

    def __init__(self, client: Any):
        self._client = client
        self.device: torch.device = client.device

    @property
    def failures(self) -> FailedLookups:
        return self._client._failed

    @property
    def lock(self) -> threading.RLock:
        return self._client._tables_lock

    @property
    def slots_epoch(self) -> int:
        return self._client._slots_epoch

    def check_current(self, lookup: LookupFuture) -> None:
        if self._client._slab is None:
            raise DaemonUnavailableError("client is closed or not registered")
        if lookup.slots_epoch != self._client._slots_epoch:
            raise DaemonUnavailableError(
                "this lookup was made before the client re-registered with a restarted daemon; "
                "its rows are lost: look them up again")
        if self._client._pending.get(lookup.slot) is not lookup:
            # A later lookup took the slot (in turn, or named): the rows there are its own, or
            # on their way, and nothing in them says so.
            raise BadRequestError(
                f"lookup seq {lookup.seq}: slot {lookup.slot} has taken a later lookup since, so "
                f"its rows are gone; read a lookup's rows before {self._client.slots} further "
                "lookups (or the next one into its slot), or keep them with result(copy=True)")

    def rows(self, lookup: LookupFuture) -> torch.Tensor:
        return self._client._slab.rows(lookup.slot, lookup.tokens)

    def poll_failure(self, lookup: LookupFuture) -> None:
        pass

    def before_wait(self, lookup: LookupFuture) -> None:
        pass

    def after_sync(self, lookup: LookupFuture) -> None:
        pass

    def reply_ready(self, lookup: LookupFuture) -> bool:
        return False

    def wait_reply(self, lookup: LookupFuture, timeout: float | None) -> Any:
        raise InternalError(f"lookup {lookup.rid}: the daemon does not acknowledge this kind of lookup")


class LookupFuture:
    """The pending rows of one lookup."""

    def __init__(self, path: LookupPath, rid: int, slot: int, seq: int, tokens: int,
                 acked: bool = True):
        self._path = path
        self._born = process.generation()  # a forked child's copy refuses (client/process.py)
        self.slots_epoch = path.slots_epoch  # a re-registration that takes the slots over makes it stale
        self.rid = rid
        self.slot = slot
        self.seq = seq
        self.tokens = tokens
        self.out_of_range = 0
        # GPU lookups are not acknowledged when they succeed (completion is the slot's counter),
        # so there is no reply to wait for; an error reply still arrives and is kept here.
        self._replied = not acked
        self._collecting = threading.Lock()  # one thread waits for the reply, others find it in
        self._error: EngramError | None = None
        self.consumers: list[torch.cuda.Stream] = []  # GPU: streams that waited on these rows
        self.event: torch.cuda.Event | None = None  # mapped GPU lookups: recorded after the gather
        self.deferred: DeferredGather | None = None  # mapped GPU lookups: the gather, until queued
        # Served GPU lookups whose wait the daemon did not satisfy: their rows are NaN, not
        # theirs (client/failures.py). Set once, by the watchdog or the lookup thread.
        self.failure: LookupFailedError | None = None
        # Served GPU: recorded where its stream handed the IDs over (after the slot's previous
        # readers): what the slot's next use and a release's NaN fill wait for.
        self.submitted: torch.cuda.Event | None = None

    def failed(self) -> bool:
        """True once this lookup is known to have failed: its rows are not its own (the daemon
        died, retired this client or refused the lookup) and wait()/result() raise. Never waits
        and never syncs: an engine may poll it off its critical path, from the thread that uses
        the client (it reads the daemon's replies)."""
        process.check_made_here(self._born, "this lookup")
        if self.failure is None and self._error is None:
            self._path.poll_failure(self)
        return self.failure is not None or self._error is not None

    def ok(self) -> bool:
        """True once the rows are known to be this lookup's (written, not failed); False while
        they may still come, and after a failure. Never waits and never syncs."""
        if self.failed():
            return False
        try:
            self._path.check_current(self)  # closed, re-registered, or its slot taken since
        except EngramError:
            return False
        return self._path.rows_written(self)

    def done(self) -> bool:
        """True once the host has nothing left to wait for: on the CPU, the daemon's reply with
        the rows written; on the GPU, always (the rows are ready in stream order, see wait())."""
        process.check_made_here(self._born, "this lookup")
        if self.slots_epoch != self._path.slots_epoch:
            return True  # made before a re-registration: result() says so (its rid is reused)
        if not self._replied and self._path.reply_ready(self):
            self._collect(None)
        return self._replied

    def result(self, timeout: float | None = None, copy: bool = False) -> torch.Tensor:
        """Block until the rows are ready; `[n_layers, T, local_heads, head_dim]` bfloat16.
        Raises LookupFailedError if this lookup, or one whose failure was not yet reported,
        failed (client/failures.py). A served CPU lookup waits for the daemon's reply up to
        `timeout` seconds (default: the client's `timeout`), then raises ReplyTimeoutError; a
        later call may still collect the rows. A GPU lookup synchronises on its rows, holding
        the client's lock: other threads' lookups wait meanwhile."""
        process.check_made_here(self._born, "this lookup")
        timeout = check_wait(timeout)
        path = self._path
        self._raise_failure()
        path.check_current(self)
        self._collect(timeout)
        # From the check to the copy, no lookup of another thread may take the slot over.
        with path.lock:
            path.check_current(self)
            rows = path.rows(self)
            if path.device.type == "cuda":
                stream = torch.cuda.current_stream(path.device.index)
                path.stream_wait(self, stream)
                stream.synchronize()
                self._raise_failure()  # released by the watchdog while we synced
                path.after_sync(self)
                self._raise_failure()
            return rows.clone() if copy else rows

    def wait(self, stream: torch.cuda.Stream | None = None) -> torch.Tensor:
        """GPU: make `stream` (default: current) wait for the rows and return their view at once."""
        process.check_made_here(self._born, "this lookup")
        path = self._path
        if path.device.type != "cuda":
            return self.result()
        self._raise_failure()
        path.check_current(self)
        path.before_wait(self)
        if self._error is not None:
            path.failures.reported(self)
            raise self._error
        stream = stream or torch.cuda.current_stream(path.device.index)
        path.stream_wait(self, stream)
        return path.rows(self)

    def _raise_failure(self) -> None:
        """This lookup's own failure (the daemon's typed error first), else any failure of the
        client not yet reported."""
        failed = self._path.failures
        for own in (self._error, self.failure):
            if own is not None:
                failed.reported(self)
                raise own
        failed.raise_unreported()

    def _collect(self, timeout: float | None) -> None:
        if not self._replied:
            # One thread waits for the reply; one that waited here finds it collected, or gives
            # up at its own timeout (it may hold the client's lock: _claim_slot, close).
            bound = -1.0 if timeout is None or timeout == math.inf else timeout  # -1: none
            if not self._collecting.acquire(timeout=bound):
                raise ReplyTimeoutError(f"lookup seq {self.seq}: another thread waits for its reply; "
                                        f"none within {timeout:.1f} s")
            try:
                if not self._replied:
                    self._wait_for_reply(timeout)
            finally:
                self._collecting.release()
        if self._error is not None:
            raise self._error

    def _wait_for_reply(self, timeout: float | None) -> None:
        try:
            reply = self._path.wait_reply(self, timeout)
            self.out_of_range = reply.body.out_of_range or 0
        except ReplyTimeoutError:
            raise  # the lookup may still complete: a later call can collect it
        except EngramError as exc:
            self._error = exc
        self._replied = True
