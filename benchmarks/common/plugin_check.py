"""The checks both engines' GPU recipes make once the engine's tree and engramd are installed
(benchmarks/<engine>_gpu/check_imports.py): the plugin accepts the engine's version and its
Engram module's seams, its entry point is registered, and which stand-ins of stubs.py loaded."""

from __future__ import annotations

import importlib.metadata as md
import sys
import time
import types


def check_plugin(plugin: types.ModuleType, version: str, engram: types.ModuleType, group: str,
                 stubs: types.ModuleType, started: float, imported: str) -> None:
    """`imported`: what the recipe imported, named in the line printed once all passed."""
    plugin.check_version(version)
    plugin.check_seams(engram)
    plugins = [e.name for e in md.entry_points(group=group)]
    assert "engramd" in plugins, f"engramd's entry point is not registered: {plugins}"
    stood = sorted(n for n, m in list(sys.modules.items()) if stubs.is_stand_in(m))
    print(f"{imported} and the engramd plugin import ({time.monotonic() - started:.1f} s); "
          f"stand-ins loaded: {', '.join(stood) or 'none'}")
