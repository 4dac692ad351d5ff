"""benchmarks/gpu_session.sh, the GPU machine's runner: every phase it has is documented at its
top and every documented phase exists; a misspelt phase, or a timing phase put beside another,
is refused before anything is installed or run (a GPU's minutes are scarce); the memcheck
phase's daemons start outside the sanitizer's environment."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "gpu_session.sh"


def _documented() -> set[str]:
    header = SCRIPT.read_text().split("\nset -u\n")[0]
    return set(re.findall(r"^#   ([a-z0-9-]+)\s{2,}", header, flags=re.MULTILINE))


def _defined() -> set[str]:
    return {name.replace("_", "-") for name in re.findall(r"^phase_(\w+)\(\)", SCRIPT.read_text(), re.MULTILINE)}


def test_every_phase_is_documented_and_every_documented_phase_exists():
    assert _defined(), "no phase found: the pattern no longer matches the script"
    assert _documented() == _defined()


@pytest.mark.parametrize("phases, refusal", [
    (["faults", "bogus"], "unknown phase: bogus"),
    (["faults+captured-reapeat"], "unknown phase: captured-reapeat"),
    (["faults+lookup"], "lookup times or counts the GPU's memory"),
    (["tests-kill-repeat+faults-mps"], "tests-kill-repeat times or counts the GPU's memory"),
    (["faults+faults-mps+faults"], "a phase twice"),
    (["tests+faults"], "tests times or counts the GPU's memory"),
])
def test_a_phase_that_cannot_run_is_refused_before_anything_runs(tmp_path, phases, refusal):
    done = subprocess.run(["bash", str(SCRIPT), str(tmp_path), *phases], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2, done
    assert refusal in done.stderr
    assert "===" not in done.stdout and list(tmp_path.iterdir()) == []  # no phase ran, nothing packed


def test_an_out_folder_that_is_not_there_is_made_before_anything_runs(tmp_path):
    """OUT may name a folder to be (OUT/half, OUT/quarter): results packed into one that is not
    there would be lost."""
    out = tmp_path / "half" / "more"
    done = subprocess.run(["bash", str(SCRIPT), str(out), "no-such-phase"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "unknown phase" in done.stderr, done
    assert out.is_dir() and list(out.iterdir()) == []


def test_a_relative_out_is_the_callers_when_the_results_are_packed(tmp_path):
    """The script moves to its tree's root before it packs: a relative OUT must still be the
    caller's. A copy of the script in a tree without the install step fails at once, after
    its exit trap is set, so it packs what it has."""
    tree, caller = tmp_path / "tree", tmp_path / "caller"
    (tree / "benchmarks").mkdir(parents=True)
    caller.mkdir()
    shutil.copy(SCRIPT, tree / "benchmarks" / SCRIPT.name)
    done = subprocess.run(["bash", str(tree / "benchmarks" / SCRIPT.name), "rel/out", "tests"],
                          capture_output=True, text=True, timeout=60, cwd=caller,
                          env={**os.environ, "TMPDIR": str(tmp_path)})  # its mktemp -d too
    assert done.returncode != 0, done
    assert (caller / "rel" / "out" / "results.tgz").is_file(), (done, list(tmp_path.rglob("*")))


def test_a_failed_phase_fails_the_command(tmp_path):
    """Each phase's exit code is printed at the end, and the command's is 1 if any phase failed:
    lookup-host-base fails at once here (no .ab_base tree); the end of the script, cut from it,
    exits 0 only where every phase did."""
    done = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out"), "lookup-host-base"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TMPDIR": str(tmp_path)})
    assert done.returncode == 1 and "phase lookup-host-base: exit 1" in done.stdout, done
    assert (tmp_path / "out" / "results.tgz").is_file()

    ending = subprocess.run(["sed", "-n", r"/^failed=0$/,/^exit \"\$failed\"/p", str(SCRIPT)],
                            capture_output=True, text=True, check=True).stdout
    assert ending.startswith("failed=0") and "exit" in ending, ending
    for statuses, expected in (("[a]=0 [b]=0", 0), ("[a]=0 [b]=3", 1)):
        script = f"declare -A status=({statuses})\nset -- a+b\n{ending}"
        assert subprocess.run(["bash", "-c", script], capture_output=True, timeout=30).returncode == expected


def test_the_memcheck_phases_daemons_start_in_the_environment_from_before_the_sanitizer(
        tmp_path, monkeypatch):
    """The phase writes its shell's environment with `env -0` and names the file in
    ENGRAMD_TEST_DAEMON_ENV; a test daemon starts from that file, not from the wrapped test
    process's environment (the sanitizer's preload helper), and a test's own settings still
    apply on top."""
    from helpers import DAEMON_ENV_FILE, DaemonProcess

    saved = tmp_path / "env"
    with saved.open("wb") as out:
        subprocess.run(["env", "-i", "PLAIN=1", "WITH_EQUALS=a=b", "MULTI=line\none", "env", "-0"],
                       stdout=out, check=True)
    monkeypatch.setenv("LD_PRELOAD", "/wrapper/preload-helper.so")
    monkeypatch.setenv(DAEMON_ENV_FILE, str(saved))
    daemon = DaemonProcess(tmp_path, tmp_path, "demo", "t", [], env={"PLAIN": "2", "OWN": "x"})
    assert daemon.env == {"PLAIN": "2", "WITH_EQUALS": "a=b", "MULTI": "line\none", "OWN": "x"}

    monkeypatch.setenv(DAEMON_ENV_FILE, "")  # unset or empty: the test process's own
    assert DaemonProcess(tmp_path, tmp_path, "demo", "t", []).env["LD_PRELOAD"] == "/wrapper/preload-helper.so"


def _run_captured_repeat(tmp_path: Path, sanitizer: str, **settings: str) -> subprocess.CompletedProcess:
    """captured-repeat's functions, cut from the script, run with `sanitizer` as the
    compute-sanitizer on PATH and no repeat runs after the memcheck ones."""
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir()
    out.mkdir()
    stub = bin_dir / "compute-sanitizer"
    stub.write_text(f"#!/bin/bash\n{sanitizer}")
    stub.chmod(0o755)
    functions = subprocess.run(["sed", "-n", r"/^fits() {/p; /^memcheck_captured() {/,/^}/p; "
                                r"/^phase_captured_repeat() {/,/^}/p", str(SCRIPT)],
                               capture_output=True, text=True, check=True).stdout
    script = f'out={out}; BUDGET_S=1000; CAPTURED_REPEAT=0\n{functions}\nphase_captured_repeat\n'
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", **settings}
    # The timeout guards against a hang only: the runs here take a few seconds at most.
    return subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(("inherited", "tests"), [("", ""), ("0", ""), ("1", "reload or restart")])
def test_the_memcheck_phase_hands_its_daemons_the_saved_environment(tmp_path, inherited, tests):
    """captured-repeat's memcheck runs, with a stand-in compute-sanitizer: the first names a
    file holding the phase shell's environment; MEMCHECK_INHERITED=1, and only 1, adds a second
    that names none (the daemon then inherits the sanitizer's); the file is gone afterwards.
    MEMCHECK_K, where set, chooses the tests of both runs."""
    sanitizer = ('f=$ENGRAMD_TEST_DAEMON_ENV\n'
                 'while [ $# -gt 0 ] && [ "$1" != -k ]; do shift; done\n'
                 'echo "daemon env [$f] marker [$( [ -n "$f" ] && tr "\\0" "\\n" < "$f" | grep "^PHASE_MARKER=")]"'
                 ' "tests [$2]"\n')
    _run_captured_repeat(tmp_path, sanitizer, PHASE_MARKER="saved", MEMCHECK_INHERITED=inherited,
                         MEMCHECK_K=tests).check_returncode()
    runs = [line for line in (tmp_path / "out" / "gpu_tests_captured.log").read_text().splitlines()
            if line.startswith("daemon env")]
    saved = runs[0].split("[")[1].split("]")[0]
    chosen = f"tests [{tests or 'equal_the_reference or closed'}]"
    assert saved and runs[0].endswith(f"marker [PHASE_MARKER=saved] {chosen}"), runs
    assert not Path(saved).exists(), "the saved environment is removed after the run"
    assert runs[1:] == ([f"daemon env [] marker [] {chosen}"] if inherited == "1" else []), runs


@pytest.mark.parametrize("stopped", [True, False])
def test_a_memcheck_run_ends_the_phase_and_kills_the_daemons_it_leaves(tmp_path, stopped):
    """A stand-in sanitizer that leaves two processes in sessions of their own, holding its
    output: a test daemon (its socket in the run's temp folder) and a stranger; then it outlives
    MEMCHECK_TIMEOUT_S, or exits 1 at once (a test timed out: os._exit skips its teardown). The
    phase ends anyway, says whether the run was stopped, fails, and kills the daemon only."""
    pids = tmp_path / "pids"
    daemon_argv0 = 'engramd serve --tables demo --socket "$TMPDIR/engramd-test-1-egd-x/run/engramd.sock"'
    sanitizer = (f'setsid bash -c \'exec -a "{daemon_argv0}" sleep 300\' & echo $! >> {pids}\n'
                 f'setsid sleep 300 & echo $! >> {pids}\n'
                 + ('sleep 300\n' if stopped else 'exit 1\n'))
    try:
        done = _run_captured_repeat(tmp_path, sanitizer, MEMCHECK_TIMEOUT_S="2")
        daemon, stranger = (int(pid) for pid in pids.read_text().split())
        log = (tmp_path / "out" / "gpu_tests_captured.log").read_text()
        assert done.returncode == 1, done
        assert ("# memcheck: stopped at its limit, 2 s" in log) == stopped, log
        assert "# killed the test daemons the run left" in log, log
        assert _gone(daemon), "the run's test daemon is killed"
        assert not _gone(stranger, within_s=0.5), "a process that is not one of the run's daemons is left alone"
    finally:
        for pid in pids.read_text().split() if pids.exists() else ():
            try:
                os.kill(int(pid), 9)
            except ProcessLookupError:
                pass


def _gone(pid: int, within_s: float = 5.0) -> bool:
    """Whether `pid` ends (or is a zombie, killed but not yet reaped) within `within_s`: a
    signal's delivery is not instant. The time bounds the wait only."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z":
                return True
        except (FileNotFoundError, IndexError):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
