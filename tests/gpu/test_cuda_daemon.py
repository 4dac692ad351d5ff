"""The CUDA data path end to end: a real daemon (--backend cuda) and client processes on one GPU."""

from __future__ import annotations

import signal
import sys
import time
import zlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import check_rows_stay_across_a_restart, run_client_processes, wait_until
from reference import bucket_ids, random_ids

from engramd.client import DaemonUnavailableError, EngramClient, LookupFailedError
from engramd.client.shared.connection import probe

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
WORKER = Path(__file__).resolve().parents[1] / "integration" / "client_worker.py"
CUDA = ["--backend", "cuda"]


def assert_exact(rows: torch.Tensor, expected: np.ndarray, what: str) -> None:
    actual = rows.double().cpu().numpy()
    assert actual.shape == expected.shape, what
    wrong = np.argwhere(actual != expected)
    assert wrong.size == 0, f"{what}: {len(wrong)} wrong values, first at {wrong[:5].tolist()}"


def test_served_and_mapped_client_processes_on_one_gpu(daemon_factory, reference, tmp_path):
    daemon = daemon_factory(extra=CUDA)
    views = [(0, 1, "served"), (1, 2, "mapped"), (3, 4, "served"), (4, 7, "mapped")]
    commands = [[sys.executable, str(WORKER), "--socket", str(daemon.socket), "--device", "cuda",
                 "--out", str(tmp_path / f"c{i}.npz"), "--tp-rank", str(r), "--tp-size", str(s),
                 "--seed", str(i), "--tokens", "1", "16", "256", "4097", "--rounds", "2", "--slots", "3",
                 "--dtype", "int32" if i % 2 else "int64", "--mode", mode]
                for i, (r, s, mode) in enumerate(views)]
    run_client_processes(commands, timeout=300)
    for i, (rank, shards, mode) in enumerate(views):
        data = np.load(tmp_path / f"c{i}.npz")
        assert str(data["mode"]) == mode
        for k in range(8):
            ids, rows = data[f"ids{k}"], data[f"rows{k}"]
            expected = reference.expected(ids, rank, shards)
            wrong = np.argwhere(rows.astype(np.float64) != expected)
            assert wrong.size == 0, f"client {i} lookup {k}: first wrong {wrong[:5].tolist()}"
    assert daemon.stop() == 0, daemon.log()


@pytest.mark.parametrize("mode", ["served", "mapped"])
@pytest.mark.parametrize("kind", ["random", "repeated", "sorted", "dead", "out_of_range", "buckets"])
def test_gpu_rows_match_reference(daemon_factory, reference, kind, mode):
    daemon = daemon_factory(extra=CUDA)
    rng = np.random.default_rng(zlib.crc32(kind.encode()))  # the same IDs in every run
    ids = random_ids(rng, 300, reference.rows, reference.heads, dead=0.0, out_of_range=0.0)
    if kind == "repeated":
        ids[:] = ids[0]
    elif kind == "sorted":
        ids = np.sort(ids, axis=0)
    elif kind == "dead":
        ids[:] = -1
    elif kind == "out_of_range":
        ids = random_ids(rng, 300, reference.rows, reference.heads, dead=0.2, out_of_range=0.5)
    elif kind == "buckets":
        ids = bucket_ids(rng, 300, reference.bucket_sizes)
    rows_per_layer = np.asarray(reference.rows).reshape(1, -1, 1)
    with EngramClient(daemon.socket, device="cuda", max_tokens=512, slots=2, mode=mode) as client:
        assert client.mode == mode
        outside = 0
        for dtype in (torch.int64, torch.int32):
            source = torch.from_numpy(np.clip(ids, -2**31, 2**31 - 1)).to(dtype).cuda()
            rows = client.lookup(source).wait()
            torch.cuda.current_stream().synchronize()
            sent = source.long().cpu().numpy()
            assert_exact(rows, reference.expected(sent), f"{kind} {dtype}")
            outside += int(np.count_nonzero((sent != -1) & ((sent < 0) | (sent >= rows_per_layer))))
        # counted on the device, reported by stats a heartbeat or two later (never synchronised)
        wait_until(lambda: client.stats()["out_of_range"] == outside, timeout=10.0, step=0.1)


