"""The engramd plugin in bench_lookup.py's process: installed as SGLang installs it, and moved to
another client mode between builds of the model's Engram layers (which no SGLang server does)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path


def load_plugin(engram, sock: Path, mode: str):
    """SGLang's `load_plugins` with the settings the plugin reads (ENGRAMD_SOCKET,
    ENGRAMD_MODE), as worker_gpu.py loads it; returns engramd.client.engines.sglang_engram."""
    os.environ.update(ENGRAMD_SOCKET=str(sock), ENGRAMD_MODE=mode)
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from engramd.client.engines import sglang_engram

    if engram.EngramEmbedding._owned_rows is not sglang_engram._owned_rows:
        raise SystemExit("the engramd plugin did not install: engramd must be installed (pip "
                         "install -e ., as setup_device.sh does) for SGLang to see its entry point")
    return sglang_engram


def forget_client(sglang_engram, mode: str | None) -> None:
    """The plugin registers one client per process, in ENGRAMD_MODE's mode, when the first
    Engram layer is built, and an SGLang worker keeps it for its life. So that the layers can be
    built again in `mode` (None: to finish), the client is closed and forgotten, and the mode
    set: two private names of sglang_engram, a benchmark's liberty. Without a client the wrapped
    EngramHasher.forward submits nothing."""
    daemon = sglang_engram._process_client
    if daemon is not None:
        daemon.close()
        sglang_engram._process_client = None
    if mode is not None:
        sglang_engram._settings = dataclasses.replace(sglang_engram._settings, mode=mode)


def took_the_step_lookup(sglang_engram) -> bool:
    """Whether the last step's layers read the rows of the one lookup the wrapped hasher
    submitted (rather than a lookup per layer)."""
    daemon = sglang_engram._process_client
    return daemon is not None and daemon.step is not None and daemon.step.rows is not None
