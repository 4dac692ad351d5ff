"""Pin probe: how fast a fresh process can cudaHostRegister a table file already in shared memory.

    python benchmarks/experiments/pin_probe.py [--gib 16] [--out DIR] [--no-hugetlb] [--threads 2,4,8,16]
                                   [--repeat 1] [--cases a,b,...] [--timeout 300] [--device 0]

The daemon restart case: a restarted daemon re-attaches its table files in /dev/shm and must pin
them before it is ready. Today it registers Portable|Mapped in one thread, in chunks of at most
64 GiB (client/shared/cuda.py, HostRegistration), at ~5.6 GB/s; the goal is 64 GiB ready in well under
5 s. What this measures, every case in a fresh process (spawned with subprocess, so that no CUDA
context or pin is inherited):

  setup     a --gib file in /dev/shm (engramd-pin-probe-<pid>), filled with non-zero words that
            depend on their offset (os.pwrite, 64 MiB chunks; fill GB/s reported). With
            --hugetlb (the default; root) also one of the same size on hugetlbfs: the 2 MiB page
            pool grown, hugetlbfs mounted at /tmp/pin-probe-huge, the file mapped MAP_SHARED and
            filled through numpy. A hugetlb step that fails is recorded and its cases skipped.
  startup   `import torch`, a CUDA context by torch (torch.cuda.init() + torch.zeros(1) on the
            device), then `from cuda.bindings import runtime`; and, in another process, cudart
            alone: its import, then a context by cudaFree(0).
  cases     each: mmap the file MAP_SHARED read/write, cudaFree(0), then cudaHostRegister of the
            whole range, timed; then cudaHostUnregister of every chunk, timed (one thread):
              a      Portable|Mapped, 1 thread, chunks <= 64 GiB (what the daemon does)
              b      Portable|Mapped|ReadOnly, 1 thread
              cN     Portable|Mapped|ReadOnly, N equal parts (2 MiB aligned), each registered in
                     a Python thread of its own, all started at once (N from --threads)
              d8     as c8 without ReadOnly
              e      (shm only) MADV_POPULATE_READ of the range in 8 threads first, then b; the
                     prefault and the registration are timed apart
              e_c8   (shm only) the same prefault, then c8
              held   b while a holder process keeps the same file registered Portable|Mapped
                     (the mapped-client case; earlier measured at 0.66 s per 16 GiB)
            Every case checks its pin: the first and last 4 KiB are copied from the device
            pointer (cudaHostGetDevicePointer) into device memory and back, and compared with
            the file's bytes. While the threads run, the main thread counts 1 ms sleeps: about
            1,000 ticks/s mean the binding released the GIL, ~0 that it held it.

GB/s are decimal (10^9 bytes per second). Prints one JSON line per case, then a markdown table;
writes DIR/pin_probe.json and DIR/pin_probe.md (rewritten after every case). The files, the
mount and the huge page pool are put back as they were at the end, on errors too. About 2-3
minutes at 16 GiB on an H200 (most of it in 20-odd registrations of 17 GB each).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common
from common.report import cell, cpu_model, machine, mount_type  # noqa: E402

NAME = "engramd-pin-probe"
SHM_DIR = Path("/dev/shm")
HUGE_MOUNT = Path("/tmp/pin-probe-huge")
HUGE_SYSFS = Path("/sys/kernel/mm/hugepages/hugepages-2048kB")
HUGE_PROC = Path("/proc/sys/vm/nr_hugepages")  # the default-size pool (2 MiB on x86)
HUGE_PAGE = 2 << 20
SPARE_HUGE_PAGES = 4
HUGE_MEM_MARGIN = 4 << 30  # memory left over after the huge pages, or hugetlb is skipped
PAGE = 4096
FILL_CHUNK = 64 << 20
FILL_WORD = 0x5EED_0000_0000_0001  # word i of a file holds FILL_WORD + i: non-zero, positional
REGISTER_CHUNK = 64 << 30  # as engramd.client.shared.host_pin.REGISTER_CHUNK (not imported: see check)
MADV_POPULATE_READ = 22  # Linux 5.14
PREFAULT_THREADS = 8
TICK_S = 0.001
BARRIER_TIMEOUT_S = 60.0
HOLDER_STOP_TIMEOUT_S = 120.0
PROJECT_GIB = 64  # the "64 GiB at this rate" column
JSON_NAME, MD_NAME = "pin_probe.json", "pin_probe.md"


# -- shared helpers ------------------------------------------------------------------------------


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def gbps(nbytes: int, seconds: float | None) -> float | None:
    return round(nbytes / seconds / 1e9, 3) if seconds else None


def split(size: int, parts: int) -> list[tuple[int, int]]:
    """(offset, bytes) of `parts` equal parts of `size` bytes, the boundaries 2 MiB aligned."""
    step = _round_up(-(-size // parts), HUGE_PAGE)
    return [(offset, min(step, size - offset)) for offset in range(0, size, step)]


def limit(offset: int, nbytes: int) -> list[tuple[int, int]]:
    """A part cut into registrations of at most REGISTER_CHUNK, as the daemon does."""
    return [(offset + start, min(REGISTER_CHUNK, nbytes - start))
            for start in range(0, nbytes, REGISTER_CHUNK)]


def fill_words(size: int) -> Iterator[tuple[int, np.ndarray]]:
    """(offset, uint64 words) covering `size` bytes, FILL_CHUNK at a time (one buffer reused)."""
    index = np.arange(FILL_CHUNK // 8, dtype=np.uint64)
    words = np.empty_like(index)
    for offset in range(0, size, FILL_CHUNK):
        count = min(FILL_CHUNK, size - offset) // 8
        np.add(index[:count], np.uint64(FILL_WORD + offset // 8), out=words[:count])
        yield offset, words[:count]


# -- worker side: runs in a fresh process ---------------------------------------------------------


def load_cudart() -> Any:
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:  # cuda-python before 12.6
        from cuda import cudart
    return cudart


def check(call: str, result: Any) -> Any:
    """`(err, *values)` -> values, as engramd.client.shared.cuda.check (not imported: importing it
    loads cuda-python, and the workers time that import themselves)."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"{call} failed: {err!r}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def init_cuda(cudart: Any, device: int) -> None:
    check("cudaSetDevice", cudart.cudaSetDevice(device))
    check("cudaFree(0)", cudart.cudaFree(0))