@pytest.mark.parametrize("mode", ["served", "mapped"])
def test_a_slots_rows_stay_where_they_were_across_a_restart(daemon_factory, reference, mode):
    """Served: the new daemon's slab is mapped at the old one's address; mapped: the client's
    own slot memory is kept. Strided rows (T < max_tokens) through the direct-launch gather."""
    check_rows_stay_across_a_restart(daemon_factory, reference, "cuda", mode, extra=tuple(CUDA))


def test_no_host_sync_consumer_reads_the_right_rows(daemon_factory, reference):
    delay_ms = 400
    daemon = daemon_factory(extra=CUDA, env={"ENGRAMD_DEBUG_GATHER_DELAY_MS": str(delay_ms)})
    rng = np.random.default_rng(1)
    with EngramClient(daemon.socket, device="cuda", max_tokens=256, slots=2, mode="served") as client:
        warm = torch.from_numpy(random_ids(rng, 64, reference.rows, reference.heads)).cuda()
        _ = client.lookup(warm).wait().float() * 1.0  # load the consumer's kernels (lazy loading)
        torch.cuda.synchronize()
        ids = torch.from_numpy(random_ids(rng, 64, reference.rows, reference.heads)).cuda()
        stream = torch.cuda.current_stream()
        started = time.perf_counter()
        rows = client.lookup(ids).wait()
        consumed = rows.float() * 1.0  # consumer work, enqueued behind the wait
        enqueue_s = time.perf_counter() - started
        pending = not stream.query()
        stream.synchronize()
        waited_s = time.perf_counter() - started
    assert enqueue_s < delay_ms / 1000 / 4, f"lookup+wait+consumer took {enqueue_s * 1e3:.1f} ms to enqueue"
    assert pending, "the consumer's stream finished before the delayed gather could have"
    assert waited_s >= delay_ms / 1000 * 0.8
    assert_exact(consumed, reference.expected(ids.cpu().numpy()), "delayed lookup")


def test_daemon_killed_mid_lookup_releases_the_stream(daemon_factory, reference):
    daemon = daemon_factory(extra=CUDA, env={"ENGRAMD_DEBUG_GATHER_DELAY_MS": "5000"})
    client = EngramClient(daemon.socket, device="cuda", max_tokens=16, slots=2, mode="served",
                          reconnect_timeout=1.0)  # no restart comes: give up at once
    ids = torch.zeros((4, 2, 24), dtype=torch.int64, device="cuda")
    future = client.lookup(ids)
    consumed = future.wait().clone()  # the engine's consumer: queued behind the wait
    daemon.proc.send_signal(signal.SIGKILL)
    daemon.proc.wait()
    started = time.perf_counter()
    torch.cuda.current_stream().synchronize()  # must not hang: the watchdog releases the wait
    released_s = time.perf_counter() - started
    assert future.failed() and not future.ok()
    assert bool(consumed.isnan().all()), "the rows the daemon never wrote must read as NaN"
    with pytest.raises(LookupFailedError) as raised:  # the engine hears of it at its next call
        client.lookup(ids)
    assert raised.value.seqs == (future.seq,)
    with pytest.raises(DaemonUnavailableError, match="exited"):
        client.lookup(ids)
    with pytest.raises(LookupFailedError):
        future.wait()  # its own wait says so too
    client.close()
    assert released_s < 2.0, f"stream released after {released_s:.2f} s"


