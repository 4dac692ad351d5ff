"""A lookup's reply routing and timing, carried on its job (`LookupJob.context`).

The daemon fills in where the reply goes and when the request was read; the backends add the
times the latency metrics are made of, and the cuda backend marks the lookups it has reported
overdue. None of it decides what is gathered. Not a wire format: nothing in it leaves the daemon.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class JobContext:
    """One lookup's reply routing and timing. Times are `time.perf_counter()` values; None where
    the lookup has not passed that point (or never does on its backend)."""

    # Where the answer goes: the client's ZeroMQ identity and the request's id. A context built
    # without a transport (in-process clients, tests) keeps the defaults and is never answered.
    identity: bytes = b""
    rid: int = 0
    # False: the client asked for no reply unless the lookup fails (its slot's counter says done).
    ack: bool = True
    # A refused lookup's slot release: the loop only books it, no reply of any kind is sent.
    silent: bool = False
    # The request was read; the store notes its own time where the caller left it None.
    received: float | None = None
    # CPU: the lookup's pieces were queued for the workers.
    submitted: float | None = None
    # CPU: a worker began its first piece; set only on the CPU, which is how the loop tells the
    # lookups whose stages it observes.
    started: float | None = None
    # GPU: the gather was enqueued on the device; CPU: the last piece's rows were written. Both
    # backends set it when they hand the job back, a failed one included.
    enqueued: float | None = None
    # CPU: the loop answered; the last stage's end.
    answered: float | None = None
    # GPU: already reported as waiting for its IDs past the limit, so it is reported once.
    overdue: bool = False
