"""GPU clients in PID, IPC and mount namespaces of their own (tests/integration/test_namespaces.py
has the CPU half): rows exact in both modes through descriptors (a VMM slab, the tables), and
twenty killed namespaced clients leave no slab and no device memory behind.

Without MPS the clients also get a private /dev/shm. Under MPS (CUDA_MPS_PIPE_DIRECTORY set) they
keep the MPS server's pipe folder and /dev/shm, which MPS clients need, and served clients must
report that they share the daemon's server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import (
    NAMESPACES_UNAVAILABLE,
    client_pids,
    namespaced,
    run_client_processes,
    wait_until,
)

from engramd.client.shared.connection import probe

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(NAMESPACES_UNAVAILABLE is not None, reason=str(NAMESPACES_UNAVAILABLE))]
WORKER = Path(__file__).resolve().parents[1] / "integration" / "client_worker.py"
CUDA = ["--backend", "cuda"]
KILLED = 20
UNDER_MPS = bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY"))
LEAK_SLACK_BYTES = 64 << 20  # far below one round of slabs (20 x 50 MiB and more)


def test_namespaced_gpu_clients_get_exact_rows_in_both_modes(daemon_factory, reference, tmp_path):
    daemon = daemon_factory(extra=CUDA)
    runs = [("served", 0, 1), ("mapped", 0, 1), ("served", 1, 2), ("mapped", 1, 2)]
    commands = [namespaced([sys.executable, str(WORKER), "--socket", str(daemon.socket),
                            "--device", "cuda", "--out", str(tmp_path / f"{i}.npz"), "--mode", mode,
                            "--tp-rank", str(rank), "--tp-size", str(shards), "--seed", str(80 + i),
                            "--tokens", "1", "16", "256", "4097", "--slots", "3"],
                           private_shm=not UNDER_MPS)
                for i, (mode, rank, shards) in enumerate(runs)]
    run_client_processes(commands, timeout=300)
    for i, (mode, rank, shards) in enumerate(runs):
        data = np.load(tmp_path / f"{i}.npz")
        assert str(data["mode"]) == mode and int(data["pid"]) == 1
        if mode == "served":
            assert bool(data["mps_shared"]) == UNDER_MPS
        for k in range(8):
            expected = reference.expected(data[f"ids{k}"], rank, shards)
            wrong = np.argwhere(data[f"rows{k}"].astype(np.float64) != expected)
            assert wrong.size == 0, f"client {i} lookup {k}: first wrong {wrong[:5].tolist()}"
    assert daemon.stop() == 0, daemon.log()


BUSY_CLIENT = textwrap.dedent("""
    import sys, torch
    from engramd.client import EngramClient
    client = EngramClient(sys.argv[1], device="cuda", max_tokens=4096, slots=4, mode="served")
    ids = torch.randint(0, 10_000, (4096, 2, 24), device="cuda")
    client.lookup(ids).result()
    print(client.client_id, flush=True)
    while True:  # killed at some point of this
        client.lookup(ids).wait()
""")


def stats_or_stacks(daemon, timeout: float) -> dict:
    """The daemon's stats; if it does not answer, fail with its log and its threads' stacks."""
    try:
        return probe(daemon.socket, "stats", timeout).body.encode()
    except Exception as exc:
        fail_with_state(daemon, str(exc), None)


def fail_with_state(daemon, what: str, stats: dict | None) -> None:
    """Fail with everything that explains a stuck release: the daemon's last stats (each
    client's lookups in flight, the slabs it holds), its threads' Python stacks (SIGUSR1 writes
    them to its log), their kernel states, and the GPU's processes."""
    exited = daemon.proc.poll()
    if exited is None:
        daemon.proc.send_signal(signal.SIGUSR1)
        time.sleep(1)
    raise AssertionError(f"{what} (daemon exit code {exited})\nlast stats: {stats}\n"
                         f"GPU processes (pid: MiB): {gpu_processes()}\n{daemon.log()[-30000:]}\n"
                         f"{thread_states(daemon.proc.pid)}") from None


def stats_until(daemon, condition, timeout: float, what: str) -> float:
    """Seconds until the daemon's stats meet `condition`; past `timeout`, fail_with_state."""
    last: list[dict] = []

    def met() -> bool:
        last[:] = [stats_or_stacks(daemon, 60.0)]
        return condition(last[0])

    try:
        return wait_until(met, timeout=timeout, step=0.05)
    except AssertionError:
        fail_with_state(daemon, f"{what}: not within {timeout} s", last[0] if last else None)


