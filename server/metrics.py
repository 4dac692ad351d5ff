"""Prometheus metrics of the daemon, served over HTTP on a configurable address.

The request loop owns all state; scrapes come on the HTTP server's thread. So the loop publishes
a plain snapshot (`Metrics.publish`, every heartbeat interval and on state changes) and the
collector reads only that snapshot: a scrape never touches live structures and is at most one
interval stale. The lookup-latency histogram is observed directly (prometheus_client's histograms
are thread-safe).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
)
from prometheus_client.exposition import make_wsgi_app

from engramd.server.gc_pauses import GENERATIONS, GcPauses
from engramd.server.job_context import JobContext

log = logging.getLogger("engramd.metrics")

# A scrape is one short request: at most this many are served at once, each for at most this
# long (idle TCP connections once took a thread each, without end).
MAX_SCRAPERS = 8
SCRAPE_TIMEOUT_S = 5.0

# A CPU lookup's stages, each from one of its job context's times to the next: received ->
# submitted -> started -> enqueued -> answered (observe_stages).
CPU_STAGES = ("submit", "queue", "gather", "completion")

LATENCY_BUCKETS = (25e-6, 50e-6, 100e-6, 200e-6, 400e-6, 800e-6, 1.6e-3, 3.2e-3, 6.4e-3,
                   12.8e-3, 25.6e-3, 51.2e-3, 0.1, 0.2, 0.5)


class _SnapshotCollector:
    def __init__(self) -> None:
        self.snapshot: dict[str, Any] = {}

    def collect(self) -> Iterator[Any]:
        s = self.snapshot  # one reference read: the loop swaps whole snapshots
        if not s:
            return
        yield _gauge("engramd_ready", "1 when tables are loaded and the self-check passed", s["ready"])
        yield _gauge("engramd_load_progress", "fraction of the tables loaded or re-attached", s["progress"])
        yield _gauge("engramd_uptime_seconds", "seconds since the daemon started", s["uptime"])
        yield _gauge("engramd_clients", "registered clients", len(s["clients"]))
        modes = GaugeMetricFamily("engramd_clients_by_mode",
                                  "registered clients by mode (served: the daemon gathers; mapped: "
                                  "the client gathers from its mapping of the tables)", labels=["mode"])
        for mode in ("served", "mapped"):
            modes.add_metric([mode], sum(c.get("mode", "served") == mode for c in s["clients"]))
        yield modes
        yield _gauge("engramd_table_bytes_pinned", "host table bytes registered with CUDA", s["pinned_bytes"])
        info = InfoMetricFamily("engramd_epoch", "the daemon run's epoch and backend")
        info.add_metric([], {"epoch": s["epoch"], "backend": s["backend"] or "none"})
        yield info
        tables = s.get("tables") or "none"
        info = InfoMetricFamily("engramd_tables", "the served tables' id, and the last reload's "
                                "state (none, loading, done, unchanged, failed)")
        info.add_metric([], {"tables": tables, "reload": s.get("reload", {}).get("state", "none")})
        yield info
        yield _gauge("engramd_clients_on_other_tables",
                     "clients that read other tables than the served ones (mapped clients not yet "
                     "re-mapped after a reload, clients pinned to the replaced tables)",
                     sum(c.get("tables", tables) != tables for c in s["clients"]))
        yield _counter("engramd_lookups", "lookups completed", s["lookups"])
        yield _counter("engramd_rows", "rows returned (tokens x layers x owned heads)", s["rows"])
        yield _counter("engramd_out_of_range_ids", "IDs past the table (zero rows)", s["out_of_range"])
        errors = CounterMetricFamily("engramd_errors", "error replies by code", labels=["code"])
        for code, count in sorted(s["errors"].items()):
            errors.add_metric([code], count)
        yield errors
        per_client = [("engramd_client_lookups", "lookups per client", "lookups"),
                      ("engramd_client_rows", "rows per client", "rows")]
        for name, doc, key in per_client:
            # No pid or name: the endpoint is open to every local user (engramd stats, as an
            # admin, says who each client is).
            family = CounterMetricFamily(name, doc, labels=["client_id", "device"])
            for c in s["clients"]:
                family.add_metric([str(c["client_id"]), c["device"]], c[key])
            yield family
        slabs = GaugeMetricFamily("engramd_slab_bytes", "client slab bytes per device", labels=["device"])
        for device, nbytes in sorted(s["slab_bytes"].items()):
            slabs.add_metric([device], nbytes)
        yield slabs
        mps = GaugeMetricFamily("engramd_mps_enabled",
                                "1 when the daemon's contexts on this GPU go through an MPS server "
                                "(served lookups overlap the clients' kernels only then)",
                                labels=["device"])
        for device, state in sorted(s.get("mps", {}).items()):
            mps.add_metric([device], int(state["enabled"]))
        yield mps
        yield from _cache_families(s.get("hot_cache", {}))


def _cache_families(caches: dict[str, dict[str, Any]]) -> Iterator[Any]:
    """Hot-row cache per GPU: reads and hits per layer, hit rate, bytes of host reads saved."""
    per_layer = [("engramd_cache_reads", "rows read by the gathers (after dedupe)", "reads", CounterMetricFamily),
                 ("engramd_cache_hits", "rows read from the HBM hot-row cache", "hits", CounterMetricFamily),
                 ("engramd_cache_hit_rate", "hits / reads since start", "hit_rate", GaugeMetricFamily)]
    for name, doc, key, kind in per_layer:
        family = kind(name, doc, labels=["device", "layer"])
        for device, c in sorted(caches.items()):
            for layer, value in enumerate(c[key]):
                family.add_metric([device, str(layer)], value)
        yield family
    per_device = [("engramd_cache_bytes_saved", "host bytes not read thanks to the cache", "bytes_saved",
                   CounterMetricFamily),
                  ("engramd_cache_admitted", "rows admitted into the cache", "admitted", CounterMetricFamily),
                  ("engramd_cache_slots", "rows the cache can hold", "slots", GaugeMetricFamily)]
    for name, doc, key, kind in per_device:
        family = kind(name, doc, labels=["device"])
        for device, c in sorted(caches.items()):
            family.add_metric([device], c[key])
        yield family


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


class _QuietHandler(WSGIRequestHandler):
    timeout = SCRAPE_TIMEOUT_S  # per read, applied by StreamRequestHandler.setup

    def setup(self) -> None:
        super().setup()
        # And for the whole request: a peer trickling a byte every few seconds must not hold a
        # thread for ever (the server's reaper cuts connections past their deadline).
        self.server.watch(self.connection)

    def finish(self) -> None:
        self.server.forget(self.connection)
        super().finish()

    def log_message(self, format: str, *args: Any) -> None:
        pass  # scrapes are not news


class _BoundedServer(ThreadingMixIn, WSGIServer):
    """A thread per scrape, at most MAX_SCRAPERS at once; connections past that are closed."""

    daemon_threads = True

    def __init__(self, *args: Any, **kwargs: Any):
        self._slots = threading.BoundedSemaphore(MAX_SCRAPERS)
        self._deadlines: dict[socket.socket, float] = {}  # scrapes in progress
        self._lock = threading.Lock()
        self._closed = threading.Event()
        super().__init__(*args, **kwargs)
        threading.Thread(target=self._reap, name="engramd-metrics-reaper", daemon=True).start()

    def watch(self, conn: socket.socket) -> None:
        with self._lock:
            self._deadlines[conn] = time.monotonic() + SCRAPE_TIMEOUT_S

    def forget(self, conn: socket.socket) -> None:
        with self._lock:
            self._deadlines.pop(conn, None)

    def _reap(self) -> None:
        """One thread for every scrape's deadline: shutting an overdue socket down ends
        whatever read or write its handler is in."""
        while not self._closed.wait(0.25):
            now = time.monotonic()
            with self._lock:
                overdue = [conn for conn, deadline in self._deadlines.items() if deadline < now]
            for conn in overdue:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # already gone

    def server_close(self) -> None:
        self._closed.set()
        super().server_close()

    def process_request(self, request: socket.socket, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: socket.socket, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class _GcCollector:
    def __init__(self, pauses: GcPauses) -> None:
        self.pauses = pauses

    def collect(self) -> Iterator[Any]:
        family = HistogramMetricFamily("engramd_gc_pause_seconds",
                                       "garbage collections (each stops every thread of the "
                                       "daemon that runs Python), by generation", labels=["generation"])
        for generation in range(GENERATIONS):
            buckets, seconds = self.pauses.histogram(generation)
            family.add_metric([str(generation)], buckets, seconds)
        yield family


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._collector = _SnapshotCollector()
        self.registry.register(self._collector)
        self.latency = Histogram("engramd_lookup_dispatch_seconds",
                                 "request received -> gather enqueued (GPU) or rows written (CPU)",
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        stages = Histogram("engramd_lookup_stage_seconds",
                           "CPU lookups, stage by stage: submit (request received -> pieces "
                           "queued), queue (-> a worker starts its first piece), gather (-> "
                           "its last piece's rows written, waits between pieces included), "
                           "completion (-> the loop answers)", labelnames=["stage"],
                           buckets=LATENCY_BUCKETS, registry=self.registry)
        self._stages = [stages.labels(stage) for stage in CPU_STAGES]
        self.gc_pauses = GcPauses(LATENCY_BUCKETS)
        self.registry.register(_GcCollector(self.gc_pauses))
        self._server = None

    def observe_stages(self, context: JobContext) -> None:
        """A finished CPU lookup's stages, from the times its job's context holds (all five, once
        the loop has answered a CPU lookup)."""
        c = context
        times = (c.received, c.submitted, c.started, c.enqueued, c.answered)
        for histogram, start, end in zip(self._stages, times[:-1], times[1:], strict=True):
            histogram.observe(end - start)

    def publish(self, snapshot: dict[str, Any]) -> None:
        self._collector.snapshot = snapshot

    def serve(self, address: str) -> None:
        """Start the HTTP endpoint; port 0 disables it. A bind failure is a warning: the
        daemon serves lookups without metrics. Two daemons on one machine (another instance,
        a second demo) meet on the default port, and refusing lookups for want of metrics would
        be the worse outcome."""
        host, _, port = address.rpartition(":")
        if int(port) == 0:
            return
        try:
            self._server = make_server(host or "127.0.0.1", int(port), make_wsgi_app(self.registry),
                                       server_class=_BoundedServer, handler_class=_QuietHandler)
        except OSError as exc:
            log.warning("metrics_address %s: cannot listen (%s); serving without metrics (set "
                        "metrics_address to a free port, or its port to 0 to turn them off)",
                        address, exc.strerror or exc)
            return
        self.gc_pauses.install()
        threading.Thread(target=self._server.serve_forever, name="engramd-metrics", daemon=True).start()
        log.info("metrics on http://%s/metrics", address)

    def close(self) -> None:
        self.gc_pauses.uninstall()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
