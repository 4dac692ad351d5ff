"""Shared fixtures: a demo checkpoint, its independent reference, and real daemon processes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from engramd.client.connection import probe
from engramd.client.errors import EngramError
from engramd.client.geometry import TableGeometry
from engramd.client.handles import admin_request, handle_socket_path

sys.path.insert(0, str(Path(__file__).parent))
from reference import ReferenceTables  # noqa: E402

START_TIMEOUT_S = 60.0
LEAK_GRACE_S = 5.0  # a killed child may take a moment to be reaped by its parent
# The temporary folders this process made (short_tempdir, shm_tempdir); daemons under test keep
# their sockets, tables and slabs inside them. Other runs on the machine make folders of the
# same names, so the leak check follows these paths, not name patterns.
_made_temp_dirs: set[Path] = set()



DEMO_HEARTBEAT_S = 0.2  # the demo daemons' heartbeat interval (daemon_factory)

def _children() -> dict[int, str]:
    """Live child processes of this process (pid -> command line), zombies excluded."""
    me, found = os.getpid(), {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        state, ppid = stat.rsplit(") ", 1)[1].split()[:2]
        if int(ppid) == me and state != "Z":
            found[int(entry)] = cmdline.replace(b"\0", b" ").decode(errors="replace").strip()
    return found


def _long_lived_helpers() -> set[int]:
    """Children that outlive a test on purpose: multiprocessing's forkserver and resource
    tracker (started once, on first use, and kept for the session)."""
    from multiprocessing import forkserver, resource_tracker

    pids = {getattr(forkserver._forkserver, "_forkserver_pid", None),
            getattr(resource_tracker._resource_tracker, "_pid", None)}
    return {pid for pid in pids if pid}


def _our_temp_entries() -> set[Path]:
    return {path for path in _made_temp_dirs if path.exists()}


def client_pids(socket_path: Path) -> dict[int, int]:
    """client_id -> pid in the daemon's namespace, as an admin sees them (the test's user is the
    daemon's, an admin; `stats` leaves pids out)."""
    reply = admin_request(handle_socket_path(socket_path), "clients", 10.0)
    return {c["client_id"]: c["pid"] for c in reply.clients}


def wait_until(condition, timeout: float, step: float = 0.01) -> float:
    """Seconds until `condition()` held; raises AssertionError after `timeout`."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(step)
    return time.monotonic() - start


@pytest.fixture(autouse=True)
def no_leaks():
    """Fail a test that leaves child processes or this suite's temporary files behind."""
    children, temps = set(_children()), _our_temp_entries()
    yield
    deadline = time.monotonic() + LEAK_GRACE_S
    while True:
        leaked = {p: c for p, c in _children().items()
                  if p not in children and p not in _long_lived_helpers()}
        if not leaked or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for pid in leaked:
        os.kill(pid, signal.SIGKILL)  # so one leak does not fail the tests after it too
    left = _our_temp_entries() - temps
    assert not leaked, f"child processes left running: {leaked}"
    assert not left, f"temporary files left behind: {sorted(left)}"


def _demo_geometry_checkpoint(tmp_path_factory, name: str, seed: int) -> Path:
    from engramd.server.synthetic import write_synthetic_checkpoint

    return write_synthetic_checkpoint(TableGeometry.named("demo"), tmp_path_factory.mktemp(name), seed=seed)


@pytest.fixture(scope="session")
def demo_checkpoint(tmp_path_factory) -> Path:
    return _demo_geometry_checkpoint(tmp_path_factory, "demo-ckpt", seed=7)


@pytest.fixture(scope="session")
def reference(demo_checkpoint) -> ReferenceTables:
    return ReferenceTables(demo_checkpoint)


@pytest.fixture(scope="session")
def second_checkpoint(tmp_path_factory) -> Path:
    """The demo geometry with other rows (another seed): what a new revision brings (reloads)."""
    return _demo_geometry_checkpoint(tmp_path_factory, "second-ckpt", seed=8)


@pytest.fixture(scope="session")
def second_reference(second_checkpoint) -> ReferenceTables:
    return ReferenceTables(second_checkpoint)