def thread_states(pid: int) -> str:
    """Each thread of `pid` with its state and kernel wait, and every process's (a thread stuck in
    the driver shows as D there, and does not take the stack-dump signal)."""
    lines = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
        try:
            stat = (task / "stat").read_text()
            stack = (task / "stack").read_text().strip().replace("\n", " | ")
        except OSError as exc:
            stat, stack = f"({exc})", ""
        lines.append(f"{task.name} {stat[stat.find('(') : stat.find(')') + 3]} {stack[:400]}")
    ps = subprocess.run(["ps", "-eo", "pid,ppid,stat,wchan:32,comm"], capture_output=True, text=True)
    return "daemon threads:\n" + "\n".join(lines) + "\nprocesses:\n" + ps.stdout


def kill_round(daemon) -> tuple[float, float, list[int]]:
    """KILLED busy namespaced clients, killed at once; (stats answered, no slab left) in s, and
    the killed pids."""
    procs = [subprocess.Popen(namespaced([sys.executable, "-c", BUSY_CLIENT, str(daemon.socket)],
                                         private_shm=not UNDER_MPS),
                              stdout=subprocess.PIPE, text=True) for _ in range(KILLED)]
    try:
        ids = [int(p.stdout.readline() or -1) for p in procs]
        stats = stats_or_stacks(daemon, 10.0)
        assert -1 not in ids, "a client could not start"
        assert sorted(c["client_id"] for c in stats["clients"]) == sorted(ids)
        assert stats["slabs"] == KILLED and stats["slab_bytes"] > KILLED * (8 << 20)
        pids = list(client_pids(daemon.socket).values())  # in the daemon's namespace (SO_PEERCRED)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        stats_or_stacks(daemon, 120.0)  # no hang: the loop answers
        answered = time.monotonic() - killed
        gone = answered + stats_until(daemon, lambda stats: stats["slabs"] == 0, 60.0,
                                      f"the slabs of {KILLED} killed clients freed")
        stats = stats_or_stacks(daemon, 10.0)
        assert stats["clients"] == [] and stats["slab_bytes"] == 0
        # Their counter blocks' unregisters, held until the GPU is quiet (server/quiet_gate.py).
        stats_until(daemon, lambda stats: stats["deferred"] == [], 60.0,
                    f"the counter blocks of {KILLED} killed clients unregistered")
        return answered, gone, pids
    finally:
        for p in procs:
            p.kill()
            p.wait(30)
            p.stdout.close()


def gpu_processes() -> dict[int, int]:
    """pid -> device memory in MiB of each process with a context on the GPU, as nvidia-smi lists
    them (empty under MPS, where the server holds the contexts, or without nvidia-smi)."""
    try:
        listed = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                                 "--format=csv,noheader,nounits"], capture_output=True, text=True,
                                timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    rows = (line.split(",") for line in listed.splitlines() if line.count(",") == 1)
    return {int(pid): int(mib) for pid, mib in rows if pid.strip().isdigit() and mib.strip().isdigit()}


def settled_free_memory(killed: list[int]) -> int:
    """Free device memory once the killed clients' contexts are torn down: none of them is listed
    on the GPU any more (without MPS), and the free memory has not risen for three seconds
    (a driver tears contexts down one by one, with pauses)."""
    wait_until(lambda: not set(killed) & set(gpu_processes()), timeout=120.0, step=0.5)
    last, free, steady = -1, torch.cuda.mem_get_info()[0], 0
    seen = [free]
    while steady < 3:
        time.sleep(1.0)
        last, free = free, torch.cuda.mem_get_info()[0]
        seen.append(free)
        steady = steady + 1 if free <= last else 0
    print(f"free memory after the kills, once a second (MiB): {[f >> 20 for f in seen]}")
    return free


