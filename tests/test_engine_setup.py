"""benchmarks/common/setup_engine.sh, an engine recipe's set-up on the GPU machine, run from a
copy of the files it reads with a stand-in interpreter that logs each install, import check and
test run: a site installed from the same carry is kept (a later command on a warm machine skips
the install and the import check), two set-ups of one engine side by side install once (the
second waits for the first's lock, which the tests do not hold), and a changed carry, another
interpreter or an edited plugin file is installed and checked again."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).parents[1]
# What the set-up runs or hashes, copied into each test's tree.
TREE_FILES = ["benchmarks/common/setup_engine.sh", "benchmarks/common/install_editable.sh",
              "benchmarks/common/plugin_check.py", "benchmarks/vllm_gpu/setup_device.sh",
              "benchmarks/vllm_gpu/check_imports.py", "benchmarks/vllm_gpu/stubs.py", "pyproject.toml",
              *(str(path.relative_to(REPO)) for path in (REPO / "client" / "engines").glob("*.py"))]

# Answers what the set-up asks of its interpreter; installs, checks and test runs go to $CALLS.
STAND_IN = r"""#!/bin/bash
case "$*" in
  *"print(sys.executable)"*) echo "$0" ;;
  "-c import sys; assert"*) ;;
  "-c import xdist") exit "${NO_XDIST:-0}" ;;
  *"pip install"*"--target"*)
    site=$(sed 's/.*--target \([^ ]*\).*/\1/' <<<"$*"); mkdir -p "$site"
    echo "install $$" >>"$CALLS"; sleep 1 ;;
  *"pip show"*) echo "Editable project location: $PWD" ;;
  *check_imports.py*) echo "check $$" >>"$CALLS"; exit "${CHECK_FAILS:-0}" ;;
  "-m pytest"*) echo "pytest ${*:3}" >>"$CALLS"; sleep "${PYTEST_S:-0}" ;;
  *) echo "stand-in asked: $*" >&2; exit 3 ;;
esac
"""


def make_tree(tmp_path: Path) -> Path:
    tree = tmp_path / "tree"
    for name in TREE_FILES:
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / name, tree / name)
    for python in ("python3", "other-python3"):
        (tmp_path / python).write_text(STAND_IN)
        (tmp_path / python).chmod(0o755)
    return tree


def make_carry(folder: Path, wheel: bytes) -> None:
    """A carry as fetch.sh writes one: wheels, the engine's tree packed, their SHA256SUMS."""
    (folder / "wheels").mkdir(parents=True)
    (folder / "wheels" / "a-1-py3-none-any.whl").write_bytes(wheel)
    tree = folder / "unpacked"
    (tree / "vllm").mkdir(parents=True)
    (tree / "vllm" / "__init__.py").write_text("")
    with tarfile.open(folder / "vllm-0.33.0-py.tar.gz", "w:gz") as tar:
        tar.add(tree / "vllm", arcname="vllm")
    sums = [f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {path.relative_to(folder)}"
            for path in sorted(folder.rglob("*")) if path.is_file()]
    (folder / "SHA256SUMS").write_text("\n".join(sums) + "\n")


