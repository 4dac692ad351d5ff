"""Is a client's process still alive? Answered from /proc, robust against PID reuse.

A diagnostic beside the lease (a registration lives as long as its handle-socket connection):
the daemon retires a client early when its process is visibly gone, and keeps a silent client
whose process is visibly alive (stopped, say). A PID alone can be reused by an unrelated process
after the client dies, so the process start time (field 22 of /proc/<pid>/stat) is recorded at
attach and compared. The answer is None, unknown, when the PID was never visible (another PID
namespace) or /proc cannot be read right now (out of descriptors): only a process that is
certainly gone is reported as gone.
"""

from __future__ import annotations

from pathlib import Path


class _Unknown(Exception):
    """/proc could not answer (not: the process is gone)."""


def _stat(pid: int) -> str | None:
    """/proc/<pid>/stat, or None when no such process exists; _Unknown when it cannot be read."""
    try:
        return Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except (OSError, ValueError) as exc:
        raise _Unknown(exc) from None


def _start_time(stat: str) -> int | None:
    # The command name (field 2) may hold spaces and parentheses; fields resume after the last ')'.
    rest = stat[stat.rfind(")") + 2:].split()
    try:
        return int(rest[19])  # field 22 overall = index 19 after pid and comm
    except (IndexError, ValueError):
        return None


class ProcessWatch:
    def __init__(self, pid: int):
        self.pid = pid
        try:
            stat = _stat(pid) if pid > 0 else None
        except _Unknown:
            stat = None
        self.start_time = _start_time(stat) if stat else None

    def alive(self) -> bool | None:
        """True, False (gone, reused, or a zombie), or None when unknown."""
        if self.start_time is None:
            return None
        try:
            stat = _stat(self.pid)
        except _Unknown:
            return None
        if stat is None or _start_time(stat) != self.start_time:
            return False
        return stat[stat.rfind(")") + 2] not in "ZX"  # a zombie has exited already
