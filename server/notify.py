"""systemd service notifications (sd_notify), dependency-free.

A no-op when the service manager did not set NOTIFY_SOCKET (not under systemd, or not
Type=notify). A NOTIFY_SOCKET starting with '@' names a Linux abstract socket. Errors while
notifying are logged, never raised: a daemon must not die because its supervisor is busy.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("engramd.notify")


class Notifier:
    def __init__(self, address: str | None = None):
        address = os.environ.get("NOTIFY_SOCKET") if address is None else address
        self._address = None
        if address:
            self._address = "\0" + address[1:] if address.startswith("@") else address
        usec = os.environ.get("WATCHDOG_USEC", "")
        pid = os.environ.get("WATCHDOG_PID", "")
        mine = not pid or pid == str(os.getpid())
        self.watchdog_interval = int(usec) / 1e6 / 2 if usec.isdigit() and mine else None

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def send(self, *fields: str) -> None:
        if self._address is None:
            return
        message = "\n".join(fields).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.sendto(message, self._address)
        except OSError as exc:
            log.warning("cannot notify the service manager: %s", exc)

    def ready(self, status: str) -> None:
        self.send("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def status(self, status: str) -> None:
        self.send(f"STATUS={status}")

    def watchdog(self) -> None:
        self.send("WATCHDOG=1")

    def stopping(self, status: str = "stopping") -> None:
        self.send("STOPPING=1", f"STATUS={status}")
