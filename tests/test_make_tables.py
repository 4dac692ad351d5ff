"""`engramd make-tables` on a first run's mistakes: a clear message and a status, no traceback,
and nothing left behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess

import pytest
from helpers import engramd_command, wait_until

from engramd.client.geometry import DEMO_CONFIG


def make_tables(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*engramd_command(), "make-tables", *args], capture_output=True,
                          text=True, timeout=120)


def test_a_folder_that_is_not_empty_is_refused(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    result = make_tables("--out", str(tmp_path))
    assert result.returncode == 2 and "exists and is not an empty folder" in result.stderr
    assert "Traceback" not in result.stderr and sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]


@pytest.mark.parametrize("bad", ["-1", "1.5"])
def test_a_bad_seed_is_a_usage_error_before_anything_is_written(tmp_path, bad):
    result = make_tables("--out", str(tmp_path / "tables"), "--seed", bad)
    assert result.returncode == 2 and "--seed: expected an integer" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "tables").exists()


def test_an_unwritable_target_gets_a_message(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = make_tables("--out", str(blocker / "tables"))  # a file where a folder must go
    assert result.returncode == 1 and str(blocker) in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1 MiB tmpfs, where this machine lets the test mount one."""
    path = tmp_path / "small"
    path.mkdir()
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    yield path
    subprocess.run(["umount", "-l", str(path)], check=False)


def test_too_little_disk_leaves_no_folder(small_tmpfs):
    target = small_tmpfs / "demo"  # the demo tables need about 14 MB
    result = make_tables("--out", str(target))
    assert result.returncode == 1 and "are free" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not target.exists()



def test_sigterm_leaves_nothing_behind_as_ctrl_c_does(tmp_path):
    """SIGTERM (timeout, systemd, a container's stop) left a partial shard, and the next run
    refused the folder."""
    if shutil.disk_usage(tmp_path).free < 4 << 30:  # make-tables checks the space first
        pytest.skip("needs 4 GiB free beside the test's folder for a write long enough to stop")
    geometry = tmp_path / "config.json"  # about 2.8 GB: still writing when the signal comes
    geometry.write_text(json.dumps({**DEMO_CONFIG, "engram_vocab_size": 200_000}))
    out = tmp_path / "tables"
    proc = subprocess.Popen([*engramd_command(), "make-tables", "--geometry", str(geometry),
                             "--out", str(out)], stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: out.is_dir() and any(out.glob("*.partial")), timeout=60, step=0.01)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "terminated; nothing was left behind" in stderr and not out.exists(), stderr


def test_a_layer_named_twice_is_refused_before_anything_is_written(tmp_path):
    geometry = tmp_path / "config.json"
    geometry.write_text(json.dumps({**DEMO_CONFIG, "engram_layer_ids": [1, 1]}))
    result = make_tables("--geometry", str(geometry), "--out", str(tmp_path / "tables"))
    assert result.returncode == 2 and "distinct non-negative ints" in result.stderr, result.stderr
    assert not (tmp_path / "tables").exists()
