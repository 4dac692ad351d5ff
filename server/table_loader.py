"""From a config to served tables: resolve the checkpoint, map the host tables, build the backend.

Runs on the daemon's loader thread. The built-in `demo` table is a synthetic checkpoint written
once into a cache folder (atomically: written aside, then renamed), so a fresh machine can run the
daemon with no download.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engramd.client.geometry import TableGeometry
from engramd.server.backend import Backend
from engramd.server.checkpoint import EngramCheckpoint
from engramd.server.config import DaemonConfig
from engramd.server.host_tables import HostTable, LoadProgress, TableStore
from engramd.server.ownership import check_own_folder, make_own_folder
from engramd.server.synthetic import write_synthetic_checkpoint

log = logging.getLogger("engramd.tables")


class DeviceBackendError(RuntimeError):
    """The configured device backend cannot start (no GPU, driver error, registration failure)."""

    device_error = True


@dataclass
class LoadedTables:
    checkpoint: EngramCheckpoint
    geometry: TableGeometry
    store: TableStore
    tables: list[HostTable]
    backend: Backend
    reattached: bool

    def close(self) -> None:
        """Unmap the tables (the backend must be closed first); the files stay for re-attach."""
        self.store.close()


def demo_checkpoint(config: DaemonConfig) -> Path:
    """The built-in demo checkpoint, written on first use."""
    base = Path(config.cache_dir) if config.cache_dir else (
        Path(tempfile.gettempdir()) / f"engramd-demo-{os.geteuid()}")
    target = base / f"demo-seed{config.demo_seed}"
    check_own_folder(base, "demo cache folder")  # planted tables must not be served
    if (target / "model.safetensors.index.json").exists():
        return target
    make_own_folder(base, "demo cache folder", mode=0o755)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=base))
    try:
        write_synthetic_checkpoint(TableGeometry.named("demo"), staging, seed=config.demo_seed)
        try:
            staging.rename(target)
        except OSError:  # another process won the race; its copy is identical
            pass
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("wrote the demo checkpoint to %s", target)
    return target


def resolve_checkpoint(config: DaemonConfig) -> EngramCheckpoint:
    path = demo_checkpoint(config) if config.tables == "demo" else Path(config.tables)
    return EngramCheckpoint.open(path)


def tables_folder_path(shm_dir: str | Path, instance: str) -> Path:
    return Path(shm_dir) / f"engramd-{instance}"


def tables_folder(shm_dir: str | Path, instance: str) -> Path:
    """Daemon `instance`'s own folder inside shm_dir, made 0750 if absent: in a shared shm_dir
    such as /dev/shm anyone may create files, and a file planted at the next table's or the
    lock's name would stop the daemon from starting (it cannot remove what it does not own).
    Whoever prepares tables for a daemon to re-attach (benchmarks) fills them here."""
    folder = tables_folder_path(shm_dir, instance)
    make_own_folder(folder, "table folder", mode=0o750)
    return folder


def check_device_backend(requested: str) -> None:
    """DeviceBackendError now if the cuda backend was asked for and no GPU is visible."""
    if requested != "cuda":
        return
    try:
        import torch

        visible = torch.cuda.is_available()
    except Exception as exc:
        raise DeviceBackendError(f"cuda backend unavailable: {exc}") from exc
    if not visible:
        raise DeviceBackendError("backend = cuda, but no CUDA device is visible to this process "
                                 "(CUDA_VISIBLE_DEVICES, the driver, the container's GPUs?)")


def choose_backend_name(requested: str) -> str:
    if requested != "auto":
        return requested
    try:
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"
    except Exception:
        return "cpu"


def build_backend(config: DaemonConfig, geometry: TableGeometry, tables: list[HostTable]) -> Backend:
    name = choose_backend_name(config.backend)
    if name == "cpu":
        from engramd.server.cpu_backend import CpuBackend
        if config.hot_cache_warm_file:
            log.warning("hot_cache_warm_file is ignored: the cpu backend has no hot-row cache")
        return CpuBackend([t.tensor for t in tables], geometry, config.workers)
    try:
        from engramd.server.cache_keeper import load_warm_ids
        from engramd.server.cuda_backend import CudaBackend, GatherOptions
    except ImportError as exc:
        raise DeviceBackendError(f"cuda backend unavailable: {exc}") from exc
    warm_ids = None
    if config.hot_cache_warm_file and config.hot_cache_gib:
        warm_ids = load_warm_ids(config.hot_cache_warm_file, geometry.n_layers, geometry.heads)
    options = GatherOptions(cache_bytes=int(config.hot_cache_gib * 2**30), warm_ids=warm_ids,
                            cache_refresh_s=config.hot_cache_refresh_ms / 1e3,
                            dedupe_min_tokens=config.dedupe_min_tokens,
                            sort_min_tokens=config.sort_min_tokens,
                            sm_fraction=config.gather_sm_fraction)
    try:
        return CudaBackend(tables, geometry, inline=config.cuda_dispatch == "inline", options=options)
    except Exception as exc:
        raise DeviceBackendError(f"cuda backend failed to start: {exc}") from exc


# Fault injection for tests and drills: seconds to stall before loading, so that a "starting"
# daemon can be observed. Never set in production.
LOAD_DELAY_ENV = "ENGRAMD_DEBUG_LOAD_DELAY_S"


def load_tables(config: DaemonConfig, progress: Callable[[float], None]) -> LoadedTables:
    delay = float(os.environ.get(LOAD_DELAY_ENV, "0") or 0)
    if delay > 0:
        log.warning("%s=%s: stalling before the load", LOAD_DELAY_ENV, delay)
        time.sleep(delay)
    check_device_backend(config.backend)  # before gigabytes go into shared memory for nothing
    checkpoint = resolve_checkpoint(config)
    geometry = checkpoint.geometry
    total = geometry.total_bytes
    done_before: dict[int, int] = {}

    def on_progress(p: LoadProgress) -> None:
        done_before[p.layer_index] = p.done_bytes
        progress(min(1.0, sum(done_before.values()) / max(1, total)))

    store = TableStore(tables_folder(config.shm_dir, config.instance), config.instance)
    started = time.monotonic()
    try:
        tables = store.open(checkpoint, progress=on_progress, verify=config.verify_tables)
        reattached = all(t.reattached for t in tables)
        seconds = time.monotonic() - started
        log.info("tables %s in %.2f s (%.2f GB/s)", "re-attached" if reattached else "loaded",
                 seconds, total / 1e9 / max(seconds, 1e-9))
        backend = build_backend(config, geometry, tables)
    except BaseException:
        store.close()
        raise
    return LoadedTables(checkpoint, geometry, store, tables, backend, reattached)