def map_file(path: str, size: int) -> tuple[mmap.mmap, int]:
    """The file mapped MAP_SHARED read/write, and the mapping's address."""
    fd = os.open(path, os.O_RDWR)
    try:
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return mapping, ctypes.addressof(ctypes.c_char.from_buffer(mapping))


def register_flags(cudart: Any, read_only: bool) -> int:
    flags = int(cudart.cudaHostRegisterPortable) | int(cudart.cudaHostRegisterMapped)
    return flags | int(cudart.cudaHostRegisterReadOnly) if read_only else flags


def run_parallel(work: Callable[[int, int], None], parts: list[tuple[int, int]]) -> dict:
    """work(offset, nbytes) for every part, a thread each, released together by a barrier; the
    main thread counts TICK_S sleeps meanwhile (it runs only while no worker holds the GIL)."""
    barrier = threading.Barrier(len(parts) + 1)
    spans: list[tuple[float, float] | None] = [None] * len(parts)
    errors: list[str] = []

    def run(index: int, offset: int, nbytes: int) -> None:
        try:
            barrier.wait(BARRIER_TIMEOUT_S)
        except threading.BrokenBarrierError:
            errors.append(f"part {index}: barrier broken")
            return
        start = time.perf_counter()
        try:
            work(offset, nbytes)
        except Exception as exc:  # reported with the case
            errors.append(f"part {index}: {exc}")
        spans[index] = (start, time.perf_counter())

    threads = [threading.Thread(target=run, args=(i, off, n), daemon=True, name=f"part{i}")
               for i, (off, n) in enumerate(parts)]
    for thread in threads:
        thread.start()
    barrier.wait(BARRIER_TIMEOUT_S)
    start, ticks = time.perf_counter(), 0
    while any(thread.is_alive() for thread in threads):
        time.sleep(TICK_S)
        ticks += 1
    ends = [span[1] for span in spans if span]
    wall = (max(ends) if ends else time.perf_counter()) - start
    busy = sum(span[1] - span[0] for span in spans if span)
    return {"s": round(wall, 4), "threads": len(parts), "main_ticks": ticks,
            "main_ticks_per_s": round(ticks / wall) if wall > 0 else None,
            "thread_sum_s": round(busy, 4), "overlap": round(busy / wall, 2) if wall > 0 else None,
            "spans": [{"offset": off, "bytes": n, "start_s": round(span[0] - start, 4),
                       "end_s": round(span[1] - start, 4)} if span else None
                      for (off, n), span in zip(parts, spans, strict=True)],
            "errors": errors}


