"""Tests of the host table store: shared-memory table files, re-attach, cleanup, locking.

The fake source's bytes are a fixed function of (layer, row, column), so every table can be
checked byte for byte against a reference computed here with plain numpy.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import textwrap
import types
import zlib
from pathlib import Path

import numpy as np
import pytest

from engramd.client.geometry import TableGeometry
from engramd.server import host_tables, table_file
from engramd.server.host_tables import (
    InsufficientSpaceError,
    LoadProgress,
    StoreLockedError,
    TableStore,
    TableStoreError,
    attach_complete,
    still_in_place,
)
from engramd.server.table_file import sample_ranges

SMALL = {
    "engram_layer_ids": [1, 14],
    "engram_max_ngram_size": 3,
    "engram_n_heads": 2,
    "engram_head_dim": 256,
    "engram_vocab_size": 300,
    "engram_compressed_vocab_size": 1000,
    "engram_pad_token_id": 2,
}
CHUNK = 50_000  # bytes per read_packed call: 189 rows, so several chunks and a short last one
TESTS_DIR = Path(__file__).resolve().parent


def small_geometry(**changes) -> TableGeometry:
    return TableGeometry.from_config({**SMALL, **changes}, source="test")


def pattern(layer_index: int, row_start: int, n: int, row_bytes: int) -> np.ndarray:
    """The bytes of rows [row_start, row_start + n) of a layer: a mixing function, no structure."""
    rows = np.arange(row_start, row_start + n, dtype=np.int64)[:, None]
    cols = np.arange(row_bytes, dtype=np.int64)[None, :]
    v = rows * 2654435761 + cols * 40503 + layer_index * 977 + 12345
    return ((v ^ (v >> 7) ^ (v >> 15)) & 0xFF).astype(np.uint8)


class FakeSource:
    def __init__(self, geometry: TableGeometry, fingerprint: str = "00c0ffee",
                 fail_on_call: int | None = None, kill_on_call: int | None = None):
        self.geometry = geometry
        self._fingerprint = fingerprint
        self.calls: list[tuple[int, int, int]] = []
        self.fail_on_call = fail_on_call
        self.kill_on_call = kill_on_call

    def fingerprint(self) -> str:
        return self._fingerprint

    def read_packed(self, layer_index: int, row_start: int, out: np.ndarray) -> None:
        self.calls.append((layer_index, row_start, out.shape[0]))
        if len(self.calls) == self.kill_on_call:
            os.kill(os.getpid(), 9)  # a daemon dying mid-load
        if len(self.calls) == self.fail_on_call:
            raise RuntimeError("checkpoint read failed")
        out[...] = pattern(layer_index, row_start, out.shape[0], out.shape[1])


def assert_table_equal(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    bad = np.argwhere(actual != expected)
    assert bad.size == 0, f"{what}: {len(bad)} bytes differ, first [row, col]: {bad[:5].tolist()}"


def check_tables(tables, geometry: TableGeometry) -> None:
    assert [t.layer_index for t in tables] == list(range(geometry.n_layers))
    for t in tables:
        expected = pattern(t.layer_index, 0, geometry.rows[t.layer_index], geometry.row_bytes)
        assert_table_equal(t.array, expected, f"layer {t.layer_index}")


def reopen(shm: Path, geometry: TableGeometry, **open_kw) -> tuple[list[bool], set[int]]:
    """Open the store again on a fresh source, checking every table byte for byte: which tables
    were re-attached, and the layers the source was read for (the ones loaded again)."""
    source = FakeSource(geometry)
    with TableStore(shm, "test") as store:
        tables = store.open(source, chunk_bytes=CHUNK, **open_kw)
        check_tables(tables, geometry)
        return [t.reattached for t in tables], {c[0] for c in source.calls}


def table_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("*.tbl"))


def load(shm: Path, source, instance: str = "test", **kw) -> None:
    with TableStore(shm, instance) as store:
        store.open(source, chunk_bytes=CHUNK, **kw)


@pytest.fixture
def shm(tmp_path: Path) -> Path:
    d = tmp_path / "shm"
    d.mkdir()
    return d


def test_load_matches_source_and_layout(shm: Path):
    geometry = small_geometry()
    source = FakeSource(geometry)
    with TableStore(shm, "test") as store:
        tables = store.open(source, chunk_bytes=CHUNK)
        check_tables(tables, geometry)
        for t in tables:
            rows = geometry.rows[t.layer_index]
            assert (t.rows, t.row_bytes, t.nbytes) == (rows, 264, rows * 264)
            assert t.layer_id == geometry.layer_ids[t.layer_index]
            assert t.path == shm / f"engramd.test.L{t.layer_id}.00c0ffee.tbl"
            assert t.data_offset % 4096 == 0 and t.data_offset >= 4096
            assert t.address % 4096 == 0
            assert not t.reattached
            assert t.path.stat().st_mode & 0o777 == 0o640
            view = t.array
            assert not view.flags.writeable
            assert view.__array_interface__["data"][0] == t.address
            import torch  # here only: the subprocess tests import this module and need no torch

            tensor = t.tensor
            assert tensor.dtype == torch.uint8 and tensor.data_ptr() == t.address
            assert torch.equal(tensor, torch.from_numpy(pattern(t.layer_index, 0, rows, 264)))
            # The mapping is the file: its bytes at data_offset are the table.
            with open(t.path, "rb") as f:
                f.seek(t.data_offset)
                on_disk = np.frombuffer(f.read(t.nbytes), dtype=np.uint8).reshape(rows, 264)
            assert_table_equal(on_disk, pattern(t.layer_index, 0, rows, 264), "file bytes")
            del view, tensor
        step = CHUNK // 264
        expected_calls = [(i, r, min(step, geometry.rows[i] - r))
                          for i in range(geometry.n_layers)
                          for r in range(0, geometry.rows[i], step)]
        assert source.calls == expected_calls
        assert store.tables == tables
    assert all(t.closed for t in tables)
    with pytest.raises(TableStoreError, match="closed"):
        tables[0].array  # noqa: B018


def test_reattach_does_not_read_source(shm: Path):
    geometry = small_geometry()
    load(shm, FakeSource(geometry))
    before = {p: p.stat().st_ino for p in shm.glob("*.tbl")}
    again = FakeSource(geometry)
    reports: list[LoadProgress] = []
    with TableStore(shm, "test") as store:
        tables = store.open(again, progress=reports.append, chunk_bytes=CHUNK)
        assert again.calls == []
        assert all(t.reattached for t in tables)
        check_tables(tables, geometry)
    assert {p: p.stat().st_ino for p in shm.glob("*.tbl")} == before
    assert [(r.layer_index, r.reattached, r.done_bytes == r.total_bytes) for r in reports] == \
        [(0, True, True), (1, True, True)]


def test_progress_ends_at_total_and_logs_rate(shm: Path, caplog):
    geometry = small_geometry()
    reports: list[LoadProgress] = []
    with caplog.at_level(logging.INFO, logger="engramd.tables"):
        load(shm, FakeSource(geometry), progress=reports.append)
    for index in range(geometry.n_layers):
        mine = [r for r in reports if r.layer_index == index]
        done = [r.done_bytes for r in mine]
        total = geometry.rows[index] * 264
        assert done == sorted(done) and done[-1] == total and len(done) > 1
        assert all(r.total_bytes == total and not r.reattached and r.seconds >= 0 for r in mine)
    assert any("100%" in m and "GB/s" in m for m in caplog.messages)
    assert LoadProgress(0, 3_000_000_000, 6_000_000_000, 1.5, False).gbps == 2.0
    assert LoadProgress(0, 0, 10, 0.0, False).gbps == 0.0


def test_dead_daemon_incomplete_file_is_removed_and_reloaded(shm: Path, caplog):
    geometry = small_geometry()
    per_layer = -(-geometry.rows[0] // (CHUNK // 264))
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(TESTS_DIR)!r})
        from test_host_tables import FakeSource, load, small_geometry
        load(__import__("pathlib").Path({str(shm)!r}),
             FakeSource(small_geometry(), kill_on_call={per_layer + 2}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert proc.returncode == -9, proc.stderr.decode()
    assert len(table_files(shm)) == 2  # layer 0 complete, layer 1 half filled
    with caplog.at_level(logging.INFO, logger="engramd.tables"):
        assert reopen(shm, geometry) == ([True, False], {1})
    removal = [m for m in caplog.messages if "removing" in m]
    assert len(removal) == 1 and "L14" in removal[0] and "incomplete: state loading" in removal[0]


def test_file_without_header_is_removed(shm: Path):
    geometry = small_geometry()
    load(shm, FakeSource(geometry))
    victim = shm / "engramd.test.L1.00c0ffee.tbl"
    size = victim.stat().st_size
    victim.unlink()
    victim.write_bytes(bytes(size))  # created, never written: what a crash right away leaves
    assert reopen(shm, geometry) == ([False, True], {0})


def test_other_fingerprint_and_layer_files_are_removed(shm: Path, caplog):
    geometry = small_geometry()
    load(shm, FakeSource(geometry, fingerprint="aaaa"))
    load(shm, FakeSource(small_geometry(engram_layer_ids=[1, 7]), fingerprint="bbbb"))
    assert table_files(shm) == ["engramd.test.L1.bbbb.tbl", "engramd.test.L7.bbbb.tbl"]
    source = FakeSource(geometry, fingerprint="cccc")
    with caplog.at_level(logging.INFO, logger="engramd.tables"):
        with TableStore(shm, "test") as store:
            tables = store.open(source, chunk_bytes=CHUNK)
            check_tables(tables, geometry)
    assert table_files(shm) == ["engramd.test.L1.cccc.tbl", "engramd.test.L14.cccc.tbl"]
    assert {c[0] for c in source.calls} == {0, 1}
    text = "\n".join(caplog.messages)
    assert "fingerprint bbbb is not the current cccc" in text
    assert "layer id 7 is not in the layers [1, 14]" in text


def test_geometry_change_with_same_fingerprint_reloads(shm: Path):
    load(shm, FakeSource(small_geometry()))
    geometry = small_geometry(engram_vocab_size=200)
    assert reopen(shm, geometry)[0] == [False, False]


def corrupt(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("where", ["first row", "middle", "last row", "header"])
def test_corruption_is_detected_and_reloaded(shm: Path, monkeypatch, where: str):
    geometry = small_geometry()
    if where != "middle":
        # Sample 4 x 4 KiB of ~300 KiB, so only the always-sampled first and last rows catch it.
        monkeypatch.setattr(table_file, "SAMPLE_BLOCKS", 4)
        monkeypatch.setattr(table_file, "SAMPLE_BLOCK_BYTES", 4096)
    with TableStore(shm, "test") as store:
        path, offset, nbytes = [(t.path, t.data_offset, t.nbytes)
                                for t in store.open(FakeSource(geometry), chunk_bytes=CHUNK)][1]
    position = {"first row": offset + 7, "middle": offset + nbytes // 2 + 3,
                "last row": offset + nbytes - 5, "header": 20}[where]
    corrupt(path, position)
    assert reopen(shm, geometry) == ([True, False], {1})


@pytest.mark.parametrize("keep", ["header only", "half the data", "one byte short", "too long"])
def test_wrong_size_file_is_reloaded(shm: Path, keep: str):
    geometry = small_geometry()
    load(shm, FakeSource(geometry))
    victim = shm / "engramd.test.L14.00c0ffee.tbl"
    size = victim.stat().st_size
    new_size = {"header only": 100, "half the data": size // 2, "one byte short": size - 1,
                "too long": size + 4096}[keep]
    os.truncate(victim, new_size)
    assert reopen(shm, geometry)[0] == [True, False]


def test_second_store_in_same_process_is_locked(shm: Path):
    with TableStore(shm, "test"):
        with pytest.raises(StoreLockedError) as info:
            TableStore(shm, "test")
        message = str(info.value)
        assert str(shm / "engramd.test.lock") in message and f"pid {os.getpid()}" in message
    with TableStore(shm, "test"):  # released on close
        pass


def test_store_in_other_process_is_locked(shm: Path, tmp_path: Path):
    script = textwrap.dedent(f"""
        import sys
        from engramd.server.host_tables import TableStore
        with TableStore({str(shm)!r}, "test", lock_dir={str(tmp_path)!r}):
            print("locked", flush=True)
            sys.stdin.read()
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(StoreLockedError, match=f"pid {proc.pid}"):
            TableStore(shm, "test", lock_dir=tmp_path)
        with TableStore(shm, "test"):  # another lock directory is another lock
            pass
    finally:
        proc.communicate("", timeout=30)
    assert proc.returncode == 0
    with TableStore(shm, "test", lock_dir=tmp_path):
        pass


