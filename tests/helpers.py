"""What the tests share besides fixtures: temporary folders, real daemon processes, raw client
steps, and the leak scan the fixtures in conftest.py run around every test.

Import it one way only, `from helpers import ...` (conftest.py puts this folder on sys.path).
Imported under a second name (`tests.helpers`) it would be a second module with a second set of
the temporary folders made, which the leak check would not see; the guard below refuses that.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from engramd.client.errors import EngramError
from engramd.client.shared.connection import probe
from engramd.client.shared.handles import admin_request, handle_socket_path

if __name__ != "helpers":
    raise ImportError(f"import the test helpers as `helpers`, not as `{__name__}`: a second copy "
                      "would keep its own record of the temporary folders made")

from reference import ReferenceTables  # noqa: E402 (after the guard: same folder, same rule)

START_TIMEOUT_S = 60.0
DEMO_HEARTBEAT_S = 0.2  # the demo daemons' heartbeat interval (daemon_factory)

# -- temporary folders and the leak scan -------------------------------------------------------

# Every folder the helpers make is named RUN_PREFIX...: the pid says which pytest process made
# it. Other test runs and people on the machine make engramd-* folders in /dev/shm and /tmp at
# the same time, so a name pattern alone cannot tell a leak of this run from their work; this
# prefix can (a folder left by an earlier process of the same pid was there before the test and
# is not new). A pid rather than a random token: whoever finds such a folder can tell with `ps`
# whether the run that made it is still going.
RUN_PREFIX = f"engramd-test-{os.getpid()}-"
SHM = Path("/dev/shm")
# Where the leak scan looks: tmpfs for tables, the temp folder for sockets, logs and caches.
WATCHED = tuple(dict.fromkeys(path for path in (SHM, Path("/tmp"), Path(tempfile.gettempdir()))
                              if path.is_dir()))

# The one record of the folders made here (the module guard keeps it one).
_made_temp_dirs: set[Path] = set()
# Processes of this run that may have made engramd-* folders of their own: this process
# (in-process services) and the daemons DaemonProcess started. Their pids are in the lock files
# a daemon writes (server/host_tables.py, server/startup.py).
_our_pids: set[int] = {os.getpid()}


def _made(path: Path) -> Path:
    _made_temp_dirs.add(path)
    return path


def short_tempdir(prefix: str) -> Path:
    """A new folder in the temp folder; ipc:// socket paths must stay under ~100 bytes, so
    sockets live in a short temp folder. The caller removes it (remove_tempdir, or the
    `work_dir` fixture); the leak check fails a test that leaves it."""
    return _made(Path(tempfile.mkdtemp(prefix=f"{RUN_PREFIX}{prefix}")))


def shm_tempdir() -> Path:
    """A new folder in /dev/shm (tmpfs, where tables live), or in the temp folder where there is
    none to write. The caller removes it (remove_tempdir, or the `shm_dir` fixture)."""
    base = str(SHM) if SHM.is_dir() and os.access(SHM, os.W_OK) else None
    return _made(Path(tempfile.mkdtemp(prefix=RUN_PREFIX, dir=base)))


def remove_dead_runs_folders() -> list[Path]:
    """Remove the engramd-test-<pid>-* folders of runs whose process is gone (a run killed by a
    signal cleans up nothing); those of live processes, other runs going on, stay. Returns
    what it removed."""
    removed = []
    for folder in WATCHED:
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            pid = name.removeprefix("engramd-test-").split("-", 1)[0]
            if name.startswith("engramd-test-") and pid.isdigit() and not Path(f"/proc/{pid}").exists():
                shutil.rmtree(folder / name, ignore_errors=True)
                removed.append(folder / name)
    return removed


def remove_tempdir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    _made_temp_dirs.discard(path)


def watched_entries() -> set[Path]:
    """The top-level entries of /dev/shm and /tmp now."""
    found = set()
    for folder in WATCHED:
        try:
            found.update(folder / name for name in os.listdir(folder))
        except OSError:
            continue
    return found


def _lock_pids(folder: Path) -> set[int]:
    """The pids in the lock files directly inside `folder`: a table folder's
    engramd.<instance>.lock, a runtime folder's <socket>.lock and engramd.handles.lock."""
    pids = set()
    try:
        locks = [p for p in folder.iterdir() if p.name.endswith(".lock")]
    except OSError:
        return pids
    for lock in locks:
        try:
            text = lock.read_text(errors="replace").strip()
        except OSError:
            continue
        if text.isdigit():
            pids.add(int(text))
    return pids


