"""The engramd process: socket, request loop, table loading, signals and shutdown.

The daemon owns the transport and the lifecycle: sockets, threads, signals, leases. What each
operation does, a reload's switch included, is the service's (service.py, no transport in it),
which reaches the client registry (registry.py), the table store (host_tables.py) and the
backend for it; the daemon only sends what it answers, with the descriptors it passes. Beside
it: the ZeroMQ socket's options, reads and sends (request_socket.py), the leases (leases.py),
the handle socket's requests (handle_requests.py) and the event queue (events.py). One thread
runs the ZeroMQ loop; tables load on a background thread so that `health` answers (not ready)
while they do; gathers run on the backend's workers, whose completions come back to the loop
through an event queue and a wake-up pipe (ZeroMQ sockets are not thread-safe).

Start order (`engramd serve`): lock the socket -> map (load or re-attach) and pin the tables on a
thread (table_loader.TablePreload) while the rest is imported -> bind -> build the backend over
them (background) -> ready. Stop (SIGTERM/SIGINT): refuse new work, finish in-flight lookups, free slabs,
close the tables (their files stay for a fast re-attach), remove the socket.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import gc
import logging
import os
import queue
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from engramd.client.errors import (
    ConfigError,
    EngramError,
    InternalError,
    PermissionDeniedError,
)
from engramd.client.geometry import TableGeometry
from engramd.client.shared import protocol
from engramd.client.shared.handles import handle_socket_path
from engramd.client.shared.messages import Message
from engramd.server.backend import LookupJob
from engramd.server.checkpoint import CONFIG_FILE
from engramd.server.config import DaemonConfig
from engramd.server.events import EventQueue
from engramd.server.file_limits import raise_open_file_limit
from engramd.server.grants import MappedGrants
from engramd.server.handle_requests import HandleRequests
from engramd.server.handle_server import HandleServer
from engramd.server.host_tables import StoreLockedError
from engramd.server.job_context import JobContext
from engramd.server.leases import Leases
from engramd.server.metrics import Metrics
from engramd.server.notify import Notifier
from engramd.server.reload import TableReload
from engramd.server.request_socket import RequestSocket
from engramd.server.selfcheck import SelfCheckError, check_host_tables, run_self_check
from engramd.server.service import Service
from engramd.server.startup import (
    EXIT_CONFIG,
    EXIT_DEVICE,
    EXIT_OK,
    EXIT_TABLES,
    DaemonHalt,
    EarlySignals,
    SocketLock,
    prepare_runtime_dir,
)
from engramd.server.table_file import HostTable
from engramd.server.table_loader import LoadedTables, TablePreload, load_tables, tables_folder_path
from engramd.server.throttle import Throttled
from engramd.server.units import size

log = logging.getLogger("engramd.daemon")

DRAIN_TIMEOUT_S = 30.0  # stopping waits this long for in-flight lookups, then exits regardless
REPLIES_FLUSH_S = 1.0  # at the stop, for replies still queued to peers that read them
SETTLE_POLL_MS = 1  # a stopping loop's look at its last gathers (_drained)
SWITCH_INTERVAL_S = 0.0002
# Requests read per wake-up, so that timers and leases are not starved (a batch sleeps at most
# DRAIN_BATCH / EVENTS_EVERY * YIELD_S = 16 ms while CPU gathers run).
DRAIN_BATCH = 1024
EVENTS_EVERY = 32  # requests read between two looks at finished lookups (_drain_socket)
YIELD_S = 0.0005  # the loop's pause after EVENTS_EVERY requests while CPU gathers run (_drain_socket)
STALL_ENV = "ENGRAMD_DEBUG_LOOP_STALL_S"  # tests: the ready loop sleeps this long, once


class Daemon:
    def __init__(self, config: DaemonConfig, lock: SocketLock | None = None,
                 preload: TablePreload | None = None, early: EarlySignals | None = None):
        """`lock`: the socket's lock, when the caller already holds it (then `preload` may be
        the tables' first stage, started under that lock). `early`: the stop signals kept
        before start() installs the daemon's handlers."""
        self.config = config
        self._early = early
        self.epoch = uuid.uuid4().hex[:16]
        self.service = Service.from_config(config, self.epoch)
        self._events = EventQueue()
        self._lock = lock or SocketLock(config.socket_path)
        self._lock_held = lock is not None
        self._preload = preload
        self._ctx = zmq.Context()
        self._socket = RequestSocket(self._ctx, self.service)  # bound by start()
        self._loader: threading.Thread | None = None
        self._halt: DaemonHalt | None = None
        self.instance_taken = False  # another live daemon holds the instance: its tables, not ours
        self._handles: HandleServer | None = None
        self._grants: MappedGrants | None = None  # the tables' descriptors, for mapped clients
        self._poller = zmq.Poller()
        # Each attached client's lease: our end of its handle-socket connection, polled by the loop.
        self._leases = Leases(self._poller, self.service.retire_client)
        self._requests = HandleRequests(self.service, self._leases, self._events.post,
                                        self._begin_stop, self._reload_done)
        self._loop_thread: int | None = None  # the thread of serve_forever
        self.notifier = Notifier()
        self.metrics = Metrics()
        self._stop_deadline = float("inf")
        self._gathers_done: Callable[[], bool] | None = None  # stopping: the backend's probe
        self._overdue = Throttled(log)
        self._ops = self._replied_ops()
        # What runs each kind of event (events.py) on the loop's thread.
        self._on_event: dict[str, Callable[[Any], None]] = {
            "done": self._event_done, "loaded": self._event_loaded,
            "load_failed": self._event_load_failed, "signal": self._event_signal,
            "reload_done": self._event_reload_done, "tables_retired": self._event_tables_retired,
            "attach": self._requests.answer, "refused": self.service.count_error}

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self._events.post("signal", signum)  # handlers only enqueue

    # -- start ----------------------------------------------------------------------------------

    def start(self) -> None:
        if not self._lock_held:
            prepare_runtime_dir(self.config.runtime_dir)
            self._lock.acquire()
        path = self.config.socket_path
        self._socket.bind(path, largest_frame(self.config))
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # SIGHUP: reload
            signal.signal(signum, self._on_signal)
        if self._early is not None and self._early.received is not None:  # before those were in
            self._events.post("signal", self._early.received)
        log.info("engramd epoch %s listening on %s (pid %d)", self.epoch, path, os.getpid())
        self._handles = HandleServer(handle_socket_path(path), self._requests.ask, self.epoch,
                                     admit=self._requests.admits,
                                     count=lambda code: self._events.post("refused", code),
                                     per_uid=self.config.handle_connections_per_uid)
        self.metrics.serve(self.config.metrics_address)
        self.service.state = "loading"
        self.notifier.status("loading tables")
        self._loader = threading.Thread(target=load_and_check, name="engramd-load", daemon=True,
                                        args=(self.config, self._preload, self._on_progress,
                                              self._events.post))
        self._loader.start()

    def _on_progress(self, fraction: float) -> None:
        self.service.progress = fraction

    # -- loop -----------------------------------------------------------------------------------

    def serve_forever(self) -> int:
        self._loop_thread = threading.get_ident()
        # The loop is the latency-critical thread; the others (cache keeper, metrics, loader) are
        # not. A thread that wants the GIL waits up to the switch interval for a running one to
        # let go, so the default 5 ms would be added to a lookup whenever a background thread
        # runs Python at the moment a request arrives.
        previous_interval = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        try:
            return self._loop()
        finally:
            faulthandler.cancel_dump_traceback_later()  # stopping is no stall
            sys.setswitchinterval(previous_interval)

    def _loop(self) -> int:
        self._poller.register(self._socket.sock, zmq.POLLIN)
        self._poller.register(self._events.fd, zmq.POLLIN)
        connections = self._socket.connections
        if connections is not None:
            self._poller.register(connections.monitor, zmq.POLLIN)
        interval_ms = int(self.config.heartbeat_interval * 1000)
        next_reap = time.monotonic()
        while self._halt is None:
            ready = dict(self._poller.poll(SETTLE_POLL_MS if self._gathers_done else interval_ms))
            # Closed leases first: a dead client's queued requests are then dropped, not enqueued
            # behind waits for IDs it will never write.
            for fd in [fd for fd in ready if fd in self._leases]:
                self._leases.event(fd)
            if connections is not None and connections.monitor in ready:
                connections.events()  # first: a user's excess goes before more requests are read
            if self._socket.sock in ready:
                self._drain_socket()
            if self._events.fd in ready:
                self._events.clear_wake()
                self._run_events()
            stopping = self.service.state == "stopping"
            if stopping and self._drained():
                break
            if stopping and time.monotonic() > self._stop_deadline:
                log.warning("stopping with %d lookups still in flight and gathers %s after %.0f s: "
                            "their clients fail them", self.service.in_flight(),
                            "running" if self._gathers_done else "not yet enqueued", DRAIN_TIMEOUT_S)
                break
            if time.monotonic() >= next_reap:
                next_reap = time.monotonic() + self.config.heartbeat_interval
                self._housekeeping()
        if self._halt is not None:
            log.error("%s", self._halt.reason)
            return self._halt.status
        return EXIT_OK

    def _drained(self) -> bool:
        """Stopping: every lookup handed to the backend, and then every one's rows written,
        before the leases close (close()): a closed lease fails lookups whose rows were on their
        way (client/failures.py). The loop goes on meanwhile: a second signal, a client's death
        (whose release lets its gathers pass) are handled."""
        if self.service.in_flight():
            return False
        if self._gathers_done is None:
            self._gathers_done = self.service.gathers_done()
        return self._gathers_done()

    def _drain_socket(self) -> None:
        """Requests waiting on the socket, at most DRAIN_BATCH. Every EVENTS_EVERY requests:

        - completions are answered: a peer flooding the socket (ROUTER reads its peers in turn)
          would otherwise hold every other client's finished lookup behind a whole batch of its own;
        - while CPU gathers run, the loop sleeps YIELD_S. Their threads need the GIL between
          torch calls, and a loop kept busy by a flood holds it: each hand-over then waited a
          switch interval, and a good client's 64-token gather took several times its idle
          time beside one peer sending heartbeats (benchmarks/results/floods.md). Lookups come first; the
          flood's requests wait in the socket's queue;
        - connections the monitor reported are counted, and a user's excess cut: peers that were
          cut reconnect (and send again what they had queued), and over whole batches of a
          flood's `stats` a user's connections stood dozens over its bound (up to 187 of 128 in
          tests/reliability/test_round5_service.py's flood)."""
        for count in range(1, DRAIN_BATCH + 1):
            try:
                frames = self._recv_request()
            except zmq.Again:
                return
            if frames is not None:
                self._handle(frames, time.perf_counter())
            if count % EVENTS_EVERY:
                continue
            if self._socket.connections is not None:
                self._socket.connections.events()
            if self.service.gathering():
                time.sleep(YIELD_S)  # first: what finishes meanwhile is answered right after
            if not self._events.empty():
                self._run_events()
                if self._halt is not None:
                    return  # the loop stops: the rest of the batch is not worth reading

    def _recv_request(self) -> list[bytes] | None:
        """The next request's frames (RequestSocket.recv, which answers a message of too many
        frames itself: None); zmq.Again when none waits. _drain_socket reads through this, so
        that tests hand it requests of their own (tests/test_daemon_yield.py)."""
        return self._socket.recv()

    def _run_events(self) -> None:
        """Run the posted events (callable at any time; bytes left in the wake pipe wake the
        next poll, which then finds no event)."""
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return
            self._on_event[event.kind](event.value)

    def _event_done(self, job: LookupJob) -> None:
        context = job.context
        if context.silent:
            self.service.finish_lookup(job)
            return
        if context.enqueued is not None:
            self.metrics.latency.observe(context.enqueued - context.received)
            if context.started is not None:  # a CPU gather: where its time went
                context.answered = time.perf_counter()
                self.metrics.observe_stages(context)
        try:
            reply = self.service.finish_lookup(job)
        except EngramError as exc:
            self.service.count_error(exc.code)
            self._socket.send(context.identity,
                              protocol.encode_error("lookup", context.rid, self.epoch, exc))
            return
        if reply is not None and context.ack:  # None: a refused lookup's slot release
            self._socket.send(context.identity, protocol.encode_reply(context.rid, self.epoch, reply))

    def _event_loaded(self, loaded: LoadedTables) -> None:
        if self.service.state == "stopping":
            loaded.backend.close()
            loaded.close()
            return
        config = self.config  # the warm-up trace goes to mapped clients' own caches, if they keep any
        caches = config.mapped_hot_cache_gib and "mapped" in config.client_modes.split(",")
        self._grants = MappedGrants(loaded.tables, config.hot_cache_warm_file if caches else "")
        self.service.serve(loaded, on_retire=self._leases.end, grants=self._grants)
        freeze_long_lived()
        summary = (f"ready: {loaded.backend.name} backend, {loaded.geometry.n_layers} layers, "
                   f"{size(loaded.geometry.total_bytes)} of tables "
                   f"{'re-attached' if loaded.reattached else 'loaded'}")
        log.info("%s", summary)
        self.metrics.publish(self.service.report.metrics())
        self.notifier.ready(summary)

    def _event_load_failed(self, exc: BaseException) -> None:
        self.instance_taken = isinstance(exc, StoreLockedError)  # two daemons configured alike
        status = (EXIT_DEVICE if getattr(exc, "device_error", False)
                  else EXIT_CONFIG if isinstance(exc, ConfigError) or self.instance_taken
                  else EXIT_TABLES)
        self._halt = DaemonHalt(f"cannot load tables: {exc}", status)

    def _event_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGHUP:
            try:
                self.service.reloads.start(name, self._reload_done)
            except EngramError as exc:
                log.warning("%s: no reload: %s", name, exc.message)
            return
        if self.service.state == "stopping":
            log.warning("%s again: stopping without waiting", name)
            self._halt = DaemonHalt(f"stopped by a second {name}", EXIT_OK)
            return
        self._begin_stop(name)

    def _begin_stop(self, reason: str) -> None:
        """Refuse new work, let in-flight lookups finish, tell every client we are going away."""
        log.info("%s: stopping (finishing %d in-flight lookups)", reason, self.service.in_flight())
        self.service.state = "stopping"
        self._stop_deadline = time.monotonic() + DRAIN_TIMEOUT_S
        self.notifier.stopping(f"stopping ({reason})")
        for identity in self.service.identities():  # a list: send may reap
            self._socket.send(identity, protocol.encode_notice(self.epoch, "stopping",
                                                               f"daemon is stopping ({reason})"))

    def _housekeeping(self) -> None:
        arm_stall_dump(self.config)
        self._socket.hear_again(time.perf_counter())
        for said in self.service.housekeeping():
            self._overdue.warning("%s", said)
        if self.service.state == "loading":
            self.notifier.status(f"loading tables: {self.service.progress:.0%}")
        if self.notifier.watchdog_interval is not None:
            self.notifier.watchdog()  # the loop is alive: it got here within one interval
        self.metrics.publish(self.service.report.metrics())
        if STALL_ENV in os.environ and self.service.state == "ready":  # fault injection, once
            time.sleep(float(os.environ.pop(STALL_ENV)))

    # -- requests -------------------------------------------------------------------------------

    def _handle(self, frames: list[bytes], received: float) -> None:
        if len(frames) < 2:
            return  # an identity alone: nothing to answer
        identity, body = frames[0], frames[1:]
        op, rid = "", 0
        try:
            request = protocol.decode_request(body)
            op, rid = request.op, request.rid
            if op != "lookup" and self._socket.deaf(identity, received):
                return  # it reads no replies: answering costs the others, and tells it nothing
            request.received = received
            reply = (self._op_lookup(identity, request) if op == "lookup" else
                     protocol.encode_reply(rid, self.epoch, self._ops[op](identity, request)))
        except EngramError as exc:
            self.service.count_error(exc.code)
            op, rid = getattr(exc, "request_op", op), getattr(exc, "request_rid", rid)
            reply = protocol.encode_error(op, rid, self.epoch, exc)
        except Exception as exc:  # a bug must not take the daemon down for everyone
            log.exception("internal error handling %r", op)
            err = InternalError(f"{type(exc).__name__}: {exc}")
            self.service.count_error(err.code)
            reply = protocol.encode_error(op, rid, self.epoch, err)
        if reply is not None:
            self._socket.send(identity, reply)

    def _replied_ops(self) -> dict[str, Callable[[bytes, protocol.Request], Message]]:
        """What each operation answered at once asks of the service (a lookup answers on its
        completion: _op_lookup)."""
        service = self.service
        return {
            "register": lambda identity, request: service.register(identity, request.body,
                                                                   self._socket.sender()),
            "release": lambda identity, request: service.release(identity, request.body),
            "heartbeat": lambda identity, request: service.heartbeat(identity, request.body),
            "stats": lambda identity, request: service.report.stats(),
            "health": lambda identity, request: service.report.health(),
            "drain": refuse_drain,
        }

    def _op_lookup(self, identity: bytes, request: protocol.Request) -> None:
        self.service.lookup(identity, request.body, request.payload, self._on_done,
                            JobContext(identity=identity, rid=request.rid, ack=request.body.ack,
                                       received=request.received))
        return None  # answered on completion (GPU lookups without ack: only if they fail)

    def _on_done(self, job: LookupJob) -> None:
        if threading.get_ident() == self._loop_thread:
            self._event_done(job)  # enqueued inline: no need to go round the event queue
        else:
            self._events.post("done", job)

    # -- reload (server/reload_control.py, server/reload.py) -----------------------------------

    def _reload_done(self, reload: TableReload) -> None:
        self._events.post("reload_done", reload)  # from the reload's thread

    def _event_reload_done(self, reload: TableReload) -> None:
        """The reload's tables are open and checked (or it failed): the service switches to
        them; every client hears."""
        if not self.service.reloads.finish(reload, lambda old: self._events.post("tables_retired", old)):
            return
        tables_id = self.service.tables_id
        for identity in self.service.identities():  # a list: send may reap
            self._socket.send(identity, protocol.encode_notice(
                self.epoch, "tables", f"the daemon serves tables {tables_id} now", tables=tables_id,
                tables_seq=self.service.tables_seq))

    def _event_tables_retired(self, tables: list[HostTable]) -> None:
        """No gather of the daemon's reads these replaced tables any more: unmap them."""
        self.service.reloads.tables_retired(tables)
        # What the old tables' caches and plans left in reference cycles was frozen at start:
        # thawed, it is collected (once, here), and what lives on is frozen again.
        gc.unfreeze()
        freeze_long_lived()

    # -- stop -----------------------------------------------------------------------------------

    def close(self) -> None:
        self.service.reloads.cancel()  # stops a load between chunks; its files go
        if self._preload is not None:  # the tables, if the loader never took them
            try:
                self._preload.abandon()
            except Exception:  # stopping goes on; the process lets go of them anyway
                log.exception("closing the preloaded tables")
        if self._handles is not None:
            self._handles.close()
        # The replies first, then the leases: a client that sees its lease close fails a lookup
        # whose reply has not come (a drain's last ones, and every CPU lookup's rows), and the
        # socket's queues went with it unsent (ZeroMQ drops them at a close without linger).
        self._socket.close(REPLIES_FLUSH_S)  # and its path, if start() got to bind it
        self._ctx.term()  # returns once the replies are sent, or REPLIES_FLUSH_S passed
        self._leases.close()
        if self._grants is not None:
            self._grants.close()
            self._grants = None
        self.metrics.close()
        self.service.close()  # backend.stop, the slabs freed, backend.close: in that order
        self._lock.release()
        self._events.close()


