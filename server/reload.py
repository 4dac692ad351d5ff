"""Reloading the tables while the daemon serves: the configured checkpoint's tables, opened
beside the served ones on a thread of their own, then served instead between two lookups.

What a reload is for: the checkpoint at the configured `tables` path was replaced (a new
revision copied in, a symlink flipped), and the replicas must not restart for it. The new
tables are loaded (or re-attached) into files of their own next to the served ones, so shared
memory must hold both for a while; their rows are compared with the checkpoint, pinned for the
GPUs, and only then does the daemon's loop switch to them (server/reload_control.py, which also
starts reloads one at a time and lets the old tables go):

    lookups the daemon takes before the switch   read the old tables
    lookups it takes after it                    read the new ones (served clients)
    a mapped client                              re-maps at its first lookup after it hears
                                                 (a notice, or its next heartbeat's reply)
    a client that pinned its tables              is refused (TablesChangedError) from then on

The old tables' files are removed at the switch; their memory is freed once the daemon's last
gather on them has run and every mapped client has let go of its mapping. A reload whose
checkpoint has the fingerprint of the served tables changes nothing ("unchanged"); one whose
geometry differs is refused (the clients' slot layouts depend on it: restart the daemon).

The path is the configured one, never one a request names: what a restart would load is what
a reload loads, so the two can never disagree.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engramd.server.checkpoint import EngramCheckpoint
from engramd.server.config import DaemonConfig
from engramd.server.host_tables import ReloadCancelled, TableStore
from engramd.server.selfcheck import SelfCheckError, check_host_tables
from engramd.server.table_file import HostTable, close_all_quietly
from engramd.server.table_loader import (
    LoadedTables,
    overall_progress,
    pin_for_backend,
    resolve_checkpoint,
    unpin_then,
)

log = logging.getLogger("engramd.reload")

# Fault injection for tests and drills: seconds a reload waits before it reads the checkpoint (a
# stop meanwhile cancels it), so that a running reload can be observed. Never set in production.
RELOAD_DELAY_ENV = "ENGRAMD_DEBUG_RELOAD_DELAY_S"


class ReloadRefused(Exception):
    """The configured checkpoint cannot replace the served tables (the message says why)."""


@dataclass
class NextTables:
    """A reload's tables, open beside the served ones until the loop switches to them."""

    checkpoint: EngramCheckpoint
    store: TableStore
    tables: list[HostTable]
    registration: Any  # their HostRegistration (cuda backend); the backend takes it over
    # How the serving backend unpins tables it never served (Backend.unpin).
    unpin: Callable[[Any, Callable[[], None]], None] = unpin_then

    @property
    def reattached(self) -> bool:
        return all(t.reattached for t in self.tables)

    def served(self, current: LoadedTables) -> LoadedTables:
        """What the daemon serves once it has switched to these tables."""
        return LoadedTables(self.checkpoint, self.checkpoint.geometry, self.store, self.tables,
                            current.backend, self.reattached)

    def close(self) -> None:
        """Never served: unpin, unmap and remove the files."""
        registration, self.registration = self.registration, None
        # Out of the store now, whenever the backend unpins them: a reload started next finds
        # no tables of this one there.
        tables = self.store.detach_next()
        self.unpin(registration, lambda: close_all_quietly(tables))


def open_next_tables(config: DaemonConfig, current: LoadedTables, progress: Callable[[float], None],
                     cancelled: Callable[[], bool]) -> NextTables | None:
    """The configured checkpoint's tables opened, checked and pinned beside the served ones;
    None when they are the served ones. ReloadRefused when they cannot replace them."""
    _injected_delay(cancelled)
    checkpoint = resolve_checkpoint(config)
    if checkpoint.geometry != current.geometry:
        raise ReloadRefused(
            f"the checkpoint at {config.tables} has another geometry ({checkpoint.geometry}) than "
            f"the served tables ({current.geometry}); clients' slot layouts depend on it, so "
            "restart the daemon to serve it")
    if checkpoint.fingerprint() == current.checkpoint.fingerprint():
        same_rows_or_refuse(checkpoint, current.tables)
        return None
    store = current.store
    tables = store.open_next(checkpoint, overall_progress(checkpoint.geometry.total_bytes, progress), verify=config.verify_tables, cancelled=cancelled)
    next_tables = NextTables(checkpoint, store, tables, None, unpin=current.backend.unpin)
    try:
        if config.self_check:  # the served kernel was checked at start; these are new bytes
            check_host_tables(checkpoint, tables)
        # What a failed pin registered is unregistered by the serving backend, not here.
        next_tables.registration = pin_for_backend(
            current.backend.name, tables, config.collapse_pages,
            unregister_later=lambda partial: next_tables.unpin(partial, lambda: None))
    except BaseException:
        next_tables.close()
        raise
    return next_tables


