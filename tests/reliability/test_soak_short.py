"""A short run of benchmarks/soak.py for CI: client processes against one daemon, rows verified.

The full soak (benchmarks/soak.py, 10 minutes, results in benchmarks/results/soak.md) is the
real test; this one runs the same code for a few seconds on the demo tables, so that the script
keeps working and a gross leak or a wrong row shows on every change.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_script(name: str):
    """benchmarks/<name>.py as a module (engramd_<name>), as its tests import it."""
    spec = importlib.util.spec_from_file_location(f"engramd_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_short_soak_verifies_every_row_and_leaks_nothing(demo_checkpoint, tmp_path):
    soak = load_script("soak")
    summary = soak.run(soak.SoakConfig(seconds=8, clients=4, tables=str(demo_checkpoint),
                                       sample_s=1.0, heartbeat_s=0.2, workdir=str(tmp_path)))
    failed = [name for name, ok in summary["checks"].items() if not ok]
    assert not failed, (failed, summary["wrong"], summary["errors"], summary["fds"],
                        summary["rss_anon_kib"])
    assert summary["wrong_rows"] == 0 and summary["lookups"] > 0
    assert summary["registrations"] >= 4 and summary["rows_verified"] > 0
