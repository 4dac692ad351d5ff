"""THP probe: pinning a /dev/shm table whose pages are 2 MiB folios, mapped by PMDs.

    python benchmarks/experiments/thp_probe.py [--gib 16] [--workers 8] [--out DIR]

On hugetlbfs a table pins at ~40-48 GB/s against 12-25 GB/s on /dev/shm (4 KiB pages), but
hugetlbfs needs a page pool set aside by root. tmpfs can hold 2 MiB folios too, and
MADV_COLLAPSE (Linux >= 6.1) makes them from a range's pages whatever the THP sysfs settings
(`shmem_enabled` may say never); the collapsed folios stay in the file for every later mapping,
and another process's MADV_COLLAPSE of a range already made of them only maps them by PMDs. The
mapping must lie 2 MiB aligned (as file offset 0), which Python's mmap does not do, so the probe
maps with mmap(2) at an aligned address (client/shared/huge_pages.py). Every case runs in a fresh process:

  setup      a --gib file in /dev/shm, filled by pwrite (64 MiB chunks)
  pin_4k     Python's mmap, then HostRegistration read-only (8 parts after a prefault, as the
             tables were pinned before client/shared/huge_pages.py)
  collapse   a HugeView with collapse_workers (as the daemon's pin collapses a table): an
             aligned mapping, MADV_COLLAPSE in --workers threads over 2 MiB aligned parts:
             seconds, GB/s, the ShmemHugePages gained, bytes not collapsed
  pin_pmd    HostRegistration.of_files (as mapped clients and a standby pin): a HugeView (an
             aligned mapping, whose faults map the folios by PMDs) and the same registration
  held_4k / held_pmd
             pin_4k / pin_pmd while a holder process keeps the file registered (a mapped client
             joining a daemon that pinned it)

Each pin is checked: the first and last 4 KiB copied through the device from the registered
address, compared with the file. Prints a JSON line per case; writes DIR/thp_probe.json and .md.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common
from common.report import machine, write_report  # noqa: E402

CHUNK = 64 << 20
_KEEP: list = []  # mappings that live as long as the process


def python_map(fd: int, size: int) -> int:
    """`fd` mapped read-only by Python's mmap, as the tables were pinned before HugeView."""
    mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    _KEEP.append(mapping)
    return np.frombuffer(mapping, dtype=np.uint8).ctypes.data


def meminfo(key: str) -> int:
    return int(re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M)[1]) << 10


def pmd_mapped(address: int) -> int:
    """ShmemPmdMapped bytes of this process's mapping that starts at `address`."""
    for block in Path("/proc/self/smaps").read_text().split("\n" + format(address, "x") + "-")[1:2]:
        return int(re.search(r"ShmemPmdMapped:\s+(\d+) kB", block)[1]) << 10
    return 0


def check_pin(address: int, path: str, size: int) -> bool:
    """The first and last 4 KiB read through the device from `address` equal the file's."""
    from cuda.bindings import runtime as rt

    ok = True
    fd = os.open(path, os.O_RDONLY)
    for offset in (0, size - 4096):
        device = rt.cudaMalloc(4096)[1]
        host = ctypes.create_string_buffer(4096)
        rt.cudaMemcpy(device, address + offset, 4096, rt.cudaMemcpyKind.cudaMemcpyDefault)
        rt.cudaMemcpy(ctypes.addressof(host), device, 4096, rt.cudaMemcpyKind.cudaMemcpyDefault)
        rt.cudaFree(device)
        ok &= host.raw == os.pread(fd, 4096, offset)
    os.close(fd)
    return ok


def register(case: str, fd: int, size: int, workers: int):
    """The pin of `case`: through Python's mapping (4 KiB) or HostRegistration.of_files."""
    from engramd.client.shared.host_pin import HostRegistration

    if case.endswith("pmd"):
        return HostRegistration.of_files([(fd, 0, size)], read_only=True, workers=workers)
    return HostRegistration([(python_map(fd, size), size)], read_only=True, workers=workers)


