"""Wall time of `engramd health` against an idle daemon (CPU backend, demo tables).

    python benchmarks/health_probe.py [--runs 20] [--out benchmarks/results]

The target is under 0.5 s: Kubernetes probes and Docker's HEALTHCHECK run it with a timeout of
their own, so its start-up (no torch, no numpy: tests/reliability/test_hostile.py) is the cost.
Each run is a fresh process, as a probe's is.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common.daemon import bench_folders, running_daemon  # noqa: E402
from common.report import run_header  # noqa: E402
from common.tables import cpu_demo_flags  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    took = []
    with bench_folders() as (work, shm), running_daemon(work, cpu_demo_flags(work, shm)) as socket:
        for _ in range(args.runs):
            start = time.perf_counter()
            probe = subprocess.run(["engramd", "health", "--socket", str(socket)], capture_output=True, text=True)
            took.append(time.perf_counter() - start)
            if probe.returncode != 0:
                raise SystemExit(f"engramd health exited {probe.returncode}: {probe.stdout}{probe.stderr}")
    result = {**run_header(), "runs": args.runs, "p50_s": round(float(np.percentile(took, 50)), 3),
              "max_s": round(max(took), 3)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "health_probe.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"engramd health: p50 {result['p50_s']} s, max {result['max_s']} s over {args.runs} runs")


if __name__ == "__main__":
    main()
