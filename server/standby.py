"""A standby daemon: `engramd serve --standby` pays a start's fixed costs ahead, then waits.

Most of a restart goes on costs that do not depend on the tables: importing the daemon (torch:
3.1-5.7 s on the H200) and, on GPUs, torch's CUDA start with its kernels loaded eagerly (2.2-3.3
s; benchmarks/results/h200/start_costs.log). A standby pays them first, then waits for the
socket's lock. While it waits it also maps and pins the tables it will serve, and keeps them
current across the serving daemon's reloads (server/standby_tables.py): the other cost of a
restart that grows with the tables. When the serving daemon exits or dies (the kernel frees its
lock), the standby takes the socket and goes on as any daemon starts from there: it re-attaches
the tables (adopting its own mappings and pins after checking them again), warms its gather
kernels and serves. Before it holds the lock it binds nothing and writes, creates or removes no
table file, so it cannot disturb the daemon it stands by for.

An upgrade: start the new version with --standby, wait until it logs that the tables are
"mapped and pinned ahead", then stop the old one (SIGTERM). Under systemd (Type=notify,
packaging/engramd@.service) the standby says READY=1 at that point, so that `systemctl start`
of the new instance returns when it can take over fast; it says where it stands in STATUS=
and pets the watchdog while it waits (StandbyNotices).

What it is not: a second server. While it waits it answers nothing (`engramd health` reaches the
serving daemon); it holds a CUDA context on every GPU it will serve, and page tables and pins of
the tables' shared memory (no second copy of it).
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import time

from engramd.server.config import DaemonConfig
from engramd.server.notify import Notifier
from engramd.server.standby_tables import PreparedTables, TableWatch
from engramd.server.startup import EXIT_OK, EXIT_SOCKET_IN_USE, DaemonHalt, EarlySignals, SocketLock
from engramd.server.table_loader import choose_backend_name

log = logging.getLogger("engramd.daemon")


def wait_as_standby(config: DaemonConfig, lock: SocketLock, early: EarlySignals) -> PreparedTables | None:
    """Start ahead, then take `lock` once it is free; DaemonHalt(EXIT_OK) if stopped first (by
    a signal `early` kept before, too). Returns the tables prepared meanwhile
    (server/standby_tables.py), for the start to adopt. A free lock is taken at once, and the
    start goes on as a plain one (None). From the lock on, `early` keeps the stop signals
    again: one that comes while the tables are handed over stops the daemon once it listens."""
    if _free(lock):  # nobody to stand by for: a plain start, its pin beside the imports
        log.info("standby: the socket %s is free; starting at once", config.socket_path)
        return None
    stop = _stop_on_signals(early)
    if early.received is not None:
        raise DaemonHalt("standby: stopped before it stood by", EXIT_OK)
    notifier = Notifier()
    notifier.status("standby: starting ahead")
    seconds, on_gpu = start_ahead(config)
    log.info("standby: daemon modules%s ready in %.2f s", " and CUDA" if on_gpu else "", seconds)
    notices = StandbyNotices(notifier)
    watch = TableWatch.start(config, notices)
    try:
        lock.acquire(stop, on_held=lambda pid: log.info(
            "standing by for %s (served by pid %s); SIGTERM ends the wait", config.socket_path, pid),
            on_poll=notices.pet)
    except BaseException:
        watch.close()
        raise
    early.install()  # until the daemon installs its own as it starts
    log.info("standby: holding the lock of %s now; starting", config.socket_path)
    return watch.hand_over()


class StandbyNotices:
    """What a waiting standby tells systemd: STATUS= whenever where it stands changes and
    READY=1 the first time it has done what it can ahead of a takeover (both from its table
    watch's thread: TableWatch's on_state); WATCHDOG=1 every half WatchdogSec from the thread
    that waits for the lock (pet), which a pin of the tables that takes long does not hold up.
    Once it holds the lock the daemon's own notices take over."""

    def __init__(self, notifier: Notifier):
        self._notifier = notifier
        self._status: str | None = None
        self._ready = False
        self._petted = -math.inf

    def __call__(self, status: str, settled: bool) -> None:
        if settled and not self._ready:
            self._notifier.ready(status)
            self._ready = True
        elif status != self._status:
            self._notifier.status(status)
        self._status = status

    def pet(self) -> None:
        interval = self._notifier.watchdog_interval
        now = time.monotonic()
        if interval is not None and now - self._petted >= interval:
            self._notifier.watchdog()
            self._petted = now


def _free(lock: SocketLock) -> bool:
    """Take `lock` if nobody holds it; False if another engramd does."""
    try:
        lock.acquire()
    except DaemonHalt as halt:
        if halt.status != EXIT_SOCKET_IN_USE:
            raise
        return False
    return True


def start_ahead(config: DaemonConfig) -> tuple[float, bool]:
    """The daemon's modules and, for the cuda backend, a CUDA context on every GPU with torch's
    kernels loaded (the loading mode is the daemon's: server/cli.py). Seconds taken, and
    whether CUDA was started."""
    started = time.monotonic()
    import engramd.server.daemon  # noqa: F401  (torch and the backends: the heavy imports)

    on_gpu = False
    if choose_backend_name(config.backend) == "cuda":
        import torch

        if torch.cuda.is_available():
            for index in range(torch.cuda.device_count()):
                torch.empty(1, device=torch.device("cuda", index))
            torch.cuda.synchronize()
            on_gpu = True
    return time.monotonic() - started, on_gpu


def _stop_on_signals(early: EarlySignals) -> threading.Event:
    """SIGTERM and SIGINT end the wait (exit 0), and are kept in `early` (one that comes as the
    lock is taken stops the daemon once it listens); SIGHUP, a reload for the serving daemon,
    is not for a standby and must not kill it."""
    stop = threading.Event()

    def stop_waiting(signum: int, frame: object) -> None:
        early.keep(signum, frame)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stop_waiting)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    return stop
