"""benchmarks/common/setup_engine.sh, an engine recipe's set-up on the GPU machine: a site
installed from the same carry is kept (a later command on a warm machine skips the install and
the import check), two set-ups of one engine side by side install once (the second waits for the
first's lock), and a changed carry is installed again. The interpreter is a stand-in that logs
each install and import check; the carry a small one made here."""

from __future__ import annotations

import hashlib
import os
import subprocess
import tarfile
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "vllm_gpu" / "setup_device.sh"

# Answers what the set-up asks of its interpreter; installs and import checks go to $CALLS.
STAND_IN = r"""#!/bin/bash
case "$*" in
  *"print(sys.executable)"*) echo /stand-in/python3 ;;
  "-c import sys; assert"*) ;;
  *"pip install"*"--target"*)
    site=$(sed 's/.*--target \([^ ]*\).*/\1/' <<<"$*"); mkdir -p "$site"
    echo "install $$" >>"$CALLS"; sleep 1 ;;
  *"pip show"*) echo "Editable project location: $PWD" ;;
  *check_imports.py*) echo "check $$" >>"$CALLS"; exit "${CHECK_FAILS:-0}" ;;
  *) echo "stand-in asked: $*" >&2; exit 3 ;;
esac
"""


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


def set_up(tmp_path: Path, carry: str = "carry", check_fails: bool = False) -> subprocess.Popen:
    python = tmp_path / "python3"
    python.write_text(STAND_IN)
    python.chmod(0o755)
    env = {**os.environ, "PYTHON": str(python), "CALLS": str(tmp_path / "calls"),
           "CHECK_FAILS": str(int(check_fails)),
           "VLLM_GPU_CARRY": str(tmp_path / carry), "VLLM_GPU_SITE": str(tmp_path / "site")}
    return subprocess.Popen(["bash", str(SCRIPT)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def finish(setup: subprocess.Popen) -> str:
    out, _ = setup.communicate(timeout=60)  # guards against a hang only
    assert setup.returncode == 0, out
    return out


def calls(tmp_path: Path) -> list[str]:
    return [line.split()[0] for line in (tmp_path / "calls").read_text().splitlines()]


def test_two_set_ups_side_by_side_install_once_and_a_later_one_keeps_the_site(tmp_path):
    make_carry(tmp_path / "carry", b"wheel one")
    outputs = [finish(setup) for setup in [set_up(tmp_path), set_up(tmp_path)]]
    assert calls(tmp_path) == ["install", "check"], outputs
    assert sum("already installed" in out for out in outputs) == 1, outputs
    assert (tmp_path / "site" / "vllm" / "__init__.py").is_file()

    assert "already installed" in finish(set_up(tmp_path))
    assert calls(tmp_path) == ["install", "check"]


def test_a_changed_carry_is_installed_and_checked_again(tmp_path):
    make_carry(tmp_path / "carry", b"wheel one")
    make_carry(tmp_path / "other", b"wheel two")
    finish(set_up(tmp_path))
    (tmp_path / "site" / "left-over").write_text("from the first install")

    assert "already installed" not in finish(set_up(tmp_path, carry="other"))
    assert calls(tmp_path) == ["install", "check", "install", "check"]
    assert not (tmp_path / "site" / "left-over").exists(), "the site is made anew"


def test_a_set_up_whose_import_check_failed_is_done_again(tmp_path):
    """The site is marked installed only after its import check passed."""
    make_carry(tmp_path / "carry", b"wheel one")
    failed = set_up(tmp_path, check_fails=True)
    failed.communicate(timeout=60)
    assert failed.returncode != 0
    assert "already installed" not in finish(set_up(tmp_path))
    assert calls(tmp_path) == ["install", "check", "install", "check"]
