"""`engramd serve` for a benchmark: started and waited for until ready, stopped, and the temporary
folders its tables and socket live in; and a client granted the mode a column asked for."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from engramd.client import EngramClient
from engramd.client.errors import EngramError
from engramd.client.shared.connection import probe

SOCKET_NAME = "engramd.sock"
LOG_NAME = "daemon.log"


def serve_command(socket: Path, flags: list[str], python: list[str] | None = None) -> list[str]:
    """The daemon's command line: `python` (default this interpreter) running the CLI's serve."""
    return [*(python or [sys.executable]), "-m", "engramd.server.cli", "serve",
            "--socket", str(socket), *flags]


def start_daemon(workdir: Path, flags: list[str], timeout: float = 600.0,
                 python: list[str] | None = None) -> tuple[subprocess.Popen, Path]:
    """Run the daemon with `flags` plus a socket in `workdir`; returns (process, socket path).

    `python` replaces the interpreter command (e.g. to run it under cProfile). The daemon's output
    goes to workdir/daemon.log, which is shown if it exits or is not ready within `timeout`.
    """
    socket = workdir / SOCKET_NAME
    log_path = workdir / LOG_NAME
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(serve_command(socket, flags, python), stdout=log,
                                stderr=subprocess.STDOUT)
    wait_for(proc, lambda: ready_pid(socket) == proc.pid, "ready", log_path, timeout)
    return proc, socket


def ready_pid(socket: Path) -> int | None:
    """The pid of the daemon answering on `socket` if it says it is ready, else None."""
    try:
        body = probe(socket, "health", 1.0).body
    except EngramError:
        return None
    return body.pid if body.ready else None


def wait_for(proc: subprocess.Popen, done: Callable[[], bool], what: str, log_path: Path,
             timeout: float, poll_s: float = 0.1) -> None:
    """Poll `done()` every `poll_s` until it holds; SystemExit showing the daemon's log if `proc`
    exits first, or (the daemon killed) if `timeout` passes."""
    deadline = time.monotonic() + timeout
    while not done():
        if proc.poll() is not None:
            raise SystemExit(f"daemon {proc.pid} exited with {proc.returncode} before {what}:\n"
                             f"{log_path.read_text(errors='replace')}")
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"daemon {proc.pid} not {what} in {timeout:.0f} s:\n"
                             f"{log_path.read_text(errors='replace')}")
        time.sleep(poll_s)


@contextmanager
def running_daemon(workdir: Path, flags: list[str], timeout: float = 600.0) -> Iterator[Path]:
    """start_daemon; yields its socket and stops the daemon (SIGTERM, then wait) on the way out."""
    proc, socket = start_daemon(workdir, flags, timeout)
    try:
        yield socket
    finally:
        proc.terminate()
        proc.wait(60)


def stop_process(proc: subprocess.Popen, timeout: float) -> int | str:
    """SIGTERM, then SIGKILL if it has not exited within `timeout`; its exit status or "killed"."""
    proc.terminate()
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return "killed"


def shm_scratch(prefix: str, root: str | None = None) -> Path:
    """A new folder for a daemon's table files: in `root`, by default /dev/shm where this
    process may write there (the temp folder otherwise)."""
    if root is None:
        root = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix=prefix, dir=root))


@contextmanager
def bench_folders(show_log: bool = True, shm_root: str | None = None) -> Iterator[tuple[Path, Path]]:
    """(work folder, folder in `shm_root`, by default /dev/shm) for one run; both removed at the
    end, after the tail of the daemon log in the work folder is printed when `show_log`."""
    work = Path(tempfile.mkdtemp(prefix="engramd-bench-"))
    shm = shm_scratch("engramd-bench-", shm_root)
    try:
        yield work, shm
    finally:
        log = work / LOG_NAME
        if show_log and log.exists():
            print(log.read_text()[-4000:])
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


def open_client(socket: Path, device: str, max_tokens: int, mode: str,
                **options: Any) -> tuple[EngramClient, float]:
    """An EngramClient (2 slots, EngramClient's other `options`) that the daemon granted `mode`,
    and the seconds its construction took, end to end. Refuses a client of another mode: its
    column would be mislabelled."""
    started = time.perf_counter()
    client = EngramClient(socket, device=device, max_tokens=max_tokens, slots=2, timeout=120,
                          mode=mode, **options)
    attach_s = time.perf_counter() - started
    if client.mode != mode:
        client.close()
        raise SystemExit(f"asked for mode {mode!r}, the daemon granted {client.mode!r}")
    return client, attach_s
