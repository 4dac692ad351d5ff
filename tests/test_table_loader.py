"""The tables' first stage (table_loader.open_tables, TablePreload) and how pinning splits ranges.

The first stage runs beside the daemon's torch import, so it must not import torch itself; a
preload hands its tables to the loader with the load's progress, passes its errors on, and
closes what it opened when nobody takes it.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
import time
import types

import numpy as np
import pytest
from helpers import wait_until

from engramd.client.shared import host_pin
from engramd.client.shared.host_pin import PART_ALIGN, split_ranges
from engramd.server.checkpoint import CheckpointError
from engramd.server.config import load_config
from engramd.server.table_loader import TablePreload


def demo_config(demo_checkpoint, shm, tables=None):
    return load_config(None, {"tables": str(tables or demo_checkpoint), "shm_dir": str(shm),
                              "socket": str(shm / "engramd.sock"), "backend": "cpu"})


def test_the_first_stage_and_the_serve_command_up_to_it_import_no_torch(demo_checkpoint, shm_dir):
    script = textwrap.dedent(f"""
        import sys
        import engramd.server.cli, engramd.server.startup, engramd.client.shared.host_pin
        from engramd.server.config import load_config
        from engramd.server.table_loader import open_tables
        config = load_config(None, {{"tables": {str(demo_checkpoint)!r}, "shm_dir": {str(shm_dir)!r},
                                     "backend": "auto"}})
        opened = open_tables(config, lambda fraction: None)
        opened.close()
        print("torch" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", "the first stage imported torch"


def test_a_preload_hands_over_the_checkpoint_rows_and_the_load_progress(demo_checkpoint, shm_dir):
    config = demo_config(demo_checkpoint, shm_dir)
    preload = TablePreload.start(config)
    seen: list[float] = []
    preload.listen(seen.append)
    opened = preload.take()
    try:
        assert opened.backend_name == "cpu" and opened.registration is None
        assert seen and seen[-1] == 1.0
        geometry = opened.geometry
        for layer, table in enumerate(opened.tables):
            rows = np.random.default_rng(layer).integers(0, geometry.rows[layer], 64)
            for row in rows:
                want = np.empty((1, geometry.row_bytes), dtype=np.uint8)
                opened.checkpoint.read_packed(layer, int(row), want)
                np.testing.assert_array_equal(table.array[row], want[0])
        with pytest.raises(RuntimeError, match="already taken"):
            preload.take()
    finally:
        opened.close()
    again = TablePreload.start(config).take()  # the files stay: the next start re-attaches them
    try:
        assert again.reattached
    finally:
        again.close()


def test_a_preload_passes_its_error_to_the_taker(demo_checkpoint, shm_dir, tmp_path):
    config = demo_config(demo_checkpoint, shm_dir, tables=tmp_path / "no-such-checkpoint")
    preload = TablePreload.start(config)
    with pytest.raises(CheckpointError, match="no-such-checkpoint.*missing config.json"):
        preload.take()


def test_an_abandoned_preload_closes_its_tables_before_and_after_it_is_done(demo_checkpoint, shm_dir,
                                                                          monkeypatch):
    from engramd.server import table_loader

    config = demo_config(demo_checkpoint, shm_dir)
    finished = TablePreload.start(config)
    finished._thread.join()
    opened = finished._result
    finished.abandon()
    assert all(t._mapping.closed for t in opened.tables)

    closed = []
    real_open = table_loader.open_tables

    def slow_open(config, progress, prepared=None):
        time.sleep(0.3)  # still running when abandoned
        result = real_open(config, progress, prepared)
        real_close = result.close
        result.close = lambda: (closed.append(True), real_close())
        return result

    monkeypatch.setattr(table_loader, "open_tables", slow_open)
    running = TablePreload.start(config)
    running.abandon()
    wait_until(lambda: closed, timeout=30)
    running._thread.join()


def test_take_after_abandon_says_the_daemon_is_stopping(demo_checkpoint, shm_dir):
    preload = TablePreload.start(demo_config(demo_checkpoint, shm_dir))
    preload.abandon()
    with pytest.raises(RuntimeError, match="abandoned"):
        preload.take()


def test_auto_serves_on_the_cpu_when_the_driver_sees_a_gpu_that_torch_cannot_use(demo_checkpoint,
                                                                                  shm_dir, monkeypatch):
    from engramd.server import table_loader
    from engramd.server.cpu_backend import CpuBackend

    config = dataclasses.replace(demo_config(demo_checkpoint, shm_dir), backend="auto")
    opened = TablePreload.start(config).take()
    unpinned = []
    opened.backend_name, opened.registration = "cuda", types.SimpleNamespace(close=lambda: unpinned.append(1))
    monkeypatch.setattr(table_loader, "_torch_sees_a_gpu", lambda: False)
    backend = table_loader.build_backend(config, opened)
    try:
        assert isinstance(backend, CpuBackend) and unpinned == [1] and opened.registration is None
    finally:
        backend.close()
        opened.close()


def test_pin_parts_cover_every_range_exactly_in_aligned_capped_pieces(monkeypatch):
    base = 1 << 40
    ranges = [(base, 17 * 2**30 + 12345), (base + 2**36, 5 * PART_ALIGN // 2), (base + 2**37, 4096)]
    for parts in (1, 3, 8, 16):
        pieces = split_ranges(ranges, parts)
        for address, nbytes in ranges:
            mine = sorted(p for p in pieces if address <= p[0] < address + nbytes)
            assert mine[0][0] == address
            assert sum(n for _, n in mine) == nbytes
            for (a, n), (b, _) in zip(mine, mine[1:], strict=False):
                assert a + n == b and n % PART_ALIGN == 0
        assert len(pieces) <= parts + len(ranges)
    monkeypatch.setattr(host_pin, "REGISTER_CHUNK", 4 * PART_ALIGN)
    assert max(n for _, n in split_ranges([(base, 64 * PART_ALIGN)], 1)) == 4 * PART_ALIGN


class FakeRegistration:
    """Stands in for a standby's HostRegistration: notes whether it was closed, and whether
    its tables were all still mapped then (it is let go of first, as the prepared set is)."""

    def __init__(self, tables):
        self.tables = list(tables)
        self.closed_while_mapped: bool | None = None

    def close(self):
        self.closed_while_mapped = not any(t.closed for t in self.tables)


def prepared_for(config):
    from engramd.server.host_tables import attach_complete
    from engramd.server.standby_tables import PreparedTables
    from engramd.server.table_loader import resolve_checkpoint, tables_folder_path

    checkpoint = resolve_checkpoint(config)
    tables = attach_complete(tables_folder_path(config.shm_dir, config.instance), config.instance,
                             checkpoint)
    assert tables is not None
    return PreparedTables(checkpoint.fingerprint(), tables, FakeRegistration(tables))


def test_a_standbys_tables_are_adopted_and_its_registration_goes_only_with_all_of_them(demo_checkpoint,
                                                                                        shm_dir):
    from engramd.server.table_loader import adopted_registration, open_tables

    config = demo_config(demo_checkpoint, shm_dir)
    TablePreload.start(config).take().close()  # the files in shared memory, as a daemon left them
    # A cpu start adopts the tables; their registration is let go of first.
    prepared = prepared_for(config)
    ahead, registration = list(prepared.tables), prepared.registration
    opened = open_tables(config, lambda fraction: None, prepared)
    try:
        assert all(t is a for t, a in zip(opened.tables, ahead, strict=True))
        assert opened.registration is None and registration.closed_while_mapped
        assert not any(t.closed for t in opened.tables)
    finally:
        opened.close()
    # Every table adopted, cuda: the registration is the backend's to close.
    prepared = prepared_for(config)
    tables, registration = list(prepared.tables), prepared.registration
    assert adopted_registration(prepared, tables, "cuda") is registration
    assert registration.closed_while_mapped is None and prepared.tables == []
    for table in tables:
        table.close()
    # Every table, in another order: the backend pairs addresses and tables by position.
    prepared = prepared_for(config)
    tables, registration = prepared.tables[::-1], prepared.registration
    assert adopted_registration(prepared, tables, "cuda") is None
    assert registration.closed_while_mapped and not any(t.closed for t in tables)
    for table in tables:
        table.close()
    # One table not adopted: unregistered, then that one unmapped; the adopted one kept.
    prepared = prepared_for(config)
    kept, dropped = prepared.tables
    registration = prepared.registration
    assert adopted_registration(prepared, [kept], "cuda") is None
    assert registration.closed_while_mapped and dropped.closed and not kept.closed
    kept.close()


@pytest.mark.parametrize("collapse", [True, False])
def test_the_start_pins_with_the_configured_collapse(demo_checkpoint, shm_dir, monkeypatch, collapse):
    """collapse_pages reaches the pin (client/shared/huge_pages.py; its effect is a GPU matter)."""
    from engramd.server import table_loader

    seen = []
    monkeypatch.setattr(table_loader, "pin_for_backend",
                        lambda backend, tables, collapse=True: seen.append((backend, collapse)))
    config = dataclasses.replace(demo_config(demo_checkpoint, shm_dir), collapse_pages=collapse)
    table_loader.open_tables(config, lambda fraction: None).close()
    assert seen == [("cpu", collapse)]
