"""What a waiting standby tells systemd (server/standby.py StandbyNotices), against a recording
notifier: READY=1 once, the first time it has done what it can; STATUS= on every change; the
watchdog petted every interval and no more often."""

from __future__ import annotations

import pytest

from engramd.server import standby


class Recorder:
    def __init__(self, watchdog_interval: float | None):
        self.watchdog_interval = watchdog_interval
        self.sent: list[tuple[str, str | None]] = []

    def ready(self, status: str) -> None:
        self.sent.append(("ready", status))

    def status(self, status: str) -> None:
        self.sent.append(("status", status))

    def watchdog(self) -> None:
        self.sent.append(("watchdog", None))


def test_ready_once_when_settled_and_status_on_every_change():
    recorder = Recorder(watchdog_interval=None)
    notices = standby.StandbyNotices(recorder)
    notices("waiting for tables A", False)
    notices("waiting for tables A", False)  # unchanged: nothing
    notices("tables A mapped ahead", True)
    notices("tables A mapped ahead", True)
    notices("waiting for tables B", False)  # a reload: where it stands changed, ready stays said
    notices("tables B mapped ahead", True)
    assert recorder.sent == [("status", "waiting for tables A"), ("ready", "tables A mapped ahead"),
                             ("status", "waiting for tables B"), ("status", "tables B mapped ahead")]


def test_the_watchdog_is_petted_every_interval(monkeypatch: pytest.MonkeyPatch):
    now = [100.0]
    monkeypatch.setattr(standby.time, "monotonic", lambda: now[0])
    recorder = Recorder(watchdog_interval=1.0)
    notices = standby.StandbyNotices(recorder)
    for step in range(9):  # every 0.5 s for 4 s: a pet at 0, 1, 2, 3 and 4 s
        now[0] = 100.0 + step * 0.5
        notices.pet()
    assert recorder.sent == [("watchdog", None)] * 5


def test_no_watchdog_without_an_interval():
    recorder = Recorder(watchdog_interval=None)
    standby.StandbyNotices(recorder).pet()
    assert recorder.sent == []
