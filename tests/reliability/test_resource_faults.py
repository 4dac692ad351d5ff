"""Resource faults: too little shared memory, table files damaged between runs, broken checkpoints.

Real `engramd serve` processes (conftest's `daemon_factory`). What each fault must produce:

- tables that do not fit the shm folder: a clear start-up error naming the folder and the bytes,
  exit status 66, and no *.tbl file left behind;
- a slab past the slab budget: a typed `resource` error for that registration only, naming the
  setting; the daemon keeps serving;
- a table file truncated, emptied, overwritten or replaced by a symlink between two runs: the
  restarted daemon notices, removes it (never the symlink's target), reloads from the
  checkpoint, and serves rows equal to the independent reference;
- a checkpoint whose shard lacks an Engram tensor: a start-up error naming the tensor, exit
  status 66, no stray files.

What this is not: the table store's own unit tests (tests/test_host_tables.py).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
import zmq
from helpers import DaemonProcess, shm_tempdir, short_tempdir, slab_files
from reference import random_ids

from engramd.client import EngramClient
from engramd.client.geometry import V41_FLASH_CONFIG, TableGeometry
from engramd.client.shared.protocol import PROTOCOL_VERSION
from engramd.server.startup import EXIT_TABLES
from engramd.server.table_file import HEADER_BYTES

INSTANCE = "faults"


def assert_serves_reference_rows(daemon, reference, seed: int) -> None:
    ids = random_ids(np.random.default_rng(seed), 64, reference.rows, reference.heads)
    with EngramClient(daemon.socket, max_tokens=64) as client:
        rows = client.lookup(torch.from_numpy(ids)).result().double().numpy()
    wrong = np.argwhere(rows != reference.expected(ids))
    assert wrong.size == 0, f"{len(wrong)} wrong values, first at {wrong[:5].tolist()}"


def leftovers(shm_dir: Path) -> list[str]:
    return sorted(p.name for p in shm_dir.rglob("*.tbl"))


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], bytes | int]]) -> None:
    """A safetensors file; a tensor given as an int byte count is left as a hole (sparse)."""
    header, offset = {}, 0
    for name, (dtype, shape, data) in tensors.items():
        size = data if isinstance(data, int) else len(data)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for _dtype, _shape, data in tensors.values():
            if isinstance(data, int):
                f.seek(data, os.SEEK_CUR)
            else:
                f.write(data)
        f.truncate(8 + len(raw) + offset)


def sparse_checkpoint(directory: Path, geometry: TableGeometry) -> None:
    """A checkpoint of `geometry` whose tensors are holes: any size, no disk space used."""
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(geometry.to_config()))
    tensors = {}
    for layer_id, rows in zip(geometry.layer_ids, geometry.rows, strict=True):
        tensors[f"layers.{layer_id}.engram.embed.weight"] = ("F8_E4M3", [rows, geometry.head_dim],
                                                             rows * geometry.head_dim)
        tensors[f"layers.{layer_id}.engram.embed.scale"] = ("F8_E8M0", [rows, geometry.scale_bytes],
                                                            rows * geometry.scale_bytes)
    write_safetensors(directory / "model.safetensors", tensors)


# -- shared memory too small -------------------------------------------------------------------


def test_tables_larger_than_the_shm_folder_refuse_to_start(daemon_factory, tmp_path):
    unstarted = daemon_factory(start=False)  # only for its (cleaned-up) folders
    st = os.statvfs(unstarted.shm_dir)
    free = st.f_bavail * st.f_frsize
    # Buckets sized so that the two tables need about twice the folder's free space.
    vocab = max(1000, 2 * free // (2 * 24 * 264))
    config = {k: v for k, v in V41_FLASH_CONFIG.items() if k != "engram_num_embeddings"}
    geometry = TableGeometry.from_config({**config, "engram_vocab_size": vocab}, source="test")
    assert geometry.total_bytes > free
    sparse_checkpoint(tmp_path / "huge", geometry)

    daemon = daemon_factory(tables=tmp_path / "huge", ready=False, shm_dir=unstarted.shm_dir,
                            workdir=unstarted.workdir)
    assert daemon.proc.wait(60) == EXIT_TABLES, daemon.log()
    log = daemon.log()
    needed = re.search(r"need (\d+) bytes", log)
    assert needed and str(daemon.shm_dir) in log and "available" in log, log
    assert int(needed[1]) >= geometry.total_bytes, log
    assert leftovers(daemon.shm_dir) == []
    assert not daemon.socket.exists()


def test_slab_past_the_budget_gets_a_typed_error_and_the_daemon_serves_on(daemon_factory, reference):
    daemon = daemon_factory(extra=["--slab-budget-gib", "0.004"])  # about 4 MiB of slabs in all
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.setsockopt(zmq.RCVTIMEO, 10_000)
    raw.connect(f"ipc://{daemon.socket}")
    try:
        # 4 slots x 1024 tokens: about 100 MiB of slab, far past the budget.
        raw.send_multipart([msgpack.packb({"v": PROTOCOL_VERSION, "op": "register", "rid": 1, "pid": os.getpid(),
                                           "device": "cpu", "tp_rank": 0, "tp_size": 1,
                                           "max_tokens": 1024, "slots": 4})])
        reply = msgpack.unpackb(raw.recv_multipart()[0])
    finally:
        raw.close(0)
    assert reply["status"] == "error" and reply["code"] == "resource", reply
    assert "slab budget" in reply["message"] and "slab_budget_gib" in reply["message"], reply["message"]
    assert not slab_files(daemon.proc.pid), "a refused registration holds no slab"
    assert_serves_reference_rows(daemon, reference, seed=1)  # a 2 MiB slab still fits
    assert daemon.stop() == 0


# -- table files damaged between runs ----------------------------------------------------------


@pytest.fixture(scope="module")
def pristine_tables(tmp_path_factory, demo_checkpoint) -> Path:
    """Table files of the demo checkpoint as a cleanly stopped daemon leaves them."""
    work, shm = short_tempdir("egd-"), shm_tempdir()
    keep = tmp_path_factory.mktemp("pristine-tables")
    try:
        daemon = DaemonProcess(work, shm, demo_checkpoint, INSTANCE, []).start().wait_ready()
        assert daemon.stop() == 0, daemon.log()
        for table in (shm / f"engramd-{INSTANCE}").glob("*.tbl"):
            shutil.copy2(table, keep / table.name)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    assert len(list(keep.glob("*.tbl"))) == 2
    return keep


def _truncate_half(path: Path, decoy: Path) -> str:
    os.truncate(path, path.stat().st_size // 2)
    return "bytes"


def _empty(path: Path, decoy: Path) -> str:
    os.truncate(path, 0)
    return "truncated"


def _flip_data(path: Path, decoy: Path) -> str:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x5A]))
    return "checksum"


def _flip_header(path: Path, decoy: Path) -> str:
    with open(path, "r+b") as f:
        f.seek(24)  # inside the header struct, past the magic: only the CRC can tell
        byte = f.read(1)
        f.seek(24)
        f.write(bytes([byte[0] ^ 0x01]))
    return "CRC"


def _symlink(path: Path, decoy: Path) -> str:
    shutil.copy2(path, decoy)
    path.unlink()
    path.symlink_to(decoy)
    return "cannot open"


DAMAGE: dict[str, Callable[[Path, Path], str]] = {
    "truncated-half": _truncate_half, "emptied": _empty, "data-byte-flipped": _flip_data,
    "header-byte-flipped": _flip_header, "replaced-by-symlink": _symlink}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_table_file_is_detected_and_reloaded(damage, pristine_tables, daemon_factory,
                                                     reference, tmp_path):
    shm = shm_tempdir()
    try:
        for table in pristine_tables.glob("*.tbl"):
            folder = shm / f"engramd-{INSTANCE}"  # the daemon's table folder (server/table_loader.py)
            folder.mkdir(mode=0o750, exist_ok=True)
            shutil.copy2(table, folder / table.name)
        victim, other = sorted(folder.glob("*.tbl"))[::1 if len(damage) % 2 else -1]
        size = (pristine_tables / victim.name).stat().st_size
        decoy = tmp_path / "decoy.tbl"
        reason = DAMAGE[damage](victim, decoy)
        decoy_bytes = decoy.read_bytes() if decoy.exists() else None

        daemon = daemon_factory(instance=INSTANCE, shm_dir=shm)
        removal = [line for line in daemon.log().splitlines() if "removing" in line and victim.name in line]
        assert removal and reason in removal[0], daemon.log()
        assert [line for line in daemon.log().splitlines() if "re-attached" in line and other.name in line], \
            "the undamaged table is re-attached, not reloaded"
        assert victim.is_file() and not victim.is_symlink() and victim.stat().st_size == size
        if decoy_bytes is not None:
            assert decoy.read_bytes() == decoy_bytes, "the symlink's target was touched"
        assert_serves_reference_rows(daemon, reference, seed=len(damage))
        assert daemon.stop() == 0
        data = slice(HEADER_BYTES, None)  # the header holds the load's time and pid
        assert (pristine_tables / victim.name).read_bytes()[data] == victim.read_bytes()[data]
    finally:
        shutil.rmtree(shm, ignore_errors=True)


# -- checkpoint missing a tensor ---------------------------------------------------------------


def test_checkpoint_shard_without_a_tensor_fails_clearly(daemon_factory, demo_checkpoint, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(demo_checkpoint, broken)
    missing = "layers.14.engram.embed.scale"
    index = json.loads((broken / "model.safetensors.index.json").read_text())["weight_map"]
    shard = broken / index[missing]
    # The index still names the shard; the shard now holds only an unrelated tensor.
    write_safetensors(shard, {"layers.14.engram.gate.weight": ("BF16", [2, 4], bytes(16))})

    daemon = daemon_factory(tables=broken, ready=False)
    assert daemon.proc.wait(60) == EXIT_TABLES, daemon.log()
    log = daemon.log()
    assert missing in log and str(shard) in log, log
    assert leftovers(daemon.shm_dir) == []
    assert not daemon.socket.exists()


def test_enospc_while_creating_a_table_leaves_no_partial_file(demo_checkpoint, tmp_path, monkeypatch):
    """The folder fills up between the free-space check and the allocation (another process)."""
    from engramd.server.checkpoint import EngramCheckpoint
    from engramd.server.host_tables import InsufficientSpaceError, TableStore

    real_fallocate = os.posix_fallocate
    calls = []

    def fallocate(fd: int, offset: int, length: int) -> None:
        calls.append(length)
        if len(calls) == 2:  # the second layer's table
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fallocate(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    checkpoint = EngramCheckpoint.open(demo_checkpoint)
    with TableStore(tmp_path, INSTANCE) as store, pytest.raises(InsufficientSpaceError) as failure:
        store.open(checkpoint)
    second = f"L{checkpoint.geometry.layer_ids[1]}"
    assert second in str(failure.value) and str(tmp_path) in str(failure.value)
    names = [p.name for p in tmp_path.glob("*.tbl")]
    assert not [n for n in names if f".{second}." in n], names


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_backend_without_a_gpu_fails_before_loading_anything(daemon_factory):
    from engramd.server.startup import EXIT_DEVICE

    daemon = daemon_factory(extra=["--backend", "cuda"], ready=False)
    assert daemon.proc.wait(60) == EXIT_DEVICE, daemon.log()[-2000:]
    assert "no CUDA device is visible" in daemon.log()
    assert leftovers(daemon.shm_dir) == [], "no table was copied into shared memory"
