"""Is a client's process still alive? Answered from /proc, robust against PID reuse.

A PID alone can be reused by an unrelated process after the client dies, so the process start
time (field 22 of /proc/<pid>/stat) is recorded at registration and compared. When the PID is not
visible (the client runs in another PID namespace) the answer is None: unknown, and the daemon
falls back to heartbeats for that client.
"""

from __future__ import annotations

from pathlib import Path


def _start_time(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    # The command name (field 2) may hold spaces and parentheses; fields resume after the last ')'.
    rest = stat[stat.rfind(")") + 2:].split()
    try:
        return int(rest[19])  # field 22 overall = index 19 after pid and comm
    except (IndexError, ValueError):
        return None


class ProcessWatch:
    def __init__(self, pid: int):
        self.pid = pid
        self.start_time = _start_time(pid) if pid > 0 else None

    def alive(self) -> bool | None:
        """True, False (gone or reused), or None when the PID was never visible."""
        if self.start_time is None:
            return None
        now = _start_time(self.pid)
        if now is None or now != self.start_time:
            return False
        try:
            state = Path(f"/proc/{self.pid}/stat").read_text()
        except OSError:
            return False
        return state[state.rfind(")") + 2] not in "ZX"  # a zombie has exited already
