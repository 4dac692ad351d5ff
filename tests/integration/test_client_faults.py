"""A client through its daemon's faults and its engine's mistakes: a daemon away longer than
`reconnect_timeout`, one stopped (alive, silent) while lookups wait, a process forked with a
client in it. Rows are checked against the reference bit for bit wherever a lookup returns."""

from __future__ import annotations

import json
import os
import signal
import time
import warnings

import numpy as np
import pytest
import torch
from helpers import wait_until
from reference import random_ids

from engramd.client import BadRequestError, DaemonUnavailableError, EngramClient, ReplyTimeoutError
from engramd.client.future import LookupFuture


def exact(rows: torch.Tensor, reference, ids: np.ndarray) -> bool:
    return np.array_equal(rows.double().numpy(), reference.expected(ids))


@pytest.mark.parametrize("mode", ["served", "mapped"])
def test_a_client_that_found_no_daemon_tries_again_at_its_next_lookup(daemon_factory, reference, mode):
    """Once a reconnect had waited out `reconnect_timeout`, every later call said "client is
    closed", the daemon back or not. The docs promise DaemonUnavailableError until the daemon
    is back, and the next lookup() registering again."""
    first = daemon_factory(instance="back")
    client = EngramClient(first.socket, mode=mode, timeout=10, reconnect_timeout=1)
    second = None
    try:
        ids = random_ids(np.random.default_rng(21), 8, reference.rows, reference.heads)
        assert exact(client.lookup(torch.from_numpy(ids)).result(), reference, ids)
        address = client.slot_rows(0).data_ptr()
        first.proc.kill()
        first.proc.wait()

        def refused() -> bool:  # a mapped client rides through on its mapping first
            try:
                client.lookup(torch.from_numpy(ids)).result()
            except DaemonUnavailableError as exc:
                assert "no daemon to re-register with within 1 s" in exc.message, exc.message
                return True
            return False

        wait_until(refused, timeout=30, step=0.2)
        for call in (client.stats, client.health):
            with pytest.raises(DaemonUnavailableError, match="not registered: no daemon answered"):
                call()
        with pytest.raises(DaemonUnavailableError, match="within 1 s"):  # again, not "closed"
            client.lookup(torch.from_numpy(ids))
        second = daemon_factory(instance="back", shm_dir=first.shm_dir, workdir=first.workdir)
        assert exact(client.lookup(torch.from_numpy(ids)).result(), reference, ids)
        assert client.mode == mode and client.health()["state"] == "ready"
        # The slots' memory stayed where it was (slot_rows' promise while mode and layout stay).
        assert client.slot_rows(0).data_ptr() == address and client.rows_generation == 0
    finally:
        client.close()
    with pytest.raises(DaemonUnavailableError, match="client is closed"):
        client.lookup(torch.from_numpy(ids))
    assert second.stop() == 0


def test_a_slot_whose_lookup_timed_out_is_not_taken_until_the_daemon_answers(daemon_factory, reference):
    """The next lookup into the slot of one the daemon had not answered within the timeout was
    sent anyway, and the daemon refused it (slot_busy). Now it is not sent: ReplyTimeoutError
    says why, and both lookups' rows come once the daemon goes on."""
    daemon = daemon_factory()
    rng = np.random.default_rng(22)
    first_ids, second_ids = (random_ids(rng, 8, reference.rows, reference.heads) for _ in range(2))
    client = EngramClient(daemon.socket, max_tokens=8, slots=1, timeout=1.0)
    try:
        daemon.proc.send_signal(signal.SIGSTOP)
        first = client.lookup(torch.from_numpy(first_ids))
        with pytest.raises(ReplyTimeoutError, match=f"slot 0 still waits for lookup seq {first.seq}"):
            client.lookup(torch.from_numpy(second_ids))
        daemon.proc.send_signal(signal.SIGCONT)
        assert exact(first.result(timeout=60), reference, first_ids)
        assert exact(client.lookup(torch.from_numpy(second_ids)).result(timeout=60), reference, second_ids)
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
        client.close()


def test_close_waits_for_a_silent_daemon_once_not_once_a_lookup(daemon_factory, reference, monkeypatch):
    """close() gave each lookup in flight the client's whole timeout: slots x timeout for a
    stopped daemon. It gives them one deadline now: the waits it grants add up to one timeout
    at most, however the machine schedules them (each wait after the first gets what the
    first left, and a stopped daemon makes the first take all of it)."""
    granted: list[float] = []
    collect = LookupFuture._collect

    def counted(future: LookupFuture, timeout: float | None) -> None:
        granted.append(timeout)
        collect(future, timeout)

    monkeypatch.setattr(LookupFuture, "_collect", counted)
    daemon = daemon_factory()
    ids = random_ids(np.random.default_rng(23), 4, reference.rows, reference.heads)
    client = EngramClient(daemon.socket, max_tokens=4, slots=8, timeout=2.0)
    try:
        daemon.proc.send_signal(signal.SIGSTOP)
        for slot in range(client.slots):
            client.lookup(torch.from_numpy(ids), slot=slot)
        client.close()
        assert len(granted) == client.slots, granted
        assert sum(granted) <= client.timeout, f"close() granted {granted}: a timeout a lookup"
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
        client.close()
    with EngramClient(daemon.socket, max_tokens=4) as other:  # the daemon goes on serving
        assert exact(other.lookup(torch.from_numpy(ids)).result(timeout=60), reference, ids)


def test_a_forked_child_cannot_use_its_parents_client_and_the_parent_goes_on(daemon_factory, reference):
    """A child's lookup() and close() waited for ever on what the parent's threads held at the
    fork. Every call there now says at once that the client is its parent's; close() does
    nothing; the parent's client and its lookup in flight are untouched."""
    daemon = daemon_factory()
    ids = random_ids(np.random.default_rng(24), 8, reference.rows, reference.heads)
    client = EngramClient(daemon.socket, max_tokens=8, slots=2)
    try:
        future = client.lookup(torch.from_numpy(ids))
        calls = {"lookup": lambda: client.lookup(torch.from_numpy(ids)), "stats": client.stats,
                 "health": client.health, "result": future.result, "done": future.done,
                 "failed": future.failed}
        read, write = os.pipe()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork() beside threads: the child only reports
            pid = os.fork()
        if pid == 0:  # the child: report each call's outcome, and never return into pytest
            try:
                told = {}
                for name, call in calls.items():
                    try:
                        call()
                        told[name] = "returned"
                    except BadRequestError as exc:
                        told[name] = "parent's" if "made before this process was forked" in exc.message else exc.message
                    except BaseException as exc:
                        told[name] = repr(exc)
                client.close()
                told["close"] = "returned"
                os.write(write, json.dumps(told).encode())
            finally:
                os._exit(0)
        os.close(write)
        deadline = time.monotonic() + 60
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail("the forked child hung on its parent's client")
            time.sleep(0.05)
        with os.fdopen(read, "rb") as pipe:
            told = json.loads(pipe.read() or b"{}")
        assert told == {**{name: "parent's" for name in calls}, "close": "returned"}, told
        assert exact(future.result(timeout=60), reference, ids)
        assert exact(client.lookup(torch.from_numpy(ids)).result(timeout=60), reference, ids)
    finally:
        client.close()