def refuse_drain(identity: bytes, request: protocol.Request) -> Message:
    raise PermissionDeniedError("drain is an admin operation and ZeroMQ cannot say who asks: "
                                "run `engramd drain` (it asks over the handle socket)")


# Frames up to this size are read whatever the tables, so that one a little too large gets a
# typed error saying so, not a silent disconnect; 16 connections may hold 64 MiB of them.
MIN_FRAME_BOUND = 4 << 20


def largest_frame(config: DaemonConfig) -> int:
    """The largest frame a request to this daemon may carry: a lookup's inline IDs (int64) at
    max_tokens, with a header's worth of margin; the protocol's bound where the geometry cannot
    be read yet (the load then says why). A reload keeps the geometry (server/reload.py)."""
    try:
        geometry = (TableGeometry.named("demo") if config.tables == "demo"
                    else TableGeometry.from_file(Path(config.tables) / CONFIG_FILE))
    except Exception:  # whatever is wrong with it, loading the tables reports it
        return protocol.MAX_PAYLOAD_BYTES
    ids = config.max_tokens * geometry.n_layers * geometry.heads * 8
    return min(protocol.MAX_PAYLOAD_BYTES, max(ids + protocol.MAX_HEADER_BYTES, MIN_FRAME_BOUND))


def load_and_check(config: DaemonConfig, preload: TablePreload | None,
                   on_progress: Callable[[float], None], post: Callable[[str, Any], None]) -> None:
    """The loader thread: load (or re-attach) the tables, self-check them if configured, and post
    the outcome to the loop: "loaded" or "load_failed"."""
    try:
        opened = None
        if preload is not None:
            preload.listen(on_progress)
            opened = preload.take()
        loaded = load_tables(config, on_progress, opened)
    except BaseException as exc:  # reported to the main thread, which decides the exit
        post("load_failed", exc)
        return
    try:
        if config.self_check:
            loaded = self_checked(config, loaded, on_progress)
    except BaseException as exc:
        post("load_failed", exc)
        return
    post("loaded", loaded)


