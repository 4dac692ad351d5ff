"""Tables on hugetlbfs (`shm_dir` on a mount of 2 MiB pages), the faster home for large tables:
the daemon loads them there, serves exact rows, and a restarted daemon re-attaches them.

Needs root to grow the huge page pool and mount hugetlbfs; skipped where that is refused.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import short_tempdir
from reference import random_ids

from engramd.client import EngramClient

POOL = Path("/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages")
PAGES = 32  # 64 MiB: the demo's two tables take a few pages each


@pytest.fixture
def hugetlbfs():
    if os.geteuid() != 0 or not POOL.exists():
        pytest.skip("needs root and 2 MiB huge pages")
    before = int(POOL.read_text())
    try:
        POOL.write_text(str(before + PAGES))
    except OSError as exc:
        pytest.skip(f"cannot grow the huge page pool: {exc}")
    mount = short_tempdir("huge-")
    try:
        done = subprocess.run(["mount", "-t", "hugetlbfs", "-o", "pagesize=2M,mode=0755", "none",
                               str(mount)], capture_output=True, text=True)
        if done.returncode != 0 or int(POOL.read_text()) < before + PAGES:
            pytest.skip(f"cannot mount hugetlbfs here: {done.stderr.strip() or 'no pages'}")
        yield mount
        subprocess.run(["umount", str(mount)], check=True)
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)  # after a skip or a failure
        mount.rmdir()
        POOL.write_text(str(before))


def lookup_matches(socket: Path, reference, seed: int) -> None:
    ids = random_ids(np.random.default_rng(seed), 64, reference.rows, reference.heads)
    with EngramClient(socket, max_tokens=64) as client:
        rows = client.lookup(torch.from_numpy(ids)).result(copy=True).float().numpy().astype(np.float64)
    wrong = np.argwhere(rows != reference.expected(ids))
    assert wrong.size == 0, f"first wrong {wrong[:5].tolist()}"


def test_tables_on_hugetlbfs_serve_exact_rows_and_are_re_attached(daemon_factory, reference, hugetlbfs):
    daemon = daemon_factory(shm_dir=hugetlbfs)
    files = sorted(daemon.tables_dir.glob("*.tbl"))
    assert len(files) == len(reference.rows)
    assert all(os.stat(f).st_blksize == 2 << 20 for f in files)  # on huge pages indeed
    lookup_matches(daemon.socket, reference, seed=1)
    assert daemon.stop() == 0
    again = daemon_factory(shm_dir=hugetlbfs, workdir=daemon.workdir)
    log = again.log()  # both daemons' lines: the first loaded the tables, the second re-attached
    assert log.count("tables loaded in") == 1 and log.count("tables re-attached in") == 1, log
    lookup_matches(again.socket, reference, seed=2)
    assert again.stop() == 0  # the files go with the mount
