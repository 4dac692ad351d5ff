"""An operator's mistakes with `engramd`: two daemons configured into one another's way, ids the
socket filter cannot take, a probe whose user may not connect, a pipe closed early. Each gets a
clear refusal and a documented status, and a daemon already serving goes on serving."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import engramd_command
from reference import random_ids

from engramd.client import EngramClient
from engramd.client.errors import PermissionDeniedError
from engramd.client.shared import connection
from engramd.server.startup import EXIT_CONFIG

DEMO_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "demo.toml"


def cli(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run([*engramd_command(), *args], capture_output=True, text=True, timeout=timeout)


def assert_serves(daemon, reference) -> None:
    ids = random_ids(np.random.default_rng(31), 8, reference.rows, reference.heads)
    with EngramClient(daemon.socket, max_tokens=8) as client:  # registers and attaches: both sockets
        rows = client.lookup(torch.from_numpy(ids)).result(timeout=60)
    assert np.array_equal(rows.double().numpy(), reference.expected(ids))


def test_a_second_daemon_in_the_socket_folder_is_refused_and_the_first_goes_on(daemon_factory, reference):
    """A second daemon of another socket in the same folder replaced the first one's handle
    socket (engramd.handles): the first one's clients could no longer attach, and a drain of the
    first one stopped the second."""
    first = daemon_factory(instance="one")
    other = first.socket.with_name("other.sock")
    second = daemon_factory(instance="two", workdir=first.workdir, ready=False,
                            extra=["--socket", str(other)])
    assert second.proc.wait(60) == EXIT_CONFIG, second.log()
    assert "one daemon a folder" in second.log() and f"pid {first.proc.pid}" in second.log(), second.log()
    assert not other.exists(), "the refused daemon bound its socket"
    assert_serves(first, reference)
    drained = cli("drain", "--socket", str(first.socket), "--timeout", "30")
    assert drained.returncode == 0, drained.stdout + drained.stderr
    assert first.proc.wait(30) == 0


def test_a_second_daemon_of_an_instance_in_use_is_a_configuration_error(daemon_factory, reference):
    """It stopped with 66 (tables unusable) and its last line named the first one's table
    folder as its own ("the tables stay in ... for the next start"): removing it, as the
    README says of a stopped daemon's, would remove the live daemon's tables."""
    first = daemon_factory(instance="same")
    second = daemon_factory(instance="same", shm_dir=first.shm_dir, ready=False)
    assert second.proc.wait(60) == EXIT_CONFIG, second.log()
    log = second.log()
    assert f"instance 'same' is in use by another daemon (pid {first.proc.pid})" in log, log
    assert "the tables stay in" not in log, log
    assert_serves(first, reference)


@pytest.mark.parametrize("flag", ["--allowed-uids", "--allowed-gids"])
def test_an_id_the_socket_filter_cannot_take_is_a_configuration_error(flag, tmp_path):
    """2^31 and above passed the check, then the bind raised OverflowError: exit 1, a traceback,
    after a log line saying "stopped (exit status 0)"."""
    result = cli("serve", "--config", str(DEMO_CONFIG), "--socket", str(tmp_path / "e.sock"),
                 flag, "0,2147483648", "--print-config")
    assert result.returncode == EXIT_CONFIG, result.stderr
    assert "ids above 2147483647" in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_a_wait_too_long_for_a_socket_is_a_usage_error(tmp_path):
    """--timeout 1e10 passed, then settimeout() raised OverflowError (a traceback, exit 1)."""
    for command in ("stats", "drain", "reload"):
        result = cli(command, "--socket", str(tmp_path / "e.sock"), "--timeout", "1e10")
        assert result.returncode == 2 and "--timeout: expected a number of seconds" in result.stderr, result.stderr


def test_a_reader_that_leaves_early_is_no_traceback(daemon_factory):
    daemon = daemon_factory()
    reader = subprocess.Popen([*engramd_command(), "stats", "--socket", str(daemon.socket)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    reader.stdout.close()  # `engramd stats | head -0`
    _, stderr = reader.communicate(timeout=60)
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr
    assert reader.returncode == 141, (reader.returncode, stderr)


def test_a_connect_this_user_may_not_make_is_told_at_once(monkeypatch, tmp_path):
    """A probe run by a user the socket's mode keeps out waited its whole timeout, then blamed
    the daemon ("is the daemon running?"). Root passes every mode, so the kernel's EACCES is
    stood in for at the connect."""

    class Refused(socket.socket):
        def connect(self, address):
            raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(connection.socket, "socket", Refused)
    with pytest.raises(PermissionDeniedError, match="this user may not connect"):
        connection.check_listening(tmp_path / "engramd.sock")