def test_other_instance_does_not_touch_files(shm: Path):
    geometry = small_geometry()
    load(shm, FakeSource(geometry), instance="a")
    mine = {p.name: (p.stat().st_ino, p.read_bytes()) for p in shm.glob("*.tbl")}
    # A name that extends "a" with something shaped like a layer and fingerprint.
    with TableStore(shm, "a.L1.ab") as other, TableStore(shm, "a"):
        other.open(FakeSource(small_geometry(engram_layer_ids=[1, 2]), fingerprint="ff"),
                   chunk_bytes=CHUNK)
        assert sorted(p.name for p in other.remove_files()) == \
            ["engramd.a.L1.ab.L1.ff.tbl", "engramd.a.L1.ab.L2.ff.tbl"]
    assert {p.name: (p.stat().st_ino, p.read_bytes()) for p in shm.glob("*.tbl")} == mine
    source = FakeSource(geometry)
    with TableStore(shm, "a") as store:
        assert all(t.reattached for t in store.open(source, chunk_bytes=CHUNK))
        assert source.calls == []
    with TableStore(shm, "a") as store:
        store.remove_files()
    assert table_files(shm) == []


def expected_file_size(rows: int) -> int:
    return -(-(4096 + rows * 264) // 4096) * 4096


def fake_statvfs(available: int, blocks: int = 1 << 30, block: int = 4096):
    return lambda path: types.SimpleNamespace(f_bavail=available // block, f_frsize=block,
                                              f_bsize=block, f_blocks=blocks)


def test_a_hugetlbfs_mount_without_a_size_limit_offers_its_free_page_pool(tmp_path, monkeypatch):
    """Such a mount says 0 blocks of 0; the free huge pages of its page size are what it holds."""
    pool = tmp_path / "free_hugepages"
    pool.write_text("5\n")
    monkeypatch.setattr(host_tables, "HUGE_PAGE_POOL", str(tmp_path / "free_hugepages"))
    monkeypatch.setattr(os, "statvfs", fake_statvfs(0, blocks=0, block=2 << 20))
    assert host_tables._available_bytes(tmp_path) == 5 * (2 << 20)
    monkeypatch.setattr(os, "statvfs", fake_statvfs(8192, blocks=0))  # 4 KiB blocks: not huge pages
    assert host_tables._available_bytes(tmp_path) == 8192


def test_free_space_refusal_names_bytes(shm: Path, monkeypatch):
    geometry = small_geometry()
    needed = sum(expected_file_size(r) for r in geometry.rows)
    monkeypatch.setattr(os, "statvfs", fake_statvfs(needed - 4096))
    with TableStore(shm, "test") as store:
        with pytest.raises(InsufficientSpaceError) as info:
            store.open(FakeSource(geometry), chunk_bytes=CHUNK)
    assert f"need {needed} bytes" in str(info.value)
    assert f"only {needed - 4096} bytes" in str(info.value)
    assert str(shm) in str(info.value)
    assert table_files(shm) == []


def test_free_space_counts_reattached_files(shm: Path, monkeypatch):
    geometry = small_geometry()
    load(shm, FakeSource(geometry))
    (shm / "engramd.test.L14.00c0ffee.tbl").unlink()
    one = expected_file_size(geometry.rows[1])
    monkeypatch.setattr(os, "statvfs", fake_statvfs(one - 4096))
    with TableStore(shm, "test") as store:
        with pytest.raises(InsufficientSpaceError, match=f"need {one} bytes"):
            store.open(FakeSource(geometry), chunk_bytes=CHUNK)
    monkeypatch.setattr(os, "statvfs", fake_statvfs(one))
    with TableStore(shm, "test") as store:
        check_tables(store.open(FakeSource(geometry), chunk_bytes=CHUNK), geometry)


def test_failed_load_removes_partial_file_keeps_complete_ones(shm: Path, caplog):
    geometry = small_geometry()
    per_layer = -(-geometry.rows[0] // (CHUNK // 264))
    with TableStore(shm, "test") as store:
        with pytest.raises(RuntimeError, match="checkpoint read failed"):
            store.open(FakeSource(geometry, fail_on_call=per_layer + 2), chunk_bytes=CHUNK)
        assert store.tables == []
    assert not [m for m in caplog.messages if "still alive" in m]  # unmapped at once
    assert table_files(shm) == ["engramd.test.L1.00c0ffee.tbl"]
    source = FakeSource(geometry)
    with TableStore(shm, "test") as store:
        check_tables(store.open(source, chunk_bytes=CHUNK), geometry)
    assert {c[0] for c in source.calls} == {1}


def test_close_with_live_view_raises_and_still_unlocks(shm: Path):
    store = TableStore(shm, "test")
    table = store.open(FakeSource(small_geometry()), chunk_bytes=CHUNK)[0]
    view = table.array
    with pytest.raises(TableStoreError, match="still alive"):
        store.close()
    with TableStore(shm, "test"):
        pass
    assert view[0, 0] == pattern(0, 0, 1, 264)[0, 0]  # mapping stays valid while viewed
    del view
    table.close()


@pytest.mark.parametrize("name", ["", "a/b", "a b", "x" * 65, "a\n", "é", "a*"])
def test_invalid_instance_rejected(shm: Path, name: str):
    with pytest.raises(TableStoreError, match="instance name"):
        TableStore(shm, name)
    assert list(shm.iterdir()) == []


@pytest.mark.parametrize("fingerprint", ["", "ABCD", "12/34", "g" * 4, "a" * 129])
def test_invalid_fingerprint_rejected(shm: Path, fingerprint: str):
    with TableStore(shm, "test") as store:
        with pytest.raises(TableStoreError, match="fingerprint"):
            store.open(FakeSource(small_geometry(), fingerprint=fingerprint))
    assert table_files(shm) == []


def test_missing_directory_rejected(tmp_path: Path):
    with pytest.raises(TableStoreError, match="shm_dir .* is not a directory"):
        TableStore(tmp_path / "absent", "test")


@pytest.mark.parametrize("nbytes", [264 * 100_000, 384_006_168 * 264, 10**9 + 264 * 7])
def test_sample_ranges_spread_over_large_tables(nbytes: int):
    blocks, block = 16, 4096
    ranges = sample_ranges(nbytes, 264, blocks, block)
    assert ranges == sorted(ranges)
    assert all(0 <= lo < hi <= nbytes for lo, hi in ranges)
    assert (0, 264) in ranges
    assert (nbytes - 264, nbytes) in ranges
    starts = [lo for lo, hi in ranges if hi - lo == block]
    assert len(starts) == blocks and starts[0] == 0 and starts[-1] == nbytes - block
    gaps = np.diff(starts)
    assert gaps.max() - gaps.min() <= 1  # evenly spaced
    assert sum(hi - lo for lo, hi in ranges) <= blocks * block + 2 * 264


def test_sample_ranges_cover_small_tables():
    assert sample_ranges(1000 * 264, 264, 16, 65536) == [(0, 1000 * 264)]


def test_sampled_checksum_is_the_crc_of_the_ranges_in_order():
    """Files written before the ranges were joined carry a CRC chained range by range: the same
    number, so they still re-attach."""
    data = np.random.default_rng(7).integers(0, 256, size=3_000_000, dtype=np.uint8)
    ranges = sample_ranges(data.size, 264, 16, 4096)
    assert len(ranges) > 2
    chained = 0
    for lo, hi in ranges:
        chained = zlib.crc32(data[lo:hi].tobytes(), chained)
    assert table_file.sampled_checksum(data.reshape(-1, 1000), 264, 16, 4096) == chained
    assert chained != zlib.crc32(data.tobytes())  # a sample, not the whole


def forge_byte(path: Path, offset: int) -> None:
    """Flip one byte of a table file and give its header the matching checksum, as someone who
    can write the file would: only a full comparison can tell."""
    with open(path, "r+b") as f:
        header = table_file._Header.unpack(f.read(4096))
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x5A]))
        f.seek(header.data_offset)
        data = np.frombuffer(f.read(header.rows * header.row_bytes), dtype=np.uint8)
        checksum = table_file.sampled_checksum(data, header.row_bytes, header.sample_blocks,
                                                header.sample_block_bytes)
        f.seek(0)
        f.write(dataclasses.replace(header, checksum=checksum).pack())


