"""Reloading the tables while clients stay (server/reload.py), on a real daemon process.

The daemon serves `--tables DIR/current`, a symlink; a test points it at another checkpoint (the
way an operator deploys a new revision) and runs `engramd reload` or sends SIGHUP. Covered:
served and mapped clients read the new rows (exact against the independent reference) without
re-registering, and never a row of neither checkpoint; clients that pinned their tables are
refused instead; the old files go; a restart re-attaches the new tables; a reload that cannot
serve (another geometry, no checkpoint) keeps the served tables; one that finds the same
tables is "unchanged".
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import point, reload, remove_tempdir, rows_match, shm_tempdir, wait_until
from reference import random_ids
from test_daemon_lookups import assert_rows_equal

from engramd.client import EngramClient
from engramd.client.errors import TablesChangedError
from engramd.client.geometry import DEMO_CONFIG, TableGeometry
from engramd.client.shared import mapped as mapped_module
from engramd.client.shared.connection import probe
from engramd.server.checkpoint import EngramCheckpoint
from engramd.server.synthetic import write_synthetic_checkpoint

RELOAD_S = 60.0  # the demo tables reload in about a second


def rows_of(client: EngramClient, ids: np.ndarray) -> np.ndarray:
    return client.lookup(torch.from_numpy(ids)).result().double().numpy()


def table_files(daemon) -> set[str]:
    return {p.name for p in daemon.tables_dir.glob("*.tbl")}


def mapped_names(pid: int) -> set[str]:
    """Names of the files process `pid` maps (a removed file's name is still shown)."""
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {Path(line.split(maxsplit=5)[5].removesuffix(" (deleted)")).name
            for line in lines if len(line.split(maxsplit=5)) == 6}


def test_served_and_mapped_clients_read_the_new_tables_after_a_reload(
        daemon_factory, demo_checkpoint, reference, second_checkpoint, second_reference, tmp_path):
    current = tmp_path / "current"
    point(current, demo_checkpoint)
    daemon = daemon_factory(tables=current)
    ids = random_ids(np.random.default_rng(5), 48, reference.rows, reference.heads)
    served = EngramClient(daemon.socket, mode="served", max_tokens=64)
    mapped = EngramClient(daemon.socket, mode="mapped", max_tokens=64)
    pinned = {mode: EngramClient(daemon.socket, mode=mode, max_tokens=64, pin_tables=True)
              for mode in ("served", "mapped")}
    clients = [served, mapped, *pinned.values()]
    try:
        first = served.tables_id
        old_files = table_files(daemon)
        for client in clients:
            assert_rows_equal(rows_of(client, ids), reference.expected(ids), f"{client.mode} before")
        point(current, second_checkpoint)
        status = reload(daemon)
        assert (status["exit"], status["state"]) == (0, "done"), status
        assert status["tables"] not in (None, first)
        # The old files are gone, the new ones are there (the same names but for the id).
        assert not table_files(daemon) & old_files and len(table_files(daemon)) == len(old_files)
        # Served: the daemon reads the new tables for every lookup it takes after the switch.
        assert_rows_equal(rows_of(served, ids), second_reference.expected(ids), "served after")
        assert (served.tables_id, served.tables_generation) == (status["tables"], 1)
        with pytest.raises(TablesChangedError, match="pinned tables"):
            rows_of(pinned["served"], ids)
        # Mapped: each lookup reads one checkpoint or the other, whole, until the client has
        # heard of the reload and re-mapped; a pinned one reads only the old rows, then stops.
        for client, references in ((mapped, (reference, second_reference)), (pinned["mapped"], (reference,))):
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                try:
                    rows = rows_of(client, ids)
                except TablesChangedError:
                    assert client.pin_tables
                    break
                assert any(rows_match(rows, r, ids) for r in references), "rows of neither checkpoint"
                if rows_match(rows, second_reference, ids):
                    break
                time.sleep(0.05)
            else:
                raise AssertionError(f"{client.mode} client never heard of the reload")
        assert mapped.tables_id == status["tables"]
        with pytest.raises(TablesChangedError):  # and stays refused
            rows_of(pinned["mapped"], ids)
        # Every unpinned client now reads the new tables (mapped ones as they report).
        def on_new() -> bool:
            listed = probe(daemon.socket, "stats", 5.0).body.clients
            return {c["client_id"]: c["tables"] for c in listed if not c["pinned"]} == {
                served.client_id: status["tables"], mapped.client_id: status["tables"]}
        wait_until(on_new, timeout=10)
        # The old tables' memory is let go: unmapped by the daemon once its last gather on them
        # ran, and by the mapped client once it re-mapped (the pinned one keeps its mapping).
        wait_until(lambda: not mapped_names(daemon.proc.pid) & old_files, timeout=10)
        assert mapped_names(os.getpid()) & old_files  # the pinned mapped client's
        pinned["mapped"].close()
        wait_until(lambda: not mapped_names(os.getpid()) & old_files, timeout=10)  # unmapped aside
    finally:
        for client in clients:
            client.close()
    assert daemon.stop() == 0
    # A restart loads what a reload loaded: the configured path's tables, re-attached.
    again = daemon_factory(tables=current, shm_dir=daemon.shm_dir, workdir=daemon.workdir)
    with EngramClient(again.socket, max_tokens=64) as client:
        assert client.tables_id == status["tables"]
        assert_rows_equal(rows_of(client, ids), second_reference.expected(ids), "after a restart")
    assert "re-attached" in again.log()
    assert again.stop() == 0


def test_a_reload_that_cannot_serve_keeps_the_served_tables(daemon_factory, demo_checkpoint,
                                                             reference, tmp_path):
    current = tmp_path / "current"
    point(current, demo_checkpoint)
    daemon = daemon_factory(tables=current)
    ids = random_ids(np.random.default_rng(6), 16, reference.rows, reference.heads)
    other_geometry = write_synthetic_checkpoint(
        TableGeometry.from_config({**DEMO_CONFIG, "engram_vocab_size": 700}), tmp_path / "wider", seed=1)
    with EngramClient(daemon.socket, max_tokens=16) as client:
        before = client.tables_id
        for target, reason in ((other_geometry, "another geometry"), (tmp_path / "nothing", "")):
            point(current, target)
            status = reload(daemon)
            assert (status["exit"], status["state"]) == (1, "failed"), status
            assert reason in status["error"]
            assert_rows_equal(rows_of(client, ids), reference.expected(ids), f"after: {status['error']}")
            assert client.tables_id == before and probe(daemon.socket, "health", 5.0).body.ready
        point(current, demo_checkpoint)
        status = reload(daemon)
        assert (status["exit"], status["state"], status["tables"]) == (0, "unchanged", before), status
        assert client.tables_generation == 0
    assert daemon.stop() == 0


def test_sighup_reloads(daemon_factory, demo_checkpoint, second_checkpoint, second_reference, tmp_path):
    current = tmp_path / "current"
    point(current, demo_checkpoint)
    daemon = daemon_factory(tables=current)
    ids = random_ids(np.random.default_rng(7), 8, second_reference.rows, second_reference.heads)
    with EngramClient(daemon.socket, max_tokens=8) as client:
        point(current, second_checkpoint)
        daemon.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: (probe(daemon.socket, "health", 5.0).body.reload or {}).get("state") == "done",
                   timeout=RELOAD_S)
        assert_rows_equal(rows_of(client, ids), second_reference.expected(ids), "after SIGHUP")
        assert "reload (asked by SIGHUP) done" in daemon.log()
    assert daemon.stop() == 0