def run_case(case: str, path: str, size: int, workers: int) -> dict:
    """One case in this (fresh) process."""
    from cuda.bindings import runtime as rt

    from engramd.client.shared.huge_pages import HugeView

    rt.cudaFree(0)
    result: dict = {"case": case}
    fd = os.open(path, os.O_RDONLY)
    if case == "collapse":
        before = meminfo("ShmemHugePages")
        started = time.perf_counter()
        view = HugeView(fd, collapse_workers=workers)
        view.close()
        result["not_collapsed_gib"] = round(view.collapsed_short / 2**30, 2)
        result["seconds"] = round(time.perf_counter() - started, 3)
        result["gbps"] = round(size / 1e9 / result["seconds"], 2)
        result["huge_gained_gib"] = round((meminfo("ShmemHugePages") - before) / 2**30, 2)
        return result
    started = time.perf_counter()
    registration = register(case, fd, size, workers)
    result["pin_s"] = round(time.perf_counter() - started, 3)
    result["pin_gbps"] = round(size / 1e9 / result["pin_s"], 2)
    address = registration.addresses[0]
    result["pmd_mapped_gib"] = round(pmd_mapped(address) / 2**30, 2)
    result["rows_ok"] = check_pin(address, path, size)
    started = time.perf_counter()
    registration.close()
    result["unpin_s"] = round(time.perf_counter() - started, 3)
    return result


def hold(path: str, size: int, workers: int, pmd: bool) -> None:
    """A holder: the file registered (as pin_pmd or pin_4k do), until stdin closes."""
    from cuda.bindings import runtime as rt

    rt.cudaFree(0)
    registration = register("held_pmd" if pmd else "held_4k", os.open(path, os.O_RDONLY), size, workers)
    print("held", flush=True)
    sys.stdin.read()
    registration.close()


def fresh(args: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True, **kw)


def measure(args: argparse.Namespace) -> dict:
    size = int(args.gib * 2**30) // CHUNK * CHUNK
    fd, path = tempfile.mkstemp(prefix="engramd-thp-probe-", dir="/dev/shm")
    report = {"meta": {"benchmark": "thp_probe", "gib": args.gib, "workers": args.workers,
                       "kernel": platform.release(), "machine": machine(),
                       "shmem_enabled": Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text().strip(),
                       "date": time.strftime("%Y-%m-%d %H:%M"),
                       "command": "python benchmarks/experiments/thp_probe.py " + " ".join(sys.argv[1:])},
              "cases": []}
    try:
        os.ftruncate(fd, size)
        started = time.perf_counter()
        words = np.arange(CHUNK // 8, dtype="<u8")
        for offset in range(0, size, CHUNK):
            os.pwrite(fd, (words + offset).tobytes(), offset)  # every word tells its place
        report["meta"]["fill_s"] = round(time.perf_counter() - started, 1)
        common = ["--path", path, "--size", str(size), "--workers", str(args.workers)]
        for case in ("pin_4k", "collapse", "pin_pmd", "held_4k", "held_pmd"):
            holder = None
            if case.startswith("held"):
                holder = fresh(["--hold", *(["--pmd"] if case.endswith("pmd") else []), *common],
                               stdin=subprocess.PIPE)
                assert holder.stdout.readline().strip() == "held"
            try:
                out = fresh(["--case", case, *common]).communicate(timeout=600)[0]
            finally:
                if holder is not None:
                    holder.stdin.close()
                    holder.wait(120)
            row = json.loads(out.strip().splitlines()[-1])
            report["cases"].append(row)
            print(json.dumps(row), flush=True)
    finally:
        os.close(fd)
        os.unlink(path)
    return report


def markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [f"# THP probe ({meta['date']})", "",
             f"{meta['gib']} GiB in /dev/shm (filled in {meta['fill_s']} s), kernel {meta['kernel']}, "
             f"shmem_enabled `{meta['shmem_enabled']}`, {meta['workers']} workers. Command: "
             f"`{meta['command']}`.", "", "| case | result |", "|---|---|"]
    for row in report["cases"]:
        lines.append(f"| {row['case']} | " + ", ".join(f"{k} {v}" for k, v in row.items() if k != "case") + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=16.0)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results"))
    parser.add_argument("--case")
    parser.add_argument("--hold", action="store_true")
    parser.add_argument("--pmd", action="store_true")
    parser.add_argument("--path")
    parser.add_argument("--size", type=int)
    args = parser.parse_args()
    if args.hold:
        hold(args.path, args.size, args.workers, args.pmd)
        return 0
    if args.case:
        print(json.dumps(run_case(args.case, args.path, args.size, args.workers)))
        return 0
    report = measure(args)
    write_report(Path(args.out), report, "thp_probe.json", "thp_probe.md", markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
