"""A fifth round of attacks on a real daemon (CPU backend, demo tables), on the one promise that
matters most: no fault ever becomes a wrong row without an error. Each test here is one finding,
and fails without its fix; every row a client returns is compared with the reference decoded
from the checkpoint's bytes (tests/reference.py).

What this is not: the daemon's resources and protocol (the earlier rounds: test_hostile.py,
test_round3.py, test_round4.py).
"""

from __future__ import annotations

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
