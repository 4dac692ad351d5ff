"""The image, built and run: daemon and engines in containers of their own (tests/container/run.sh).

Needs root and podman (with runc and debootstrap to make the base image once); skipped, with the
reason, where they are missing or podman does not work. With ENGRAMD_CONTAINER_TEST=1 (what
.ci/run sets) a missing or broken podman fails instead. Under CI=true without it, the main run
skips this test: CI runs it in a step of its own.

Run alone, with what each check saw: python -m pytest -q -s tests/container
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("run.sh")
REQUIRED = os.environ.get("ENGRAMD_CONTAINER_TEST") == "1"
# First run on a fresh machine: the base image (debootstrap, ~45 s) and the build (~1 min with
# torch's CPU wheel on the machine's disk; several minutes where pip downloads it).
TIMEOUT_S = 1500


def podman_problem() -> str | None:
    """Why the container test cannot run here, or None."""
    if os.environ.get("CI") and not REQUIRED:
        return "CI runs the container test in a step of its own (.ci/run)"
    if os.geteuid() != 0:
        return "needs root (podman as root, debootstrap, chown of the shared folders)"
    missing = [tool for tool in ("podman", "runc", "debootstrap") if shutil.which(tool) is None]
    if missing:
        return f"not installed: {', '.join(missing)} (apt-get install podman runc debootstrap)"
    with tempfile.NamedTemporaryFile("w", suffix=".conf") as conf:
        conf.write('[engine]\nruntime = "runc"\n')  # as run.sh sets it
        conf.flush()
        env = {**os.environ, "CONTAINERS_CONF": conf.name}
        try:
            info = subprocess.run(["podman", "info"], env=env, capture_output=True, text=True, timeout=60)
        except subprocess.TimeoutExpired:
            return "podman info did not answer within 60 s"
    if info.returncode != 0:
        return f"podman does not work here: {info.stderr.strip()[-300:]}"
    return None


PROBLEM = podman_problem()
if PROBLEM is not None and REQUIRED:
    raise RuntimeError(f"ENGRAMD_CONTAINER_TEST=1 but the container test cannot run: {PROBLEM}")
pytestmark = pytest.mark.skipif(PROBLEM is not None, reason=str(PROBLEM))


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 60)
def test_daemon_and_engines_in_containers_of_their_own():
    result = subprocess.run([str(SCRIPT)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)
    print(result.stdout)
    assert result.returncode == 0, result.stdout[-6000:]
