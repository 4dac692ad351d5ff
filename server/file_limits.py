"""The open-file budget: descriptors the daemon may need for its configured clients, and the
soft limit raised to cover them before it starts.

Not the daemon's other resources (memory, slabs: server/registry.py's budget).
"""

from __future__ import annotations

import logging
import resource

from engramd.server.config import DaemonConfig
from engramd.server.handle_server import MAX_CONNECTIONS
from engramd.server.metrics import MAX_SCRAPERS

log = logging.getLogger("engramd.daemon")

# Descriptors the daemon holds whatever its clients: libraries, the sockets, the tables, CUDA's
# device files (21 measured for an idle CPU daemon; CUDA adds a few per GPU).
BASE_FILES = 128
# Per registered client: its ZeroMQ connection, its lease and its slab's descriptors (5 measured
# for a served CPU client, 3 for a mapped one), with room for a GPU slab's counters.
FILES_PER_CLIENT = 8
# Per handle-socket connection in progress: it, its duplicate, and the descriptors it passes (a
# slab's, or a mapped client's tables and warm-up trace).
FILES_PER_HANDLE_CONNECTION = 8


def files_needed(config: DaemonConfig) -> int:
    """Descriptors the daemon may need with max_clients clients attached, while one user has
    handle_connections_per_uid connections waiting (one each) and the handle socket and the
    metrics endpoint answer as many as they take at once."""
    return (BASE_FILES + FILES_PER_CLIENT * config.max_clients + config.handle_connections_per_uid
            + FILES_PER_HANDLE_CONNECTION * MAX_CONNECTIONS + MAX_SCRAPERS)


def raise_open_file_limit(config: DaemonConfig) -> int:
    """Raise the soft limit on open files to the hard one; returns the limit now in force.

    Every peer connection costs the daemon a descriptor, and libzmq aborts the whole process
    (an assertion in its ipc listener) when an accept fails for want of one. So the limit must
    cover what the configured clients need (files_needed); a warning names max_clients when it
    does not. A higher limit only raises the number of idle connections a hostile local peer
    must open to reach it, so a limit that covers the clients is not warned about: a warning at
    every start is one nobody reads.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (OSError, ValueError):  # needs no privilege; if it fails, the check below tells
            pass
    need = files_needed(config)
    if soft != resource.RLIM_INFINITY and soft < need:
        log.warning("open-file limit %d is below the %d descriptors that max_clients = %d and "
                    "handle_connections_per_uid = %d may need; raise it (systemd: LimitNOFILE, "
                    "docker: --ulimit nofile) or lower max_clients", soft, need, config.max_clients,
                    config.handle_connections_per_uid)
    return soft
