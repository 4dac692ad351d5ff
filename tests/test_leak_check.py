"""The leak check itself (conftest.py's no_leaks): a test that leaves a folder of its own in
/dev/shm or /tmp fails, naming it, and the folder is removed; what other processes on the machine
make there at the same time is left alone.

The leaking tests run in a pytest of their own (pytester), under a copy of this suite's
conftest.py: their failures are the result here, and they run in another process, so that their
folders carry that process's prefix and never count against this one.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest
from helpers import SHM, ours

pytest_plugins = ["pytester"]

TESTS = Path(__file__).parent

LEAKING = """
import os
from pathlib import Path

import pytest
from helpers import SHM, DaemonProcess, shm_tempdir, short_tempdir


def test_leaks_a_shm_folder():
    (shm_tempdir() / "table").write_bytes(b"rows")


def test_leaks_a_temp_folder():
    (short_tempdir("egd-") / "probe").write_bytes(b"probe")


def test_cleans_up_what_it_made(shm_dir, work_dir):
    (shm_dir / "table").write_bytes(b"rows")
    (work_dir / "probe").write_bytes(b"probe")


@pytest.mark.skipif(not os.access(SHM, os.W_OK), reason="no /dev/shm to write")
def test_leaves_a_daemon_table_folder_in_the_default_shm_dir(demo_checkpoint, work_dir):
    instance = f"leakcheck{os.getpid()}"
    daemon = DaemonProcess(work_dir, SHM, demo_checkpoint, instance, []).start().wait_ready()
    assert daemon.stop() == 0, daemon.log()
"""


def leaked_paths(output: str, test: str) -> list[Path]:
    """The paths the leak check named, failing `test` at its teardown."""
    parts = re.split(r"_+ ERROR at teardown of (\w+) _+", output)
    section = dict(zip(parts[1::2], parts[2::2], strict=True)).get(test)
    assert section is not None, f"no error at the teardown of {test}:\n{output}"
    named = re.search(r"AssertionError: temporary files left behind in /dev/shm or /tmp: \[(.*)\]",
                      section)
    assert named, section
    return [Path(p) for p in re.findall(r"'([^']+)'", named[1])]


@pytest.mark.slow
def test_a_test_that_leaves_a_folder_in_dev_shm_or_tmp_fails_naming_it(pytester, monkeypatch):
    pytester.makeconftest((TESTS / "conftest.py").read_text())
    pytester.makepyfile(test_leaking=LEAKING)
    # The copy imports helpers and reference from this folder, as the suite's conftest does.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS),
                                                                   os.environ.get("PYTHONPATH")])))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    output = result.stdout.str()

    shm_base = SHM if os.access(SHM, os.W_OK) else Path(tempfile.gettempdir())
    [in_shm] = leaked_paths(output, "test_leaks_a_shm_folder")
    assert in_shm.parent == shm_base and in_shm.name.startswith("engramd-test-"), in_shm
    [in_tmp] = leaked_paths(output, "test_leaks_a_temp_folder")
    assert in_tmp.parent == Path(tempfile.gettempdir()), in_tmp
    assert in_tmp.name.startswith("engramd-test-") and "-egd-" in in_tmp.name, in_tmp
    leaked = [in_shm, in_tmp]
    if os.access(SHM, os.W_OK):
        [tables] = leaked_paths(output, "test_leaves_a_daemon_table_folder_in_the_default_shm_dir")
        assert tables.parent == SHM and re.fullmatch(r"engramd-leakcheck\d+", tables.name), tables
        leaked.append(tables)
    assert "ERROR at teardown of test_cleans_up_what_it_made" not in output, output
    assert not [path for path in leaked if path.exists()], "the leak check removes what it reports"
    result.assert_outcomes(passed=4 if os.access(SHM, os.W_OK) else 3,
                           skipped=0 if os.access(SHM, os.W_OK) else 1,
                           errors=len(leaked))


def test_engramd_folders_of_other_processes_are_not_ours(tmp_path):
    """Other test runs and daemons make engramd-* folders in /dev/shm and /tmp at the same time as
    this run: only those whose lock file names a process of this run count."""
    base = SHM if os.access(SHM, os.W_OK) else Path(tempfile.gettempdir())
    folder = base / f"engramd-leakcheck-{os.getpid()}"
    folder.mkdir()
    try:
        lock = folder / f"engramd.leakcheck-{os.getpid()}.lock"
        lock.write_text(f"{os.getppid()}\n")  # a process that is not this run's
        assert not ours(folder)
        lock.write_text(f"{os.getpid()}\n")  # an in-process service of this run
        assert ours(folder)
    finally:
        shutil.rmtree(folder)
    assert not ours(tmp_path)  # pytest's own folders are pytest's to clean


def test_a_killed_runs_folders_go_and_a_live_ones_stay():
    """A run killed by a signal cleans up nothing: the next run removes its folders (those of
    a process that is gone), never those of a run still going (this one's)."""
    import subprocess
    import sys

    from helpers import RUN_PREFIX, remove_dead_runs_folders, remove_tempdir, shm_tempdir

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead = Path(tempfile.mkdtemp(prefix=f"engramd-test-{gone.stdout.strip()}-", dir=SHM))
    (dead / "table").write_bytes(b"rows")
    live = shm_tempdir()
    try:
        removed = remove_dead_runs_folders()
        assert dead in removed and not dead.exists()
        assert live.exists() and live.name.startswith(RUN_PREFIX) and live not in removed
    finally:
        shutil.rmtree(dead, ignore_errors=True)
        remove_tempdir(live)