def test_verify_reloads_a_reattached_table_that_differs_in_one_byte(shm: Path, caplog):
    """A re-attach checks the header, not the rows: one byte changed in the middle of a table
    (a same-user process writing through its mapping, a memory fault) is served as it is. With
    `verify`, every row is compared first: the differing table alone is removed and loaded
    again, the intact one is kept."""
    geometry = small_geometry()
    load(shm, FakeSource(geometry))
    with TableStore(shm, "test") as store:
        victim = store.open(FakeSource(geometry), chunk_bytes=CHUNK)[1]
        path, offset = victim.path, victim.data_offset + 250 * victim.row_bytes + 7
    forge_byte(path, offset)
    with TableStore(shm, "test") as store:
        unverified = store.open(FakeSource(geometry), chunk_bytes=CHUNK)
        assert all(t.reattached for t in unverified)
        assert unverified[1].array[250, 7] != pattern(1, 250, 1, geometry.row_bytes)[0, 7]
    with caplog.at_level(logging.INFO, logger="engramd.tables"):
        assert reopen(shm, geometry, verify=True) == ([True, False], {0, 1})  # both read to compare
    assert "row 250 differs from the checkpoint" in caplog.text
    assert "every row matches the checkpoint" in caplog.text


class OtherSource(FakeSource):
    """Another revision of the same geometry: other bytes, another fingerprint."""

    def __init__(self, geometry: TableGeometry, fingerprint: str = "0be77e4"):
        super().__init__(geometry, fingerprint)

    def read_packed(self, layer_index: int, row_start: int, out: np.ndarray) -> None:
        self.calls.append((layer_index, row_start, out.shape[0]))
        out[...] = pattern(layer_index + 50, row_start, out.shape[0], out.shape[1])