def test_a_lookup_whose_ids_are_late_is_reported_and_holds_its_slot(daemon_factory, reference):
    """A client whose stream has not handed over a lookup's IDs holds the daemon stream's wait
    (and every stream sharing its hardware queue): past `ids_wait_s` the daemon names it in the
    log; until the IDs come, the slot takes no further lookup (the daemon queues nothing more
    behind the wait). Once they come, the lookup's rows are exact."""
    from engramd.client.errors import SlotBusyError
    from engramd.client.shared import cuda
    from engramd.client.shared.host_counters import HostCounters
    from engramd.client.shared.slab import SlabLayout

    daemon = daemon_factory(extra=[*CUDA, "--ids-wait-s", "1.5", "--heartbeat-interval", "0.25"])
    rng = np.random.default_rng(5)
    gate = HostCounters.create(SlabLayout(1, 1, 1, 1, 1, 1), "engramd-test-gate", 0)
    stream = cuda.new_stream(0)
    try:
        with EngramClient(daemon.socket, device="cuda", max_tokens=64, slots=2, mode="served") as client:
            ids = torch.from_numpy(random_ids(rng, 64, reference.rows, reference.heads)).cuda()
            torch.cuda.synchronize()
            cuda.stream_wait_u32(stream.cuda_stream, gate.address(0, 0), 1)  # shut until opened
            late = client.lookup(ids, stream=stream)  # its IDs' copy waits behind the gate
            with pytest.raises(SlotBusyError, match="not handed over yet"):  # a slot takes no more
                client._conn.call("lookup", 10.0, client_id=client.client_id, slot=late.slot,
                                  seq=late.seq + 1, ids_dtype="int64", ids_shape=list(ids.shape),
                                  inline=False, ack=True)
            wait_until(lambda: "has waited over 1.5 s for its IDs" in daemon.log(), timeout=30.0, step=0.1)
            assert f"lookup {late.seq} (slot {late.slot})" in daemon.log()
            gate.store(0, 0, 1)
            assert_exact(late.result(), reference.expected(ids.cpu().numpy()), "late IDs")
            again = torch.from_numpy(random_ids(rng, 64, reference.rows, reference.heads)).cuda()
            assert_exact(client.lookup(again, slot=late.slot).result(),
                         reference.expected(again.cpu().numpy()), "the slot's next lookup")
    finally:
        gate.store(0, 0, 1)
        torch.cuda.synchronize()
        cuda.STREAMS.give(stream)
        gate.close()


def test_mapped_lookup_enqueues_without_a_host_sync(daemon_factory, reference):
    """A mapped lookup whose IDs are produced late on the caller's stream: lookup, wait and the
    consumer are enqueued at once, the gather runs after the IDs, the consumer after the gather."""
    delay_ms = 400
    daemon = daemon_factory(extra=CUDA)
    rng = np.random.default_rng(2)
    with EngramClient(daemon.socket, device="cuda", max_tokens=256, slots=2, mode="mapped") as client:
        warm = torch.from_numpy(random_ids(rng, 64, reference.rows, reference.heads)).cuda()
        _ = client.lookup(warm).wait().float() * 1.0
        torch.cuda.synchronize()
        ids = torch.from_numpy(random_ids(rng, 64, reference.rows, reference.heads)).cuda()
        late = torch.full_like(ids, -1)
        stream = torch.cuda.current_stream()
        started = time.perf_counter()
        torch.cuda._sleep(int(delay_ms * 2_000_000))  # the IDs' producer is slow
        late.copy_(ids)
        rows = client.lookup(late).wait()
        consumed = rows.float() * 1.0
        enqueue_s = time.perf_counter() - started
        pending = not stream.query()
        stream.synchronize()
        waited_s = time.perf_counter() - started
    assert enqueue_s < delay_ms / 1000 / 4, f"lookup+wait+consumer took {enqueue_s * 1e3:.1f} ms to enqueue"
    assert pending and waited_s >= delay_ms / 1000 * 0.8
    assert_exact(consumed, reference.expected(ids.cpu().numpy()), "late IDs, mapped")
    stats = probe(daemon.socket, "stats", 5.0).body.encode()
    assert stats["clients"] == [] and stats["lookups"] >= 2  # reported with its release