def self_checked(config: DaemonConfig, loaded: LoadedTables,
                 on_progress: Callable[[float], None]) -> LoadedTables:
    """`loaded` after the self-check, or the tables opened again where re-attached ones failed
    it and their own sampled rows differ from the checkpoint: their files may hold another
    revision (whose files carry the same names, sizes and mtimes: the fingerprint cannot tell)
    or have been damaged, and kept, they would fail every later start too. Opened again as with
    `verify_tables`: every row of a re-attached file compared with the checkpoint, a file that
    differs loaded anew (as long as a load); then checked again. What is not returned is
    closed."""
    try:
        run_self_check(loaded.checkpoint, loaded)
        return loaded
    except SelfCheckError as exc:
        again = (any(table.reattached for table in loaded.tables) and not config.verify_tables
                 and not host_rows_agree(loaded))  # else the kernel, not the tables: no reload helps
        close_loaded(loaded)
        if not again:
            raise
        log.warning("self-check failed on re-attached tables (%s): comparing every row with the "
                    "checkpoint and loading what differs. Their id is the checkpoint's fingerprint "
                    "(file names, sizes, mtimes): a new revision whose files carry the old ones' "
                    "mtimes gets the old id; give its files new mtimes (touch them)", exc)
    except BaseException:
        close_loaded(loaded)
        raise
    loaded = load_tables(dataclasses.replace(config, verify_tables=True), on_progress)
    try:
        run_self_check(loaded.checkpoint, loaded)
    except BaseException:
        close_loaded(loaded)
        raise
    return loaded


