"""The daemon's side of a reload: started one at a time, switched to between two lookups, the
replaced tables let go once no gather reads them, and the served tables granted to the mapped
clients that follow it.

A reload's tables are opened, checked and pinned on a thread of their own (server/reload.py,
`TableReload`). Here, on the loop's thread, the service starts one (an admin's `engramd reload`,
or SIGHUP), and once its tables are ready switches the backend, the store, the registry and the
mapped clients' grants to them (`finish`, `switch_tables`); a mapped client that hears of it asks
for the new tables' descriptors (the handle socket's `tables` request, `grant_tables`).

Apart from the operations (server/service.py, which holds one: `Service.reloads`) because a
reload has a course of its own beside them: its thread, its verdict, the old tables' release.
Nothing here knows the transport: the daemon posts the reload's end to its loop and tells the
clients; the CUDA backend's own switch is server/cuda_switch.py's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from engramd.client.errors import NotReadyError
from engramd.client.shared.handles import PeerCredentials
from engramd.client.shared.messages import ReloadReply, TablesReply
from engramd.server.grants import MappedGrants, TableDescriptors, passable
from engramd.server.reload import NextTables, TableReload
from engramd.server.table_file import HostTable
from engramd.server.table_loader import LoadedTables

if TYPE_CHECKING:
    from engramd.server.service import Service

log = logging.getLogger("engramd.daemon")


class ReloadControl:
    def __init__(self, service: Service):
        self.service = service
        self.last: TableReload | None = None  # the last reload, if any
        # Who asked while one ran (it may have read the checkpoint before they changed it): a
        # reload of their own follows the running one. One such, for any number of askers.
        self.follow: tuple[str, Callable[[TableReload], None]] | None = None

    def ask(self, peer: PeerCredentials, done: Callable[[TableReload], None]) -> ReloadReply:
        """Admin: load the configured checkpoint's tables beside the served ones, then serve
        them (as on SIGHUP). Answers at once; `health` follows the reload."""
        self.service.require_admin(peer, "reload")
        self.start(f"pid {peer.pid} uid {peer.uid}", done)
        return ReloadReply(state=self.last.state, tables=self.service.tables_id)

    def start(self, requested_by: str, done: Callable[[TableReload], None]) -> None:
        """A reload on its thread; `done(reload)` is called from that thread once its tables are
        open and checked, or it failed. Asked while one runs, another follows it (`follow`):
        the checkpoint may have changed since the running one read it."""
        service = self.service
        if service.state != "ready":
            raise NotReadyError(f"reload: the daemon is {service.state}")
        if self.last is not None and self.last.running:
            log.info("reload asked by %s: one is running; another follows it", requested_by)
            self.follow = (requested_by, done)
            return
        log.info("reload asked by %s: loading %s beside the served tables %s", requested_by,
                 service.config.tables, service.tables_id)
        self.last = TableReload(service.config, service.tables, requested_by, done)

    def finish(self, reload: TableReload, retired: Callable[[list[HostTable]], None]) -> bool:
        """The reload's tables are open and checked (or it failed): switch to them, then start
        the reload asked for meanwhile, if any. True when the tables changed (the daemon tells
        the clients). `retired(old)` is called, from any thread, once no gather reads the
        replaced tables (then release them: tables_retired)."""
        try:
            return self._switch(reload, retired)
        finally:
            if self.follow is not None and reload is self.last:
                asked_by, done = self.follow
                self.follow = None
                try:
                    self.start(f"{asked_by}, during the last", done)
                except NotReadyError as exc:  # stopping: nothing follows
                    log.info("the reload asked by %s does not follow: %s", asked_by, exc.message)

    def _switch(self, reload: TableReload, retired: Callable[[list[HostTable]], None]) -> bool:
        service = self.service
        if reload is not self.last:  # cannot happen: one reload at a time
            stray = reload.take()
            if stray is not None:
                stray.close()
            return False
        if reload.error is not None:
            reload.finish("failed")
            return False
        next_tables = reload.take()
        if next_tables is None:
            reload.finish("unchanged", tables=service.tables_id)
            return False
        if service.state != "ready":
            next_tables.close()
            reload.finish("failed", f"the daemon is {service.state}")
            return False
        try:
            service.tables = switch_tables(service.tables, next_tables, service.grants, retired)
        except Exception as exc:
            log.exception("reload: switching to the new tables failed")
            next_tables.close()
            reload.finish("failed", f"switching failed: {type(exc).__name__}: {exc}")
            return False
        service.registry.tables_changed(next_tables.checkpoint.fingerprint())
        reload.finish("done", tables=service.tables_id)
        return True

    def tables_retired(self, tables: list[HostTable]) -> None:
        """No gather of the daemon's reads these replaced tables any more: unmap them."""
        if self.service.tables is not None:
            self.service.tables.store.release(tables)

    def grant_tables(self, client_id: int, token: str,
                     peer: PeerCredentials) -> tuple[TablesReply, list[int]]:
        """A mapped client after a reload: the served tables, and a new descriptor of each."""
        service = self.service
        service.serving("tables").grant_tables(client_id, token, peer)
        with passable():
            grants, fds = service.grants.tables()
        return TablesReply(version=service.tables_id, tables=grants, tables_seq=service.tables_seq), fds

    def status(self) -> dict[str, Any]:
        """For health and stats: where the last reload stands (empty: none yet)."""
        return self.last.status() if self.last is not None else {}

    def cancel(self) -> None:
        """Stopping: a running load stops between chunks; its files go."""
        if self.last is not None:
            self.last.cancel()


def switch_tables(current: LoadedTables, next_tables: NextTables, grants: MappedGrants,
                  retired: Callable[[list[HostTable]], None]) -> LoadedTables:
    """From the next lookup on, serve `next_tables` instead of `current`; returns what is served
    then. What can fail comes before the backend's switch, which is the point of no return;
    nothing after it raises. `retired(old tables)` as for the backend's replace_tables."""
    old = current.tables
    descriptors = TableDescriptors(next_tables.tables)  # for mapped clients
    try:
        current.backend.replace_tables(next_tables.tables, next_tables.registration,
                                       retired=lambda: retired(old))
    except BaseException:
        descriptors.close()
        raise
    next_tables.registration = None  # the backend's now
    current.store.switch()  # the old files go; their memory once nobody maps them
    grants.replace(descriptors)
    return next_tables.served(current)