def prefault(mapping: mmap.mmap, address: int, size: int, threads: int) -> dict:
    """Page tables of the range filled in `threads` threads: madvise(MADV_POPULATE_READ) through
    ctypes (which lets go of the GIL), or, where the kernel lacks it, one byte read per page."""
    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int

    def populate(offset: int, nbytes: int) -> None:
        if madvise(address + offset, nbytes, MADV_POPULATE_READ) != 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))

    result = run_parallel(populate, split(size, threads))
    result["method"] = "madvise(MADV_POPULATE_READ)"
    if result["errors"]:
        view = np.frombuffer(mapping, dtype=np.uint8)
        failed = result["errors"]
        result = run_parallel(lambda off, n: np.bitwise_or.reduce(view[off:off + n:PAGE]),
                              split(size, threads))
        result["method"] = f"numpy read per page (madvise failed: {failed[0]})"
        del view
    result["gbps"] = gbps(size, result["s"])
    return result


def register(cudart: Any, device: int, address: int, size: int, threads: int,
             flags: int) -> tuple[dict, list[tuple[int, int]]]:
    """cudaHostRegister of the range in `threads` parts at once; the chunks that were registered."""
    chunks: list[tuple[int, int]] = []

    def work(offset: int, nbytes: int) -> None:
        check("cudaSetDevice", cudart.cudaSetDevice(device))
        for off, n in limit(offset, nbytes):
            check(f"cudaHostRegister({n} bytes at +{off})",
                  cudart.cudaHostRegister(address + off, n, flags))
            chunks.append((off, n))

    return run_parallel(work, split(size, threads)), chunks


def unregister(cudart: Any, address: int, chunks: list[tuple[int, int]]) -> dict:
    start, errors = time.perf_counter(), []
    for offset, _ in chunks:
        try:
            check("cudaHostUnregister", cudart.cudaHostUnregister(address + offset))
        except RuntimeError as exc:
            errors.append(str(exc))
    return {"s": round(time.perf_counter() - start, 4), "chunks": len(chunks), "errors": errors}


def verify_pin(cudart: Any, mapping: mmap.mmap, address: int, size: int,
               chunks: list[tuple[int, int]]) -> dict:
    """The first and last 4 KiB, host pin -> device memory -> host, compared with the file."""
    device_buffer = int(check("cudaMalloc", cudart.cudaMalloc(PAGE)))
    host = ctypes.create_string_buffer(PAGE)
    result: dict[str, Any] = {}
    try:
        for label, offset in (("first", 0), ("last", size - PAGE)):
            base = next(off for off, n in chunks if off <= offset < off + n)
            device_ptr = int(check("cudaHostGetDevicePointer",
                                   cudart.cudaHostGetDevicePointer(address + base, 0)))
            result["unified"] = result.get("unified", True) and device_ptr == address + base
            check("cudaMemcpy(pin -> device)", cudart.cudaMemcpy(
                device_buffer, device_ptr + offset - base, PAGE,
                cudart.cudaMemcpyKind.cudaMemcpyDefault))
            check("cudaMemcpy(device -> host)", cudart.cudaMemcpy(
                ctypes.addressof(host), device_buffer, PAGE,
                cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost))
            result[label] = "ok" if host.raw == mapping[offset:offset + PAGE] else "mismatch"
    finally:
        cudart.cudaFree(device_buffer)
    result["ok"] = result.get("first") == "ok" and result.get("last") == "ok"
    return result


def attach(spec: dict) -> tuple[Any, mmap.mmap, int, dict]:
    """cudart imported, the file mapped, a context made: each timed."""
    timings: dict[str, Any] = {}
    start = time.perf_counter()
    cudart = load_cudart()
    timings["import_cudart_s"] = round(time.perf_counter() - start, 4)
    start = time.perf_counter()
    mapping, address = map_file(spec["file"], spec["size"])
    timings["mmap_s"] = round(time.perf_counter() - start, 4)
    timings["address_2mib_aligned"] = address % HUGE_PAGE == 0
    start = time.perf_counter()
    init_cuda(cudart, spec["device"])
    timings["context_s"] = round(time.perf_counter() - start, 4)
    return cudart, mapping, address, timings