def host_rows_agree(loaded: LoadedTables) -> bool:
    """Whether sampled rows of the host tables themselves (the reference gather, no device)
    equal the checkpoint's."""
    try:
        check_host_tables(loaded.checkpoint, loaded.tables)
    except SelfCheckError:
        return False
    return True


def close_loaded(loaded: LoadedTables) -> None:
    loaded.backend.close()
    loaded.close()


def arm_stall_dump(config: DaemonConfig) -> None:
    """Re-arm the stall dump: a C thread of faulthandler's writes every thread's stack to
    stderr if the loop does not come back here in time. It needs no GIL, so it reports a
    loop stuck in a driver call too (a launch on a stream that waits for a dead client)."""
    if config.stall_dump_s:
        faulthandler.dump_traceback_later(max(config.stall_dump_s,
                                              3 * config.heartbeat_interval), exit=False)


def freeze_long_lived() -> None:
    """Move every object alive now out of the collector's sight (gc.freeze): what exists once
    the daemon serves (torch, the tables' bookkeeping, the kernels) lives as long as it does, and
    a full collection then walks only what serving makes. Without it, full collections stalled
    the request loop for 45-110 ms at a time during floods (benchmarks/results/floods.md)."""
    gc.collect()
    gc.freeze()


def run_daemon(config: DaemonConfig, lock: SocketLock | None = None,
               preload: TablePreload | None = None, early: EarlySignals | None = None) -> int:
    """Run until stopped; returns the exit status. `lock`, `preload` and `early` as for Daemon."""
    raise_open_file_limit(config)
    daemon = Daemon(config, lock, preload, early)
    status = EXIT_OK
    try:
        daemon.start()
        status = daemon.serve_forever()
    except DaemonHalt as halt:
        log.error("%s", halt.reason)
        status = halt.status
    finally:
        daemon.close()
        folder = tables_folder_path(config.shm_dir, config.instance)
        if folder.is_dir() and not daemon.instance_taken:  # a start whose load failed left none
            log.info("stopped (exit status %d); the tables stay in %s for the next start", status, folder)
        else:
            log.info("stopped (exit status %d)", status)
    return status
