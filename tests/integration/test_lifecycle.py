"""Daemon lifecycle: health CLI, restart re-attach, one daemon per socket, startup errors, SIGTERM."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import threading
import time

import numpy as np
import pytest
import torch
from helpers import check_rows_stay_across_a_restart, engramd_command, raised_in_thread, wait_until
from reference import random_ids

from engramd.client import BadRequestError, DaemonUnavailableError, EngramClient, ReplyTimeoutError
from engramd.client.shared.handles import handle_socket_path
from engramd.server.startup import EXIT_CONFIG, EXIT_SOCKET_IN_USE, EXIT_TABLES


def cli(*args: str, timeout: float = 30.0) -> subprocess.CompletedProcess:
    return subprocess.run([*engramd_command(), *args], capture_output=True, text=True, timeout=timeout)


def test_commands_against_no_daemon_say_so_alike(tmp_path):
    """`reload` said "handle socket .../engramd.handles: No such file or directory" where
    `health`, `stats` and `drain` say there is no daemon socket."""
    socket = str(tmp_path / "engramd.sock")
    for command in ("health", "stats", "drain", "reload"):
        result = cli(command, "--socket", socket, "--timeout", "5")
        assert result.returncode != 0, (command, result.stdout)
        assert f"no daemon socket at {socket}" in result.stderr + result.stdout, (command, result.stderr)


def test_health_cli_ready_starting_and_dead(daemon_factory):
    slow = daemon_factory(ready=False, env={"ENGRAMD_DEBUG_LOAD_DELAY_S": "30"})
    deadline = time.monotonic() + 20
    while slow.health() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    starting = cli("health", "--socket", str(slow.socket), "--json", "--timeout", "2")
    assert starting.returncode == 1, starting
    state = json.loads(starting.stdout)
    assert state["live"] is True and state["ready"] is False and state["state"] == "loading"
    assert cli("health", "--socket", str(slow.socket), "--live", "--timeout", "2").returncode == 0

    ready = daemon_factory()
    result = cli("health", "--socket", str(ready.socket), "--json")
    assert result.returncode == 0, result
    assert json.loads(result.stdout)["ready"] is True
    assert cli("health", "--socket", str(ready.socket)).stdout.startswith("ready")

    ready.proc.kill()  # dead: the socket file is left behind, nobody listens at it
    ready.proc.wait()
    # Refused at the connect, not after the wait for a reply (whose error says it timed out):
    # a probe's timeout (a Kubernetes probe's is 5 s) is not waited out.
    dead = cli("health", "--socket", str(ready.socket), "--json", "--timeout", "5")
    assert dead.returncode == 1 and json.loads(dead.stdout)["live"] is False, dead
    assert "nothing listens at" in json.loads(dead.stdout)["error"]
    for command in ("stats", "drain", "reload"):  # each says it alike (reload named the handle socket)
        told = cli(command, "--socket", str(ready.socket), "--timeout", "5")
        assert told.returncode == 1 and "nothing listens at" in told.stderr, (command, told.stderr)
    missing = cli("health", "--socket", str(ready.workdir / "nothing.sock"))
    assert missing.returncode == 1 and "no daemon socket" in missing.stderr
    (ready.workdir / "plain-file").write_text("")
    not_socket = cli("stats", "--socket", str(ready.workdir / "plain-file"), "--timeout", "5")
    assert not_socket.returncode == 1 and "is no socket" in not_socket.stderr, not_socket
    assert slow.stop() == 0, slow.log()


def test_stats_cli(daemon_factory):
    daemon = daemon_factory()
    with EngramClient(daemon.socket, name="stats-test") as client:
        client.lookup(torch.full((3, 2, 24), 5)).result()
        text = cli("stats", "--socket", str(daemon.socket))
        data = json.loads(cli("stats", "--socket", str(daemon.socket), "--json").stdout)
    assert text.returncode == 0 and "lookups 1" in text.stdout and "clients 1" in text.stdout
    assert data["lookups"] == 1 and data["rows"] == 3 * 2 * 24 and len(data["clients"]) == 1


def test_restart_reattaches_tables_and_serves_same_rows(daemon_factory, reference):
    first = daemon_factory(instance="keep")
    rng = np.random.default_rng(11)
    ids = random_ids(rng, 64, reference.rows, reference.heads)
    with EngramClient(first.socket) as client:
        before = client.lookup(torch.from_numpy(ids)).result(copy=True)
    assert first.stop() == 0
    tables = sorted(p.name for p in first.tables_dir.glob("*.tbl"))
    assert len(tables) == 2, tables

    second = daemon_factory(instance="keep", shm_dir=first.shm_dir, workdir=first.workdir)
    assert "re-attached" in second.log(), second.log()
    assert sorted(p.name for p in second.tables_dir.glob("*.tbl")) == tables
    with EngramClient(second.socket) as client:
        after = client.lookup(torch.from_numpy(ids)).result()
        assert torch.equal(before, after)
        assert np.array_equal(after.double().numpy(), reference.expected(ids))
    assert second.stop() == 0
    assert {p.suffix for p in second.tables_dir.iterdir()} <= {".tbl", ".lock"}, "only tables stay"


def test_second_daemon_on_the_same_socket_refuses(daemon_factory):
    first = daemon_factory()
    second = daemon_factory(workdir=first.workdir, instance="other", start=False)
    second.start()
    assert second.proc.wait(30) == EXIT_SOCKET_IN_USE, second.log()
    assert "in use" in second.log()
    assert not second.tables_dir.exists(), "it touched tables before it held the socket's lock"
    assert first.health()["ready"], "the first daemon keeps serving"


def test_killed_daemon_is_reported_to_a_waiting_client(daemon_factory):
    daemon = daemon_factory()
    client = EngramClient(daemon.socket, timeout=30)
    daemon.proc.send_signal(signal.SIGSTOP)  # freeze it so the lookup is surely in flight
    future = client.lookup(torch.zeros((1, 2, 24), dtype=torch.int64))
    daemon.proc.kill()
    daemon.proc.wait()
    started = time.monotonic()
    with pytest.raises(DaemonUnavailableError, match="exited"):
        future.result()
    assert time.monotonic() - started < 2.0
    client.close()


@pytest.fixture
def no_core_files():
    """The daemons this test crashes leave no core file (the limit is the test process's, which
    they inherit; put back after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_CORE)
    resource.setrlimit(resource.RLIMIT_CORE, (0, hard))
    yield
    resource.setrlimit(resource.RLIMIT_CORE, (soft, hard))