def test_a_stop_during_a_reload_cancels_it_and_leaves_the_served_tables(
        daemon_factory, demo_checkpoint, second_checkpoint, tmp_path):
    current = tmp_path / "current"
    point(current, demo_checkpoint)
    delay = 120.0  # the reload stalls this long first: a stop that waited for it would show
    daemon = daemon_factory(tables=current, env={"ENGRAMD_DEBUG_RELOAD_DELAY_S": str(delay)})
    served_files = table_files(daemon)
    point(current, second_checkpoint)
    started = reload(daemon, "--wait", "0")
    assert (started["exit"], started["state"]) == (0, "loading"), started
    again = reload(daemon, "--wait", "1")  # the one running answers: still loading
    assert (again["exit"], again["state"]) == (1, "loading"), again
    assert probe(daemon.socket, "health", 5.0).body.ready  # serving all along
    assert daemon.stop(timeout=delay / 2) == 0  # stop() fails if it takes longer
    assert "cancelled: the reload was cancelled" in daemon.log()  # not waited out
    assert table_files(daemon) == served_files


def follow(client: EngramClient, ids: np.ndarray, old, new) -> None:
    """Lookups until `client` reads `new`'s rows (each one reads `old`'s or `new`'s, whole)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        rows = rows_of(client, ids)
        assert rows_match(rows, old, ids) or rows_match(rows, new, ids), "rows of neither checkpoint"
        if rows_match(rows, new, ids):
            return
        time.sleep(0.05)
    raise AssertionError("the client never followed the reload")


def test_a_mapped_client_follows_a_reload_back_from_heartbeats_alone(
        daemon_factory, demo_checkpoint, reference, second_checkpoint, second_reference, tmp_path):
    """A -> B -> A, and the notice of the return lost (as when a client's reply queue is full):
    the heartbeat replies that name A again are news, since the daemon numbers its switches,
    while a reply read late, naming tables from before the last switch, is not."""
    current = tmp_path / "current"
    point(current, demo_checkpoint)
    daemon = daemon_factory(tables=current)
    ids = random_ids(np.random.default_rng(8), 32, reference.rows, reference.heads)
    with EngramClient(daemon.socket, mode="mapped", max_tokens=64) as client:
        first = client.tables_id
        assert rows_match(rows_of(client, ids), reference, ids)
        point(current, second_checkpoint)
        assert reload(daemon)["state"] == "done"
        follow(client, ids, reference, second_reference)
        second = client.tables_id
        # A stale heartbeat reply (tables A, from before the switch) moves nothing.
        client._heard_tables = (first, 0)
        for _ in range(5):
            assert rows_match(rows_of(client, ids), second_reference, ids)
        assert client.tables_id == second
        point(current, demo_checkpoint)
        assert reload(daemon)["state"] == "done"
        # The notice arrives; drop it unread, as a full queue would have (holding the lock that
        # keeps the client's heartbeat thread from following it meanwhile).
        def notice_read() -> bool:
            client._conn._collect(0)
            return client._conn.tables_notice is not None
        with client._tables_lock:
            wait_until(notice_read, timeout=10)
            client._conn.tables_notice = None
        follow(client, ids, second_reference, reference)
        assert (client.tables_id, client.tables_generation) == (first, 2)
    assert daemon.stop() == 0


def test_an_idle_mapped_client_lets_the_old_tables_go(
        daemon_factory, demo_checkpoint, reference, second_checkpoint, second_reference, tmp_path):
    """No lookup after the reload: the client's heartbeat thread re-maps and unmaps the old
    tables by itself, so an idle engine does not hold them (a second reload needs the room)."""
    current = tmp_path / "current"
    point(current, demo_checkpoint)
    daemon = daemon_factory(tables=current)
    ids = random_ids(np.random.default_rng(9), 32, reference.rows, reference.heads)
    with EngramClient(daemon.socket, mode="mapped", max_tokens=64) as client:
        assert rows_match(rows_of(client, ids), reference, ids)
        old_files = table_files(daemon)
        assert mapped_names(os.getpid()) & old_files
        point(current, second_checkpoint)
        status = reload(daemon)
        assert status["state"] == "done"
        wait_until(lambda: not mapped_names(os.getpid()) & old_files, timeout=20)
        assert (client.tables_id, client.tables_generation) == (status["tables"], 1)
        assert rows_match(rows_of(client, ids), second_reference, ids)
    assert daemon.stop() == 0


def test_a_restart_while_a_reload_is_being_mapped_means_registering_from_scratch(
        daemon_factory, demo_checkpoint, reference, second_checkpoint, second_reference, tmp_path,
        monkeypatch):
    """The daemon dies (kill -9) while a mapped client maps a reload's tables B (held here at a
    gate, as registering V4.1's 189 GiB takes seconds), and comes back on the old tables A (the
    deployment rolled back). The client's mapping is of A, so a takeover of its background
    registration would look right, but the re-mapping under way would then switch it to B
    behind the daemon's back: the registration is let go and the client registers from
    scratch. Every lookup reads one checkpoint or the other, whole; it ends reading A from the
    restarted daemon, and no table file stays mapped after close()."""
    current = tmp_path / "current"
    point(current, demo_checkpoint)
    first = daemon_factory(tables=current, instance="race")
    ids = random_ids(np.random.default_rng(10), 32, reference.rows, reference.heads)
    client = EngramClient(first.socket, mode="mapped", max_tokens=64, timeout=10, reconnect_timeout=60)
    gate, takeovers = threading.Event(), []

    class GatedTables(mapped_module.MappedTables):  # a reload's re-mapping only (PendingMapping)
        def __init__(self, *args, **kwargs):
            assert gate.wait(60), "the gate was never opened"
            super().__init__(*args, **kwargs)

    def take_rejoined(joined) -> bool:  # the background registration's hand-over, observed
        kept = take(joined)
        takeovers.append(kept)
        gate.set()  # the re-mapping may finish now (close() and a reconnect wait for it)
        return kept

    take = client._ride.take_rejoined
    monkeypatch.setattr(client._ride, "take_rejoined", take_rejoined)
    monkeypatch.setattr(mapped_module, "MappedTables", GatedTables)
    try:
        assert rows_match(rows_of(client, ids), reference, ids)
        all_files = table_files(first)
        point(current, second_checkpoint)
        assert reload(first)["state"] == "done"
        all_files |= table_files(first)
        wait_until(lambda: rows_match(rows_of(client, ids), reference, ids)
                   and client._mapped_path.remapping is not None, timeout=10, step=0.02)
        first.proc.kill()
        first.proc.wait()
        point(current, demo_checkpoint)
        second = daemon_factory(tables=current, instance="race", shm_dir=first.shm_dir,
                                workdir=first.workdir)
        health = probe(second.socket, "health", 5.0)

        def registered_again() -> bool:
            rows = rows_of(client, ids)
            assert rows_match(rows, reference, ids) or rows_match(rows, second_reference, ids), \
                "rows of neither checkpoint"
            return client.epoch == health.epoch and client._mapped_path.remapping is None
        wait_until(registered_again, timeout=30, step=0.05)
        assert takeovers == [False], "a registration was taken over while a reload was being mapped"
        assert (client.mode, client.tables_id, client.registrations) == ("mapped", health.body.tables, 2)
        for n in range(10):  # nothing left to switch it to B
            assert rows_match(rows_of(client, ids), reference, ids), f"lookup {n}: not the daemon's tables"
            time.sleep(0.05)
    finally:
        gate.set()
        client.close()
    assert not mapped_names(os.getpid()) & all_files, "a table file is still mapped"
    assert second.stop() == 0, second.log()


def same_mtimes(revision: Path, like: Path) -> None:
    """Give each file of `revision` the mtime of its namesake in `like` (`touch -r`, `cp -p`, an
    image built with fixed timestamps): the files' sizes and times then say nothing new."""
    for path in revision.iterdir():
        stat = (like / path.name).stat()
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_a_revision_whose_files_carry_the_served_ones_mtimes_is_refused_until_touched(
        daemon_factory, demo_checkpoint, reference, second_checkpoint, second_reference, tmp_path):
    """Same geometry, names and sizes, the mtimes set to the served files': the fingerprint is
    the served one, the rows are not. The reload once said `unchanged` and kept the old rows;
    now sampled rows tell, and it is refused, saying how to give the revision an id of its
    own. Touched, it is served."""
    revision = Path(shutil.copytree(second_checkpoint, tmp_path / "revision"))
    same_mtimes(revision, demo_checkpoint)
    current = tmp_path / "current"
    point(current, demo_checkpoint)
    daemon = daemon_factory(tables=current)
    ids = random_ids(np.random.default_rng(8), 32, reference.rows, reference.heads)
    with EngramClient(daemon.socket, mode="served", max_tokens=32) as client:
        assert_rows_equal(rows_of(client, ids), reference.expected(ids), "before")
        point(current, revision)
        status = reload(daemon)
        assert (status["exit"], status["state"]) == (1, "failed"), status
        assert "fingerprint" in status["error"] and "touch" in status["error"], status["error"]
        assert_rows_equal(rows_of(client, ids), reference.expected(ids), "after the refusal")
        for path in revision.iterdir():
            path.touch()
        status = reload(daemon)
        assert (status["exit"], status["state"]) == (0, "done"), status
        assert_rows_equal(rows_of(client, ids), second_reference.expected(ids), "after the touch")
    assert daemon.stop() == 0


