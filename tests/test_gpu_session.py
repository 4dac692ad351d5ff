"""benchmarks/gpu_session.sh, the GPU machine's runner: every phase it has is documented at its
top and every documented phase exists; a misspelt phase, or a timing phase put beside another,
is refused before anything is installed or run (a GPU's minutes are scarce); the memcheck
phase's daemons start outside the sanitizer's environment."""

from __future__ import annotations

import re
import subprocess
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
    (["faults+vllm-tests+vllm-tests-mps"], "one vllm phase to a group"),
    (["faults+faults-mps+faults"], "a phase twice"),
    (["tests+faults"], "tests times or counts the GPU's memory"),
])
def test_a_phase_that_cannot_run_is_refused_before_anything_runs(tmp_path, phases, refusal):
    done = subprocess.run(["bash", str(SCRIPT), str(tmp_path), *phases], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2, done
    assert refusal in done.stderr
    assert "===" not in done.stdout and list(tmp_path.iterdir()) == []  # no phase ran, nothing packed


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
