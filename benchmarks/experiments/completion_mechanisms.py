"""Cross-process completion on one GPU: stream-memory-op counters vs interprocess CUDA events.

    python benchmarks/experiments/completion_mechanisms.py [--iters 2000] [--out DIR]

A producer process (the daemon's role) owns device memory and an interprocess event, both shared
over CUDA IPC. Per request the consumer (the client's role) sends a ZeroMQ message; the producer
enqueues a small kernel on its stream and marks completion:
  counter: the producer writes the request number into a shared counter (cuStreamWriteValue32);
           the consumer enqueued cuStreamWaitValue32 right after sending, without a reply.
  event:   the producer records the IPC event, then replies; the consumer must wait for the
           reply before cudaStreamWaitEvent (a wait binds to the last record enqueued so far).
Reported: host time until the consumer's wait is enqueued, and until the consumer's stream has
passed it (p50/p99 over `--iters` requests).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import zmq

from engramd.client.shared import cuda
from engramd.client.shared.cuda import check


def event_handle_bytes(event) -> bytes:
    handle = check("cudaIpcGetEventHandle", cuda.cudart.cudaIpcGetEventHandle(event))
    return ctypes.string_at(handle.getPtr(), 64)


def ipc_handle_bytes(ptr: int) -> bytes:
    """Legacy CUDA IPC memory handle (what slabs used before descriptors), as bytes."""
    handle = check("cudaIpcGetMemHandle", cuda.cudart.cudaIpcGetMemHandle(ptr))
    return ctypes.string_at(handle.getPtr(), 64)


def ipc_open(data: bytes) -> int:
    handle = cuda.cudart.cudaIpcMemHandle_t()
    ctypes.memmove(handle.getPtr(), data, 64)
    return int(check("cudaIpcOpenMemHandle", cuda.cudart.cudaIpcOpenMemHandle(
        handle, cuda.cudart.cudaIpcMemLazyEnablePeerAccess)))


def ipc_close(ptr: int) -> None:
    check("cudaIpcCloseMemHandle", cuda.cudart.cudaIpcCloseMemHandle(ptr))


def open_event(data: bytes):
    handle = cuda.cudart.cudaIpcEventHandle_t()
    ctypes.memmove(handle.getPtr(), data, 64)
    return check("cudaIpcOpenEventHandle", cuda.cudart.cudaIpcOpenEventHandle(handle))


def producer(address: str) -> None:
    sock = zmq.Context.instance().socket(zmq.PAIR)
    sock.connect(address)
    ptr = int(check("cudaMalloc", cuda.cudart.cudaMalloc(2 << 20)))
    check("cudaMemset", cuda.cudart.cudaMemset(ptr, 0, 2 << 20))
    flags = cuda.cudart.cudaEventInterprocess | cuda.cudart.cudaEventDisableTiming
    event = check("cudaEventCreateWithFlags", cuda.cudart.cudaEventCreateWithFlags(flags))
    stream = torch.cuda.Stream()
    work = torch.empty(1 << 18, dtype=torch.float32, device="cuda")
    with torch.cuda.stream(stream):
        work.fill_(1.0)  # load the kernel before any cross-process wait exists
    torch.cuda.synchronize()
    sock.send_multipart([ipc_handle_bytes(ptr), event_handle_bytes(event)])
    while True:
        mode, seq = sock.recv_multipart()
        if mode == b"stop":
            break
        with torch.cuda.stream(stream):
            work.fill_(float(int(seq)))
        if mode == b"counter":
            cuda.stream_write_u32(stream.cuda_stream, ptr, int(seq))
        else:
            check("cudaEventRecord", cuda.cudart.cudaEventRecord(event, stream.cuda_stream))
            sock.send(seq)
    torch.cuda.synchronize()


def consumer(iters: int) -> dict:
    address = f"ipc://{tempfile.mkdtemp(prefix='egd-cm-')}/s"
    sock = zmq.Context.instance().socket(zmq.PAIR)
    sock.bind(address)
    child = subprocess.Popen([sys.executable, __file__, "--producer", address])
    mem, ev = sock.recv_multipart()
    ptr = ipc_open(mem)
    event = open_event(ev)
    stream = torch.cuda.current_stream()
    results = {}
    for mode in ("counter", "event", "counter", "event"):  # interleaved, second round reported
        enqueue, total = [], []
        for i in range(1, iters + 1):
            seq = str(i).encode()
            start = time.perf_counter()
            sock.send_multipart([mode.encode(), seq])
            if mode == "counter":
                cuda.stream_wait_u32(stream.cuda_stream, ptr, i)
            else:
                sock.recv()
                check("cudaStreamWaitEvent", cuda.cudart.cudaStreamWaitEvent(stream.cuda_stream, event, 0))
            enqueued = time.perf_counter()
            stream.synchronize()
            done = time.perf_counter()
            enqueue.append(enqueued - start)
            total.append(done - start)
        if mode == "counter":  # the next counter round starts over from 1
            cuda.stream_write_u32(stream.cuda_stream, ptr, 0)
            stream.synchronize()
        results[mode] = {name: {"p50_us": float(np.percentile(np.array(v) * 1e6, 50)),
                                "p99_us": float(np.percentile(np.array(v) * 1e6, 99))}
                         for name, v in (("wait_enqueued", enqueue), ("rows_ready", total))}
    sock.send_multipart([b"stop", b"0"])
    child.wait(30)
    torch.cuda.synchronize()
    ipc_close(ptr)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--producer", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results"))
    args = parser.parse_args()
    if args.producer:
        producer(args.producer)
        return 0
    results = consumer(args.iters)
    print(json.dumps(results, indent=2))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"gpu": torch.cuda.get_device_name(), "iters": args.iters, "date": time.strftime("%Y-%m-%d"),
            "command": "python benchmarks/experiments/completion_mechanisms.py " + " ".join(sys.argv[1:])}
    (out / "completion_mechanisms.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
