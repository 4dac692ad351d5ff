"""Shared fixtures: a demo checkpoint, its independent reference, real daemon processes, temporary
folders, and the leak check around every test. The helpers they use are in helpers.py."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from engramd.client.geometry import TableGeometry

# Test modules import helpers.py and reference.py by these names, from this folder.
sys.path.insert(0, str(Path(__file__).parent))
pytest.register_assert_rewrite("helpers")  # its checks report what they compared, as here
from helpers import (  # noqa: E402
    DaemonProcess,
    children,
    long_lived_helpers,
    new_entries_of_ours,
    remove_dead_runs_folders,
    remove_entry,
    remove_tempdir,
    shm_tempdir,
    short_tempdir,
    watched_entries,
)
from reference import ReferenceTables  # noqa: E402

LEAK_GRACE_S = 5.0  # a killed child may take a moment to be reaped by its parent
DAEMONS = pytest.StashKey[list[DaemonProcess]]()  # the daemons a test made (daemon_factory)
DAEMON_LOG_TAIL = 6000  # characters of each one's log its failure report shows


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report ends with each of its daemons' state and the end of its log: the
    daemon's side of what went wrong (a refusal, a dropped connection, a crash), which its folder
    takes with it."""
    report = yield
    if report.when in ("setup", "call") and report.failed:
        for daemon in item.stash.get(DAEMONS, []):
            pid = daemon.proc.pid if daemon.proc is not None else None
            report.sections.append((f"{daemon.log_path.name} (pid {pid}, {daemon.state()}), its end",
                                    daemon.log()[-DAEMON_LOG_TAIL:]))
    return report


def _leak_message(left: list[Path]) -> str:
    return f"temporary files left behind in /dev/shm or /tmp: {[str(p) for p in left]}"


@pytest.fixture(autouse=True, scope="session")
def no_leaks_at_exit():
    """What module and session fixtures made in /dev/shm and /tmp (before a test's no_leaks looked,
    and kept past it) must be gone when the run ends. First, what killed runs left goes."""
    remove_dead_runs_folders()
    before = watched_entries()
    yield
    left = new_entries_of_ours(before)
    for path in left:
        remove_entry(path)
    assert not left, _leak_message(left)


@pytest.fixture(autouse=True)
def no_leaks():
    """Fail a test that leaves child processes, or entries of its own in /dev/shm or /tmp, behind.

    The entries are the top-level names there; other processes on the machine (other test runs,
    people) add and remove entries of the same kinds meanwhile, so only entries this run provably
    made count (helpers.ours): names with this process's prefix, which every helper folder has,
    and engramd-* folders whose lock file names a process of this run (a daemon left on a default
    shm_dir or runtime folder). Leaks are removed after they are reported, so that one leak does
    not fail the tests after it too; pytest's own tmp_path folders are pytest's to clean."""
    children_before, entries_before = set(children()), watched_entries()
    yield
    deadline = time.monotonic() + LEAK_GRACE_S
    while True:
        leaked = {p: c for p, c in children().items()
                  if p not in children_before and p not in long_lived_helpers()}
        if not leaked or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for pid in leaked:
        os.kill(pid, signal.SIGKILL)  # so one leak does not fail the tests after it too
    left = new_entries_of_ours(entries_before)  # after the kill: no daemon writes in them anymore
    for path in left:
        remove_entry(path)
    assert not leaked, f"child processes left running: {leaked}"
    assert not left, _leak_message(left)


@pytest.fixture
def shm_dir() -> Path:
    """A folder of this test's own in /dev/shm, removed after it."""
    folder = shm_tempdir()
    yield folder
    remove_tempdir(folder)


@pytest.fixture
def work_dir() -> Path:
    """A folder of this test's own in the temp folder, short enough for socket paths; removed
    after it."""
    folder = short_tempdir("egd-")
    yield folder
    remove_tempdir(folder)


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


@pytest.fixture
def daemon_factory(demo_checkpoint, request):
    """Make daemons: factory(tables=, instance=, extra=[flags], shm_dir=, workdir=, start=, ready=,
    env=, nofile=(soft, hard)). A failed test's report shows the end of each one's log."""
    started: list[DaemonProcess] = []
    request.node.stash[DAEMONS] = started
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
        remove_tempdir(path)