def test_a_crashed_daemon_leaves_every_threads_stack_in_its_log(daemon_factory, no_core_files):
    """A crash in a driver or library call ends the daemon; what each thread was doing must be in
    its log (the journal, under systemd), or a client's bare closed connection has no story."""
    daemon = daemon_factory()
    daemon.proc.send_signal(signal.SIGSEGV)
    assert daemon.proc.wait(30) == -signal.SIGSEGV
    assert daemon.state() == "killed by SIGSEGV"
    log = daemon.log()
    assert "Fatal Python error: Segmentation fault" in log, log[-2000:]
    assert log.count("Thread 0x") + log.count("Current thread 0x") >= 2, log[-4000:]


def test_a_lookup_of_a_stopped_daemon_times_out_and_is_collected_later(daemon_factory, reference):
    """result() with no timeout waited for a stopped daemon (alive, its lease open) for as long
    as it was stopped; it waits the client's timeout now, raises ReplyTimeoutError, and a later
    result() collects the rows once the daemon goes on."""
    daemon = daemon_factory()
    ids = torch.from_numpy(random_ids(np.random.default_rng(12), 8, reference.rows, reference.heads))
    client = EngramClient(daemon.socket, timeout=2.0)
    try:
        daemon.proc.send_signal(signal.SIGSTOP)
        future = client.lookup(ids)
        # It gives up at the client's timeout (its error says which); ten of them are the margin.
        raised = raised_in_thread(future.result, join_s=10 * client.timeout)
        assert isinstance(raised, ReplyTimeoutError) and f"within {client.timeout:.1f} s" in str(raised), raised
        daemon.proc.send_signal(signal.SIGCONT)
        rows = future.result(timeout=60)
        assert np.array_equal(rows.double().numpy(), reference.expected(ids.numpy()))
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
        client.close()


