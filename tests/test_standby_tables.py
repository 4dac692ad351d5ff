"""A standby's look at its configured checkpoint (server/standby_tables.py TableWatch): opened
again only when a file it was read from changed, and never kept stale by a change that lands
while it opens."""

from __future__ import annotations

import os
import shutil
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


def test_a_checkpoint_that_cannot_be_opened_is_none_and_looked_at_again(watch):
    watch._checkpoint()
    (watch.folder / "config.json").rename(watch.folder / "config.moved")
    assert watch._checkpoint() == (None, None)
    (watch.folder / "config.moved").rename(watch.folder / "config.json")
    assert watch._checkpoint()[0] is not None
