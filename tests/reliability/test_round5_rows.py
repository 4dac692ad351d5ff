"""A fifth round of attacks on a real daemon (CPU backend, demo tables), on the one promise that
matters most: no fault ever becomes a wrong row without an error. Each test here is one finding,
and fails without its fix; every row a client returns is compared with the reference decoded
from the checkpoint's bytes (tests/reference.py).

What this is not: the daemon's resources and protocol (the earlier rounds: test_hostile.py,
test_round3.py, test_round4.py).
"""

from __future__ import annotations

import signal

import numpy as np
import pytest
import torch
from helpers import rows_match
from reference import random_ids

from engramd.client import BadRequestError, EngramClient


def ids_of(reference, rng: np.random.Generator, tokens: int) -> torch.Tensor:
    return torch.from_numpy(random_ids(rng, tokens, reference.rows, reference.heads))


# -- 1. a future read after its slot was taken -----------------------------------------------------


@pytest.mark.parametrize("mode", ["served", "mapped"])
def test_a_lookup_read_after_its_slot_was_taken_raises_not_the_later_rows(daemon_factory,
                                                                         reference, mode):
    """A result stays valid until `slots` further lookups; a future read after that returned
    the rows of the lookup that took its slot since, as its own, without a word (an engine that
    runs one step deeper than it has slots; a lookup read late after a reply timed out). Such a
    read raises BadRequestError now, and ok() says False."""
    daemon = daemon_factory()
    rng = np.random.default_rng(51)
    with EngramClient(daemon.socket, max_tokens=8, slots=2, timeout=30, mode=mode) as client:
        first, second, third = (ids_of(reference, rng, 4) for _ in range(3))
        early = client.lookup(first)
        client.lookup(second)
        late = client.lookup(third)  # slot 0 again: early's
        assert rows_match(late.result().double().numpy(), reference, third.numpy())
        assert not early.ok()
        with pytest.raises(BadRequestError, match="slot 0 has taken a later lookup"):
            early.result()
        named = client.lookup(first, slot=1)
        client.lookup(second, slot=1)
        with pytest.raises(BadRequestError, match="slot 1 has taken a later lookup"):
            named.result()


# -- 2. IDs refilled after lookup() -----------------------------------------------------------------

REFILLED_TOKENS = 4096  # 1.5 MiB of int64 IDs: far over ZeroMQ's copy threshold (64 KiB)


def test_a_served_cpu_lookup_reads_the_ids_it_was_given_not_what_the_caller_wrote_after(
        daemon_factory, reference):
    """A served client copies the IDs in lookup() (docs/client.md), so an engine may refill its
    IDs buffer for the next step at once. On the CPU the frame was sent from the caller's own
    tensor, which ZeroMQ reads on its I/O thread after lookup() returns: a refill before it was
    sent (always, with the daemon slow to read; in most of a few tries even idle, for a prefill
    of 4096 tokens) was looked up instead, and its rows returned as the lookup's."""
    daemon = daemon_factory()
    rng = np.random.default_rng(52)
    with EngramClient(daemon.socket, max_tokens=REFILLED_TOKENS, slots=2, timeout=60) as client:
        ids = ids_of(reference, rng, REFILLED_TOKENS)
        asked = ids.clone()
        daemon.proc.send_signal(signal.SIGSTOP)  # it reads nothing: the frame waits to be sent
        try:
            future = client.lookup(ids)
            ids.copy_(ids_of(reference, rng, REFILLED_TOKENS))  # the next step's, in the same buffer
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        assert rows_match(future.result().double().numpy(), reference, asked.numpy()), \
            "the rows of the IDs written after lookup(), not of the ones it was given"


# -- 3. the adapter after a restart on tables of another geometry ------------------------------------


def test_the_adapter_refuses_rows_of_a_restarted_daemon_of_another_geometry(daemon_factory,
                                                                            tmp_path_factory):
    """EngramRunnerAdapter builds its hasher once, from the geometry of its first registration.
    Its client follows a daemon restarted on tables of another geometry (here: other bucket
    sizes, the same layers and heads, so the IDs' shape passes) without a word, and the adapter
    went on hashing for the old buckets: every step's rows were rows of the new tables at IDs
    that are no n-gram's there, returned as the step's. Its prefetch raises TablesChangedError
    now."""
    from engramd.client.adapter import EngramRunnerAdapter
    from engramd.client.errors import TablesChangedError
    from engramd.client.geometry import DEMO_CONFIG, TableGeometry
    from engramd.server.synthetic import write_synthetic_checkpoint

    other = TableGeometry.from_config({**DEMO_CONFIG, "engram_vocab_size": 600}, source="other buckets")
    other_checkpoint = write_synthetic_checkpoint(other, tmp_path_factory.mktemp("other-geometry"), seed=9)
    first = daemon_factory()
    token_map = np.arange(DEMO_CONFIG["engram_compressed_vocab_size"], dtype=np.int32)
    tokens = torch.arange(100, 116)
    with EngramRunnerAdapter(first.socket, max_tokens=16, token_map=token_map, timeout=30) as adapter:
        adapter.prefetch(tokens)
        adapter.rows(layer_id=1)
        first.proc.kill()
        first.proc.wait()
        second = daemon_factory(tables=other_checkpoint, instance="other", shm_dir=first.shm_dir,
                                workdir=first.workdir)
        with pytest.raises(TablesChangedError, match="another geometry"):
            adapter.prefetch(tokens)
        with pytest.raises(RuntimeError, match="before prefetch"):
            adapter.rows(layer_id=1)  # the refused step's rows are not handed out either
    assert second.stop() == 0, second.log()