def short_tempdir(prefix: str) -> Path:
    """ipc:// socket paths must stay under ~100 bytes, so sockets live in a short temp folder."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    _made_temp_dirs.add(path)
    return path


def shm_tempdir() -> Path:
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    path = Path(tempfile.mkdtemp(prefix="engramd-test-", dir=base))
    _made_temp_dirs.add(path)
    return path


def engramd_command() -> list[str]:
    exe = shutil.which("engramd")
    return [exe] if exe else [sys.executable, "-m", "engramd.server.cli"]


class DaemonProcess:
    """`engramd serve` started as users start it, on a private socket and shm folder."""

    def __init__(self, workdir: Path, shm_dir: Path, tables: Path | str, instance: str,
                 extra: list[str], env: dict[str, str] | None = None,
                 nofile: tuple[int, int] | None = None):
        self.env = {**os.environ, **(env or {})}
        self.workdir = workdir
        self.socket = workdir / "run" / "engramd.sock"
        self.shm_dir = shm_dir
        self.log_path = workdir / f"daemon-{instance}.log"
        self.tables_dir = shm_dir / f"engramd-{instance}"  # server/table_loader.py tables_folder
        self.args = [*engramd_command(), "serve", "--tables", str(tables), "--socket",
                     str(self.socket), "--shm-dir", str(shm_dir), "--instance", instance,
                     "--backend", "cpu", "--heartbeat-interval", str(DEMO_HEARTBEAT_S),
                     "--metrics-address", "127.0.0.1:0", *extra]
        self.nofile = nofile  # (soft, hard) open-file limits to start it with
        self.proc: subprocess.Popen | None = None

    def _limits(self) -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, self.nofile)

    def start(self) -> DaemonProcess:
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=self.env,
                                     preexec_fn=self._limits if self.nofile else None)
        return self

    def health(self, timeout: float = 1.0) -> dict | None:
        try:
            return probe(self.socket, "health", timeout).body.encode()
        except EngramError:
            return None

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> DaemonProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited with {self.proc.returncode}:\n{self.log()}")
            health = self.health()
            if health and health["ready"]:
                return self
            time.sleep(0.05)
        raise AssertionError(f"daemon not ready within {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"daemon ignored {sig} for {timeout} s:\n{self.log()}") from None
        self._log.close()
        return self.proc.returncode


@pytest.fixture
def daemon_factory(demo_checkpoint):
    """Make daemons: factory(tables=, instance=, extra=[flags], shm_dir=, workdir=, start=, ready=,
    env=, nofile=(soft, hard))."""
    started: list[DaemonProcess] = []
    dirs: list[Path] = []

    def make(tables: Path | str | None = None, instance: str = "t", extra: list[str] | None = None,
             shm_dir: Path | None = None, workdir: Path | None = None, start: bool = True,
             ready: bool = True, env: dict[str, str] | None = None,
             nofile: tuple[int, int] | None = None) -> DaemonProcess:
        if workdir is None:
            workdir = short_tempdir("egd-")
            dirs.append(workdir)
        if shm_dir is None:
            shm_dir = shm_tempdir()
            dirs.append(shm_dir)
        daemon = DaemonProcess(workdir, shm_dir, tables or demo_checkpoint, instance, extra or [], env,
                               nofile)
        started.append(daemon)
        if start:
            daemon.start()
            if ready:
                daemon.wait_ready()
        return daemon

    yield make
    for daemon in started:
        if daemon.proc is not None and daemon.proc.poll() is None:
            daemon.proc.kill()
            daemon.proc.wait()
    for path in dirs:
        shutil.rmtree(path, ignore_errors=True)


SLAB_MEMFD = "/memfd:engramd-slab-c"  # how the daemon's slabs show in /proc (server/cpu_backend.py)


def slab_files(pid: int) -> set[str]:
    """The slabs a daemon process holds open: its memfd descriptors, read from /proc."""
    names = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(fd_dir / fd)
        except OSError:
            continue  # closed meanwhile
        if target.startswith(SLAB_MEMFD):
            names.add(target.split(" ")[0])
    return names


UNSHARE = ["unshare", "--pid", "--ipc", "--mount", "--fork", "--mount-proc"]


def namespaced(command: list[str], private_shm: bool = True) -> list[str]:
    """`command` as pid 1 of new PID, IPC and mount namespaces, with a private /dev/shm unless
    told otherwise (an MPS client needs its server's): as an engine in a container of its own
    sees the machine."""
    script = ('mount -t tmpfs engramd-private /dev/shm && ' if private_shm else '') + 'exec "$@"'
    return [*UNSHARE, "sh", "-c", script, "sh", *command]


def _namespaces_unavailable() -> str | None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return "needs root and unshare"
    run = subprocess.run(namespaced(["true"]), capture_output=True, text=True, timeout=30)
    return None if run.returncode == 0 else f"unshare failed here: {run.stderr.strip()}"


NAMESPACES_UNAVAILABLE = _namespaces_unavailable()  # None where namespaced clients can run


def attach_raw(socket_path: Path, reply: dict, keep_descriptors: bool = False):
    """The second step of a registration made with raw messages: attach over the handle socket
    (client/handles.py). Keep the returned attachment: its lease is the registration's life."""
    from engramd.client.handles import attach, handle_socket_path

    attached = attach(handle_socket_path(socket_path), reply["client_id"], reply["token"])
    if not keep_descriptors:
        attached.close_descriptors()
    return attached


def run_client_processes(commands: list[list[str]], timeout: float = 120.0) -> None:
    """Run client scripts as separate processes concurrently; fail with their output if any fails."""
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for cmd in commands]
    failures = []
    for cmd, proc in zip(commands, procs, strict=True):
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            failures.append(f"{cmd}: timed out\n{out.decode(errors='replace')}")
            continue
        if proc.returncode != 0:
            failures.append(f"{cmd}: exit {proc.returncode}\n{out.decode(errors='replace')}")
    assert not failures, "\n\n".join(failures)


