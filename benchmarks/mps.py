"""A private NVIDIA MPS server for a benchmark, and the --mps flag the GPU benchmarks share.

Without MPS, kernels of different processes time-slice one GPU: a gather
the daemon launches waits for the client's matmuls instead of running beside them. With MPS the
processes' kernels share the GPU at once. `private_mps(folder)` starts a control daemon with pipe
and log folders of its own for the length of a `with` block, so it neither finds nor disturbs any
other MPS on the machine; every CUDA process started inside the block (the engramd daemon, client
processes, a child benchmark) inherits CUDA_MPS_PIPE_DIRECTORY and becomes a client of the one
MPS server that daemon starts on first use.

CUDA reads those variables when a process creates its context, so the process that enters
private_mps must not have used CUDA before, and had better not use it inside either: `quit` only
completes once the server's clients are gone. The benchmarks therefore run each mode in a fresh
child process: run_children() re-executes the script with `--mps on|off --mps-child` (MPS started
around the `on` child, by a parent that never touches CUDA), and the parent merges the JSON each
child wrote.

    parser = argparse.ArgumentParser(); mps_argument(parser); args = parser.parse_args()
    if needs_children(args):            # --mps on / both, in the parent
        for child in run_children(Path(__file__), mps_modes(args), Path(args.out)): ...
    else:                               # --mps off, or a child: measure here
        meta.update(require_mps_state(args.mps == "on"))
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONTROL = "nvidia-cuda-mps-control"
CHOICES = ("off", "on", "both")
START_S = 15.0  # for `-d` to return and the control pipe to appear
STOP_S = 30.0  # for `quit` to be taken and the control daemon to exit
LOG_LINES = 12
NVIDIA_DEFAULT_PIPE = Path("/tmp/nvidia-mps")  # where clients look when the variable is unset


class MpsError(RuntimeError):
    """The MPS control daemon could not be started (the message names the folder and its log)."""


@dataclass(frozen=True)
class MpsDaemon:
    """The folders of one private MPS control daemon."""

    folder: Path

    @property
    def pipe(self) -> Path:
        return self.folder / "pipe"

    @property
    def log(self) -> Path:
        return self.folder / "log"

    @property
    def control_pipe(self) -> Path:
        return self.pipe / "control"

    def env(self) -> dict[str, str]:
        return {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe), "CUDA_MPS_LOG_DIRECTORY": str(self.log)}

    def log_tail(self, lines: int = LOG_LINES) -> str:
        """The last lines of the control daemon's and the server's logs (empty if none yet)."""
        parts = []
        for name in ("control.log", "server.log"):
            path = self.log / name
            if path.exists():
                text = path.read_text(errors="replace").splitlines()[-lines:]
                parts.append(f"--- {name}\n" + "\n".join(text))
        return "\n".join(parts)

    def control_pid(self) -> int | None:
        try:
            return int((self.pipe / "nvidia-cuda-mps-control.pid").read_text().strip())
        except (OSError, ValueError):
            return None


@contextmanager
def private_mps(folder: Path, start_timeout: float = START_S,
                stop_timeout: float = STOP_S) -> Iterator[MpsDaemon]:
    """Run an MPS control daemon with pipe and log folders under `folder` inside the block.

    os.environ carries CUDA_MPS_PIPE_DIRECTORY / CUDA_MPS_LOG_DIRECTORY inside the block (so child
    processes inherit them) and gets its previous values back afterwards. On the way out the
    daemon is told to `quit`, and waited for, both within `stop_timeout`.
    """
    daemon = MpsDaemon(Path(folder))
    variables = daemon.env()
    for path in variables.values():
        Path(path).mkdir(parents=True, exist_ok=True)
    previous = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        try:
            _start(daemon, start_timeout)
        except BaseException:
            _stop(daemon, stop_timeout)  # `-d` may have left a daemon that never answered
            raise
        try:
            yield daemon
        finally:
            _stop(daemon, stop_timeout)
    finally:
        _restore(previous)


def _start(daemon: MpsDaemon, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    output = daemon.log / "start.out"
    try:
        # `-d` forks the control daemon into the background and returns. Its output goes to a
        # file, not a pipe: a background daemon holding the pipe open would keep run() waiting.
        with open(output, "wb") as sink:
            done = subprocess.run([CONTROL, "-d"], stdin=subprocess.DEVNULL, stdout=sink,
                                  stderr=subprocess.STDOUT, timeout=timeout)
    except FileNotFoundError:
        raise MpsError(f"{CONTROL} is not on PATH: MPS needs the NVIDIA driver's tools") from None
    except subprocess.TimeoutExpired:
        raise MpsError(f"`{CONTROL} -d` did not return within {timeout:.0f} s "
                       f"(folder {daemon.folder})\n{daemon.log_tail()}") from None
    if done.returncode != 0:
        raise MpsError(f"`{CONTROL} -d` exited with {done.returncode} (folder {daemon.folder}): "
                       f"{output.read_text(errors='replace').strip()}\n{daemon.log_tail()}")
    while not daemon.control_pipe.exists():
        if time.monotonic() > deadline:
            raise MpsError(f"the MPS control daemon made no {daemon.control_pipe} within "
                           f"{timeout:.0f} s; its log ({daemon.log}):\n{daemon.log_tail()}")
        time.sleep(0.05)


def _stop(daemon: MpsDaemon, timeout: float) -> None:
    """`echo quit | nvidia-cuda-mps-control`, then wait for the control daemon to exit.

    Warns rather than raises: the block's own exception, if any, is the one worth seeing.
    """
    if not daemon.control_pipe.exists():
        return  # nothing listens: `-d` failed before making its pipe
    deadline = time.monotonic() + timeout
    pid = daemon.control_pid()
    try:
        with open(daemon.log / "quit.out", "wb") as sink:
            subprocess.run([CONTROL], input=b"quit\n", stdout=sink, stderr=subprocess.STDOUT,
                           timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        _warn(f"`echo quit | {CONTROL}` failed ({exc}); folder {daemon.folder}\n{daemon.log_tail()}")
        return
    while pid is not None and _alive(pid):
        if time.monotonic() > deadline:
            _warn(f"MPS control daemon (pid {pid}) still runs {timeout:.0f} s after quit: are "
                  f"CUDA processes of this run still alive? folder {daemon.folder}\n"
                  f"{daemon.log_tail()}")
            return
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _restore(previous: dict[str, str | None]) -> None:
    for name, value in previous.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _warn(message: str) -> None:
    print(f"mps: {message}", file=sys.stderr, flush=True)


@contextmanager
def temporary_mps() -> Iterator[MpsDaemon]:
    """private_mps in a fresh temporary folder, removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="engramd-mps-"))
    try:
        with private_mps(folder) as daemon:
            yield daemon
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# -- the flag and the child processes ------------------------------------------------------------