def test_client_re_registers_with_a_restarted_daemon(daemon_factory, reference):
    first = daemon_factory(instance="again")
    rng = np.random.default_rng(4)
    client = EngramClient(first.socket, timeout=10, reconnect_timeout=60)
    ids = torch.from_numpy(random_ids(rng, 32, reference.rows, reference.heads))
    assert np.array_equal(client.lookup(ids).result().double().numpy(), reference.expected(ids.numpy()))
    old_epoch = client.epoch
    first.proc.send_signal(signal.SIGSTOP)
    future = client.lookup(ids)
    first.proc.kill()
    first.proc.wait()
    started = time.monotonic()
    with pytest.raises(DaemonUnavailableError, match="exited"):
        future.result()
    assert time.monotonic() - started < 1.5, "the in-flight lookup fails within about a second"
    # Restart in the background while the client's next lookup waits for it (with backoff).
    second = daemon_factory(instance="again", shm_dir=first.shm_dir, workdir=first.workdir, start=False)
    threading.Timer(1.0, second.start).start()
    rows = client.lookup(ids).result()
    assert client.epoch != old_epoch
    assert np.array_equal(rows.double().numpy(), reference.expected(ids.numpy()))
    second.wait_ready()
    assert "re-attached" in second.log()
    client.close()
    assert second.stop() == 0


@pytest.mark.parametrize("mode", ["served", "mapped"])
def test_a_slots_rows_stay_where_they_were_across_a_restart(daemon_factory, reference, mode):
    check_rows_stay_across_a_restart(daemon_factory, reference, "cpu", mode)


def test_rows_that_move_are_counted_and_the_old_ones_stay_readable(daemon_factory, reference):
    """A restarted daemon that allows only mapped clients re-registers an `auto` client (served
    before) as mapped: its rows move, `rows_generation` says so, and a view taken before still
    reads what it held (the old memory stays mapped until close)."""
    first = daemon_factory(instance="move")
    client = EngramClient(first.socket, mode="auto", max_tokens=8, timeout=10, reconnect_timeout=60)
    try:
        assert client.mode == "served" and client.rows_generation == 0
        ids = torch.from_numpy(random_ids(np.random.default_rng(5), 8, reference.rows, reference.heads))
        old_view = client.slot_rows(0)
        client.lookup(ids, slot=0).result()
        held = old_view.clone()
        first.proc.kill()
        first.proc.wait()
        second = daemon_factory(instance="move", shm_dir=first.shm_dir, workdir=first.workdir,
                                extra=["--client-modes", "mapped"])
        rows = client.lookup(ids[:3], slot=0).result()
        assert client.mode == "mapped" and client.rows_generation == 1
        assert rows.data_ptr() != old_view.data_ptr()
        assert np.array_equal(rows.double().numpy(), reference.expected(ids[:3].numpy()))
        assert torch.equal(old_view, held), "the view of the moved rows changed"
    finally:
        client.close()
    assert second.stop() == 0


