"""One client shared by several threads of its process, against a real daemon.

Six threads shared a served CPU client of two slots: two of them could wait for the same reply,
one took it and the other waited for good (or until its timeout, for a daemon that was fine),
and a result(copy=True) could copy a slot while another thread's lookup was writing it: rows of
two lookups, returned without an error. Now the connection is read and written by one thread at
a time, a lookup's reply is waited for by one thread (the others find it collected), and no
lookup takes a slot between result()'s check of it and its copy. A lookup whose slot another
thread took first is told so (BadRequestError), as in one thread."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from reference import random_ids

from engramd.client import BadRequestError, EngramClient

THREADS = 6
LOOKUPS_PER_THREAD = 40
CLIENT_TIMEOUT_S = 20.0
# What the client promises: each of a thread's two calls a lookup (lookup(), which may wait for
# its slot's last reply, and result()) returns or raises within the client's timeout. A thread
# that runs past that has hung.
JOIN_S = LOOKUPS_PER_THREAD * 2 * CLIENT_TIMEOUT_S


@pytest.mark.timeout(JOIN_S + 120)
@pytest.mark.parametrize("own_slots", [False, True], ids=["slots_in_turn", "a_slot_each"])
@pytest.mark.parametrize("mode", ["served", "mapped"])
def test_threads_sharing_a_client_get_their_own_rows_or_a_typed_error(daemon_factory, reference,
                                                                       mode, own_slots):
    """Slots in turn (two for six threads): each lookup gives its own rows or, its slot taken by
    another thread's lookup first, BadRequestError saying so. A slot each: its own rows always."""
    daemon = daemon_factory()
    pool = [random_ids(np.random.default_rng(seed), 24, reference.rows, reference.heads)
            for seed in range(20)]
    expected = [reference.expected(ids) for ids in pool]
    counts = {"exact": 0, "slot_taken": 0}
    wrong: list[str] = []
    lock = threading.Lock()
    slots = THREADS if own_slots else 2
    with EngramClient(daemon.socket, device="cpu", mode=mode, max_tokens=32, slots=slots,
                      timeout=CLIENT_TIMEOUT_S) as client:
        def worker(n: int) -> None:
            rng = np.random.default_rng(100 + n)
            for _ in range(LOOKUPS_PER_THREAD):
                pick = int(rng.integers(len(pool)))
                try:
                    future = client.lookup(torch.from_numpy(pool[pick]), slot=n if own_slots else None)
                    rows = future.result(copy=True)
                except BadRequestError as exc:
                    with lock:
                        if own_slots or "has taken a later lookup" not in str(exc):
                            wrong.append(f"{type(exc).__name__}: {exc}")
                        else:
                            counts["slot_taken"] += 1
                    continue
                except Exception as exc:  # a timeout from a healthy daemon, or anything else
                    with lock:
                        wrong.append(f"{type(exc).__name__}: {exc}")
                    continue
                same = np.array_equal(rows.double().numpy(), expected[pick], equal_nan=True)
                with lock:
                    if same:
                        counts["exact"] += 1
                    else:
                        wrong.append(f"ID set {pick}: rows not its own")

        threads = [threading.Thread(target=worker, args=(n,), daemon=True) for n in range(THREADS)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + JOIN_S
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in threads), f"a thread still waits after {JOIN_S:.0f} s: {counts}"
    assert not wrong, (wrong[:5], counts)
    assert counts["exact"] + counts["slot_taken"] == THREADS * LOOKUPS_PER_THREAD, counts
    if own_slots:
        assert counts["exact"] == THREADS * LOOKUPS_PER_THREAD, counts
