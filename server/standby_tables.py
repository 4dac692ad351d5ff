"""The tables a standby keeps ready for its takeover: mapped, checked and pinned while it waits.

After torch, pinning is the largest part of a restart that grows with the tables: 5.4-5.7 s for
64 GiB on /dev/shm, 1.6-1.9 s on hugetlbfs, on the H200 (benchmarks/results/h200/README.md),
and ~3x that for V4.1's 189 GiB. A standby (server/standby.py) pays it while the serving daemon
still serves: it maps the complete table files of its configured checkpoint as a re-attach
would and registers them for the GPUs (read-only, beside the serving daemon's registration of
the same pages). At the takeover the store adopts those mappings once it has checked them again
(host_tables.TableStore.open), and the registration comes with them; the start then has only
the backend left to build.

It follows the serving daemon. Every WATCH_S it asks whether its tables are still the ones a
start would re-attach: the checkpoint's fingerprint unchanged (a reload's new revision is
deployed at the configured path), every file still in place (a reload's switch removes the old
ones). When not, it lets go of them at once (a removed file's memory is freed only when its last
mapping goes). It prepares tables only once the serving daemon reports them served and ready
(`health`): by then that daemon has pinned them and collapsed their pages into 2 MiB folios,
which a standby's pin taken earlier would have kept in 4 KiB pages (pinned pages cannot move).

What it never does: create, write or remove a table file, take the instance's lock, or
collapse the tables' pages (client/shared/huge_pages.py: the serving daemon did). (With `tables =
demo`, resolving the checkpoint may write the demo checkpoint into its cache, atomically, as any
start does.) Whatever it prepared is checked again by the takeover, so a stale preparation
costs only time.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engramd.client.shared.connection import probe
from engramd.server.config import DaemonConfig
from engramd.server.host_tables import attach_complete, still_in_place
from engramd.server.table_file import HostTable
from engramd.server.table_loader import (
    DeviceBackendError,
    choose_backend_name,
    pin_for_backend,
    resolve_checkpoint,
    tables_folder_path,
    unpin_then,
)
from engramd.server.units import size

log = logging.getLogger("engramd.daemon")

# How often a standby checks that its prepared tables are still current: also the longest it
# keeps a replaced table's memory alive after the serving daemon removed its file.
WATCH_S = 0.5
HEALTH_TIMEOUT_S = 1.0  # a ready daemon answers health within milliseconds
SETTLE_AFTER_FAILURES = 20  # looks (10 s) that raise before a standby says it can do no more


@dataclass
class PreparedTables:
    """A checkpoint's tables mapped ahead and, for a cuda backend, pinned."""

    fingerprint: str
    tables: list[HostTable]
    registration: Any = None  # HostRegistration over every table (cuda), or None

    def status(self) -> str:
        pinned = " and pinned" if self.registration is not None else ""
        return (f"standby: tables {self.fingerprint} mapped{pinned} ahead; takes over when the "
                "serving daemon goes")

    def current(self, fingerprint: str | None) -> bool:
        return fingerprint == self.fingerprint and all(still_in_place(t) for t in self.tables)

    def close(self, keep: list[HostTable] | None = None) -> None:
        """Unpin, then unmap every table but those in `keep` (a store took them)."""
        kept = keep or []
        registration, self.registration = self.registration, None
        tables, self.tables = self.tables, []
        unpin_then(registration, lambda: _close_all([t for t in tables if t not in kept]))


def _not_pinned(fingerprint: str) -> str:
    return f"standby: tables {fingerprint} could not be pinned ahead; the takeover pins them"


def _close_all(tables: list[HostTable]) -> None:
    for table in tables:
        try:
            table.close()
        except Exception:  # a view still alive keeps it mapped until it goes; nothing to stop for
            log.warning("standby: %s stays mapped until its last view goes", table.path)