def test_mapped_rows_of_ids_in_any_layout_match_the_reference(daemon_factory, reference):
    """A mapped client launches the gather directly for contiguous, 16-byte aligned IDs on its
    GPU (reusing the kernel its first such launch compiled) and through the checked call for
    others: rows are exact either way, in both dtypes and at several token counts. One client
    for every layout, aligned first: a direct launch of unaligned IDs would reuse the aligned
    kernel and read them wrong."""
    daemon = daemon_factory(extra=CUDA)
    rng = np.random.default_rng(11)
    with EngramClient(daemon.socket, device="cuda", max_tokens=512, slots=2, mode="mapped") as client:
        for layout in ("contiguous", "unaligned", "strided", "host"):
            for tokens in (1, 5, 16, 300):
                ids = random_ids(rng, tokens, reference.rows, reference.heads)
                for dtype in (torch.int64, torch.int32):
                    source = ids_in_layout(torch.from_numpy(ids).to(dtype), layout)
                    rows = client.lookup(source).wait()
                    torch.cuda.current_stream().synchronize()
                    sent = source.long().cpu().numpy()  # int32: out-of-range IDs wrap as sent
                    assert_exact(rows, reference.expected(sent), f"{layout}, {tokens} tokens, {dtype}")


@pytest.mark.parametrize("mode", ["mapped", "served"])
def test_a_client_made_and_used_under_a_cuda_default_device(daemon_factory, reference, mode):
    """Engines build their modules, and so their engramd client, under `with torch.device("cuda")`
    (vLLM does): the client's host buffers stay on the host there (pinning a CUDA tensor fails)
    and its rows are exact; so are a mapped client's captured lookup's (its descriptor's host
    words)."""
    daemon = daemon_factory(extra=CUDA)
    ids = torch.from_numpy(random_ids(np.random.default_rng(5), 40, reference.rows, reference.heads))
    with torch.device("cuda"), EngramClient(daemon.socket, device="cuda", max_tokens=64, slots=2,
                                            mode=mode) as client:
        rows = client.lookup(ids).wait()
        torch.cuda.current_stream().synchronize()
        assert_exact(rows, reference.expected(ids.numpy()), f"{mode}, CUDA default device")
        if mode == "mapped":
            captured = client.capturable_lookup(ids.cuda())
            rows = captured.record(ids.shape[0])
            torch.cuda.synchronize()
            assert_exact(rows, reference.expected(ids.numpy()), "captured, CUDA default device")
            captured.close()


def test_a_mapped_lookups_sm_fraction_sets_its_grid(daemon_factory, reference, monkeypatch):
    """Without a fraction a mapped gather's grid takes the daemon's share of the SMs; with one,
    its own, in the direct launch (unsorted) and the checked ones (strided IDs, sorted) alike;
    rows exact."""
    import triton

    from engramd.kernels import gather_triton as gt

    sort_from = 1000
    daemon = daemon_factory(extra=[*CUDA, "--gather-sm-fraction", "0.5",
                                   "--sort-min-tokens", str(sort_from)])
    launched = []
    original = gt._Launch

    def recording(*args):
        launched.append(original(*args))
        return launched[-1]

    monkeypatch.setattr(gt, "_Launch", recording)
    direct = gt._DirectLaunch.__call__

    def recording_direct(self, grid, *args):  # a direct launch makes no _Launch
        launched.append(SimpleNamespace(grid=grid))
        return direct(self, grid, *args)

    monkeypatch.setattr(gt._DirectLaunch, "__call__", recording_direct)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rng = np.random.default_rng(12)
    with EngramClient(daemon.socket, device="cuda", max_tokens=2 * sort_from, slots=2,
                      mode="mapped") as client:
        for tokens, layout in ((600, "contiguous"), (600, "strided"), (2 * sort_from, "contiguous")):
            for fraction, share in ((None, 0.5), (1.0, 1.0), (0.25, 0.25), (None, 0.5)):
                ids = random_ids(rng, tokens, reference.rows, reference.heads)
                launched.clear()
                source = ids_in_layout(torch.from_numpy(ids), layout)
                rows = client.lookup(source, sm_fraction=fraction).wait()
                torch.cuda.current_stream().synchronize()
                what = f"{tokens} tokens, {layout}, sm_fraction {fraction}"
                assert_exact(rows, reference.expected(ids), what)
                programs = gt.grid_programs(sms, share)
                items = tokens * len(reference.layer_ids) * reference.heads
                block = gt.sorted_block_rows(items, programs) if tokens >= sort_from else gt.DEFAULT_BLOCK_ROWS
                assert [launch.grid for launch in launched] == [min(programs, triton.cdiv(items, block))], what


