"""Test hooks for a daemon a test starts with this folder on PYTHONPATH (Python imports
`sitecustomize` at start-up; helpers.GatherGate sets the environment). Not part of engramd: a
hook changes no result, it only makes a moment the test must observe last until the test lets
it go, so that the test waits on that, not on a sleep.

    ENGRAMD_TEST_GATHER_GATE=PATH   the CPU backend's lookup gathers wait until PATH exists
                                    (the start-up self-check's gather does not)
    ENGRAMD_TEST_SETTLE_GATE=PATH   a stopping daemon's backend reports its gathers unfinished
                                    (gathers_done) until PATH exists, as a GPU's running
                                    gathers keep a drain waiting
"""

from __future__ import annotations

import os
import time

GATE_ENV = "ENGRAMD_TEST_GATHER_GATE"
SETTLE_GATE_ENV = "ENGRAMD_TEST_SETTLE_GATE"
# A test that never opens the gate fails on its own waits; the daemon then goes on, so that
# stopping it does not wait this long.
GATE_LIMIT_S = 120.0


def _hold_gathers(gate: str) -> None:
    from engramd.server.cpu_backend import CpuBackend

    run_piece = CpuBackend._run_piece

    def held(self, lookup, start, stop):
        deadline = time.monotonic() + GATE_LIMIT_S
        while not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.01)
        run_piece(self, lookup, start, stop)

    CpuBackend._run_piece = held


def _hold_settling(gate: str) -> None:
    from engramd.server.cpu_backend import CpuBackend

    def gathers_done(self):
        return lambda: os.path.exists(gate)

    CpuBackend.gathers_done = gathers_done


if os.environ.get(GATE_ENV):
    _hold_gathers(os.environ[GATE_ENV])
if os.environ.get(SETTLE_GATE_ENV):
    _hold_settling(os.environ[SETTLE_GATE_ENV])
