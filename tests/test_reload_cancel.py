"""server/reload.py: a stop waits for a reload's load a bounded time (TableReload.cancel)."""

from __future__ import annotations

import logging
import threading

from engramd.server import reload


def test_a_stop_does_not_wait_for_good_on_a_load_that_hangs(monkeypatch, caplog):
    """A load stops between chunks when cancelled; one stuck in a read (a stalled filesystem)
    never gets there, and the stop waited for it without end."""
    stuck = threading.Event()

    def hanging_load(config, current, progress, cancelled):
        stuck.wait(60)  # deaf to `cancelled`, as a read that hangs is
        raise reload.ReloadCancelled("released by the test")

    monkeypatch.setattr(reload, "open_next_tables", hanging_load)
    monkeypatch.setattr(reload, "CANCEL_WAIT_S", 0.2)
    loading = reload.TableReload(config=None, current=None, requested_by="uid 0", done=lambda r: None)
    try:
        with caplog.at_level(logging.ERROR, logger="engramd.reload"):
            loading.cancel()  # returns: the test's own timeout would stop a wait without end
        assert "did not stop within" in caplog.text
    finally:
        stuck.set()


def test_a_load_that_stops_when_cancelled_is_closed(monkeypatch):
    closed = []

    class Opened:
        def close(self):
            closed.append(True)

    def load(config, current, progress, cancelled):
        return Opened()

    monkeypatch.setattr(reload, "open_next_tables", load)
    loading = reload.TableReload(config=None, current=None, requested_by="uid 0", done=lambda r: None)
    loading.cancel()
    assert closed == [True]