def test_a_mapped_clients_own_cache_serves_hits_with_exact_rows(daemon_factory, reference, tmp_path):
    """A mapped GPU client gathers through a hot-row cache of its own, warmed from the daemon's
    trace (on the keeper's thread) and refreshed by its keeper while the lookups run (every 5 ms, so ways change under
    running gathers): rows stay exact, the cache is hit, and closing the client stops the
    keeper's thread."""
    import threading

    rng = np.random.default_rng(21)
    hot = random_ids(rng, 64, reference.rows, reference.heads, dead=0.0, out_of_range=0.0)
    np.save(tmp_path / "warm.npy", np.repeat(hot[:32], 8, axis=0))  # counted past admit_min
    daemon = daemon_factory(extra=[*CUDA, "--hot-cache-warm-file", str(tmp_path / "warm.npy"),
                                   "--mapped-hot-cache-gib", "0.01", "--hot-cache-refresh-ms", "5"])
    keepers = lambda: [t for t in threading.enumerate() if t.name.startswith("engramd-cache-")]  # noqa: E731
    with EngramClient(daemon.socket, device="cuda", max_tokens=256, slots=2, mode="mapped") as client:
        assert client.hot_cache_stats() is not None and len(keepers()) == 1
        # the warm-up's admissions, made on the keeper's thread after the attach
        wait_until(lambda: client.hot_cache_stats()["admitted"] > 0, timeout=10.0, step=0.02)
        for i in range(80):  # hot tokens (the warmed half and one the refreshes admit) and cold ones
            ids = np.concatenate([hot[rng.integers(0, 64, 160)],
                                  random_ids(rng, 40, reference.rows, reference.heads)])
            for dtype in (torch.int64, torch.int32):
                source = torch.from_numpy(ids).to(dtype).cuda()
                rows = client.lookup(source).wait()
                torch.cuda.current_stream().synchronize()
                assert_exact(rows, reference.expected(source.long().cpu().numpy()), f"lookup {i} {dtype}")
            time.sleep(0.002)
        wait_until(lambda: sum(client.hot_cache_stats()["hits"]) > 0, timeout=5.0, step=0.02)
        stats = client.hot_cache_stats()
        assert stats["refreshes"] > 0 and stats["admitted"] > 0, stats
    assert keepers() == []