def check_other_tables(tables, geometry: TableGeometry) -> None:
    for t in tables:
        expected = pattern(t.layer_index + 50, 0, geometry.rows[t.layer_index], geometry.row_bytes)
        assert_table_equal(t.array, expected, f"reloaded layer {t.layer_index}")


def test_a_reload_opens_tables_beside_the_served_ones_then_switches(shm: Path):
    geometry = small_geometry()
    with TableStore(shm, "test") as store:
        served = store.open(FakeSource(geometry), chunk_bytes=CHUNK)
        served_files = table_files(shm)
        stale = shm / "engramd.test.L1.0ddba11.tbl"  # a third version's leftover
        stale.write_bytes(b"x")
        loaded = store.open_next(OtherSource(geometry), chunk_bytes=CHUNK)
        assert not stale.exists() and set(served_files) < set(table_files(shm))
        assert store.tables == served  # nothing switched yet: the served tables are untouched
        check_tables(served, geometry)
        check_other_tables(loaded, geometry)
        with pytest.raises(TableStoreError, match="open already"):
            store.open_next(OtherSource(geometry, "0ab"), chunk_bytes=CHUNK)
        replaced = store.switch()
        assert replaced == served and store.tables == loaded
        assert table_files(shm) == sorted(t.path.name for t in loaded)  # the old files are gone
        check_tables(replaced, geometry)  # and still readable until released
        store.release(replaced).join()
        assert all(t.closed for t in replaced)
    assert all(t.closed for t in loaded)
    again = FakeSource(geometry, "0be77e4")  # a restart finds the reloaded files complete
    with TableStore(shm, "test") as store:
        assert all(t.reattached for t in store.open(again, chunk_bytes=CHUNK)) and again.calls == []