def test_a_restart_on_other_tables_is_told_to_the_client(daemon_factory, demo_checkpoint, tmp_path):
    """The register reply names the served tables (the checkpoint's fingerprint): a client that
    re-registers with a daemon restarted on another checkpoint can tell (the vLLM plugin then
    refuses to go on)."""
    other = tmp_path / "other-checkpoint"
    shutil.copytree(demo_checkpoint, other)  # the same rows, but its files were written again
    for shard in other.glob("*.safetensors"):
        os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    first = daemon_factory(instance="other")
    client = EngramClient(first.socket, timeout=10, reconnect_timeout=60)
    try:
        before = client.tables_id
        ids = torch.zeros((1, client.geometry.n_layers, client.geometry.heads), dtype=torch.int64)
        first.proc.kill()
        first.proc.wait()
        second = daemon_factory(tables=other, instance="other", shm_dir=first.shm_dir,
                                workdir=first.workdir)
        client.lookup(ids).result()
        assert before is not None and client.tables_id not in (None, before)
    finally:
        client.close()
    assert second.stop() == 0


def test_a_lookup_into_a_slot_that_is_not_there_is_refused(daemon_factory):
    with EngramClient(daemon_factory().socket, slots=2) as client:
        ids = torch.zeros((1, client.geometry.n_layers, client.geometry.heads), dtype=torch.int64)
        for slot in (2, -1, True, "0", 1.0):
            with pytest.raises(BadRequestError, match="slots 0..1") as refused:
                client.lookup(ids, slot=slot)
            if not isinstance(slot, int) or isinstance(slot, bool):  # named as no index at all
                assert f"is a {type(slot).__name__}, not a slot index" in str(refused.value)
            with pytest.raises(BadRequestError, match="slot"):
                client.slot_rows(slot)
        assert client.lookup(ids, slot=1).result().shape[1] == 1  # the client still serves


def test_config_error_exits_with_config_status(daemon_factory, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("workers = -3\n")
    result = cli("serve", "--config", str(bad))
    assert result.returncode == EXIT_CONFIG
    assert str(bad) in result.stderr and "'workers'" in result.stderr and "-3" in result.stderr


def test_a_file_as_shm_dir_exits_with_config_status_naming_the_setting(tmp_path):
    (tmp_path / "tables-here").write_text("")
    result = cli("serve", "--tables", "demo", "--socket", str(tmp_path / "run" / "engramd.sock"),
                 "--shm-dir", str(tmp_path / "tables-here"), "--backend", "cpu")
    assert result.returncode == EXIT_CONFIG, result
    assert "shm_dir" in result.stderr and "is a file, not a folder" in result.stderr, result.stderr


def test_sigterm_during_the_start_stops_it_with_status_zero(daemon_factory):
    """Before the daemon listens (its imports), SIGTERM ended the process by the signal (status
    143, no log line, its lock file left); now the start goes on to listen, then stops."""
    daemon = daemon_factory(ready=False, env={"ENGRAMD_DEBUG_START_DELAY_S": "30"})
    wait_until(lambda: "stalling before the daemon's imports" in daemon.log(), timeout=60)
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.proc.wait(60) == 0, daemon.log()[-2000:]
    assert "SIGTERM: stopping" in daemon.log() and "stopped (exit status 0)" in daemon.log()


def test_broken_checkpoint_exits_with_table_status(daemon_factory, demo_checkpoint, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(demo_checkpoint, broken)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    del index["weight_map"]["layers.14.engram.embed.scale"]
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    daemon = daemon_factory(tables=broken, ready=False)
    assert daemon.proc.wait(60) == EXIT_TABLES
    assert "layers.14.engram.embed.scale" in daemon.log()
    # Its load left no tables behind, and its last line does not say it did.
    assert not daemon.tables_dir.exists()
    assert "stopped (exit status" in daemon.log() and "stay in" not in daemon.log(), daemon.log()[-2000:]


def test_sigterm_finishes_and_exits_zero(daemon_factory):
    daemon = daemon_factory()
    with EngramClient(daemon.socket) as client:
        client.lookup(torch.zeros((2, 2, 24), dtype=torch.int64)).result()
    assert daemon.stop(signal.SIGTERM) == 0
    assert not daemon.socket.exists() and not handle_socket_path(daemon.socket).exists()
