"""The pending rows of one lookup, as the client's lookup() returns them.

A future is made by one of the client's paths (served GPU: client/served.py; mapped:
client/mapped_path.py; CPU served: client/client.py) and asks the client what only it knows: the
slot memory, the daemon's replies and death, the failures not reported yet (client/failures.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engramd.client.errors import EngramError, LookupFailedError, ReplyTimeoutError
from engramd.client.mapped import DeferredGather

if TYPE_CHECKING:
    from engramd.client.client import EngramClient


class LookupFuture:
    """The pending rows of one lookup."""

    def __init__(self, client: EngramClient, rid: int, slot: int, seq: int, tokens: int,
                 acked: bool = True):
        self._client = client
        self.slots_epoch = client._slots_epoch  # a re-registration that takes the slots over makes it stale
        self.rid = rid
        self.slot = slot
        self.seq = seq
        self.tokens = tokens
        self.out_of_range = 0
        # GPU lookups are not acknowledged when they succeed (completion is the slot's counter),
        # so there is no reply to wait for; an error reply still arrives and is kept here.
        self._replied = not acked
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
        client = self._client
        if self.failure is None and self._error is None and client.device.type == "cuda":
            client._take_in()  # error replies the daemon sent since
            if self._error is None and client._served.daemon_failed(self):  # its reply may be late
                client._failed.add(self, "the daemon did not serve it")
        return self.failure is not None or self._error is not None

    def ok(self) -> bool:
        """True once the rows are known to be this lookup's (written, not failed); False while
        they may still come, and after a failure. Never waits and never syncs."""
        return not self.failed() and self._client._rows_written(self)

    def done(self) -> bool:
        """True once the host has nothing left to wait for: on the CPU, the daemon's reply with
        the rows written; on the GPU, always (the rows are ready in stream order, see wait())."""
        if self.slots_epoch != self._client._slots_epoch:
            return True  # made before a re-registration: result() says so (its rid is reused)
        if not self._replied and self._client._conn.poll_reply(self.rid):
            self._collect(None)
        return self._replied

    def result(self, timeout: float | None = None, copy: bool = False) -> torch.Tensor:
        """Block until the rows are ready; `[n_layers, T, local_heads, head_dim]` bfloat16.
        Raises LookupFailedError if this lookup, or one whose failure was not yet reported,
        failed (client/failures.py)."""
        self._raise_failure()
        self._client._check_current(self)
        self._collect(timeout)
        rows = self._client._slab.rows(self.slot, self.tokens)
        if self._client.device.type == "cuda":
            stream = torch.cuda.current_stream(self._client.device.index)
            self._client._stream_wait(self, stream)
            stream.synchronize()
            self._raise_failure()  # released by the watchdog while we synced
            if self.event is None:  # served: error replies and the daemon's death come in here
                self._client._take_in()
                self._client._check_alive()
            if self._error is None and self._client._served.daemon_failed(self):
                self._error = self._client._served.error_of(self)
            if self.event is None and self._error is None and not self._client._rows_written(self):
                # Released by the daemon's free of the slab (it retired us) before our watchdog
                # saw the lease close: the counters say these rows were never written.
                self._client._failed.add(self, "its wait was released without its rows")
            self._raise_failure()
        return rows.clone() if copy else rows

    def wait(self, stream: torch.cuda.Stream | None = None) -> torch.Tensor:
        """GPU: make `stream` (default: current) wait for the rows and return their view at once."""
        client = self._client
        if client.device.type != "cuda":
            return self.result()
        self._raise_failure()
        client._check_current(self)
        if self.event is None:  # served: error replies and the daemon's death come in here
            client._take_in()
            self._raise_failure()
            client._check_alive()
        if self._error is not None:
            client._failed.reported(self)
            raise self._error
        stream = stream or torch.cuda.current_stream(client.device.index)
        client._stream_wait(self, stream)
        return client._slab.rows(self.slot, self.tokens)

    def _raise_failure(self) -> None:
        """This lookup's own failure (the daemon's typed error first), else any failure of the
        client not yet reported."""
        failed = self._client._failed
        for own in (self._error, self.failure):
            if own is not None:
                failed.reported(self)
                raise own
        failed.raise_unreported()

    def _collect(self, timeout: float | None) -> None:
        if not self._replied:
            try:
                reply = self._client._conn.wait(self.rid, timeout, f"lookup of {self.tokens} tokens")
                self.out_of_range = reply.body.out_of_range or 0
            except ReplyTimeoutError:
                raise  # the lookup may still complete: a later call can collect it
            except EngramError as exc:
                self._error = exc
            self._replied = True
        if self._error is not None:
            raise self._error
