"""The engramd plugin in bench_lookup.py's process: installed as vLLM installs it, and moved to
another client mode between builds of the model's Engram layers (which no vLLM server does)."""

from __future__ import annotations

import os
from pathlib import Path


def load_plugin(engram, sock: Path, mode: str):
    """vLLM's `load_general_plugins` with the settings the plugin reads (ENGRAMD_SOCKET,
    ENGRAMD_MODE), as worker_gpu.py loads it; returns engramd.client.engines.vllm_engram."""
    os.environ.update(ENGRAMD_SOCKET=str(sock), ENGRAMD_MODE=mode)
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    from engramd.client.engines import vllm_engram

    if engram.Engram._ready_rows is not vllm_engram._ready_rows:
        raise SystemExit("the engramd plugin did not install: engramd must be installed (pip "
                         "install -e ., as setup_device.sh does) for vLLM to see its entry point")
    return vllm_engram


def forget_client(vllm_engram, mode: str | None) -> None:
    """The plugin registers one client per process, in ENGRAMD_MODE's mode, when the first
    Engram layer is built, and a vLLM server keeps it for its life. So that the layers can be
    built again in `mode` (None: to finish), the client is closed and forgotten, and the mode
    set: two private names of vllm_engram, a benchmark's liberty."""
    rows = vllm_engram._process_rows
    if rows is not None:
        rows.close()
        vllm_engram._process_rows = None
    if mode is not None:
        vllm_engram._settings["mode"] = mode
