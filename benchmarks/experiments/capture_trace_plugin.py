"""A pytest plugin for the GPU tests: what one test leaves behind that could spoil a later test's
capture in CUDA's default (global) mode. Load it with `-p capture_trace_plugin` (this folder on
PYTHONPATH). At each test's start and end it prints, on stderr with the wall clock (the clock of
torch's warnings), the main thread's capture interaction mode, whether the current stream
captures, and the threads alive; every cycle collection is printed with its thread.

CAPTURE_TRACE_COLLECT=1: at each test's end, a cycle collection and a device synchronize, so
what the test left for the collector goes before the next test starts."""

from __future__ import annotations

import gc
import os
import sys
import threading
import time


def _now() -> str:
    return time.strftime("%H:%M:%S") + f".{int(time.time() * 1e6) % 1000000:06d}"


def _say(what: str) -> None:
    print(f"[capture-trace {_now()} {threading.current_thread().name}] {what}", file=sys.stderr, flush=True)


def _state() -> str:
    import torch
    from capture_state import capture_status, thread_capture_mode  # this folder, on PYTHONPATH

    if not torch.cuda.is_available():
        return "no CUDA device"
    threads = ", ".join(sorted(t.name for t in threading.enumerate()))
    return (f"main mode {thread_capture_mode()}; current stream "
            f"{capture_status(torch.cuda.current_stream())}; threads: {threads}")


def _on_collection(phase: str, info: dict) -> None:
    _say(f"gc {phase} gen {info['generation']}" + (f" collected {info.get('collected')}" if phase == "stop" else ""))


def pytest_configure(config) -> None:
    gc.callbacks.append(_on_collection)


def pytest_runtest_setup(item) -> None:
    _say(f"setup {item.name}: {_state()}")


def pytest_runtest_teardown(item, nextitem) -> None:
    _say(f"teardown {item.name}: {_state()}")


def pytest_runtest_logfinish(nodeid, location) -> None:
    if os.environ.get("CAPTURE_TRACE_COLLECT") == "1":
        import torch

        _say(f"collecting after {nodeid.rsplit('::', 1)[-1]}")
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        _say(f"collected: {_state()}")