def test_re_attached_tables_that_fail_the_self_check_are_loaded_again(
        daemon_factory, demo_checkpoint, second_checkpoint, second_reference, tmp_path):
    """Another revision put in place of the served one while the daemon was stopped, its files
    given the old files' mtimes: a restart finds the old tables in shared memory under the
    same id and re-attaches them, and the self-check finds other rows there. The daemon
    compares every row with the checkpoint, loads the tables again and serves the revision's
    rows (it once exited 66 at this and every later start, the files staying)."""
    revision = Path(shutil.copytree(second_checkpoint, tmp_path / "revision"))
    same_mtimes(revision, demo_checkpoint)
    assert EngramCheckpoint.open(revision).fingerprint() == EngramCheckpoint.open(demo_checkpoint).fingerprint()
    current, shm = tmp_path / "current", shm_tempdir()
    try:
        point(current, demo_checkpoint)
        assert daemon_factory(tables=current, shm_dir=shm).stop() == 0  # its tables stay in shm
        point(current, revision)
        daemon = daemon_factory(tables=current, shm_dir=shm)
        assert "self-check failed on re-attached tables" in daemon.log()
        ids = random_ids(np.random.default_rng(9), 64, second_reference.rows, second_reference.heads)
        with EngramClient(daemon.socket, mode="served", max_tokens=64) as client:
            assert_rows_equal(rows_of(client, ids), second_reference.expected(ids), "after the restart")
        assert daemon.stop() == 0
    finally:
        remove_tempdir(shm)