@pytest.mark.parametrize("gather_at", ["wait", "lookup"])
def test_a_mapped_gather_is_queued_where_gather_at_says(daemon_factory, reference, gather_at):
    """gather_at="wait" (the default): a mapped lookup's gather is queued at its first wait or at
    the next lookup, not in lookup(): after lookup() and a device sync its slot still holds what
    was there, and the IDs, dropped by the caller in between while the allocator hands memory
    out again, are still the ones gathered. gather_at="lookup": the rows are there after
    lookup() and a sync. Rows exact either way; a lookup never waited for is gathered at
    close(), its out-of-range IDs counted."""
    sentinel, tokens = -3.0, 48
    daemon = daemon_factory(extra=CUDA)
    rng = np.random.default_rng(31)
    options = {} if gather_at == "wait" else {"gather_at": gather_at}
    batches = [random_ids(rng, tokens, reference.rows, reference.heads) for _ in range(3)]
    with EngramClient(daemon.socket, device="cuda", max_tokens=64, slots=2, mode="mapped",
                      **options) as client:
        assert client.gather_at == gather_at
        client.lookup(torch.from_numpy(batches[0]).cuda()).wait()  # load the kernels
        torch.cuda.synchronize()
        for slot in range(client.slots):
            client.slot_rows(slot).fill_(sentinel)
        slot_of = lambda future: client.slot_rows(future.slot)[:, :tokens]  # noqa: E731
        ids = torch.from_numpy(batches[1]).cuda()
        first = client.lookup(ids)
        del ids
        clobber = [torch.from_numpy(batches[2]).cuda() for _ in range(4)]  # may reuse freed blocks
        torch.cuda.synchronize()
        if gather_at == "wait":
            assert bool((slot_of(first) == sentinel).all()), "gathered before its wait"
        else:
            assert_exact(slot_of(first), reference.expected(batches[1]), "gathered in lookup()")
        second = client.lookup(clobber[0])  # queues the first lookup's gather, if it waits
        torch.cuda.synchronize()
        assert_exact(slot_of(first), reference.expected(batches[1]), "the first lookup, then a second")
        if gather_at == "wait":
            assert bool((slot_of(second) == sentinel).all()), "gathered before its wait"
        assert_exact(second.wait(), reference.expected(batches[2]), "the second lookup, waited")
        assert_exact(first.wait(), reference.expected(batches[1]), "the first lookup, waited last")
        torch.cuda.synchronize()
        last = random_ids(rng, tokens, reference.rows, reference.heads, dead=0.0, out_of_range=0.5)
        client.lookup(torch.from_numpy(last).cuda())  # never waited for: close() gathers it
    rows_per_layer = np.asarray(reference.rows).reshape(1, -1, 1)
    outside = [int(np.count_nonzero((ids != -1) & ((ids < 0) | (ids >= rows_per_layer))))
               for ids in (*batches, last)]
    assert outside[-1] > 0
    stats = probe(daemon.socket, "stats", 5.0).body.encode()  # the counts of the release
    assert stats["clients"] == [] and stats["out_of_range"] == sum(outside), (stats, outside)


@pytest.mark.parametrize("gather_at", ["wait", "lookup"])
def test_a_mapped_gather_that_fails_is_raised_by_its_own_wait(daemon_factory, reference, gather_at):
    """A gather that raises when it is queued (here: at the next lookup, or in lookup()) fails
    that lookup's wait() with InternalError; the next lookup is served, rows exact."""
    from engramd.client.errors import InternalError

    daemon = daemon_factory(extra=CUDA)
    rng = np.random.default_rng(32)
    with EngramClient(daemon.socket, device="cuda", max_tokens=64, slots=2, mode="mapped",
                      gather_at=gather_at) as client:
        gather = client._mapped_path.gather

        class FailsOnce:
            out_of_range = gather.out_of_range
            failed = False

            def __call__(self, *args):
                if not self.failed:
                    self.failed = True
                    raise RuntimeError("CUDA out of memory (a test's)")
                return gather(*args)

        client._mapped_path.gather = FailsOnce()
        batches = [random_ids(rng, 16, reference.rows, reference.heads) for _ in range(2)]
        failed = client.lookup(torch.from_numpy(batches[0]).cuda())
        served = client.lookup(torch.from_numpy(batches[1]).cuda())
        assert client._mapped_path.gather.failed
        with pytest.raises(InternalError, match="gather of a lookup of 16 tokens failed: CUDA out of memory"):
            failed.wait()
        assert_exact(served.wait(), reference.expected(batches[1]), "the lookup after the failed one")


