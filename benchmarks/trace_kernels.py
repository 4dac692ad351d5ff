"""The device operations of a profiled cell's Chrome trace, in order of start: stream, start (us
from the first one), length, name. For a pipelined trace (common/cell_profile.py's first pass),
where one step's kernels run beside the next one's, which the synchronised timeline cannot show.

    python benchmarks/trace_kernels.py OUT/profile/plugin_captured_T16_lead1.trace.json.gz --count 30
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common.cell_profile import device_operations, read_trace


def table(operations: list[dict]) -> str:
    if not operations:
        return "no device operations\n"
    first = operations[0]["ts"]
    lines = [f"{'stream':>7} {'start':>9} {'dur':>7}  name"]
    for op in operations:
        stream = op.get("args", {}).get("stream", op.get("tid"))
        lines.append(f"{stream!s:>7} {op['ts'] - first:9.1f} {op['dur']:7.1f}  {op['name'][:90]}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path, help="a .trace.json.gz (or .json)")
    parser.add_argument("--count", type=int, default=40, help="the first this many operations")
    args = parser.parse_args()
    print(table(device_operations(read_trace(args.trace))[:args.count]), end="")


if __name__ == "__main__":
    main()