def mps_argument(parser: argparse.ArgumentParser) -> None:
    """--mps {off,on,both} (default off), and the hidden --mps-child that run_children passes."""
    parser.add_argument("--mps", choices=CHOICES, default="off",
                        help="run without MPS, under a private MPS server (a fresh child process), "
                             "or both in turn (a child each, results merged)")
    parser.add_argument("--mps-child", action="store_true", help=argparse.SUPPRESS)


def mps_modes(args: argparse.Namespace) -> list[bool]:
    """The MPS settings to run, in order: off before on, so a lingering server cannot touch off."""
    return {"off": [False], "on": [True], "both": [False, True]}[args.mps]


def mode_key(on: bool) -> str:
    return "mps_on" if on else "mps_off"


def needs_children(args: argparse.Namespace) -> bool:
    """True in a parent asked for MPS: it must start the server and measure in child processes."""
    return not args.mps_child and args.mps != "off"


@dataclass(frozen=True)
class ChildRun:
    key: str  # mode_key
    mps: bool
    out: Path  # the --out the child wrote to
    returncode: int
    mps_log: str  # tail of the MPS logs, read before the server stopped ("" without MPS)


def run_children(script: Path, modes: Sequence[bool], out: Path,
                 argv: Sequence[str] | None = None) -> list[ChildRun]:
    """Run `script` once per mode in a fresh process: the same arguments plus `--mps on|off
    --mps-child --out DIR` (later flags win in argparse), a private MPS around the `on` one.

    With one mode the child writes to `out` itself; with several, to out/mps_off, out/mps_on.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    runs = []
    for on in modes:
        key = mode_key(on)
        folder = out if len(modes) == 1 else out / key
        command = [sys.executable, str(script), *argv, "--mps", "on" if on else "off",
                   "--mps-child", "--out", str(folder)]
        try:
            with temporary_mps() if on else nullcontext() as daemon:
                print(f"[{key}] {shlex.join(command)}", flush=True)
                returncode = subprocess.run(command).returncode
                log = daemon.log_tail() if daemon is not None else ""
        except MpsError as exc:  # the other modes still run; the caller sees the failure
            returncode, log = 1, str(exc)
            _warn(f"[{key}] not run: {exc}")
        print(f"[{key}] exited with {returncode}", flush=True)
        runs.append(ChildRun(key, on, folder, returncode, log))
    return runs


def child_reports(children: Sequence[ChildRun], name: str) -> list[tuple[ChildRun, dict]]:
    """The JSON report `name` each child wrote into its --out, with the child; a child that
    wrote none is said on stdout and left out (its exit status tells the caller why)."""
    reports = []
    for child in children:
        path = child.out / name
        if path.exists():
            reports.append((child, json.loads(path.read_text())))
        else:
            print(f"[{child.key}] wrote no {path} (exit {child.returncode})", flush=True)
    return reports


def mps_state(requested: bool) -> dict[str, Any]:
    """What the calling process runs under, for a benchmark's metadata (call it where CUDA is used:
    it initialises the driver, which reads CUDA_MPS_PIPE_DIRECTORY then).

    `mps` is CUDA's own answer where the driver gives one (cuda_mps_enabled), else whether a
    control pipe is where CUDA would look; `mps_server` says whose server it is.
    """
    variable = os.environ.get("CUDA_MPS_PIPE_DIRECTORY")
    pipe = Path(variable) if variable else NVIDIA_DEFAULT_PIPE
    enabled = cuda_mps_enabled()
    active = enabled if enabled is not None else (pipe / "control").exists()
    if requested:
        server = "private MPS control daemon of this run" if active and variable else \
            "requested, but CUDA does not see an MPS server (not started by run_children?)"
    else:
        server = "none" if not active else f"an MPS server already running on the machine ({pipe})"
    return {"mps": active, "mps_requested": requested, "mps_server": server,
            "cuda_mps_enabled": enabled}


def require_mps_state(requested: bool) -> dict[str, Any]:
    """mps_state, refusing a run whose MPS state is not the one asked for (it would be mislabeled);
    an MPS server found without asking is reported on stderr, and the results say so."""
    state = mps_state(requested)
    if requested and not state["mps"]:
        raise SystemExit(f"mps: {state['mps_server']}")
    if not requested and state["mps"]:
        _warn(f"measuring 'without MPS' under {state['mps_server']}")
    return state


def cuda_mps_enabled(device_index: int = 0) -> bool | None:
    """CU_DEVICE_ATTRIBUTE_MPS_ENABLED for this process (contexts on the device go through MPS);
    None where cuda-python or the attribute is missing. Needs no context, only cuInit."""
    try:
        from cuda.bindings import driver as cu
    except ImportError:
        return None
    attribute = getattr(cu.CUdevice_attribute, "CU_DEVICE_ATTRIBUTE_MPS_ENABLED", None)
    if attribute is None:
        return None
    ok = cu.CUresult.CUDA_SUCCESS
    try:
        if cu.cuInit(0)[0] != ok:
            return None
        err, device = cu.cuDeviceGet(device_index)
        if err != ok:
            return None
        err, value = cu.cuDeviceGetAttribute(attribute, device)
    except Exception:  # no driver library at all (a CPU machine): no answer, not a failure
        return None
    return bool(value) if err == ok else None


def gpu_processes(timeout: float = 10.0) -> list[str] | None:
    """Names of the GPU's compute processes as nvidia-smi lists them (None where it cannot).

    Under MPS the GPU runs `nvidia-cuda-mps-server` instead of the client processes themselves:
    evidence, in the results, of which mode a run was in. Some sandboxes list nothing.
    """
    try:
        done = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    names = []
    for line in done.stdout.splitlines():
        if "," in line:
            names.append(Path(line.split(",", 1)[1].strip()).name)
    return names
