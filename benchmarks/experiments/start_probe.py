"""Start probe: in which order a fresh daemon process should import torch, create its CUDA context
and pin tables already in shared memory (H200).

    python benchmarks/experiments/start_probe.py [--gib 64] [--out DIR]

A file of --gib GiB is filled in /dev/shm once. Then each order runs in a fresh process with
CUDA_MODULE_LOADING=EAGER (as the daemon runs), timing each step from the process's start:
  serial       import torch, torch's CUDA context, then the pin (client/shared/host_pin.py, read-only,
               eight parts after a parallel prefault)
  with-import  the pin on a thread from the start, beside import torch + context
  with-context import torch, then the pin on a thread beside torch's context creation
  pin-N        the pin alone (no torch), in N parts on N threads
Why: a pin holds the process's mmap lock while it walks pages, and an import maps libraries.
Results: DIR/start_probe.json and .md.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ORDERS = ("pin-8", "pin-1", "serial", "with-import", "with-context")  # pin-N: any N

WORKER = textwrap.dedent("""
    import json, mmap, os, sys, threading, time
    t0 = time.monotonic()
    order, path = sys.argv[1], sys.argv[2]
    marks = {}
    def mark(name):
        marks[name] = round(time.monotonic() - t0, 3)
    fd = os.open(path, os.O_RDWR)
    size = os.fstat(fd).st_size
    mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    import ctypes
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    from engramd.client.shared.host_pin import HostRegistration
    pins = []
    def pin(workers=8):
        mark("pin_start")
        pins.append(HostRegistration([(address, size)], read_only=True, workers=workers))
        mark("pin_end")
    def torch_path():
        import torch
        mark("torch_imported")
        torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
        mark("context")
    if order.startswith("pin-"):
        pin(int(order[4:]))
    elif order == "serial":
        torch_path(); pin()
    elif order == "with-import":
        t = threading.Thread(target=pin); t.start(); torch_path(); t.join()
    elif order == "with-context":
        import torch
        mark("torch_imported")
        t = threading.Thread(target=pin); t.start()
        torch.zeros(1, device="cuda"); torch.cuda.synchronize(); mark("context"); t.join()
    mark("done")
    marks["gb_s_pin"] = round(size / 1e9 / max(1e-9, marks["pin_end"] - marks["pin_start"]), 2)
    started = time.monotonic()
    pins[0].close()
    marks["unpin_s"] = round(time.monotonic() - started, 3)
    print(json.dumps({"order": order, **marks}))
""")


def fill(path: Path, nbytes: int) -> float:
    started = time.monotonic()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        chunk = bytes(range(256)) * (64 << 12)  # 64 MiB, non-zero
        for offset in range(0, nbytes, len(chunk)):
            os.pwrite(fd, chunk[: nbytes - offset], offset)
    finally:
        os.close(fd)
    return time.monotonic() - started


def run_order(order: str, path: Path) -> dict:
    env = {**os.environ, "CUDA_MODULE_LOADING": "EAGER"}
    out = subprocess.run([sys.executable, "-c", WORKER, order, str(path)], env=env,
                         capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        return {"order": order, "error": out.stderr[-2000:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def markdown(report: dict) -> str:
    cols = ("torch_imported", "context", "pin_start", "pin_end", "done", "gb_s_pin", "unpin_s")
    lines = [f"# Start orders, {report['gib']} GiB in /dev/shm, fresh processes (EAGER)", "",
             f"Command: `{report['command']}`. Seconds after the process started; filled at "
             f"{report['fill_gb_s']} GB/s.", "",
             "| order | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for row in report["orders"]:
        cells = [str(row.get(c, "")) for c in cols]
        if "error" in row:
            cells[-1] = "failed: " + row["error"].strip().splitlines()[-1][:80]
        lines.append(f"| {row['order']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=64.0)
    parser.add_argument("--out", default="start_probe")
    parser.add_argument("--orders", default=",".join(ORDERS), help="comma separated")
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    nbytes = int(args.gib * 2**30) // mmap.PAGESIZE * mmap.PAGESIZE
    path = Path("/dev/shm") / f"engramd-start-probe-{os.getpid()}"
    try:
        fill_s = fill(path, nbytes)
        rows = []
        for order in args.orders.split(",") * args.repeat:
            rows.append(run_order(order, path))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        path.unlink(missing_ok=True)
    report = {"gib": args.gib, "command": f"python benchmarks/experiments/start_probe.py --gib {args.gib:g} "
                                          f"--orders {args.orders} --repeat {args.repeat}",
              "fill_gb_s": round(nbytes / 1e9 / fill_s, 2), "orders": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "start_probe.json").write_text(json.dumps(report, indent=1))
    (out / "start_probe.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
