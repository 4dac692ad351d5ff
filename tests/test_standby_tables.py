"""A standby's look at its configured checkpoint (server/standby_tables.py TableWatch): opened
again only when a file it was read from changed, and never kept stale by a change that lands
while it opens."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from engramd.server import standby_tables
from engramd.server.checkpoint import EngramCheckpoint
from engramd.server.config import load_config
from engramd.server.standby_tables import TableWatch


@pytest.fixture
def watch(demo_checkpoint, tmp_path, monkeypatch):
    """A TableWatch (not started) on a copy of the demo checkpoint; `watch.opens` counts opens."""
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(demo_checkpoint, checkpoint)
    config = load_config(None, {"tables": str(checkpoint), "shm_dir": str(tmp_path / "shm"),
                                "socket": str(tmp_path / "engramd.sock"), "backend": "cpu"})
    watch = TableWatch(config)
    watch.opens = 0
    watch.folder = checkpoint
    real = standby_tables.resolve_checkpoint

    def counted(config):
        watch.opens += 1
        return real(config)

    monkeypatch.setattr(standby_tables, "resolve_checkpoint", counted)
    return watch


def touch(path: Path) -> None:
    info = os.stat(path)
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns + 1_000_000_000))


def test_an_untouched_checkpoint_is_not_opened_again(watch):
    first = watch._checkpoint()
    for _ in range(5):
        assert watch._checkpoint()[0] == first[0]
    assert watch.opens == 2  # the second open learns which files to watch


@pytest.mark.parametrize("which", ["config", "index", "shard"])
def test_a_changed_file_is_opened_again_and_changes_the_fingerprint(watch, which):
    fingerprint, checkpoint = watch._checkpoint()
    watch._checkpoint()
    opens = watch.opens
    files = {"config": checkpoint.files()[0], "index": checkpoint.files()[1],
             "shard": checkpoint.files()[-1]}
    assert files["index"].name == "model.safetensors.index.json"
    touch(files[which])
    again, _ = watch._checkpoint()
    assert watch.opens == opens + 1
    assert (again != fingerprint) == (which == "shard")  # the fingerprint holds the shards' mtimes
    watch._checkpoint()
    assert watch.opens == opens + 1


def test_a_change_during_an_open_is_seen_at_the_next_look(watch, monkeypatch):
    watch._checkpoint()  # learns the files
    shard = watch._opened.files[-1]
    real = EngramCheckpoint.open

    def changed_while_opening(directory):
        opened = real(directory)
        touch(shard)  # after the read: the open's fingerprint is the old one
        return opened

    monkeypatch.setattr(EngramCheckpoint, "open", changed_while_opening)
    stale, _ = watch._checkpoint()
    monkeypatch.setattr(EngramCheckpoint, "open", real)
    fresh, _ = watch._checkpoint()
    assert fresh != stale
    assert fresh == EngramCheckpoint.open(watch.folder).fingerprint()


def test_a_form_of_the_checkpoint_that_appears_is_a_change(watch):
    """A single-file checkpoint that gains an index (or the reverse) may be another checkpoint:
    the files watched include the forms that are not there."""
    fingerprint, _ = watch._checkpoint()
    watch._checkpoint()
    opens = watch.opens
    (watch.folder / "model.safetensors").write_bytes(b"not read: the index comes first")
    assert watch._checkpoint()[0] == fingerprint
    assert watch.opens == opens + 1


def test_a_checkpoint_that_cannot_be_opened_is_none_and_looked_at_again(watch):
    watch._checkpoint()
    (watch.folder / "config.json").rename(watch.folder / "config.moved")
    assert watch._checkpoint() == (None, None)
    (watch.folder / "config.moved").rename(watch.folder / "config.json")
    assert watch._checkpoint()[0] is not None


class Health:
    def __init__(self, ready: bool, tables: str | None, reload_state: str | None = None):
        self.ready, self.tables = ready, tables
        self.reload = {"state": reload_state} if reload_state else {}


@pytest.mark.parametrize("health,settled", [
    (None, False),  # the serving daemon does not answer (starting, or gone)
    (Health(False, None), False),  # starting
    (Health(True, "other"), True),  # ready on other tables, no reload: it may stay so
    (Health(True, "other", reload_state="loading"), False),  # reloading: perhaps to ours
])
def test_a_standby_whose_tables_are_not_served_waits_or_settles(watch, health, settled):
    fingerprint, _ = watch._checkpoint()
    watch._health = lambda: health
    status, got = watch._step()
    assert got == settled, status
    assert fingerprint in status


def test_tables_served_but_not_where_the_standby_looks_settle_it(watch):
    fingerprint, _ = watch._checkpoint()
    watch._health = lambda: Health(True, fingerprint)  # nothing in the standby's shm folder
    status, settled = watch._step()
    assert settled and "are served, but not in" in status


def test_looks_that_keep_failing_settle_after_a_while_and_one_that_passes_does_not(
        watch, monkeypatch):
    monkeypatch.setattr(standby_tables, "WATCH_S", 0.001)
    monkeypatch.setattr(standby_tables, "SETTLE_AFTER_FAILURES", 3)
    states = []
    looks = iter([RuntimeError("a look that raced a reload"), ("waiting", False)]
                 + [RuntimeError("for good")] * 1000)

    def step():
        look = next(looks)
        if isinstance(look, Exception):
            raise look
        return look

    watch._step = step
    watch._on_state = lambda status, settled: states.append(settled)
    watch._thread.start()
    try:
        deadline = time.monotonic() + 30
        while True not in states and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        watch.hand_over()
    assert states[:5] == [False, False, False, False, True]
