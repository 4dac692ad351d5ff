"""The host tables registered with the GPUs: what lets a device read the table files in place.

The table files (table_file.py, kept by the store in host_tables.py) know nothing of GPUs;
this pins their rows with cudaHostRegister, read-only since no device writes them
(client/shared/host_pin.py does the driver calls). The serving daemon's backend, a reload and the benchmarks' in-process gathers register
tables here. Needs no torch: the daemon registers its tables while it imports torch.

Not the client option `EngramClient(pin_tables=True)`, which pins a client to one version of
the tables (README, "Reload").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from engramd.server.units import size

if TYPE_CHECKING:
    from engramd.client.shared.host_pin import HostRegistration
    from engramd.server.table_file import HostTable

logger = logging.getLogger("engramd.tables")  # one log for the tables' load, attach and pinning


def register_for_gpus(tables: list[HostTable], collapse: bool = True,
                      unregister_later: Callable[[HostRegistration], None] | None = None) -> HostRegistration:
    """The tables registered for the GPUs, read-only; CudaError if that fails. `collapse`: their
    pages made 2 MiB folios first (the serving daemon; a standby leaves that to it:
    client/shared/huge_pages.py). `unregister_later`: where a failure hands what it pinned
    (a serving daemon's reload: HostRegistration says why)."""
    from engramd.client.shared.host_pin import HostRegistration

    started = time.monotonic()
    registration = HostRegistration.of_files([(t.fd, t.data_offset, t.nbytes) for t in tables],
                                             read_only=True, collapse=collapse,
                                             unregister_later=unregister_later)
    total, seconds = sum(t.nbytes for t in tables), time.monotonic() - started
    logger.info("pinned %s of host tables in %.2f s (%.1f GB/s)%s", size(total), seconds,
                total / 1e9 / max(seconds, 1e-9),
                f"; {size(registration.not_collapsed_bytes)} not in 2 MiB folios of tmpfs"
                if collapse else "")
    return registration
