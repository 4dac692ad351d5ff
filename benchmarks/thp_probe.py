"""THP probe: pinning a /dev/shm table whose pages are 2 MiB folios, mapped by PMDs.

    python benchmarks/thp_probe.py [--gib 16] [--workers 8] [--out DIR]

On hugetlbfs a table pins at ~40-48 GB/s against 12-25 GB/s on /dev/shm (4 KiB pages), but
hugetlbfs needs a page pool set aside by root. tmpfs can hold 2 MiB folios too, and
MADV_COLLAPSE (Linux >= 6.1) makes them from a range's pages whatever the THP sysfs settings
(`shmem_enabled` may say never); the collapsed folios stay in the file for every later mapping,
and another process's MADV_COLLAPSE of a range already made of them only maps them by PMDs. The
mapping must lie 2 MiB aligned (as file offset 0), which Python's mmap does not do, so the probe
maps with mmap(2) at an aligned address. Every case runs in a fresh process:

  setup      a --gib file in /dev/shm, filled by pwrite (64 MiB chunks)
  pin_4k     Python's mmap, then HostRegistration read-only (8 parts after a prefault, as the
             daemon pins today)
  collapse   an aligned read/write mapping; MADV_COLLAPSE in --workers threads over 2 MiB
             aligned parts: seconds, GB/s, the ShmemHugePages gained, failures
  pin_pmd    an aligned read-only mapping; MADV_COLLAPSE (PMD mapping of the folios: timed),
             then the same HostRegistration
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common.report import machine, write_report  # noqa: E402

HUGE = 2 << 20
MADV_COLLAPSE = 25
CHUNK = 64 << 20


def aligned_map(fd: int, size: int, writable: bool) -> int:
    """`fd` mapped MAP_SHARED from offset 0 at a 2 MiB aligned address (a PROT_NONE (0) reservation
    made first, then MAP_FIXED into it)."""
    from engramd.client.libc import MAP_FIXED, mmap_at

    reservation = mmap_at(None, size + HUGE, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1)
    address = -(-reservation // HUGE) * HUGE
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    return mmap_at(address, size, prot, mmap.MAP_SHARED | MAP_FIXED, fd)


_KEEP: list = []  # mappings that live as long as the process


def python_map(fd: int, size: int) -> int:
    """`fd` mapped read-only by Python's mmap, as the daemon and clients map tables today."""
    mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    _KEEP.append(mapping)
    return np.frombuffer(mapping, dtype=np.uint8).ctypes.data


def collapse(address: int, size: int, workers: int) -> int:
    """MADV_COLLAPSE over the range in `workers` parts; the number of parts that failed."""
    from engramd.client.libc import libc

    step = max(HUGE, -(-size // workers) // HUGE * HUGE)
    parts = [(address + start, min(step, size - start)) for start in range(0, size, step)]
    with ThreadPoolExecutor(workers) as pool:
        codes = list(pool.map(lambda p: libc().madvise(ctypes.c_void_p(p[0]), ctypes.c_size_t(p[1]),
                                                       MADV_COLLAPSE), parts))
    return sum(1 for code in codes if code != 0)


def meminfo(key: str) -> int:
    return int(re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M)[1]) << 10


def pmd_mapped(address: int) -> int:
    """ShmemPmdMapped bytes of the mapping that starts at `address` (this process)."""
    for block in Path("/proc/self/smaps").read_text().split("\n" + format(address, "x") + "-")[1:2]:
        return int(re.search(r"ShmemPmdMapped:\s+(\d+) kB", block)[1]) << 10
    return 0


def check_pin(address: int, path: str, size: int) -> bool:
    from cuda.bindings import runtime as rt

    ok = True
    for offset in (0, size - 4096):
        expected = os.pread(os.open(path, os.O_RDONLY), 4096, offset)
        device = rt.cudaMalloc(4096)[1]
        host = ctypes.create_string_buffer(4096)
        rt.cudaMemcpy(device, address + offset, 4096, rt.cudaMemcpyKind.cudaMemcpyDefault)
        rt.cudaMemcpy(ctypes.addressof(host), device, 4096, rt.cudaMemcpyKind.cudaMemcpyDefault)
        rt.cudaFree(device)
        ok &= host.raw == expected
    return ok


def run_case(case: str, path: str, size: int, workers: int) -> dict:
    """One case in this (fresh) process."""
    from cuda.bindings import runtime as rt

    from engramd.client.host_pin import HostRegistration

    rt.cudaFree(0)
    result: dict = {"case": case}
    if case == "collapse":
        fd = os.open(path, os.O_RDWR)
        address = aligned_map(fd, size, writable=True)
        before = meminfo("ShmemHugePages")
        started = time.perf_counter()
        result["failed_parts"] = collapse(address, size, workers)
        result["seconds"] = round(time.perf_counter() - started, 3)
        result["gbps"] = round(size / 1e9 / result["seconds"], 2)
        result["huge_gained_gib"] = round((meminfo("ShmemHugePages") - before) / 2**30, 2)
        return result
    fd = os.open(path, os.O_RDONLY)
    if case.endswith("pmd"):
        address = aligned_map(fd, size, writable=False)
        started = time.perf_counter()
        result["collapse_failed_parts"] = collapse(address, size, workers)
        result["collapse_s"] = round(time.perf_counter() - started, 4)
        result["pmd_mapped_gib"] = round(pmd_mapped(address) / 2**30, 2)
    else:
        address = python_map(fd, size)
    started = time.perf_counter()
    registration = HostRegistration([(address, size)], read_only=True)
    result["pin_s"] = round(time.perf_counter() - started, 3)
    result["pin_gbps"] = round(size / 1e9 / result["pin_s"], 2)
    result["rows_ok"] = check_pin(address, path, size)
    started = time.perf_counter()
    registration.close()
    result["unpin_s"] = round(time.perf_counter() - started, 3)
    return result


def hold(path: str, size: int, workers: int, pmd: bool) -> None:
    """A holder: the file registered (through a PMD mapping or Python's), until stdin closes."""
    from cuda.bindings import runtime as rt

    from engramd.client.host_pin import HostRegistration

    rt.cudaFree(0)
    fd = os.open(path, os.O_RDONLY)
    if pmd:
        address = aligned_map(fd, size, writable=False)
        collapse(address, size, workers)
    else:
        address = python_map(fd, size)
    registration = HostRegistration([(address, size)], read_only=True)
    print("held", flush=True)
    sys.stdin.read()
    registration.close()


def fresh(args: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True, **kw)


def measure(args: argparse.Namespace) -> dict:
    size = int(args.gib * 2**30) // HUGE * HUGE
    fd, path = tempfile.mkstemp(prefix="engramd-thp-probe-", dir="/dev/shm")
    report = {"meta": {"benchmark": "thp_probe", "gib": args.gib, "workers": args.workers,
                       "kernel": platform.release(), "machine": machine(),
                       "shmem_enabled": Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text().strip(),
                       "date": time.strftime("%Y-%m-%d %H:%M"),
                       "command": "python benchmarks/thp_probe.py " + " ".join(sys.argv[1:])},
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
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
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