def test_a_cancelled_or_abandoned_reload_leaves_only_the_served_tables(shm: Path):
    geometry = small_geometry()
    with TableStore(shm, "test") as store:
        served = store.open(FakeSource(geometry), chunk_bytes=CHUNK)
        served_files = table_files(shm)
        source = OtherSource(geometry)
        with pytest.raises(host_tables.ReloadCancelled):  # in the second layer: the first is done
            store.open_next(source, chunk_bytes=CHUNK, cancelled=lambda: source.calls[-1][0] == 1)
        assert table_files(shm) == served_files and store.tables == served
        store.open_next(OtherSource(geometry), chunk_bytes=CHUNK)  # a cancelled one leaves no trace
        store.abandon_next()
        assert table_files(shm) == served_files
        check_tables(served, geometry)
        with pytest.raises(TableStoreError, match="are the ones open"):
            store.open_next(FakeSource(geometry), chunk_bytes=CHUNK)
        with pytest.raises(TableStoreError, match="no reload"):
            store.switch()
    with TableStore(shm, "test") as store, pytest.raises(TableStoreError, match="open\\(\\) first"):
        store.open_next(OtherSource(geometry))


def test_tables_are_mapped_ahead_only_from_complete_files_and_nothing_is_removed(shm: Path):
    """attach_complete, a standby's preparation: no lock taken, nothing created or removed."""
    geometry = small_geometry()
    assert attach_complete(shm, "test", FakeSource(geometry)) is None  # nothing loaded yet
    with TableStore(shm, "test") as store:  # another daemon holds the lock and serves
        store.open(FakeSource(geometry), chunk_bytes=CHUNK)
        ahead = attach_complete(shm, "test", FakeSource(geometry))
        assert ahead is not None
        check_tables(ahead, geometry)
        assert [t.identity for t in ahead] == [
            (os.stat(t.path).st_dev, os.stat(t.path).st_ino) for t in ahead]
        assert all(still_in_place(t) for t in ahead)
        for table in ahead:
            table.close()
        assert attach_complete(shm, "test", FakeSource(geometry, fingerprint="0dd")) is None
    files = table_files(shm)
    victim = shm / "engramd.test.L14.00c0ffee.tbl"
    size = victim.stat().st_size
    victim.unlink()
    victim.write_bytes(bytes(size))  # what a load in progress looks like: no complete header
    assert attach_complete(shm, "test", FakeSource(geometry)) is None
    assert table_files(shm) == files  # left for the store that holds the lock to judge


