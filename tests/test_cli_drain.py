"""`engramd drain`'s wait for the daemon it drained: what counts as its exit (server/cli.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engramd.client.errors import DaemonUnavailableError, ReplyTimeoutError
from engramd.server import cli
from engramd.server.daemon import DRAIN_TIMEOUT_S


def answering(result):
    def probe(socket, op, timeout):
        assert op == "health"
        if isinstance(result, Exception):
            raise result
        return SimpleNamespace(epoch=result)
    return probe


@pytest.mark.parametrize("answer, seen", [
    (DaemonUnavailableError("no daemon socket at /x"), (True, None)),  # its socket is gone
    ("e2", (True, "e2")),  # another daemon answers there: a standby took over, or a restart
    ("e1", (False, None)),  # it still answers: draining
    (ReplyTimeoutError("no answer"), (False, None)),  # silent: busy finishing, not gone
])
def test_what_counts_as_the_drained_daemons_exit(monkeypatch, answer, seen):
    monkeypatch.setattr(cli, "probe", answering(answer))
    assert cli._drained_gone("/x", "e1") == seen


def test_drain_waits_longer_than_the_daemon_may_drain():
    """A daemon drains for at most DRAIN_TIMEOUT_S before it exits regardless; drain's default
    wait covers that, so a slow drain is not reported as a failure."""
    wait = cli.build_parser().parse_args(["drain"]).wait
    assert wait > DRAIN_TIMEOUT_S
