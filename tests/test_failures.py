"""The record of lookups whose rows the daemon did not write (client/failures.py), and the
futures' non-blocking ok()/failed() on a CPU client of a real daemon."""

from __future__ import annotations

import signal
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from reference import random_ids

from engramd.client import EngramClient, LookupFailedError
from engramd.client.failures import FailedLookups


@dataclass
class Lookup:
    seq: int
    slots_epoch: int = 1
    failure: LookupFailedError | None = None


def test_a_failure_is_raised_once_naming_its_lookups():
    failed, first, second = FailedLookups(), Lookup(7), Lookup(9)
    assert failed.add(first, "the daemon exited") and failed.add(second, "the daemon exited")
    assert not failed.add(first, "found again by the other thread")  # failed once
    with pytest.raises(LookupFailedError, match=r"seq 7, 9 .*the daemon exited") as raised:
        failed.raise_unreported()
    assert raised.value.seqs == (7, 9) and raised.value.code == "lookup_failed"
    failed.raise_unreported()  # reported: not again
    assert not failed.add(first, "the client's disconnect finds it again")
    failed.raise_unreported()  # still not again
    assert isinstance(first.failure, LookupFailedError) and first.failure.seqs == (7,)
    assert "found again" not in str(first.failure)


def test_the_same_seq_of_another_registration_is_another_lookup():
    failed = FailedLookups()
    old, new = Lookup(5, slots_epoch=1), Lookup(5, slots_epoch=2)
    failed.add(old, "the daemon exited")
    failed.reported(new)  # the new registration's seq 5 reported: the old one's still stands
    with pytest.raises(LookupFailedError, match="seq 5 "):
        failed.raise_unreported()


def test_a_failure_its_own_future_reported_is_not_raised_again():
    failed, lookup = FailedLookups(), Lookup(3)
    failed.add(lookup, "refused by the daemon: slot busy")
    failed.reported(lookup)
    assert len(failed) == 0
    failed.raise_unreported()


def test_many_failures_are_named_in_a_bounded_message():
    failed = FailedLookups()
    for seq in range(1, 101):
        failed.add(Lookup(seq), "the daemon exited")
    with pytest.raises(LookupFailedError) as raised:
        failed.raise_unreported()
    assert raised.value.seqs == tuple(range(1, 101))
    assert "and 92 more" in str(raised.value) and len(str(raised.value)) < 400


def test_cpu_futures_say_ok_once_their_rows_are_there_and_not_after_a_restart(
        daemon_factory, reference):
    daemon = daemon_factory()
    ids = torch.from_numpy(random_ids(np.random.default_rng(5), 8, reference.rows, reference.heads))
    with EngramClient(daemon.socket, max_tokens=8, slots=2, reconnect_timeout=60) as client:
        done = client.lookup(ids)
        done.result()
        assert done.ok() and not done.failed()
        daemon.proc.send_signal(signal.SIGKILL)
        daemon.proc.wait()
        restarted = daemon_factory(workdir=daemon.workdir, shm_dir=daemon.shm_dir)
        client.lookup(ids).result()  # re-registers: the slots are the new registration's
        assert client.registrations == 2
        assert not done.ok(), "a lookup of the old registration: its slot is not its own any more"
    assert restarted.stop() == 0
