"""server/reload_control.py: a reload asked while one runs is not dropped. The running one may
have read the checkpoint before the asker changed it (a symlink repointed to a new revision), so
another reload follows it once it ends, one for any number of such askers; a daemon that stops
meanwhile starts none."""

from __future__ import annotations

import types

import pytest

from engramd.server import reload_control


class FakeReload:
    """A TableReload that runs until the test ends it; it failed, so nothing is switched."""

    made: list[FakeReload] = []

    def __init__(self, config, current, requested_by, done):
        self.requested_by, self.running, self.error, self.state = requested_by, True, None, "loading"
        FakeReload.made.append(self)

    def end(self) -> FakeReload:
        self.running, self.error = False, RuntimeError("the fake's load failed")
        return self

    def finish(self, state: str, *_args, **_fields) -> None:
        self.state = state


@pytest.fixture
def control(monkeypatch):
    FakeReload.made = []
    monkeypatch.setattr(reload_control, "TableReload", FakeReload)
    service = types.SimpleNamespace(state="ready", config=types.SimpleNamespace(tables="ckpt"), tables=None,
                                    tables_id="t1")
    return reload_control.ReloadControl(service)


def test_a_reload_asked_during_one_follows_it_once(control):
    control.start("pid 1", done=lambda r: None)
    control.start("pid 2", done=lambda r: None)
    control.start("SIGHUP", done=lambda r: None)
    assert [r.requested_by for r in FakeReload.made] == ["pid 1"], "one reload at a time"

    assert control.finish(FakeReload.made[0].end(), retired=lambda old: None) is False
    assert [r.requested_by for r in FakeReload.made] == ["pid 1", "SIGHUP, during the last"]
    assert control.last is FakeReload.made[1] and control.follow is None

    control.finish(FakeReload.made[1].end(), retired=lambda old: None)
    assert len(FakeReload.made) == 2, "nothing asked during the second: nothing follows it"


def test_no_reload_follows_once_the_daemon_stops(control):
    control.start("pid 1", done=lambda r: None)
    control.start("pid 2", done=lambda r: None)
    control.service.state = "stopping"
    control.finish(FakeReload.made[0].end(), retired=lambda old: None)
    assert len(FakeReload.made) == 1 and control.follow is None