def set_up(tmp_path: Path, *args: str, carry: str = "carry", python: str = "python3",
           **env: str) -> subprocess.Popen:
    settings = {**os.environ, "PYTHON": str(tmp_path / python), "CALLS": str(tmp_path / "calls"),
                "VLLM_GPU_CARRY": str(tmp_path / carry), "VLLM_GPU_SITE": str(tmp_path / "site"), **env}
    return subprocess.Popen(["bash", str(tmp_path / "tree" / "benchmarks/vllm_gpu/setup_device.sh"), *args],
                            env=settings, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its stand-in's sleep killed with it


def finish(setup: subprocess.Popen, code: int = 0) -> str:
    out, _ = setup.communicate(timeout=60)  # guards against a hang only
    assert setup.returncode == code, out
    return out


def calls(tmp_path: Path) -> list[str]:
    path = tmp_path / "calls"
    return [line.split()[0] for line in path.read_text().splitlines()] if path.exists() else []


def test_two_set_ups_side_by_side_install_once_and_a_later_one_keeps_the_site(tmp_path):
    make_tree(tmp_path)
    make_carry(tmp_path / "carry", b"wheel one")
    outputs = [finish(setup) for setup in [set_up(tmp_path), set_up(tmp_path)]]
    assert calls(tmp_path) == ["install", "check"], outputs
    assert sum("already installed" in out for out in outputs) == 1, outputs
    assert (tmp_path / "site" / "vllm" / "__init__.py").is_file()

    assert "already installed" in finish(set_up(tmp_path))
    assert calls(tmp_path) == ["install", "check"]


def test_another_carry_interpreter_or_plugin_file_is_installed_and_checked_again(tmp_path):
    tree = make_tree(tmp_path)
    make_carry(tmp_path / "carry", b"wheel one")
    make_carry(tmp_path / "other", b"wheel two")
    finish(set_up(tmp_path))
    (tmp_path / "site" / "left-over").write_text("from the first install")

    assert "already installed" not in finish(set_up(tmp_path, carry="other"))
    assert not (tmp_path / "site" / "left-over").exists(), "the site is made anew"
    assert "already installed" not in finish(set_up(tmp_path, carry="other", python="other-python3"))
    with (tree / "client" / "engines" / "vllm.py").open("a") as plugin:
        plugin.write("# edited between two commands\n")
    assert "already installed" not in finish(set_up(tmp_path, carry="other", python="other-python3"))
    assert calls(tmp_path) == ["install", "check"] * 4
    with (tree / "benchmarks" / "vllm_gpu" / "setup_device.sh").open("a") as recipe:
        recipe.write("# a file the import check does not read\n")
    assert "already installed" in finish(set_up(tmp_path, carry="other", python="other-python3"))


def test_a_set_up_whose_import_check_failed_is_done_again(tmp_path):
    """The site is marked installed only after its import check passed."""
    make_tree(tmp_path)
    make_carry(tmp_path / "carry", b"wheel one")
    finish(set_up(tmp_path, CHECK_FAILS="1"), code=1)
    assert "already installed" not in finish(set_up(tmp_path))
    assert calls(tmp_path) == ["install", "check", "install", "check"]


def test_the_tests_run_outside_the_lock_in_the_processes_asked_for(tmp_path):
    """A set-up's tests (--test) do not hold the site's lock: a second set-up beside them keeps
    the site and goes on. ENGINE_TESTS_N=4 runs them in four processes where pytest-xdist is,
    one by one (said so) where it is not; a count that is not one is refused."""
    make_tree(tmp_path)
    make_carry(tmp_path / "carry", b"wheel one")
    slow = set_up(tmp_path, "--test", str(tmp_path / "out"), PYTEST_S="300", ENGINE_TESTS_N="4")
    try:
        deadline = time.monotonic() + 30
        while "pytest" not in calls(tmp_path):  # the first is in its tests
            assert slow.poll() is None and time.monotonic() < deadline, slow.communicate()
            time.sleep(0.1)
        # Held through the tests, the lock would keep this one waiting past finish()'s bound.
        assert "already installed" in finish(set_up(tmp_path))
        assert slow.poll() is None, "the first set-up's tests still run"
    finally:
        os.killpg(slow.pid, signal.SIGKILL)
        slow.communicate()
    pytest_runs = [line for line in (tmp_path / "calls").read_text().splitlines() if line.startswith("pytest")]
    assert " -n 4 " in pytest_runs[0], pytest_runs

    out = finish(set_up(tmp_path, "--test", str(tmp_path / "out"), ENGINE_TESTS_N="4", NO_XDIST="1"))
    assert "no pytest-xdist here, the tests run one by one" in out
    runs = [line for line in (tmp_path / "calls").read_text().splitlines() if line.startswith("pytest")]
    assert " -n " not in runs[-1], runs
    out = finish(set_up(tmp_path, "--test", str(tmp_path / "out"), ENGINE_TESTS_N="four"), code=2)
    assert "not a count of processes" in out
