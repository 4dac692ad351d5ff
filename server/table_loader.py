"""From a config to served tables: resolve the checkpoint, map the host tables, pin them, build
the backend.

Two stages. `open_tables` needs no torch: it checks the device, maps (re-attaches or loads) the
host tables and, for the cuda backend, pins them. `build_backend` then puts the backend over
them. `TablePreload` runs the first stage on a thread of its own as soon as the daemon holds its
lock, so that pinning tables already in shared memory overlaps the seconds the daemon spends
importing torch and creating its CUDA context (the restart-to-ready path). The built-in `demo`
table is a synthetic checkpoint written once into a cache folder (atomically: written aside, then
renamed), so a fresh machine can run the daemon with no download.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engramd.client.geometry import TableGeometry
from engramd.server.checkpoint import EngramCheckpoint
from engramd.server.config import DaemonConfig
from engramd.server.host_tables import TableStore
from engramd.server.ownership import check_own_folder, make_own_folder
from engramd.server.synthetic import write_synthetic_checkpoint
from engramd.server.table_file import HostTable, LoadProgress
from engramd.server.table_registration import register_for_gpus

if TYPE_CHECKING:
    from engramd.server.backend import Backend
    from engramd.server.standby_tables import PreparedTables

log = logging.getLogger("engramd.tables")


class DeviceBackendError(RuntimeError):
    """The configured device backend cannot start (no GPU, driver error, registration failure)."""

    device_error = True


@dataclass
class OpenTables:
    """The first stage: the host tables mapped and, for a cuda backend, pinned."""

    checkpoint: EngramCheckpoint
    store: TableStore
    tables: list[HostTable]
    reattached: bool
    backend_name: str  # "cpu" | "cuda"
    registration: Any = None  # the tables' HostRegistration (cuda); the backend takes it over

    @property
    def geometry(self) -> TableGeometry:
        return self.checkpoint.geometry

    def close(self) -> None:
        """Unpin and unmap (when no backend took them over); the files stay for re-attach."""
        registration, self.registration = self.registration, None
        unpin_then(registration, self.store.close)


def unpin_then(registration: Any, let_go: Callable[[], None]) -> None:
    """Unregister `registration` (None: nothing pinned), then `let_go()` of the tables, also
    when unpinning failed."""
    try:
        if registration is not None:
            registration.close()
    finally:
        let_go()


def overall_progress(total: int, progress: Callable[[float], None]) -> Callable[[LoadProgress], None]:
    """A store's progress callback that reports to `progress` the fraction of `total` bytes
    done over every layer."""
    done: dict[int, int] = {}

    def on_progress(report: LoadProgress) -> None:
        done[report.layer_index] = report.done_bytes
        progress(min(1.0, sum(done.values()) / max(1, total)))

    return on_progress


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
    if requested == "cuda" and not visible_gpus():
        raise DeviceBackendError("backend = cuda, but no CUDA device is visible to this process "
                                 "(CUDA_VISIBLE_DEVICES, the driver, the container's GPUs, or "
                                 "cuda-python missing?)")


def choose_backend_name(requested: str) -> str:
    if requested != "auto":
        return requested
    return "cuda" if visible_gpus() else "cpu"


def _torch_sees_a_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def visible_gpus() -> int:
    """CUDA devices this process sees, through the driver (0 without a driver or cuda-python):
    asking torch would import it, and that is what the first stage runs beside."""
    try:
        from cuda.bindings import driver as cu

        if int(cu.cuInit(0)[0]) != 0:
            return 0
    except Exception:  # no cuda-python, or no driver library on this machine
        return 0
    err, count = cu.cuDeviceGetCount()
    return int(count) if int(err) == 0 else 0


def build_backend(config: DaemonConfig, opened: OpenTables) -> Backend:
    geometry, tables = opened.geometry, opened.tables
    if opened.backend_name == "cuda" and config.backend == "auto" and not _torch_sees_a_gpu():
        # The driver sees a GPU but this torch cannot use it (a CPU build, or built for a newer
        # CUDA than the driver's): auto means the cpu backend then, as it always did.
        log.warning("a GPU is visible but torch cannot use it (torch.cuda.is_available() is "
                    "false): backend = auto serves on the cpu")
        registration, opened.registration = opened.registration, None
        if registration is not None:
            registration.close()
        opened.backend_name = "cpu"
    if opened.backend_name == "cpu":
        from engramd.server.cpu_backend import CpuBackend
        if config.hot_cache_warm_file:
            log.warning("the cpu backend has no hot-row cache: hot_cache_warm_file only warms "
                        "mapped GPU clients' caches")
        return CpuBackend([t.tensor for t in tables], geometry, config.workers)
    try:
        from engramd.client.shared.cache_keeper import load_warm_ids, warm_ids_array
        from engramd.server.cuda_backend import CudaBackend, GatherOptions
    except ImportError as exc:
        raise DeviceBackendError(f"cuda backend unavailable: {exc}") from exc
    warm_ids = None
    if config.hot_cache_warm_file and config.hot_cache_gib:
        warm_ids = load_warm_ids(config.hot_cache_warm_file, geometry.n_layers, geometry.heads)
    elif config.hot_cache_warm_file and config.mapped_hot_cache_gib:
        # Checked (not read) for the mapped clients' caches where the daemon keeps none: a bad
        # file stops the start instead of every client's warm-up.
        warm_ids_array(config.hot_cache_warm_file, geometry.n_layers, geometry.heads)
    options = GatherOptions.from_config(config, warm_ids)
    try:
        backend = CudaBackend(tables, geometry, inline=config.cuda_dispatch == "inline",
                              options=options, registration=opened.registration)
    except Exception as exc:
        raise DeviceBackendError(f"cuda backend failed to start: {exc}") from exc
    opened.registration = None  # the backend's now: it unpins when it closes
    return backend


# Fault injection for tests and drills: seconds to stall before loading, so that a "starting"
# daemon can be observed. Never set in production.
LOAD_DELAY_ENV = "ENGRAMD_DEBUG_LOAD_DELAY_S"


def open_tables(config: DaemonConfig, progress: Callable[[float], None],
                prepared: PreparedTables | None = None) -> OpenTables:
    """The first stage (no torch): the device checked, the host tables mapped, pinned for cuda.
    `prepared`: a standby's tables, adopted where they are still the ones to serve (and then
    their registration too, if it covers every table); the rest of them closed."""
    try:
        delay = float(os.environ.get(LOAD_DELAY_ENV, "0") or 0)
        if delay > 0:
            log.warning("%s=%s: stalling before the load", LOAD_DELAY_ENV, delay)
            time.sleep(delay)
        check_device_backend(config.backend)  # before gigabytes go into shared memory for nothing
        backend_name = choose_backend_name(config.backend)
        checkpoint = resolve_checkpoint(config)
        store = TableStore(tables_folder(config.shm_dir, config.instance), config.instance)
    except BaseException:
        if prepared is not None:
            prepared.close()
        raise
    total = checkpoint.geometry.total_bytes
    on_progress = overall_progress(total, progress)
    started = time.monotonic()
    try:
        tables = store.open(checkpoint, progress=on_progress, verify=config.verify_tables,
                            adopt=prepared.tables if prepared is not None else None)
        reattached = all(t.reattached for t in tables)
        seconds = time.monotonic() - started
        log.info("tables %s in %.2f s (%.2f GB/s)", "re-attached" if reattached else "loaded",
                 seconds, total / 1e9 / max(seconds, 1e-9))
        registration = adopted_registration(prepared, tables, backend_name)
        prepared = None  # closed or taken: the store owns its tables, the backend the registration
        if registration is None:
            registration = pin_for_backend(backend_name, tables, config.collapse_pages)
    except BaseException:
        if prepared is not None:  # the adopted tables too: the store did not keep them
            prepared.close()
        store.close()
        raise
    return OpenTables(checkpoint, store, tables, reattached, backend_name, registration)


def adopted_registration(prepared: PreparedTables | None, tables: list[HostTable],
                         backend_name: str) -> Any:
    """The prepared registration when `tables` are the prepared ones, in their order (the
    backend pairs the registration's addresses with the tables by position), for cuda;
    otherwise None, with the registration closed and the prepared tables the store did not
    take unmapped."""
    if prepared is None:
        return None
    if tables == prepared.tables and backend_name == "cuda" and prepared.registration is not None:
        log.info("tables pinned ahead by the standby")
        registration, prepared.registration, prepared.tables = prepared.registration, None, []
        return registration
    prepared.close(keep=tables)
    return None


def load_tables(config: DaemonConfig, progress: Callable[[float], None],
                opened: OpenTables | None = None) -> LoadedTables:
    """Both stages (the first one's result may come from a TablePreload)."""
    opened = opened if opened is not None else open_tables(config, progress)
    try:
        backend = build_backend(config, opened)
    except BaseException:
        opened.close()
        raise
    return LoadedTables(opened.checkpoint, opened.geometry, opened.store, opened.tables, backend,
                        opened.reattached)


def pin_for_backend(backend_name: str, tables: list[HostTable], collapse: bool = True,
                    unregister_later: Callable[[Any], None] | None = None) -> Any:
    """The tables' HostRegistration for a cuda backend (None for the cpu one); `collapse` and
    `unregister_later` as for register_for_gpus."""
    if backend_name != "cuda":
        return None
    try:
        return register_for_gpus(tables, collapse, unregister_later)
    except Exception as exc:
        raise DeviceBackendError(f"cuda backend failed to start: cannot pin the tables: {exc}") from exc


class TablePreload:
    """open_tables on a thread of its own, started before the daemon imports torch.

    The daemon's loader takes the result with take(); progress goes to whoever listens by then
    (listen()). A preload nobody takes (the daemon stopped first) closes what it opened."""

    def __init__(self, config: DaemonConfig, prepared: PreparedTables | None = None):
        self._config = config
        self._prepared = prepared
        self._lock = threading.Lock()
        self._progress = 0.0
        self._listener: Callable[[float], None] | None = None
        self._result: OpenTables | None = None
        self._error: BaseException | None = None
        self._abandoned = False
        self._thread = threading.Thread(target=self._run, name="engramd-preload", daemon=True)

    @classmethod
    def start(cls, config: DaemonConfig, prepared: PreparedTables | None = None) -> TablePreload:
        """`prepared`: a standby's tables, for open_tables to adopt."""
        preload = cls(config, prepared)
        preload._thread.start()
        return preload

    def _run(self) -> None:
        try:
            opened = open_tables(self._config, self._on_progress, self._prepared)
        except BaseException as exc:
            self._error = exc
            return
        with self._lock:
            if not self._abandoned:
                self._result = opened
                return
        try:
            opened.close()
        except Exception:
            log.exception("closing the abandoned preload's tables")

    def _on_progress(self, fraction: float) -> None:
        with self._lock:  # listeners are quick; under the lock, progress never goes back
            self._progress = fraction
            if self._listener is not None:
                self._listener(fraction)

    def listen(self, listener: Callable[[float], None]) -> None:
        """Send progress to `listener` from now on, starting with where the load stands."""
        with self._lock:
            self._listener = listener
            listener(self._progress)

    def take(self) -> OpenTables:
        """The opened tables (blocks until the stage is done); raises what the stage raised.
        Once only, and not after abandon()."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        with self._lock:
            if self._abandoned:
                raise RuntimeError("the preload was abandoned: the daemon is stopping")
            opened, self._result = self._result, None
        if opened is None:
            raise RuntimeError("the preloaded tables were already taken")
        return opened

    def abandon(self) -> None:
        """Nobody will take the result: close it now, or when the stage ends."""
        with self._lock:
            self._abandoned = True
            opened, self._result = self._result, None
        if opened is not None:
            opened.close()