def _descends_from_us(pid: int) -> bool:
    me = os.getpid()
    while pid > 1:
        if pid == me:
            return True
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return False
    return False


def _run_pid(pid: int) -> bool:
    """Whether `pid` is a process of this run: one it started, unless that pid now belongs to a
    live process of someone else (a pid reused after our daemon exited)."""
    return pid in _our_pids and (not Path(f"/proc/{pid}").exists() or _descends_from_us(pid))


def ours(entry: Path) -> bool:
    """Whether a /dev/shm or /tmp entry was made by this run: by the helpers (its name starts
    with RUN_PREFIX: every folder short_tempdir and shm_tempdir make, daemon_factory's among
    them), or a daemon's engramd-* table or runtime folder whose lock file names a process of
    this run (a daemon started on the default shm_dir or runtime folder instead of a temp folder
    of the test's). engramd-* folders of other processes are never ours: the leak check removes
    what it reports."""
    if entry.name.startswith(RUN_PREFIX) or entry in _made_temp_dirs:
        return True
    return (entry.name.startswith("engramd-") and not entry.is_symlink() and entry.is_dir()
            and any(_run_pid(pid) for pid in _lock_pids(entry)))


def new_entries_of_ours(before: set[Path]) -> list[Path]:
    """What this run made in /dev/shm and /tmp since `before` (watched_entries())."""
    return sorted(entry for entry in watched_entries() - before if ours(entry))