def check_rows_stay_across_a_restart(daemon_factory, reference, device: str, mode: str,
                                     extra: tuple[str, ...] = ()) -> None:
    """EngramClient.slot_rows' promise: views of a slot's rows taken once read every later
    lookup into that slot, of any token count, also after the daemon was killed and restarted
    (the client re-registers and keeps its rows' address). The restarted daemon comes up while
    the client's next lookup is already waiting for it, so failed attempts come first; a lookup
    made before the restart is refused afterwards, not waited for. A mapped client does not wait:
    its lookups go on from its mapping with no daemon, re-registering in the background, and
    its lookup made before the restart stays valid."""
    import threading

    import numpy as np
    import torch
    from reference import random_ids

    from engramd.client import DaemonUnavailableError, EngramClient

    first = daemon_factory(instance="stay", extra=list(extra))
    client = EngramClient(first.socket, device=device, mode=mode, max_tokens=64, slots=2,
                          timeout=10, reconnect_timeout=60)
    rng = np.random.default_rng(9)
    views = [client.slot_rows(slot) for slot in range(2)]

    def lookups(when: str) -> None:
        for tokens, slot in ((5, 1), (64, 0), (1, 0), (17, 1)):
            ids = torch.from_numpy(random_ids(rng, tokens, reference.rows, reference.heads))
            rows = client.lookup(ids.to(device), slot=slot).wait()
            if device == "cuda":
                torch.cuda.current_stream().synchronize()
            what = f"{when}, {tokens} tokens into slot {slot}"
            assert rows.data_ptr() == views[slot].data_ptr(), f"{what}: the rows moved"
            got = views[slot][:, :tokens].double().cpu().numpy()
            wrong = np.argwhere(got != reference.expected(ids.numpy()))
            assert wrong.size == 0, f"{what}: {len(wrong)} wrong values, first {wrong[:3].tolist()}"

    try:
        assert client.mode == mode
        lookups("before the restart")
        epoch, generation, tables = client.epoch, client.rows_generation, client.tables_id
        stale_ids = random_ids(rng, 3, reference.rows, reference.heads)
        stale = client.lookup(torch.from_numpy(stale_ids).to(device))
        first.proc.kill()
        first.proc.wait()
        if mode == "mapped":  # its own gather, which no daemon took part in: still valid
            rows = stale.wait()
            if device == "cuda":
                torch.cuda.current_stream().synchronize()
            assert np.array_equal(rows.double().cpu().numpy(), reference.expected(stale_ids)), \
                "a lookup made before the kill"
        second = daemon_factory(instance="stay", shm_dir=first.shm_dir, workdir=first.workdir,
                                extra=list(extra), start=False)
        restart = threading.Timer(1.0, second.start)
        restart.start()
        lookups("after the restart" if mode == "served" else "with no daemon")
        restart.join()
        second.wait_ready()
        if mode == "mapped":
            wait_until(lambda: client.epoch != epoch, timeout=30)
            lookups("after the restart")
        assert client.epoch != epoch and client.mode == mode
        assert client.rows_generation == generation, "the rows moved"
        assert tables is not None and client.tables_id == tables, "the same checkpoint, other tables?"
        assert stale.done()  # nothing to wait for: its rid belongs to the new connection now
        if mode == "served":
            with pytest.raises(DaemonUnavailableError, match="before the client re-registered"):
                stale.wait()  # its slot has been the new registration's since
    finally:
        client.close()
    assert second.stop() == 0, second.log()


def point(link: Path, target: Path) -> None:
    """Point the symlink `link` at `target` in one step (as a deployment flips it)."""
    staged = link.with_name(link.name + ".new")
    staged.unlink(missing_ok=True)
    staged.symlink_to(target)
    os.replace(staged, link)


def reload(daemon: DaemonProcess, *flags: str, timeout: float = 120.0) -> dict:
    """`engramd reload --json` against `daemon`: its exit status, stderr and final status."""
    result = subprocess.run([*engramd_command(), "reload", "--socket", str(daemon.socket), "--json",
                             *flags], capture_output=True, text=True, timeout=timeout)
    status = json.loads(result.stdout) if result.stdout.strip() else {}
    return {"exit": result.returncode, "stderr": result.stderr, **status}


def rows_match(actual: np.ndarray, reference: ReferenceTables, ids: np.ndarray,
               rank: int = 0, shards: int = 1) -> bool:
    """Whether float64 rows are exactly the reference's for `ids` (NaN where it has NaN)."""
    expected = reference.expected(ids, rank, shards)
    return actual.shape == expected.shape and bool(
        ((actual == expected) | (np.isnan(actual) & np.isnan(expected))).all())
