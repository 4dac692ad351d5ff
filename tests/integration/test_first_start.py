"""A newcomer's first start: mistakes in the settings are named at once, and a start that is
fine says nothing alarming. Each test starts `engramd serve` as a user does."""

from __future__ import annotations

import ctypes
import socket
import subprocess
from pathlib import Path

import pytest
from helpers import engramd_command

from engramd.client import BadRequestError, CudaUnavailableError, EngramClient
from engramd.client.shared.connection import default_socket_path, probe
from engramd.client.shared.libc import filesystem_type
from engramd.server.config import build_config
from engramd.server.startup import EXIT_CONFIG, HUGETLBFS_MAGIC, TMPFS_MAGIC
from engramd.server.table_loader import visible_gpus

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

DEMO_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "demo.toml"


def cli(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run([*engramd_command(), *args], capture_output=True, text=True,
                          timeout=timeout)


def warnings(log: str) -> list[str]:
    return [line for line in log.splitlines() if " WARNING " in line or " ERROR " in line]


def has_cuda_driver() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


@pytest.mark.skipif(has_cuda_driver(), reason="needs a machine without the CUDA driver")
def test_a_cuda_client_without_a_driver_gets_a_typed_error(daemon_factory):
    """It raised cuda.pathfinder's DynamicLibNotFoundError, after registering."""
    daemon = daemon_factory()
    for device in ("cuda:0", "cuda"):
        with pytest.raises(CudaUnavailableError, match="no CUDA driver on this machine") as caught:
            EngramClient(daemon.socket, device=device)
        assert isinstance(caught.value, BadRequestError) and f"'{device}'" in str(caught.value)
    assert probe(daemon.socket, "stats", 10.0).body.clients == [], "it registered anyway"
    assert daemon.stop() == 0, daemon.log()


def test_a_missing_tables_folder_is_named_before_the_daemon_listens(daemon_factory, tmp_path):
    """It was `.../config.json: missing config.json` (exit 66) seconds after "listening"."""
    missing = tmp_path / "checkpoint"
    daemon = daemon_factory(tables=missing, ready=False)
    assert daemon.proc.wait(60) == EXIT_CONFIG, daemon.log()
    log = daemon.log()
    assert f"tables = '{missing}'" in log and "does not exist" in log, log
    assert "listening" not in log and "modules imported" not in log, log


def test_an_shm_dir_whose_parent_is_missing_is_refused(daemon_factory, tmp_path):
    """A mistyped --shm-dir was created, parents and all, and served from."""
    typo = tmp_path / "shmm" / "engramd"
    daemon = daemon_factory(shm_dir=typo, ready=False)
    assert daemon.proc.wait(60) == EXIT_CONFIG, daemon.log()
    assert f"shm_dir = '{typo}'" in daemon.log() and str(typo.parent) in daemon.log(), daemon.log()
    assert not typo.parent.exists()


def test_an_shm_dir_on_a_disk_is_warned_about_once(daemon_factory, tmp_path):
    if filesystem_type(tmp_path) in (TMPFS_MAGIC, HUGETLBFS_MAGIC):
        pytest.skip(f"{tmp_path} is on tmpfs or hugetlbfs here")
    daemon = daemon_factory(shm_dir=tmp_path / "shm")
    lines = warnings(daemon.log())
    assert len(lines) == 1 and f"shm_dir {tmp_path / 'shm'} is on " in lines[0], lines
    assert "not tmpfs or hugetlbfs" in lines[0], lines
    assert daemon.stop() == 0, daemon.log()


def test_a_taken_metrics_port_is_one_warning_and_the_daemon_serves(daemon_factory):
    """It was an ERROR line, which a user reads as the reason the daemon failed."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        daemon = daemon_factory(extra=["--metrics-address", address])  # ready, or it fails here
        lines = warnings(daemon.log())
        expected = f"WARNING engramd.metrics: metrics_address {address}"
        assert len(lines) == 1 and expected in lines[0], lines
        assert "serving without metrics" in lines[0], lines
        assert daemon.stop() == 0, daemon.log()


def test_the_open_file_limit_is_warned_about_only_below_what_the_clients_need(daemon_factory):
    """Every start warned of a limit below 65,536, 1,024 covers the demo's 64 clients. The
    demo start (shm_dir in tmpfs) then logs no warning at all."""
    enough = daemon_factory(instance="enough", nofile=(1024, 1024))
    short = daemon_factory(instance="short", nofile=(1024, 1024), extra=["--max-clients", "512"])
    assert warnings(enough.log()) == [], enough.log()
    lines = warnings(short.log())
    assert len(lines) == 1 and "open-file limit 1024 is below" in lines[0], lines
    assert "max_clients = 512" in lines[0], lines
    assert enough.stop() == 0 and short.stop() == 0


def test_print_config_shows_the_socket_and_backend_in_effect():
    """It printed `socket = ""` and `backend = "auto"`."""
    result = cli("serve", "--config", str(DEMO_CONFIG), "--print-config")
    assert result.returncode == 0, result.stderr
    printed = tomllib.loads(result.stdout)
    assert printed["socket"] == default_socket_path(), result.stdout
    assert printed["backend"] == ("cuda" if visible_gpus() else "cpu"), result.stdout
    assert "# auto: " in result.stdout, result.stdout
    build_config(printed, "the printed config")  # it is a config a daemon can start from
