"""server/daemon.py self_checked: re-attached tables that fail the start's self-check are opened
again with every row compared (verify_tables) where their own sampled rows differ from the
checkpoint; where they agree the kernel is what failed, and no reload would help: the start
fails at once, as it did."""

from __future__ import annotations

import types

import pytest

from engramd.server import daemon
from engramd.server.config import load_config
from engramd.server.selfcheck import SelfCheckError


def loaded_tables(closed: list) -> types.SimpleNamespace:
    backend = types.SimpleNamespace(close=lambda: closed.append("backend"))
    return types.SimpleNamespace(checkpoint="ckpt", tables=[types.SimpleNamespace(reattached=True)],
                                 backend=backend, close=lambda: closed.append("tables"))


@pytest.mark.parametrize("host_rows_differ", [True, False])
def test_only_tables_whose_own_rows_differ_are_loaded_again(monkeypatch, host_rows_differ):
    checks, loads, closed = [], [], []
    again = loaded_tables([])

    def self_check(checkpoint, loaded):
        checks.append(loaded)
        if len(checks) == 1:
            raise SelfCheckError("layer 0 row 3 differs")

    def host_check(checkpoint, tables):
        if host_rows_differ:
            raise SelfCheckError("the host tables' row 3 differs")

    monkeypatch.setattr(daemon, "run_self_check", self_check)
    monkeypatch.setattr(daemon, "check_host_tables", host_check)
    monkeypatch.setattr(daemon, "load_tables", lambda config, progress: loads.append(config) or again)
    config = load_config(None, {"verify_tables": False})
    first = loaded_tables(closed)
    if host_rows_differ:
        assert daemon.self_checked(config, first, lambda fraction: None) is again
        assert [c.verify_tables for c in loads] == [True] and checks == [first, again]
    else:
        with pytest.raises(SelfCheckError, match="layer 0 row 3"):
            daemon.self_checked(config, first, lambda fraction: None)
        assert loads == [], "the kernel failed, not the tables: nothing loaded again"
    assert closed == ["backend", "tables"], "the tables that failed are closed either way"
