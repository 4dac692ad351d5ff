"""No fault becomes a wrong row: a served GPU client looks up batches whose rows are known in
advance, the way an engine does (lookup, wait, a consumer on the stream, no sync per step), while
its daemon is killed (-9) and restarted, killed and replaced by a standby, drained (SIGTERM), or
reloads its tables. Every lookup either has exactly its rows or is reported failed
(client/failures.py): LookupFailedError from a later call, LookupFuture.failed(), rows of NaN.

Run it under MPS by exporting CUDA_MPS_PIPE_DIRECTORY (the daemon and this process share it).
ENGRAMD_TEST_KILLS sets the kills per run (default 20)."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
import torch
from helpers import point, reload, wait_until
from reference import bucket_ids

from engramd.client import DaemonUnavailableError, EngramClient, LookupFailedError

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CUDA = ["--backend", "cuda"]
KILLS = int(os.environ.get("ENGRAMD_TEST_KILLS", "20"))
TOKENS = 64
BATCHES = 8
# Each gather takes at least this long on the daemon's stream, so that most kills land between
# a gather's launch and its ROWS_DONE, the window this test is about.
GATHER_DELAY = {"ENGRAMD_DEBUG_GATHER_DELAY_MS": "2"}
LOOKUPS_BETWEEN_FAULTS = 20  # exact lookups on each daemon before the next fault
STANDING_BY_S = 180.0


class Ledger:
    """Every lookup of the loop with the copy its consumer made, checked after a sync."""

    def __init__(self, expected: list[list[torch.Tensor]]):
        self.expected = expected  # per table version, per batch: float64 rows on the GPU
        self.pending: list[tuple[object, int, torch.Tensor]] = []
        self.reported: set[int] = set()  # id() of futures a LookupFailedError named
        # failed_nan: failed, rows all NaN; false_failures: failed, rows exactly right (the
        # gather finished before the release's fill; the lease said nothing of it).
        self.counts = {"lookups": 0, "exact": 0, "failed": 0, "failed_nan": 0, "false_failures": 0,
                       "silent_wrong": 0, "raised": 0, "unavailable": 0}
        self.exact_since = 0  # exact lookups since the controller last asked (see fault_loop)
        self.wrong: list[str] = []

    def add(self, future, batch: int, consumed: torch.Tensor) -> None:
        self.pending.append((future, batch, consumed))
        self.counts["lookups"] += 1

    def settle(self) -> None:
        torch.cuda.current_stream().synchronize()
        for future, batch, consumed in self.pending:
            rows = consumed.double()
            exact = any(torch.equal(rows, version[batch]) for version in self.expected)
            if future.failed():
                self.counts["failed"] += 1
                self.counts["failed_nan"] += int(bool(rows.isnan().all()))
                self.counts["false_failures"] += int(exact)
                # NaN where the release's fill landed, the lookup's own rows where its gather
                # (still running as its daemon died) wrote after it: never another batch's.
                own_or_nan = any(bool((rows.isnan() | (rows == version[batch])).all())
                                 for version in self.expected)
                if not own_or_nan:
                    self.wrong.append(f"failed seq {future.seq} batch {batch}: "
                                      f"{int(rows.isnan().sum())} NaN of {rows.numel()}")
            elif exact:
                self.counts["exact"] += 1
                self.exact_since += 1
            else:
                self.counts["silent_wrong"] += 1
                nan = int(rows.isnan().sum())
                self.wrong.append(f"seq {future.seq} batch {batch}: {nan} NaN of {rows.numel()}")
        self.pending.clear()


def drive(client: EngramClient, batches: list[torch.Tensor], ledger: Ledger,
          stop: threading.Event, backoff_s: float) -> None:
    """The engine's loop: lookup, wait, consume on the stream; a sync every BATCHES steps only;
    `backoff_s` of pause after the daemon was found unavailable."""
    step = 0
    while not stop.is_set():
        batch = step % BATCHES
        try:
            future = client.lookup(batches[batch])
            rows = future.wait()
            ledger.add(future, batch, rows.clone())  # the consumer, queued behind the wait
        except LookupFailedError as exc:
            ledger.counts["raised"] += 1
            assert exc.seqs, exc
        except DaemonUnavailableError:
            ledger.counts["unavailable"] += 1
            time.sleep(backoff_s)
        step += 1
        if step % BATCHES == 0:
            ledger.settle()
    ledger.settle()


def fault_loop(client: EngramClient, batches: list[torch.Tensor], ledger: Ledger,
               faults: int, fault: Callable[[int], None], backoff_s: float = 0.01) -> None:
    """Drive the client while another thread makes `faults` faults, each after
    LOOKUPS_BETWEEN_FAULTS exact lookups and a random pause."""
    stop, failure = threading.Event(), []
    start = time.monotonic()

    def control() -> None:
        try:
            for k in range(faults):
                ledger.exact_since = 0
                wait_until(lambda: ledger.exact_since >= LOOKUPS_BETWEEN_FAULTS, timeout=STANDING_BY_S,
                           step=0.01)
                time.sleep(random.uniform(0.0, 0.05))
                # A timeline in the output (-s): a failure of the client's own CUDA context is
                # placed among the faults by it.
                print(f"fault {k} at {time.monotonic() - start:.2f} s", flush=True)
                fault(k)
                print(f"fault {k} over at {time.monotonic() - start:.2f} s", flush=True)
            ledger.exact_since = 0
            wait_until(lambda: ledger.exact_since >= LOOKUPS_BETWEEN_FAULTS, timeout=STANDING_BY_S)
        except BaseException as exc:
            failure.append(exc)
        finally:
            stop.set()

    controller = threading.Thread(target=control, name="faults")
    controller.start()
    drive(client, batches, ledger, stop, backoff_s)
    controller.join()
    if failure:
        raise failure[0]


def known_batches(reference, *others) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    rng = np.random.default_rng(38)
    ids = [bucket_ids(rng, TOKENS, reference.bucket_sizes) for _ in range(BATCHES)]
    expected = [[torch.from_numpy(ref.expected(i)).cuda() for i in ids] for ref in (reference, *others)]
    return [torch.from_numpy(i).cuda() for i in ids], expected


def served_client(socket) -> EngramClient:
    client = EngramClient(socket, device="cuda", max_tokens=TOKENS, slots=2, mode="served",
                          reconnect_timeout=STANDING_BY_S)
    assert client.mode == "served"
    return client


def report(ledger: Ledger, what: str) -> None:
    print(f"{what}: {ledger.counts}")
    assert ledger.counts["silent_wrong"] == 0, f"{what}: wrong rows without an error: {ledger.wrong[:10]}"


@pytest.mark.parametrize("restart", ["plain", "standby"])
def test_a_served_client_never_takes_wrong_rows_across_kills(daemon_factory, reference, restart):
    serving = [daemon_factory(extra=CUDA, env=GATHER_DELAY)]
    standby = [None]

    def start_standby() -> None:
        first = serving[0]
        standby[0] = daemon_factory(shm_dir=first.shm_dir, start=False, env=GATHER_DELAY,
                                    extra=[*CUDA, "--standby", "--socket", str(first.socket)])
        standby[0].socket = first.socket
        standby[0].start()
        wait_until(lambda: "mapped and pinned ahead" in standby[0].log(), timeout=STANDING_BY_S,
                   step=0.05)

    def kill(k: int) -> None:
        victim = serving[0]
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait()
        if restart == "standby":
            serving[0] = standby[0]
            serving[0].wait_ready()
            start_standby()
        else:
            serving[0] = daemon_factory(workdir=victim.workdir, shm_dir=victim.shm_dir,
                                        extra=CUDA, env=GATHER_DELAY)
        # The PIDs an MPS server's log names, beside the fault's timeline.
        print(f"fault {k}: killed {victim.proc.pid}, serving {serving[0].proc.pid}, standing by "
              f"{standby[0].proc.pid if standby[0] else None}, this client {os.getpid()}", flush=True)

    if restart == "standby":
        start_standby()
    batches, expected = known_batches(reference)
    ledger = Ledger(expected)
    with served_client(serving[0].socket) as client:
        fault_loop(client, batches, ledger, KILLS, kill)
        registrations = client.registrations
    report(ledger, f"{KILLS} kills, {restart} restarts")
    assert registrations >= KILLS + 1
    # Kills land mid-lookup (GATHER_DELAY): failures must have been seen and raised, and no
    # failed lookup's rows hold another batch's values (Ledger.settle).
    assert ledger.counts["failed"] > 0 and ledger.counts["raised"] > 0, ledger.counts
    assert not ledger.wrong, ledger.wrong[:10]


def test_a_served_client_never_takes_wrong_rows_across_drains(daemon_factory, reference):
    """SIGTERM: the daemon finishes what it has and retires its clients; lookups sent meanwhile
    are refused (NaN, FAILED, an error reply) or fail with the lease."""
    serving = [daemon_factory(extra=CUDA, env=GATHER_DELAY)]

    def drain(k: int) -> None:
        victim = serving[0]
        assert victim.stop(signal.SIGTERM) == 0, victim.log()
        serving[0] = daemon_factory(workdir=victim.workdir, shm_dir=victim.shm_dir, extra=CUDA,
                                    env=GATHER_DELAY)

    batches, expected = known_batches(reference)
    ledger = Ledger(expected)
    drains = max(3, KILLS // 4)
    with served_client(serving[0].socket) as client:
        # No pause after an error: the next lookup goes out while the daemon still drains.
        fault_loop(client, batches, ledger, drains, drain, backoff_s=0.0)
    report(ledger, f"{drains} drains")
    # A drained daemon writes the rows of every lookup it took before its leases close
    # (Daemon._drained): a failed lookup is one it refused, never one whose rows came.
    assert ledger.counts["false_failures"] == 0, ledger.counts
    assert not ledger.wrong, ledger.wrong[:10]


def test_a_served_client_never_takes_wrong_rows_across_reloads(
        daemon_factory, demo_checkpoint, reference, second_checkpoint, second_reference, tmp_path):
    """A reload switches tables between two lookups: each lookup's rows are one version's, whole."""
    current = tmp_path / "current"
    point(current, demo_checkpoint)
    daemon = daemon_factory(tables=current, extra=CUDA, env=GATHER_DELAY)
    checkpoints = [second_checkpoint, demo_checkpoint]

    def switch(k: int) -> None:
        point(current, checkpoints[k % 2])
        status = reload(daemon)
        assert (status["exit"], status["state"]) == (0, "done"), status

    batches, expected = known_batches(reference, second_reference)
    ledger = Ledger(expected)
    reloads = max(4, KILLS // 4)
    with served_client(daemon.socket) as client:
        fault_loop(client, batches, ledger, reloads, switch)
    report(ledger, f"{reloads} reloads")
    assert ledger.counts["failed"] == 0, ledger.counts
    assert daemon.stop() == 0, daemon.log()