@pytest.mark.parametrize("dispatch", ["inline", "worker"])
def test_twenty_killed_namespaced_gpu_clients_leave_no_slab_and_no_memory(daemon_factory, dispatch):
    """Two rounds of KILLED killed clients: every slab is freed within a bound, and the second
    round leaves the GPU's free memory where the first left it (the daemon's allocator cache
    is warm by then, so any loss is a leak). In both dispatch modes: inline, a launch that
    blocks stops the request loop itself."""
    daemon = daemon_factory(extra=[*CUDA, "--cuda-dispatch", dispatch])
    torch.cuda.init()
    first = kill_round(daemon)
    free_after_first, held_after_first = settled_free_memory(first[2]), gpu_processes()
    second = kill_round(daemon)
    free_after_second, held_after_second = settled_free_memory(second[2]), gpu_processes()
    print(f"{KILLED} killed, twice: stats answered after {first[0]:.3f} / {second[0]:.3f} s, no slab "
          f"left after {first[1]:.3f} / {second[1]:.3f} s; free memory {free_after_first / 2**30:.2f}"
          f" -> {free_after_second / 2**30:.2f} GiB; MiB held by pid {held_after_first} -> "
          f"{held_after_second} (daemon {daemon.proc.pid})")
    if free_after_second < free_after_first - LEAK_SLACK_BYTES:
        fail_with_state(daemon, f"{(free_after_first - free_after_second) >> 20} MiB less free "
                        f"after the second round; held before {held_after_first}",
                        stats_or_stacks(daemon, 10.0))
    assert probe(daemon.socket, "stats", 10.0).body.reaped == 2 * KILLED
    assert daemon.proc.poll() is None


IMPORTER = textwrap.dedent("""
    import sys, torch
    from engramd.client.shared import cuda
    fd, size = int(sys.argv[1]), int(sys.argv[2])
    memory = cuda.DeviceAllocation.from_descriptor(fd, size, 0)
    view = cuda.tensor_view(memory.ptr, size, torch.device("cuda", 0))
    print(int(view[: 1 << 20].to(torch.int64).sum()), flush=True)
    view[:4096].fill_(7)  # the exporter must see this write
    torch.cuda.synchronize()
    memory.close()
""")


def test_device_allocation_is_shared_through_a_descriptor():
    from engramd.client.shared import cuda

    memory = cuda.DeviceAllocation.create(0, 3 << 20)  # rounded up to the granularity
    assert memory.size % (2 << 20) == 0 and memory.size >= 3 << 20
    view = cuda.tensor_view(memory.ptr, memory.size, torch.device("cuda", 0))
    pattern = torch.arange(1 << 20, device="cuda", dtype=torch.int64) % 251
    view[: 1 << 20].copy_(pattern.to(torch.uint8))
    torch.cuda.synchronize()
    fd = memory.descriptor()
    try:
        run = subprocess.run([sys.executable, "-c", IMPORTER, str(fd), str(memory.size)],
                             pass_fds=[fd], capture_output=True, text=True, timeout=120)
    finally:
        os.close(fd)
    assert run.returncode == 0, run.stderr
    assert int(run.stdout) == int(pattern.sum())
    assert int(view[:4096].to(torch.int64).sum()) == 7 * 4096
    del view
    memory.close()


def test_new_streams_are_never_shared():
    """Slab streams must be the slab's own: torch's pool hands out 32 streams per device again
    and again, and a slab on a stream that waits for a dead client's counter would wait too."""
    from engramd.client.shared import cuda

    streams = [cuda.new_stream(0) for _ in range(100)]
    try:
        assert len({s.cuda_stream for s in streams}) == 100
        pooled = {torch.cuda.Stream().cuda_stream for _ in range(64)}
        assert not pooled & {s.cuda_stream for s in streams}
        blocked, free = streams[0], streams[1]
        counter = torch.zeros(1, dtype=torch.int32, device="cuda")
        cuda.stream_wait_u32(blocked.cuda_stream, counter.data_ptr(), 1)  # waits until released
        done = torch.cuda.Event()
        with torch.cuda.stream(free):
            torch.ones(1, device="cuda").sum()
        done.record(free)
        done.synchronize()  # would hang if `free` were `blocked`
        cuda.stream_write_u32(free.cuda_stream, counter.data_ptr(), 1)
        blocked.synchronize()
    finally:
        torch.cuda.synchronize()
        for s in streams:
            cuda.STREAMS.give(s)
    again = cuda.new_stream(0)  # an idle stream given back is handed out again
    assert again.cuda_stream in {s.cuda_stream for s in streams}
    cuda.STREAMS.give(again)
