"""CPU time over a stretch of a benchmark, per thread of this process and per process of the
daemon and the MPS server, with the machine's steal time: what was busy while a variant's cells
ran.

A decode step's host time is mostly Python and driver calls on one thread; when it rises for a
stretch, every operation of that thread reading slower alike, the cause is beside the step: a
thread of this process holding the GIL (a hot-row cache's keeper, an engine's own), another
process on the same cores, or the VM's host taking the CPUs (steal). The numbers come from
/proc (Linux): a thread's or process's utime + stime, and /proc/stat's all-CPU busy and steal
times; `proc` points elsewhere for tests. A process that /proc does not show (another PID
namespace, hidepid) reads as not found.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
MPS_SERVER = "nvidia-cuda-mps-server"  # its comm is cut to 15 characters, as the control's is


def task_seconds(stat_line: str) -> float:
    """utime + stime in seconds from a /proc/<pid>[/task/<tid>]/stat line (its command name,
    field 2, may hold spaces and parentheses: the fields are counted after its last ')')."""
    fields = stat_line[stat_line.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S  # fields 14 and 15 of the line


def machine_seconds(stat_text: str) -> dict[str, float]:
    """All CPUs' busy and steal time in seconds from /proc/stat's first line."""
    names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    values = dict(zip(names, (int(v) for v in stat_text.splitlines()[0].split()[1:9]), strict=False))
    busy = sum(values.get(n, 0) for n in ("user", "nice", "system", "irq", "softirq"))
    return {"busy": busy * TICK_S, "steal": values.get("steal", 0) * TICK_S}


class CpuUse:
    """`with CpuUse({"daemon": pid}) as use: ...`, then use.result(): seconds of CPU over the
    block's wall time, per thread of this process ("name [tid]": its Python name where it has
    one, else its command name), per named process and per MPS server ("mps_server [pid]"), and
    the machine's busy and steal time. A thread or process begun inside counts from 0; one that
    ended inside is lost and listed in "ended"."""

    def __init__(self, processes: dict[str, int | None] | None = None, proc: Path | str = "/proc",
                 pid: int | None = None):
        self.named = {name: pid for name, pid in (processes or {}).items() if pid is not None}
        self.proc = Path(proc)
        self.pid = os.getpid() if pid is None else pid
        self._before: dict[str, dict] = {}
        self._result: dict | None = None

    def __enter__(self) -> CpuUse:
        self._before = self._snapshot()
        return self

    def __exit__(self, *exc) -> None:
        after = self._snapshot()
        before = self._before
        self._result = {
            "wall_s": round(after["wall"] - before["wall"], 3),
            "threads": _deltas(before["threads"], after["threads"]),
            "processes": _deltas(before["processes"], after["processes"], keep_idle=True),
            "machine": {k: round(after["machine"][k] - before["machine"][k], 3) for k in after["machine"]},
            "ended": sorted({*before["threads"], *before["processes"]}
                            - {*after["threads"], *after["processes"]}),
        }

    def result(self) -> dict:
        if self._result is None:
            raise RuntimeError("CpuUse.result() before its block ended")
        return self._result

    def _snapshot(self) -> dict:
        return {"wall": time.monotonic(), "threads": self._threads(), "processes": self._processes(),
                "machine": machine_seconds((self.proc / "stat").read_text())}

    def _threads(self) -> dict[str, float]:
        names = {t.native_id: t.name for t in threading.enumerate()} if self.pid == os.getpid() else {}
        seconds: dict[str, float] = {}
        for task in (self.proc / str(self.pid) / "task").iterdir():
            stat = _read(task / "stat")
            if stat is None:
                continue  # ended between the listing and the read
            tid = int(task.name)
            name = names.get(tid) or (_read(task / "comm") or "?").strip()
            seconds[f"{name} [{tid}]"] = task_seconds(stat)
        return seconds

    def _processes(self) -> dict[str, float]:
        pids = {f"{name} [{pid}]": pid for name, pid in self.named.items()}
        pids |= {f"mps_server [{pid}]": pid for pid in self._mps_servers()}
        seconds = {}
        for key, pid in pids.items():
            stat = _read(self.proc / str(pid) / "stat")
            if stat is not None:  # else gone, or not visible here
                seconds[key] = task_seconds(stat)
        return seconds

    def _mps_servers(self) -> list[int]:
        """The MPS servers' pids: their command's name, not their comm, which the control
        daemon's shares."""
        found = []
        for entry in self.proc.iterdir():
            if entry.name.isdigit():
                command = (_read(entry / "cmdline") or "").split("\0")[0]
                if os.path.basename(command) == MPS_SERVER:
                    found.append(int(entry.name))
        return found


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:  # gone, or not ours to read
        return None


def _deltas(before: dict[str, float], after: dict[str, float], keep_idle: bool = False) -> dict[str, float]:
    """Each key's seconds in the stretch, the busiest first; keys that used none left out
    unless `keep_idle` (a watched process that idled is news; most threads idle)."""
    used = {key: round(seconds - before.get(key, 0.0), 3) for key, seconds in after.items()}
    return dict(sorted(((k, s) for k, s in used.items() if s > 0 or keep_idle), key=lambda item: -item[1]))


def table(runs: list[dict], step_thread: str = "MainThread") -> list[str]:
    """The markdown table of each run's "cpu_use" entries ({"variant", "round" (optional),
    **CpuUse.result()}): a row per variant's timed steps (a round's); none where no run has any.
    "-" in a process column: none found."""
    rows = []
    for run in runs:
        for use in run.get("cpu_use", []):
            steps = {k: s for k, s in use["threads"].items() if k.startswith(f"{step_thread} [")}
            others = [(k, s) for k, s in use["threads"].items() if k not in steps]
            variant = use["variant"] + (f" [round {use['round'] + 1}]" if "round" in use else "")
            rows.append(["on" if run.get("mps") else "off", variant, f"{use['wall_s']:.1f}",
                         f"{sum(steps.values()):.1f}",
                         ", ".join(f"{k} {s:.1f}" for k, s in others[:3]) or "-",
                         _total(use["processes"], "daemon"), _total(use["processes"], "mps_server"),
                         f"{use['machine']['busy']:.1f}", f"{use['machine']['steal']:.1f}"])
    if not rows:
        return []
    header = ["MPS", "variant", "wall", step_thread, "other threads of this process (busiest 3)",
              "daemon", "MPS server", "all CPUs busy", "steal"]
    return [f"## CPU time while each variant's steps ran (s; {step_thread} runs the steps)", "",
            "| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(str(v) for v in row) + " |" for row in rows)]


def _total(processes: dict[str, float], kind: str) -> str:
    seconds = [s for key, s in processes.items() if key.startswith(kind + " ")]
    return f"{sum(seconds):.1f}" if seconds else "-"