def ids_in_layout(exact: torch.Tensor, layout: str) -> torch.Tensor:
    """`exact` (on the CPU) as IDs of `layout`: on the GPU contiguous, one element past a 16-byte
    aligned start, strided (every other element of a wider tensor), or left on the host."""
    if layout == "unaligned":
        size = exact.element_size()
        raw = torch.empty(exact.numel() * size + size, dtype=torch.uint8, device="cuda")
        source = raw[size:].view(exact.dtype).view(exact.shape)
        source.copy_(exact.cuda())
        assert source.data_ptr() % 16 != 0
        return source
    if layout == "strided":
        source = torch.stack([exact, exact], dim=-1).cuda()[..., 0]
        assert not source.is_contiguous()
        return source
    return exact if layout == "host" else exact.cuda()


@pytest.mark.parametrize("mode", ["served", "mapped"])
def test_a_slot_is_not_overwritten_under_a_slow_reader_on_another_stream(daemon_factory, reference,
                                                                         mode):
    """One slot: the rows of lookup A are read on a second stream that is held up, and lookup B
    into the same slot is made on the first stream meanwhile. B's gather must wait for that
    reader (stream order, no host sync), so the reader copies A's rows, and B's are B's."""
    daemon = daemon_factory(extra=CUDA)
    rng = np.random.default_rng(3)
    with EngramClient(daemon.socket, device="cuda", max_tokens=64, slots=1, mode=mode) as client:
        ids = [torch.from_numpy(random_ids(rng, 32, reference.rows, reference.heads)).cuda()
               for _ in range(2)]
        reader = torch.cuda.Stream()
        copied = torch.empty((2, 32, client.shard.local_heads, 256), dtype=torch.bfloat16, device="cuda")
        client.lookup(ids[0]).wait(reader)  # load the kernels
        torch.cuda.synchronize()
        first = client.lookup(ids[0])
        rows = first.wait(reader)
        with torch.cuda.stream(reader):
            torch.cuda._sleep(400_000_000)  # ~0.2 s: the reader is slow
            copied.copy_(rows)
        second = client.lookup(ids[1]).wait()
        torch.cuda.synchronize()
        assert_exact(copied, reference.expected(ids[0].cpu().numpy()), f"{mode}: the slow reader's rows")
        assert_exact(second, reference.expected(ids[1].cpu().numpy()), f"{mode}: the next lookup's rows")


def mps_control_running() -> bool:
    """Independent of CUDA's answer: an MPS control daemon process is alive and its pipe folder
    (the one this process would use) exists."""
    from engramd.client.shared.mps import pipe_directory

    names = []
    for entry in Path("/proc").iterdir():
        try:
            names.append((entry / "comm").read_text().strip())
        except OSError:
            continue
    return "nvidia-cuda-mps" in " ".join(names) and Path(pipe_directory()).is_dir()


def test_mps_report_matches_reality(daemon_factory):
    """Registration, stats and health say whether daemon and client share MPS, and that agrees
    with whether an MPS control daemon serves this run (the GPU tests run with and without)."""
    daemon = daemon_factory(extra=CUDA)
    running = mps_control_running()
    with EngramClient(daemon.socket, device="cuda:0", max_tokens=4) as client:
        assert client.mps["shared"] is running, client.mps
        assert client.mode == "mapped"  # what auto makes of a GPU client, with or without MPS
        assert client.mps["daemon"]["enabled"] is running and client.mps["client"]["enabled"] is running
        stats = client.stats()
        assert [c["mps_shared"] for c in stats["clients"]] == [running]
        assert {s["enabled"] for s in stats["mps"].values()} == {running}
        assert {s["enabled"] for s in client.health()["mps"].values()} == {running}