def replace_file(path: Path, change_at: int | None = None) -> None:
    """The same bytes (one of them flipped at `change_at`) in a new file at `path`, as the
    store writes them: a new inode."""
    data = bytearray(path.read_bytes())
    if change_at is not None:
        data[change_at] ^= 0xFF
    path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, table_file.FILE_MODE)
    try:
        os.write(fd, bytes(data))
    finally:
        os.close(fd)


@pytest.mark.parametrize("change", ["none", "file replaced", "rows changed in place"])
def test_the_store_adopts_tables_mapped_ahead_only_while_they_pass_the_checks(shm: Path, caplog, change):
    geometry = small_geometry()
    load(shm, FakeSource(geometry))
    ahead = attach_complete(shm, "test", FakeSource(geometry))
    second = ahead[1]
    if change == "file replaced":  # the same rows, but not the file mapped ahead
        replace_file(second.path)
        assert not still_in_place(second) and still_in_place(ahead[0])
    elif change == "rows changed in place":  # the mapping ahead sees it too; the checksum tells
        corrupt(second.path, second.data_offset + second.nbytes // 2 + 3)
    source = FakeSource(geometry)
    with caplog.at_level(logging.INFO, logger="engramd.tables"):
        with TableStore(shm, "test") as store:
            tables = store.open(source, chunk_bytes=CHUNK, adopt=ahead)
            check_tables(tables, geometry)
            assert tables[0] is ahead[0]
            assert (tables[1] is second) == (change == "none")
            assert [t.reattached for t in tables] == [True, change != "rows changed in place"]
            assert {c[0] for c in source.calls} == ({1} if change == "rows changed in place" else set())
        assert all(t.closed for t in tables)  # the store closes what it took
    adopted = [m for m in caplog.messages if "mapped ahead by the standby" in m]
    assert len(adopted) == (2 if change == "none" else 1)
    if change != "none":
        assert not second.closed  # not taken: still the caller's to close
        second.close()


def test_a_table_mapped_ahead_that_fails_verify_is_replaced_and_left_to_its_owner(shm: Path):
    """With `verify`, an adopted table whose rows differ from the checkpoint is removed and
    loaded again; the mapping made ahead is not closed by the store (its owner may have pinned
    it, and must unregister it before it is unmapped)."""
    geometry = small_geometry()
    load(shm, FakeSource(geometry))
    ahead = attach_complete(shm, "test", FakeSource(geometry))
    forge_byte(ahead[1].path, ahead[1].data_offset + 250 * ahead[1].row_bytes + 7)
    with TableStore(shm, "test") as store:
        tables = store.open(FakeSource(geometry), chunk_bytes=CHUNK, verify=True, adopt=ahead)
        check_tables(tables, geometry)
        assert tables[0] is ahead[0] and tables[1] is not ahead[1] and not tables[1].reattached
    assert not ahead[1].closed
    ahead[1].close()