def same_rows_or_refuse(checkpoint: EngramCheckpoint, served: list[HostTable]) -> None:
    """A checkpoint with the served tables' fingerprint: unchanged, if sampled rows say so. Not
    if another revision's files carry the served files' names, sizes and mtimes (`touch -r`,
    `cp -p`, an image built with fixed timestamps), which the fingerprint cannot see: its rows
    could be served only under the served tables' id, so the reload is refused, saying how to
    give the revision an id of its own."""
    try:
        check_host_tables(checkpoint, served)
    except SelfCheckError as exc:
        raise ReloadRefused(
            f"the checkpoint at {checkpoint.directory} has the served tables' fingerprint (the "
            f"same geometry, file names, sizes and mtimes) but other rows ({exc}); give its "
            "files new mtimes (touch them) and reload") from None


def _injected_delay(cancelled: Callable[[], bool]) -> None:
    delay = float(os.environ.get(RELOAD_DELAY_ENV, "0") or 0)
    if delay > 0:
        log.warning("%s=%s: stalling before the reload", RELOAD_DELAY_ENV, delay)
    deadline = time.monotonic() + delay
    while time.monotonic() < deadline:
        if cancelled():
            raise ReloadCancelled("the reload was cancelled (the daemon is stopping)")
        time.sleep(0.05)


# How long a stop waits for a reload's load to end (it stops between chunks); a read that hangs
# (a stalled network filesystem) must not keep the daemon from stopping.
CANCEL_WAIT_S = 30.0


class TableReload:
    """One reload's first stage on a thread of its own; `done(self)` is called from that thread
    when it ends. The loop then take()s the tables and switches, or reads why it failed."""

    def __init__(self, config: DaemonConfig, current: LoadedTables, requested_by: str,
                 done: Callable[[TableReload], None]):
        self.requested_by = requested_by
        self.state = "loading"  # -> "done" | "unchanged" | "failed" (set by the loop)
        self.progress = 0.0
        self.error: str | None = None
        self.tables: str | None = None  # the new tables' id, once switched to
        self.started = time.monotonic()
        self.finished: float | None = None
        self._result: NextTables | None = None
        self._lock = threading.Lock()
        self._cancel = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(config, current, done),
                                        name="engramd-reload", daemon=True)
        self._thread.start()

    def _run(self, config: DaemonConfig, current: LoadedTables, done: Callable[[TableReload], None]) -> None:
        try:
            result = open_next_tables(config, current, self._on_progress, self._cancel.is_set)
        except ReloadCancelled as exc:
            log.info("reload (asked by %s) cancelled: %s", self.requested_by, exc)
            self.error = str(exc)
        except ReloadRefused as exc:
            self.error = str(exc)
        except Exception as exc:  # a bad checkpoint, no space, a failed pin: said, not raised
            log.exception("reload failed")
            self.error = f"{type(exc).__name__}: {exc}"
        else:
            with self._lock:
                self._result = result
        self.progress = 1.0 if self.error is None else self.progress
        done(self)

    def _on_progress(self, fraction: float) -> None:
        self.progress = fraction

    def take(self) -> NextTables | None:
        """The opened tables (None: the served ones are the configured checkpoint's); once."""
        with self._lock:
            result, self._result = self._result, None
        return result

    def finish(self, state: str, error: str | None = None, tables: str | None = None) -> None:
        """The loop's verdict: "done" (switched to `tables`), "unchanged" or "failed"."""
        self.state, self.error, self.tables = state, error or self.error, tables
        self.finished = time.monotonic()
        level = logging.ERROR if state == "failed" else logging.INFO
        log.log(level, "reload (asked by %s) %s after %.2f s%s", self.requested_by, state,
                self.finished - self.started, f": {self.error}" if state == "failed" else
                f": serving tables {tables}" if tables else "")

    @property
    def running(self) -> bool:
        return self.state == "loading"

    def status(self) -> dict[str, Any]:
        """For health and stats: where this reload stands."""
        end = self.finished if self.finished is not None else time.monotonic()
        return {"state": self.state, "progress": round(self.progress, 4), "tables": self.tables,
                "error": self.error, "seconds": round(end - self.started, 3),
                "requested_by": self.requested_by}

    def cancel(self) -> None:
        """The daemon stops: end the load (between chunks), and close what it opened if the
        loop never took it."""
        self._cancel.set()
        self._thread.join(CANCEL_WAIT_S)
        if self._thread.is_alive():  # a daemon thread: the process exits without it
            log.error("the reload asked by %s did not stop within %.0f s (a read of the checkpoint "
                      "that hangs?); stopping without it, what it opened left open",
                      self.requested_by, CANCEL_WAIT_S)
            return
        with self._lock:
            result, self._result = self._result, None
        if result is not None:
            result.close()