def case_register(spec: dict) -> dict:
    cudart, mapping, address, result = attach(spec)
    size = spec["size"]
    if spec.get("prefault_threads"):
        result["prefault"] = prefault(mapping, address, size, spec["prefault_threads"])
        result["prefault_s"] = result["prefault"]["s"]
    flags = register_flags(cudart, spec["read_only"])
    result["register"], chunks = register(cudart, spec["device"], address, size,
                                          spec["threads"], flags)
    result["register_s"] = result["register"]["s"]
    if result["register"]["errors"]:
        result["error"] = "; ".join(result["register"]["errors"])
    else:
        result["register_gbps"] = gbps(size, result["register_s"])
        try:
            result["verify"] = verify_pin(cudart, mapping, address, size, chunks)
        except Exception as exc:  # the timing stands; the check's failure is reported
            result["verify"] = {"ok": False, "error": str(exc)}
    result["unregister"] = unregister(cudart, address, chunks)
    result["unregister_s"] = result["unregister"]["s"]
    return result


def case_holder(spec: dict) -> dict:
    """Registers the file as the daemon does, says so on stdout, holds it until stdin has a line."""
    cudart, mapping, address, result = attach(spec)
    result["register"], chunks = register(cudart, spec["device"], address, spec["size"], 1,
                                          register_flags(cudart, read_only=False))
    result["register_s"] = result["register"]["s"]
    result["register_gbps"] = gbps(spec["size"], result["register_s"])
    result["ready"] = not result["register"]["errors"]
    print(json.dumps(result), flush=True)
    sys.stdin.readline()
    return {"unregister": unregister(cudart, address, chunks)}


def case_startup_torch(spec: dict) -> dict:
    result: dict[str, Any] = {}
    start = time.perf_counter()
    import torch
    result["import_torch_s"] = round(time.perf_counter() - start, 4)
    start = time.perf_counter()
    torch.cuda.init()
    torch.zeros(1, device=f"cuda:{spec['device']}")
    torch.cuda.synchronize()
    result["torch_context_s"] = round(time.perf_counter() - start, 4)
    start = time.perf_counter()
    load_cudart()
    result["import_cudart_after_torch_s"] = round(time.perf_counter() - start, 4)
    result.update(torch=torch.__version__, torch_cuda=torch.version.cuda,
                  gpu=torch.cuda.get_device_name(spec["device"]))
    return result


def case_startup_cudart(spec: dict) -> dict:
    result: dict[str, Any] = {}
    start = time.perf_counter()
    cudart = load_cudart()
    result["import_cudart_s"] = round(time.perf_counter() - start, 4)
    start = time.perf_counter()
    init_cuda(cudart, spec["device"])
    result["cudart_context_s"] = round(time.perf_counter() - start, 4)
    result["driver_version"] = check("cudaDriverGetVersion", cudart.cudaDriverGetVersion())
    result["runtime_version"] = check("cudaRuntimeGetVersion", cudart.cudaRuntimeGetVersion())
    props = check("cudaGetDeviceProperties", cudart.cudaGetDeviceProperties(spec["device"]))
    name = props.name
    result["gpu"] = (name.decode(errors="replace") if isinstance(name, bytes) else str(name)
                     ).split("\x00")[0]
    for attr in ("cudaDevAttrHostRegisterSupported", "cudaDevAttrHostRegisterReadOnlySupported",
                 "cudaDevAttrCanUseHostPointerForRegisteredMem", "cudaDevAttrUnifiedAddressing"):
        try:
            result[attr] = check(attr, cudart.cudaDeviceGetAttribute(
                getattr(cudart.cudaDeviceAttr, attr), spec["device"]))
        except (AttributeError, RuntimeError) as exc:
            result[attr] = f"? ({exc})"
    return result


WORKERS: dict[str, Callable[[dict], dict]] = {
    "register": case_register, "holder": case_holder,
    "startup_torch": case_startup_torch, "startup_cudart": case_startup_cudart,
}


def worker_main(spec: dict) -> int:
    """One case; its result is the last line on stdout (JSON)."""
    try:
        result = WORKERS[spec["kind"]](spec)
    except Exception as exc:  # the parent records it and goes on
        result = {"error": repr(exc), "traceback": traceback.format_exc()[-2000:]}
    print(json.dumps(result), flush=True)
    return 0


# -- parent side: files, processes, report --------------------------------------------------------


def worker_command(spec: dict) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]


