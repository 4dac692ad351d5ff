"""The engramd plugin in bench_lookup.py's process: installed as vLLM installs it, and given
other settings (ENGRAMD_MODE, ENGRAMD_GATHER_AT, ENGRAMD_CAPTURE) between builds of the model's
Engram layers, which no vLLM server does.

Why in one process, and not a child process per setting (as the --mps modes are run): the plugin
reads its settings at two points only. install() (once per process) replaces vLLM's Engram
methods with functions that are the same for every setting: each decides by its own layer's
ProcessRows (`rows.captured`), never by the settings. process_rows(), when the first Engram
layer is built, registers the client (mode, gather_at) and makes the ProcessRows (capture, the
captured lookup). So closing and forgetting the process's ProcessRows, setting the settings and
building the layers again gives layers that are what a process started with those settings
builds. What stays from an earlier setting is the wrap of vLLM's Worker.execute_model, made on
the first captured build, which this benchmark never calls. A child per setting would import
vLLM and its Engram module again (19 s on the H200), start its own engramd phase or share the
parent's daemon, and need vLLM's reference rows handed over, in each MPS mode: with four
settings about 2.5 minutes more of the next run's 9.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PLUGIN_MODES = ("mapped", "served", "captured")  # --plugin-modes; captured: mapped + ENGRAMD_CAPTURE
GATHER_AT = ("wait", "lookup")  # ENGRAMD_GATHER_AT


@dataclass(frozen=True)
class Setting:
    """One build of the plugin's layers: the plugin's environment, and the variant's name."""

    mode: str  # ENGRAMD_MODE: mapped | served
    gather_at: str = "wait"  # ENGRAMD_GATHER_AT: a mapped client's alone (served and captured ignore it)
    capture: bool = False  # ENGRAMD_CAPTURE=on

    @property
    def name(self) -> str:
        if self.capture:
            return "plugin_captured"
        return f"plugin_{self.mode}" + ("_at_lookup" if self.gather_at == "lookup" else "")

    def environment(self) -> dict[str, str]:
        return {"ENGRAMD_MODE": self.mode, "ENGRAMD_GATHER_AT": self.gather_at,
                "ENGRAMD_CAPTURE": "on" if self.capture else "off"}


def settings(modes: list[str], gather_at: list[str]) -> list[Setting]:
    """The builds of --plugin-modes and --plugin-gather-at: a mapped one per gather_at, then
    served, then captured. The captured one comes last whatever the order given: it is the one
    not yet run on a GPU, and should it fail, the others have their cells."""
    chosen = []
    for mode in PLUGIN_MODES:
        if mode not in modes:
            continue
        if mode == "mapped":
            chosen += [Setting("mapped", at) for at in dict.fromkeys(gather_at)]
        elif mode == "served":
            chosen.append(Setting("served"))
        else:
            chosen.append(Setting("mapped", capture=True))
    return chosen


def load_plugin(engram, sock: Path, first: Setting):
    """vLLM's `load_general_plugins` with the settings the plugin reads (ENGRAMD_SOCKET and
    `first`'s), as worker_gpu.py loads it; returns engramd.client.engines.vllm_engram."""
    os.environ.update(ENGRAMD_SOCKET=str(sock), **first.environment())
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    from engramd.client.engines import vllm_engram

    if engram.Engram._ready_rows is not vllm_engram._ready_rows:
        raise SystemExit("the engramd plugin did not install: engramd must be installed (pip "
                         "install -e ., as setup_device.sh does) for vLLM to see its entry point")
    return vllm_engram


def use(vllm_engram, setting: Setting | None) -> None:
    """The plugin registers one client per process, with the settings it installed with, when
    the first Engram layer is built, and a vLLM server keeps it for its life. So that the layers
    can be built again with `setting` (None: to finish), the client is closed and forgotten, and
    the settings set: two private names of vllm_engram, a benchmark's liberty (the module
    docstring says why this is sound). Layers, graphs and captured lookups of the last setting
    must be gone first: they read the client's memory."""
    rows = vllm_engram._process_rows
    if rows is not None:
        rows.close()
        vllm_engram._process_rows = None
    if setting is not None:
        os.environ.update(setting.environment())  # for whatever reads them later (nothing now)
        vllm_engram._settings.update(mode=setting.mode, gather_at=setting.gather_at,
                                     capture=setting.capture)


def check_built(vllm_engram, setting: Setting):
    """The process's ProcessRows after a build: refuse to time a client other than `setting`
    asked for (another mode granted, or a captured lookup refused: the plugin then logs a
    warning and keeps its eager breaks, which would be timed as plugin_captured)."""
    rows = vllm_engram._process_rows
    client = rows.client
    got = Setting(client.mode, client.gather_at, rows.captured is not None)
    if got != setting:
        raise SystemExit(f"the plugin built {got}, not {setting} (ENGRAMD_CAPTURE=on is a mapped "
                         "GPU client's alone; the plugin's log says why it refused)")
    return rows
