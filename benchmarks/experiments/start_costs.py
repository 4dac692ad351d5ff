"""What a daemon's start pays for torch on a GPU machine: its import, then its CUDA start.

    CUDA_MODULE_LOADING=EAGER python benchmarks/experiments/start_costs.py --order plain
    CUDA_MODULE_LOADING=LAZY  python benchmarks/experiments/start_costs.py --order context-first

One fresh process per run (the costs are the first ones a process pays), one JSON line out:

  plain          import torch -> torch's CUDA start (torch.cuda.init, a first allocation, a first
                 kernel, synchronize)
  context-first  cudaSetDevice through cuda-python first (what the daemon's table preload does
                 before torch is imported: it pins the tables), then the same

Seconds after the process's own start: `context` (context-first only), `torch_imported`,
`torch_cuda` (its CUDA start done). Comparing EAGER with LAZY in both orders says where the
eager loading of torch's kernels lands (in the import, if the runtime already runs when torch's
libraries register their kernels; in its CUDA start otherwise) and what it costs.

What it is not: the daemon (benchmarks/mapped_attach.py times a real restart, with its log's
marks); tables and pinning are left out here on purpose.
"""

from __future__ import annotations

import argparse
import json
import os
import time

STARTED = time.perf_counter()


def since_start() -> float:
    return round(time.perf_counter() - STARTED, 3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--order", choices=("plain", "context-first"), default="plain")
    args = parser.parse_args()
    marks: dict[str, float] = {}
    if args.order == "context-first":
        from engramd.client.shared.cuda import make_current

        make_current(0)
        marks["context"] = since_start()
    import torch

    marks["torch_imported"] = since_start()
    torch.cuda.init()
    x = torch.ones(1024, device="cuda")
    x.add_(1)
    torch.cuda.synchronize()
    marks["torch_cuda"] = since_start()
    marks["torch_cuda_s"] = round(marks["torch_cuda"] - marks["torch_imported"], 3)
    print(json.dumps({"loading": os.environ.get("CUDA_MODULE_LOADING", "(default)"),
                      "order": args.order, **marks}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