class TableWatch:
    """Keeps a standby's PreparedTables current on a thread of its own until hand_over().

    After every look it tells `on_state(status, settled)` (if given) where it stands: a line
    for a supervisor, and whether the standby has done what it can ahead of a takeover: its
    tables prepared; their pin failed (not tried again); the serving daemon ready on other
    tables, or on these from another folder; or SETTLE_AFTER_FAILURES looks in a row raised."""

    def __init__(self, config: DaemonConfig, on_state: Callable[[str, bool], None] | None = None):
        self._config = config
        self._on_state = on_state
        self._backend = choose_backend_name(config.backend)
        self._prepared: PreparedTables | None = None
        self._failed: str | None = None  # a fingerprint whose pin failed: not tried again
        self._logged: str | None = None  # the last state _not_served logged
        self._opened: OpenedCheckpoint | None = None  # the checkpoint's last open (_checkpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engramd-standby-tables", daemon=True)

    @classmethod
    def start(cls, config: DaemonConfig,
              on_state: Callable[[str, bool], None] | None = None) -> TableWatch:
        watch = cls(config, on_state)
        watch._thread.start()
        return watch

    def hand_over(self) -> PreparedTables | None:
        """Stop watching (a preparation under way is finished first) and give up the tables."""
        self._stop.set()
        self._thread.join()
        prepared, self._prepared = self._prepared, None
        return prepared

    def close(self) -> None:
        prepared = self.hand_over()
        if prepared is not None:
            prepared.close()

    def _run(self) -> None:
        reported, failures = None, 0
        while not self._stop.is_set():
            try:
                state = self._step()
                reported, failures = None, 0
            except Exception as exc:  # a standby that cannot prepare still takes over, slower
                failures += 1
                # Settled once it persists: an upgrade must not wait for what may never come,
                # nor go ahead on a passing failure (a look that raced a reload, say).
                state = ("standby: preparing the tables failed; the takeover will map them",
                         failures >= SETTLE_AFTER_FAILURES)
                if str(exc) != reported:  # once per cause, not every WATCH_S
                    log.exception("%s", state[0])
                    reported = str(exc)
            if self._on_state is not None and not self._stop.is_set():  # not once it took over
                self._on_state(*state)
            self._stop.wait(WATCH_S)

    def _step(self) -> tuple[str, bool]:
        """One look: prepare, keep or let go of the tables; where the standby stands (see
        on_state)."""
        fingerprint, checkpoint = self._checkpoint()
        if self._prepared is not None:
            if self._prepared.current(fingerprint):
                return self._prepared.status(), True
            log.info("standby: letting go of tables %s (replaced or removed)", self._prepared.fingerprint)
            prepared, self._prepared = self._prepared, None
            prepared.close()
        if checkpoint is None:
            return "standby: the configured tables cannot be opened now", False
        if fingerprint == self._failed:
            return _not_pinned(fingerprint), True
        health = self._health()
        if health is None or not health.ready or health.tables != fingerprint:
            return self._not_served(fingerprint, health)
        folder = tables_folder_path(self._config.shm_dir, self._config.instance)
        started = time.monotonic()
        tables = attach_complete(folder, self._config.instance, checkpoint) if folder.is_dir() else None
        if tables is None:  # served and ready, so complete: not where this standby looks
            return (f"standby: tables {fingerprint} are served, but not in {folder} (shm_dir and "
                    "instance as the serving daemon's?); the takeover loads them", True)
        try:
            registration = pin_for_backend(self._backend, tables, collapse=False)
        except DeviceBackendError as exc:
            self._failed = fingerprint
            _close_all(tables)
            log.warning("standby: %s; the takeover will pin the tables itself", exc)
            return _not_pinned(fingerprint), True
        self._prepared = PreparedTables(fingerprint, tables, registration)
        log.info("standby: tables %s (%s) mapped%s ahead in %.2f s", fingerprint,
                 size(sum(t.nbytes for t in tables)), " and pinned" if registration else "",
                 time.monotonic() - started)
        return self._prepared.status(), True

    def _not_served(self, fingerprint: str, health: Any) -> tuple[str, bool]:
        """Where a standby stands whose tables the serving daemon does not serve (yet): it waits
        while that daemon starts or reloads; one ready on other tables (the configured ones
        deployed but not reloaded) may serve those for good, so the standby has done all it
        can: its takeover will load the configured ones."""
        if (health is not None and health.ready and health.tables != fingerprint
                and (health.reload or {}).get("state") != "loading"):
            state = (f"standby: the serving daemon serves tables {health.tables}, the configured "
                     f"ones are {fingerprint}; the takeover loads them", True)
        else:
            state = (f"standby: waiting for the serving daemon to serve tables {fingerprint}", False)
        if self._logged != state[0]:
            log.info("%s%s", state[0], "" if state[1] else " before mapping them")
            self._logged = state[0]
        return state

    def _health(self) -> Any:
        """The serving daemon's health reply, None if it does not answer."""
        try:
            return probe(self._config.socket_path, "health", HEALTH_TIMEOUT_S).body
        except Exception:  # gone, stopping or stuck: the takeover, if any, maps the tables
            return None

    def _checkpoint(self) -> tuple[str | None, Any]:
        """The configured checkpoint and its fingerprint, or (None, None) while it cannot be
        opened (it is being replaced, say): the takeover reports why, if it still cannot.

        Opened again only when one of the files it was read from changed (file_stats): V4.1's
        index alone is ~7 MB of JSON; an open took 75 ms of CPU, a look at the stats 0.03 ms
        (benchmarks/results/standby_watch_cpu.md). The stats kept are those taken before the
        open that read the same files, so a file replaced during an open is seen at the next
        look."""
        opened = self._opened
        if (opened is not None and opened.reusable_stats == file_stats(opened.files)
                and self._points_at(opened.checkpoint.directory)):
            return opened.fingerprint, opened.checkpoint
        files = opened.files if opened is not None else []
        before = file_stats(files)
        try:
            checkpoint = resolve_checkpoint(self._config)
            read = checkpoint.files()
            fingerprint = checkpoint.fingerprint()
        except Exception:
            self._opened = None
            return None, None
        self._opened = OpenedCheckpoint(checkpoint, fingerprint, read, before if read == files else None)
        return fingerprint, checkpoint

    def _points_at(self, directory: Path) -> bool:
        """Whether the configured path still leads to `directory`: an open resolves symlinks
        (the files it read are the old revision's, untouched when a link is repointed)."""
        tables = self._config.tables
        return tables == "demo" or Path(tables).resolve() == directory


@dataclass(frozen=True)
class OpenedCheckpoint:
    """A checkpoint as a standby last opened it, and the stats of its files from before that
    open (None when that open read other files than the one before: then not reused)."""

    checkpoint: Any
    fingerprint: str
    files: list[Path]
    reusable_stats: tuple | None


def file_stats(files: list[Path]) -> tuple:
    """(device, inode, size, mtime) of each file, None for one that is gone: what a new
    revision deployed at the same path, or a file rewritten in place, changes."""
    stats = []
    for path in files:
        try:
            info = os.stat(path)
        except OSError:
            stats.append(None)
            continue
        stats.append((info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns))
    return tuple(stats)
