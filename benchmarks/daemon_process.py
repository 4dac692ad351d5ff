"""Start `engramd serve` for a benchmark and wait until it is ready (shared by the scripts here)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from engramd.client.connection import probe
from engramd.client.errors import EngramError


def start_daemon(workdir: Path, flags: list[str], timeout: float = 600.0,
                 python: list[str] | None = None) -> tuple[subprocess.Popen, Path]:
    """Run the daemon with `flags` plus a socket in `workdir`; returns (process, socket path).

    `python` replaces the interpreter command (e.g. to run it under cProfile). The daemon's output
    goes to workdir/daemon.log, which is shown if it exits or is not ready within `timeout`.
    """
    socket = workdir / "engramd.sock"
    log_path = workdir / "daemon.log"
    command = [*(python or [sys.executable]), "-m", "engramd.server.cli", "serve",
               "--socket", str(socket), *flags]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"daemon exited with {proc.returncode}:\n{log_path.read_text()}")
        try:
            if probe(socket, "health", 1.0).fields["ready"]:
                return proc, socket
        except EngramError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"daemon not ready in {timeout:.0f} s:\n{log_path.read_text()}")