def last_json(text: str) -> dict | None:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def run_worker(spec: dict, timeout: float) -> dict:
    start = time.perf_counter()
    try:
        proc = subprocess.run(worker_command(spec), capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s (killed)"}
    result = last_json(proc.stdout) or {}
    if proc.returncode != 0 or not result:
        result.setdefault("error", f"worker exited with {proc.returncode}, no result")
        result["stderr_tail"] = proc.stderr[-2000:]
    result["process_s"] = round(time.perf_counter() - start, 3)
    return result


def read_json_line(stream: Any, timeout: float) -> dict | None:
    """The next JSON line of a child's stdout, or None at EOF or after `timeout` s."""
    box: list[dict | None] = []

    def read() -> None:
        for line in stream:
            if line.startswith("{"):
                box.append(last_json(line))
                return
        box.append(None)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    return box[0] if box else None


def run_held(spec: dict, timeout: float) -> dict:
    """`spec` measured while a holder process keeps the same file registered Portable|Mapped."""
    holder_spec = {"kind": "holder", "file": spec["file"], "size": spec["size"],
                   "device": spec["device"]}
    with tempfile.TemporaryFile("w+") as stderr:
        holder = subprocess.Popen(worker_command(holder_spec), stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=stderr, text=True)
        try:
            ready = read_json_line(holder.stdout, timeout)
            if ready and ready.get("ready"):
                result = run_worker(spec, timeout)
                result["holder"] = ready
                result["holder_unregister"] = stop_holder(holder)
            else:
                result = {"error": f"holder not ready: {ready}"}
        finally:
            if holder.poll() is None:
                holder.kill()
                holder.wait()
            stderr.seek(0)
            tail = stderr.read()[-2000:]
        if "error" in result and tail:
            result["holder_stderr_tail"] = tail
    return result


def stop_holder(holder: subprocess.Popen) -> dict:
    """Tell the holder to unregister and exit; its unregistration, or what went wrong."""
    try:
        holder.stdin.write("stop\n")
        holder.stdin.close()
    except OSError as exc:  # it died: the caller reports its stderr
        return {"error": repr(exc)}
    stopped = read_json_line(holder.stdout, HOLDER_STOP_TIMEOUT_S)
    try:
        holder.wait(HOLDER_STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"error": f"holder still running {HOLDER_STOP_TIMEOUT_S} s after stop (killed)"}
    return (stopped or {}).get("unregister") or {"error": f"no unregistration reported: {stopped}"}


def cleanup_step(errors: list[str], what: str, fn: Callable[..., Any], *args: Any) -> None:
    """One cleanup action for an ExitStack; its failure is recorded, the others still run."""
    try:
        fn(*args)
    except Exception as exc:
        errors.append(f"{what}: {exc!r}")


def run_command(*command: str) -> None:
    proc = subprocess.run(command, capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: exit {proc.returncode}: {proc.stderr.strip()}")


def create_file(stack: ExitStack, errors: list[str], path: Path) -> int:
    """A new file (O_EXCL), unlinked when `stack` closes; returns its descriptor (caller closes)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    stack.callback(cleanup_step, errors, f"unlink {path}", path.unlink)
    return fd


def setup_shm(stack: ExitStack, errors: list[str], size: int) -> dict:
    st = os.statvfs(SHM_DIR)
    free = st.f_bavail * st.f_frsize
    if free < size:
        raise SystemExit(f"{SHM_DIR} has {free / 2**30:.1f} GiB free, the probe needs "
                         f"{size / 2**30:.1f} GiB")
    path = SHM_DIR / f"{NAME}-{os.getpid()}"
    fd = create_file(stack, errors, path)
    try:
        start = time.perf_counter()
        for offset, words in fill_words(size):
            view = memoryview(words).cast("B")
            while view:
                written = os.pwrite(fd, view, offset)
                view, offset = view[written:], offset + written
        seconds = time.perf_counter() - start
    finally:
        os.close(fd)
    return {"path": str(path), "bytes": size, "fill_s": round(seconds, 3),
            "fill_gbps": gbps(size, seconds), "fill": "os.pwrite, 64 MiB chunks"}


class HugePool:
    """The 2 MiB huge page pool: sysfs hugepages-2048kB, else /proc/sys/vm/nr_hugepages where
    2 MiB is the default huge page size."""

    def __init__(self) -> None:
        if HUGE_SYSFS.is_dir():
            self.nr_path = HUGE_SYSFS / "nr_hugepages"
            self.free_path: Path | None = HUGE_SYSFS / "free_hugepages"
        elif meminfo().get("Hugepagesize") == "2048 kB":
            self.nr_path, self.free_path = HUGE_PROC, None
        else:
            raise RuntimeError("no 2 MiB huge page pool (sysfs hugepages-2048kB is missing)")

    def nr(self) -> int:
        return int(self.nr_path.read_text())

    def free(self) -> int:
        if self.free_path is None:
            return int(meminfo()["HugePages_Free"])
        return int(self.free_path.read_text())

    def set(self, pages: int) -> None:
        self.nr_path.write_text(f"{pages}\n")


def meminfo() -> dict[str, str]:
    fields = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return fields


def grow_pool(stack: ExitStack, errors: list[str], size: int) -> dict:
    """Enough free 2 MiB pages for `size` bytes; the pool's old size is restored at the end."""
    available = int(meminfo()["MemAvailable"].split()[0]) * 1024
    if available < size + HUGE_MEM_MARGIN:
        raise RuntimeError(f"MemAvailable {available / 2**30:.1f} GiB < {size / 2**30:.1f} GiB "
                           f"of huge pages + {HUGE_MEM_MARGIN >> 30} GiB margin")
    pool = HugePool()
    old, free, need = pool.nr(), pool.free(), size // HUGE_PAGE
    info = {"pool": str(pool.nr_path), "nr_before": old, "free_before": free, "needed": need}
    if free < need + SPARE_HUGE_PAGES:
        stack.callback(cleanup_step, errors, f"restore {pool.nr_path} to {old}", pool.set, old)
        target = old + need + SPARE_HUGE_PAGES - free
        pool.set(target)
        info["nr_set"] = target
    info["free_after"] = got = pool.free()
    if got < need:
        raise RuntimeError(f"the kernel gave {got} free 2 MiB pages, {need} are needed ({info})")
    return info


def mount_hugetlbfs(stack: ExitStack, errors: list[str]) -> dict:
    """hugetlbfs (2 MiB pages) at HUGE_MOUNT, unmounted and removed at the end if made here."""
    if not HUGE_MOUNT.exists():
        HUGE_MOUNT.mkdir(parents=True)
        stack.callback(cleanup_step, errors, f"rmdir {HUGE_MOUNT}", HUGE_MOUNT.rmdir)
    if os.path.ismount(HUGE_MOUNT):
        kind = mount_type(HUGE_MOUNT)
        if kind != "hugetlbfs":
            raise RuntimeError(f"{HUGE_MOUNT} is already a {kind} mount")
        return {"mount": str(HUGE_MOUNT), "mounted_here": False}
    run_command("mount", "-t", "hugetlbfs", "-o", "pagesize=2M", "none", str(HUGE_MOUNT))
    stack.callback(cleanup_step, errors, f"umount {HUGE_MOUNT}", run_command, "umount",
                   str(HUGE_MOUNT))
    return {"mount": str(HUGE_MOUNT), "mounted_here": True}


def setup_hugetlb(stack: ExitStack, errors: list[str], size: int) -> dict:
    if os.geteuid() != 0:
        raise RuntimeError("not root: cannot grow the huge page pool or mount hugetlbfs")
    info = {"bytes": size, **grow_pool(stack, errors, size), **mount_hugetlbfs(stack, errors)}
    path = HUGE_MOUNT / f"{NAME}-{os.getpid()}"
    fd = create_file(stack, errors, path)
    try:
        start = time.perf_counter()
        os.ftruncate(fd, size)  # size is a multiple of 2 MiB (hugetlbfs maps whole pages)
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    try:
        view = np.frombuffer(mapping, dtype=np.uint64)
        for offset, words in fill_words(size):  # hugetlbfs has no write(2): fill the mapping
            view[offset // 8:offset // 8 + words.size] = words
        del view
        seconds = time.perf_counter() - start
    finally:
        mapping.close()
    info.update(path=str(path), fill_s=round(seconds, 3), fill_gbps=gbps(size, seconds),
                fill="numpy into a MAP_SHARED mapping")
    return info


def case_specs(file_kind: str, path: str, size: int, args: argparse.Namespace) -> list[dict]:
    base = {"kind": "register", "file": path, "file_kind": file_kind, "size": size,
            "device": args.device, "prefault_threads": 0}
    specs = [dict(base, name="a", read_only=False, threads=1),
             dict(base, name="b", read_only=True, threads=1)]
    specs += [dict(base, name=f"c{n}", read_only=True, threads=n) for n in args.threads]
    specs.append(dict(base, name="d8", read_only=False, threads=8))
    if file_kind == "shm":
        specs += [dict(base, name="e", read_only=True, threads=1,
                       prefault_threads=PREFAULT_THREADS),
                  dict(base, name="e_c8", read_only=True, threads=8,
                       prefault_threads=PREFAULT_THREADS)]
    specs.append(dict(base, name="held", read_only=True, threads=1, held=True))
    return [spec for spec in specs if args.cases is None or spec["name"] in args.cases]


def run_case(spec: dict, timeout: float) -> dict:
    measured = run_held(spec, timeout) if spec.get("held") else run_worker(spec, timeout)
    return {**{k: v for k, v in spec.items() if k != "kind"}, **measured}


def read_text(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def meta(args: argparse.Namespace, size: int) -> dict:
    cmdline = read_text("/proc/cmdline") or ""
    groups = Path("/sys/kernel/iommu_groups")
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv),
            "host": platform.node(), "machine": machine(), "cpu": cpu_model(),
            "kernel": platform.release(), "python": platform.python_version(),
            "mem_total": meminfo().get("MemTotal"), "gib": args.gib, "bytes": size,
            "thp_enabled": read_text("/sys/kernel/mm/transparent_hugepage/enabled"),
            "thp_shmem": read_text("/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
            "iommu_cmdline": [t for t in cmdline.split() if "iommu" in t],
            "iommu_groups": len(list(groups.iterdir())) if groups.is_dir() else None,
            "nvidia_driver": (read_text("/proc/driver/nvidia/version") or "").split("\n")[0]
            or None}


# -- the report ------------------------------------------------------------------------------------


def projected_s(case: dict) -> float | None:
    rate = case.get("register_gbps")
    return PROJECT_GIB * 2**30 / (rate * 1e9) if rate else None


def case_note(case: dict) -> str:
    notes = []
    if case.get("error"):
        notes.append(f"error: {str(case['error'])[:160]}")
    if case.get("holder"):
        notes.append(f"holder registered in {case['holder'].get('register_s')} s")
    prefault = case.get("prefault") or {}
    if prefault.get("method", "").startswith("numpy"):
        notes.append(prefault["method"][:120])
    overlap = (case.get("register") or {}).get("overlap")
    if case.get("threads", 1) > 1 and overlap is not None:
        notes.append(f"overlap {overlap}")
    return "; ".join(notes).replace("|", "/")


def case_row(case: dict) -> str:
    flags = "P+M+RO" if case.get("read_only") else "P+M"
    verify = case.get("verify") or {}
    pin = "" if not verify else ("ok" if verify.get("ok") else
                                 f"FAIL {verify.get('error') or verify}"[:80].replace("|", "/"))
    cells = [case["name"], case.get("file_kind"), flags, case.get("threads"),
             cell(case.get("prefault_s")), cell(case.get("register_s")),
             cell(case.get("register_gbps"), 2), cell(projected_s(case), 2),
             cell(case.get("unregister_s")),
             cell((case.get("register") or {}).get("main_ticks_per_s")), pin, case_note(case)]
    return "| " + " | ".join(str(c) for c in cells) + " |"


def setup_lines(report: dict) -> list[str]:
    shm, huge = report["setup"].get("shm") or {}, report["setup"].get("hugetlb") or {}
    lines = [f"- /dev/shm file filled at {cell(shm.get('fill_gbps'), 2)} GB/s "
             f"({cell(shm.get('fill_s'))} s, {shm.get('fill', '')})."]
    if huge.get("skipped"):
        lines.append(f"- hugetlbfs skipped: {huge['skipped']}")
    elif huge:
        lines.append(f"- hugetlbfs (2 MiB pages) file filled at {cell(huge.get('fill_gbps'), 2)} "
                     f"GB/s ({cell(huge.get('fill_s'))} s).")
    startup = report.get("startup", {})
    torch_s, cudart_s = startup.get("torch") or {}, startup.get("cudart") or {}
    lines.append(f"- Fresh process, torch: `import torch` {cell(torch_s.get('import_torch_s'))} s, "
                 f"CUDA context {cell(torch_s.get('torch_context_s'))} s, then cudart import "
                 f"{cell(torch_s.get('import_cudart_after_torch_s'))} s"
                 + (f" (error: {torch_s['error']})" if torch_s.get("error") else "") + ".")
    lines.append(f"- Fresh process, cudart alone: import {cell(cudart_s.get('import_cudart_s'))} "
                 f"s, cudaFree(0) context {cell(cudart_s.get('cudart_context_s'))} s; "
                 f"ReadOnly supported: "
                 f"{cudart_s.get('cudaDevAttrHostRegisterReadOnlySupported', '?')}"
                 + (f" (error: {cudart_s['error']})" if cudart_s.get("error") else "") + ".")
    return lines


def markdown(report: dict) -> str:
    m, gpu = report["meta"], (report.get("startup", {}).get("cudart") or {}).get("gpu", "GPU ?")
    lines = [f"# cudaHostRegister of a {m['gib']} GiB shared-memory file, fresh processes, "
             f"{gpu} ({m['date']})", "",
             f"Command: `{m['command']}`. {m['machine']}, kernel {m['kernel']}, THP shmem "
             f"`{m['thp_shmem']}`, IOMMU cmdline {m['iommu_cmdline'] or 'none'}, "
             f"driver {m['nvidia_driver'] or '?'}.", "", *setup_lines(report), "",
             f"GB/s = {m['bytes'] / 1e9:.2f} GB / register s; \"{PROJECT_GIB} GiB\" is the time "
             "at that rate; ticks/s: main-thread 1 ms sleeps during the registration (~1000: "
             "GIL released); pin: first and last 4 KiB through the device pointer.", "",
             f"| case | file | flags | threads | prefault s | register s | GB/s | "
             f"{PROJECT_GIB} GiB s | unregister s | ticks/s | pin | notes |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    lines += [case_row(case) for case in report["cases"]]
    if report.get("cleanup_errors"):
        lines += ["", "Cleanup errors: " + "; ".join(report["cleanup_errors"])]
    return "\n".join(lines) + "\n"


def save(report: dict, out: Path) -> None:
    (out / JSON_NAME).write_text(json.dumps(report, indent=2) + "\n")
    (out / MD_NAME).write_text(markdown(report))


# -- main ------------------------------------------------------------------------------------------


def measure(args: argparse.Namespace, size: int, stack: ExitStack, report: dict,
            out: Path) -> None:
    errors = report["cleanup_errors"]
    report["setup"]["shm"] = shm = setup_shm(stack, errors, size)
    print(json.dumps({"setup": "shm", **shm}), flush=True)
    files = [("shm", shm["path"])]
    if args.hugetlb:
        huge_stack = ExitStack()
        try:
            huge = setup_hugetlb(huge_stack, errors, size)
        except Exception as exc:  # recorded; its cases are skipped
            huge_stack.close()
            huge = {"skipped": str(exc)}
        else:
            stack.enter_context(huge_stack)
            files.append(("hugetlb", huge["path"]))
        report["setup"]["hugetlb"] = huge
        print(json.dumps({"setup": "hugetlb", **huge}), flush=True)
    save(report, out)
    for key in ("cudart", "torch"):
        result = run_worker({"kind": f"startup_{key}", "device": args.device}, args.timeout)
        report["startup"][key] = result
        print(json.dumps({"startup": key, **result}), flush=True)
        save(report, out)
    for repeat in range(args.repeat):
        for file_kind, path in files:
            for spec in case_specs(file_kind, path, size, args):
                case = {**run_case(spec, args.timeout), "repeat": repeat}
                report["cases"].append(case)
                print(json.dumps(case), flush=True)
                save(report, out)


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through the cleanup


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=16.0, help="file size, GiB (default 16)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results"))
    parser.add_argument("--hugetlb", action=argparse.BooleanOptionalAction, default=True,
                        help="also a file on hugetlbfs, 2 MiB pages (root; skipped if it fails)")
    parser.add_argument("--threads", default="2,4,8,16",
                        help="thread counts of the cN cases (comma separated)")
    parser.add_argument("--repeat", type=int, default=1, help="times to run every case")
    parser.add_argument("--cases", default=None,
                        help="only these cases (comma separated: a,b,c2,...,d8,e,e_c8,held)")
    parser.add_argument("--timeout", type=float, default=300.0, help="per process, seconds")
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one case, JSON spec
    args = parser.parse_args()
    try:
        args.threads = [int(n) for n in args.threads.split(",") if n.strip()]
    except ValueError:
        parser.error("--threads takes comma separated integers")
    if args.cases is not None:
        args.cases = {name.strip() for name in args.cases.split(",") if name.strip()}
    if args.gib <= 0 or args.repeat < 1 or args.timeout <= 0 or min(args.threads, default=1) < 1:
        parser.error("--gib, --repeat, --timeout and --threads must be positive")
    return args


def main() -> int:
    args = parse_args()
    if args.worker:
        return worker_main(json.loads(args.worker))
    size = _round_up(int(args.gib * 2**30), HUGE_PAGE)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _terminate)
    report: dict[str, Any] = {"meta": meta(args, size), "setup": {}, "startup": {}, "cases": [],
                              "cleanup_errors": []}
    started = time.perf_counter()
    try:
        with ExitStack() as stack:
            measure(args, size, stack, report, out)
    finally:
        report["meta"]["seconds"] = round(time.perf_counter() - started, 1)
        save(report, out)
    print(markdown(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
