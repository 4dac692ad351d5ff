"""Python calls and host time of SlotGather's direct launch (kernels/gather_triton.py), this
tree's against another's, on the CPU.

Both copies of the module run under Triton's interpreter, so the plan builds over CPU tables;
a recording stand-in takes the compiled kernel's place (the interpreter compiles nothing), so
what is counted is the Python work of a launch up to the kernel's launcher, which is the same
C code in both. One checked launch first (the one that keeps the kernel), then CALLS direct
ones of 16 tokens under cProfile (calls per launch), then the best of five unprofiled runs.

    git show REV:kernels/gather_triton.py > /tmp/gather_base.py
    TRITON_INTERPRET=1 python benchmarks/experiments/direct_launch_calls.py --base /tmp/gather_base.py
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from reference import (  # noqa: E402
    StandInKernel,
    exec_fresh,
    launch_then_keep,
    small_geometry,
    triton_interpreter,
)

CALLS = 2000
TOKENS = 16


def measure(name: str, origin: Path) -> tuple[float, float]:
    """(Python calls, us) per direct launch of the module at `origin`."""
    with triton_interpreter():
        module = exec_fresh(name, str(origin))
    geometry = small_geometry()
    shard = geometry.shard(0, 1)
    generator = torch.Generator().manual_seed(1)
    tables = [torch.randint(0, 256, (rows, geometry.row_bytes), dtype=torch.uint8, generator=generator)
              for rows in geometry.rows]
    plan = module.GatherPlan(tables, shard)
    module.GatherPlan._launch = launch_then_keep(module, StandInKernel())  # one that does nothing
    gather = module.SlotGather(plan, torch.zeros(1, dtype=torch.int64), None, num_programs=4)
    gather._direct = True  # as on a GPU
    ids = torch.stack([torch.randint(0, rows, (TOKENS, geometry.heads), generator=generator)
                       for rows in geometry.rows], dim=1)
    out = torch.empty(plan.output_shape(TOKENS), dtype=torch.bfloat16)
    stream = SimpleNamespace(cuda_stream=1)
    gather(ids, out, stream)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(CALLS):
        gather(ids, out, stream)
    profile.disable()
    best = float("inf")
    for _ in range(5):
        begun = time.perf_counter()
        for _ in range(CALLS):
            gather(ids, out, stream)
        best = min(best, (time.perf_counter() - begun) / CALLS * 1e6)
    return pstats.Stats(profile).total_calls / CALLS, best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True, help="the other tree's gather_triton.py")
    args = parser.parse_args(argv)
    for name, origin in (("base", args.base), ("this tree", ROOT / "kernels" / "gather_triton.py")):
        calls, us = measure(f"direct_launch_{name.replace(' ', '_')}", origin)
        print(f"{name}: {calls:.1f} Python calls a direct launch, {us:.2f} us (best of 5 x {CALLS})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