def remove_entry(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
    _made_temp_dirs.discard(path)


def children() -> dict[int, str]:
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


def long_lived_helpers() -> set[int]:
    """Children that outlive a test on purpose: multiprocessing's forkserver and resource
    tracker (started once, on first use, and kept for the session)."""
    from multiprocessing import forkserver, resource_tracker

    pids = {getattr(forkserver._forkserver, "_forkserver_pid", None),
            getattr(resource_tracker._resource_tracker, "_pid", None)}
    return {pid for pid in pids if pid}


# -- daemons -------------------------------------------------------------------------------------


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


DAEMON_HOOKS = Path(__file__).parent / "daemon_hooks"  # sitecustomize.py: hooks for test daemons


class GatherGate:
    """Holds a test daemon's CPU lookup gathers until the test opens the gate
    (daemon_hooks/sitecustomize.py): a lookup then stays in flight, as the daemon reports, for as
    long as the test needs. Start the daemon with `env=gate.env()`."""

    variable = "ENGRAMD_TEST_GATHER_GATE"

    def __init__(self, folder: Path):
        self.path = folder / self.variable.lower()

    def env(self) -> dict[str, str]:
        path = os.pathsep.join(p for p in (str(DAEMON_HOOKS), daemon_base_env().get("PYTHONPATH")) if p)
        return {"PYTHONPATH": path, self.variable: str(self.path)}

    def open(self) -> None:
        self.path.touch()


class SettleGate(GatherGate):
    """Holds a stopping test daemon in the wait for its last gathers' rows (Daemon._drained)
    until the test opens the gate, as running GPU gathers do."""

    variable = "ENGRAMD_TEST_SETTLE_GATE"


def engramd_command() -> list[str]:
    exe = shutil.which("engramd")
    return [exe] if exe else [sys.executable, "-m", "engramd.server.cli"]


DAEMON_ENV_FILE = "ENGRAMD_TEST_DAEMON_ENV"  # names a file of `env -0` output (daemon_base_env)


def daemon_base_env() -> dict[str, str]:
    """The environment test daemons start from: this process's or, where ENGRAMD_TEST_DAEMON_ENV
    names a file of `env -0` output, that one's. A tool that wraps the tests puts itself in their
    environment (compute-sanitizer: its preload helper); a daemon is no child of its clients in
    production, and one that inherited the sanitizer's died inside cuMemCreate
    (benchmarks/results/h100/2026-12-06-d/; whether for that, not yet shown)."""
    path = os.environ.get(DAEMON_ENV_FILE)
    if not path:
        return dict(os.environ)
    entries = (os.fsdecode(entry).partition("=") for entry in Path(path).read_bytes().split(b"\0"))
    return {name: value for name, equals, value in entries if equals}


class DaemonProcess:
    """`engramd serve` started as users start it, on a private socket and shm folder."""

    def __init__(self, workdir: Path, shm_dir: Path, tables: Path | str, instance: str,
                 extra: list[str], env: dict[str, str] | None = None,
                 nofile: tuple[int, int] | None = None):
        self.env = {**daemon_base_env(), **(env or {})}
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
        _our_pids.add(self.proc.pid)  # the leak scan knows its lock files by this pid
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

    def state(self) -> str:
        """"running", or how it ended: a connection closed without a reply reads the same to a
        client whether the daemon closed it or died."""
        if self.proc is None:
            return "not started"
        status = self.proc.poll()
        if status is None:
            return "running"
        if status < 0:
            try:
                return f"killed by {signal.Signals(-status).name}"
            except ValueError:
                return f"killed by signal {-status}"
        return f"exited with {status}"

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


def fd_count(pid: int) -> int:
    """The descriptors process `pid` holds open."""
    return len(os.listdir(f"/proc/{pid}/fd"))


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
    (client/shared/handles.py). Keep the returned attachment: its lease is the registration's life."""
    from engramd.client.shared.handles import attach, handle_socket_path

    attached = attach(handle_socket_path(socket_path), reply["client_id"], reply["token"])
    if not keep_descriptors:
        attached.close_descriptors()
    return attached


def dealer(daemon, timeout_ms: int = 10_000, routing_id: bytes | None = None):
    """A raw ZeroMQ peer of `daemon`'s request socket (its replies waited for up to timeout_ms),
    for tests that send what no client library would; `routing_id`: one the peer claims."""
    import zmq

    peer = zmq.Context.instance().socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.setsockopt(zmq.RCVTIMEO, timeout_ms)
    if routing_id is not None:
        peer.setsockopt(zmq.ROUTING_ID, routing_id)
    peer.connect(f"ipc://{daemon.socket}")
    return peer


def request(peer, op: str, rid: int, **fields) -> dict:
    """Send one raw request on a dealer() and return its reply's header."""
    import msgpack

    from engramd.client.shared.protocol import PROTOCOL_VERSION

    peer.send(msgpack.packb({"v": PROTOCOL_VERSION, "op": op, "rid": rid, **fields}))
    return msgpack.unpackb(peer.recv())


def register(peer, rid: int, **fields) -> dict:
    """A raw registration of a CPU client of 4 tokens and one slot, `fields` overriding."""
    fields = {"pid": os.getpid(), "device": "cpu", "tp_rank": 0, "tp_size": 1, "max_tokens": 4,
              "slots": 1, **fields}
    return request(peer, "register", rid, **fields)


def engramd_stats(daemon, *flags: str) -> subprocess.CompletedProcess:
    """`engramd stats` of `daemon`, as a user runs it."""
    return subprocess.run([*engramd_command(), "stats", "--socket", str(daemon.socket), *flags],
                          capture_output=True, text=True, timeout=60)


def free_port() -> int:
    """A TCP port on 127.0.0.1 free now (a metrics endpoint, a gloo rendezvous)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


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
    made before the restart is refused afterwards, not waited for (a served GPU client fails it
    once its lease closes, and its next lookup says so: docs/client.md). A mapped client does
    not wait: its lookups go on from its mapping with no daemon, re-registering in the
    background, and its lookup made before the restart stays valid."""
    import threading

    import torch
    from reference import random_ids

    from engramd.client import DaemonUnavailableError, EngramClient, LookupFailedError
    from engramd.client.watchdog import WATCHDOG_S

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

    restart = None
    try:
        assert client.mode == mode
        lookups("before the restart")
        epoch, generation, tables = client.epoch, client.rows_generation, client.tables_id
        stale_ids = random_ids(rng, 3, reference.rows, reference.heads)
        stale_on_device = torch.from_numpy(stale_ids).to(device)
        served_gpu = mode == "served" and device == "cuda"
        if served_gpu:  # its IDs are handed over after ~1 s: the daemon dies before it writes
            torch.cuda._sleep(2_000_000_000)
        stale = client.lookup(stale_on_device)
        first.proc.kill()
        first.proc.wait()
        if mode == "mapped":  # its own gather, which no daemon took part in: still valid
            rows = stale.wait()
            if device == "cuda":
                torch.cuda.current_stream().synchronize()
            assert np.array_equal(rows.double().cpu().numpy(), reference.expected(stale_ids)), \
                "a lookup made before the kill"
        if served_gpu:  # its rows were never written: the next lookup reports it, once
            # Noticed within a watchdog period of the lease's close; the margin is for a busy machine.
            wait_until(stale.failed, timeout=50 * WATCHDOG_S)
            with pytest.raises(LookupFailedError) as failed:
                client.lookup(torch.from_numpy(stale_ids).to(device))
            assert failed.value.seqs == (stale.seq,)
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
        if served_gpu:
            with pytest.raises(LookupFailedError):
                stale.wait()  # its own failure, raised by its own wait too
        elif mode == "served":
            with pytest.raises(DaemonUnavailableError, match="before the client re-registered"):
                stale.wait()  # its slot has been the new registration's since
    finally:
        if restart is not None:  # a failure before it fired: no daemon starts after this test
            restart.cancel()
            restart.join()
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


def row_kinds(actual: np.ndarray, ids: np.ndarray, old: ReferenceTables,
              new: ReferenceTables) -> set[str]:
    """Which tables a lookup's rows [n_layers, T, heads, dim] came from, row by row: "old",
    "new", "nan" (a row all NaN, a poisoned read); a row of neither (nor equal in both) fails.
    Rows the two tables agree on (DEAD, out of range) count as neither."""
    def same(expected: np.ndarray) -> np.ndarray:
        return ((actual == expected) | (np.isnan(actual) & np.isnan(expected))).all(-1)

    is_old, is_new = same(old.expected(ids)), same(new.expected(ids))
    is_nan = np.isnan(actual).all(-1) & ~is_old & ~is_new
    other = ~(is_old | is_new | is_nan)
    assert not other.any(), f"{int(other.sum())} rows of neither tables, nor all NaN"
    return {kind for kind, rows in (("old", is_old & ~is_new), ("new", is_new & ~is_old),
                                    ("nan", is_nan)) if rows.any()}


def rows_match(actual: np.ndarray, reference: ReferenceTables, ids: np.ndarray,
               rank: int = 0, shards: int = 1) -> bool:
    """Whether float64 rows are exactly the reference's for `ids` (NaN where it has NaN)."""
    expected = reference.expected(ids, rank, shards)
    return actual.shape == expected.shape and bool(
        ((actual == expected) | (np.isnan(actual) & np.isnan(expected))).all())


def engine_tree(package: str, marker: Path) -> Path | None:
    """An engine's package folder (vLLM's, SGLang's) if it is on the path and holds `marker`,
    found without importing it (that takes seconds): the engines' GPU tests skip without it."""
    import importlib.machinery

    spec = importlib.machinery.PathFinder.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations)))
    return folder if (folder / marker).is_file() else None


def run_engine_worker(command: list[str], report: Path, daemon, timeout: float) -> dict:
    """Run an engine's GPU worker (benchmarks/*_gpu/worker_gpu.py) to its end and return the
    report it wrote (printed too: shown with -s, and kept in a failure's output); its output
    and the daemon's log's end if it failed."""
    try:
        run = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"worker timed out:\n{exc.stdout}\n{exc.stderr}") from None
    result = json.loads(report.read_text()) if report.exists() else {}
    print(json.dumps(result, indent=1))
    assert run.returncode == 0, f"{run.stdout[-4000:]}\n{run.stderr[-8000:]}\n{daemon.log()[-2000:]}"
    return result


def raised_in_thread(call, join_s: float) -> BaseException | None:
    """Run `call()` on a thread of its own and wait up to `join_s` for it: what it raised (None
    if it returned). AssertionError if it still runs then (a hang)."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # the test looks at what it was
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(join_s)
    assert not thread.is_alive(), f"{call} still runs after {join_s:.0f} s"
    return raised[0] if raised else None
