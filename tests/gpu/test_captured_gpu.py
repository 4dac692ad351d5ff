"""Lookups recorded in CUDA graphs (client/captured.py) on a mapped GPU client: replays equal the
reference bit for bit, follow a reload and a daemon restart without a new capture, and write NaN
rows, which check() reports, while the client has no tables: never another table's rows.

Graphs are captured with capture_error_mode="thread_local", as docs/client.md asks of engines,
but for one test: the client's threads (the cache keeper, the upkeep) make CUDA calls while the
engine captures, in CUDA's default mode too, as vLLM and SGLang capture."""

from __future__ import annotations

import gc
import time
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from helpers import DEMO_HEARTBEAT_S, point, reload, row_kinds, rows_match, wait_until
from reference import random_ids
from test_reload_gpu import CUDA

from engramd.client import (
    BadRequestError,
    CaptureUnsupportedError,
    EngramClient,
    ReplayFailedError,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
MAX_TOKENS = 256
FOLLOW_S = 120.0  # a reload or a restart reaches the replays within this


def captured_graph(client: EngramClient, tokens: int, captured=None, per_layer: bool = False):
    """(graph, captured lookup, its rows view): a step of `tokens` in a graph of its own, one
    record, or one a layer (`per_layer`)."""
    if captured is None:
        buffer = torch.full((MAX_TOKENS, client.geometry.n_layers, client.geometry.heads), -1,
                            dtype=torch.int64, device="cuda")
        captured = client.capturable_lookup(buffer)
    graph = torch.cuda.CUDAGraph()
    n_layers = client.geometry.n_layers
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for layers in [range(layer, layer + 1) for layer in range(n_layers)] if per_layer else [None]:
            rows = captured.record(tokens, layers=layers)
    return graph, captured, rows


@contextmanager
def global_capture(graph):
    """torch.cuda.graph in CUDA's default mode (capture_error_mode="global"), as vLLM and SGLang
    capture, with the cycle collector run first and kept off during the capture, as vLLM's model
    runner does around its captures. In that mode a graph may not be destroyed while a stream
    captures, and the collector destroys an unreachable graph left by earlier code (a test's
    frame kept in a cycle) at whatever allocation starts it: inside the capture, that spoils it."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph):
            yield
    finally:
        if was_enabled:
            gc.enable()


def replay(graph, captured, rows, ids: np.ndarray) -> np.ndarray:
    """Write `ids` into the buffer, replay, and return the rows as float64."""
    captured.ids[:ids.shape[0]].copy_(torch.from_numpy(ids), non_blocking=False)
    graph.replay()
    torch.cuda.synchronize()
    return rows.double().cpu().numpy()


def settled(captured) -> dict[str, int]:
    """Counts once the device is idle (counts() reads the last finished copy)."""
    torch.cuda.synchronize()
    captured.counts()
    torch.cuda.synchronize()
    return captured.counts()


def outside(ids: np.ndarray, rows: list[int]) -> int:
    return int(sum(((col != -1) & ((col < 0) | (col >= r))).sum()
                   for col, r in zip(np.moveaxis(ids, 1, 0), rows, strict=True)))


def test_replays_equal_the_reference_and_count_out_of_range_ids(daemon_factory, reference):
    daemon = daemon_factory(extra=CUDA)
    rng = np.random.default_rng(31)
    with EngramClient(daemon.socket, device="cuda", mode="mapped", max_tokens=MAX_TOKENS) as client:
        graphs = {}
        captured = None
        for tokens in (1, 16, MAX_TOKENS):
            graphs[tokens] = captured_graph(client, tokens, captured)
            captured = graphs[tokens][1]
        bad = 0
        hot = random_ids(rng, 32, reference.rows, reference.heads)
        for step in range(30):
            for tokens, (graph, _, rows) in graphs.items():
                ids = (np.concatenate([hot] * 8)[:tokens] if step % 2
                       else random_ids(rng, tokens, reference.rows, reference.heads))
                got = replay(graph, captured, rows, ids)
                assert rows_match(got, reference, ids), f"step {step}, {tokens} tokens"
                bad += outside(ids, reference.rows)
        counts = settled(captured)
        assert counts == {"replays": 90, "poisoned": 0, "out_of_range": bad, "abandoned": 0}
        captured.check()
        # lookup() keeps off the captured slot.
        for _ in range(client.slots * 2):
            future = client.lookup(torch.from_numpy(hot).cuda())
            assert future.slot != captured.slot
        with pytest.raises(BadRequestError, match="captured lookup"):
            client.lookup(torch.from_numpy(hot).cuda(), slot=captured.slot)


@pytest.mark.parametrize("per_layer", [False, True], ids=["one launch", "a launch per layer"])
def test_replays_read_in_place_ids_the_graph_itself_writes_on_a_forked_stream(daemon_factory,
                                                                              reference, per_layer):
    """As the vLLM plugin records it in a full graph: IDs the graph computes (here a copy of its
    input, in the graph's memory pool) read in place by a gather forked to a side stream, a
    launch per layer each joined before its layer's rows are read (or one launch). Every
    replay's rows are its own IDs' rows, bit for bit (the lookup's buffer holds only DEAD IDs,
    whose rows are zeros: a gather of the buffer fails), and each replay counts once."""
    daemon = daemon_factory(extra=CUDA)
    rng = np.random.default_rng(37)
    tokens = 16
    with EngramClient(daemon.socket, device="cuda", mode="mapped", max_tokens=MAX_TOKENS) as client:
        buffer = torch.full((MAX_TOKENS, client.geometry.n_layers, client.geometry.heads), -1,
                            dtype=torch.int64, device="cuda")
        captured = client.capturable_lookup(buffer)
        source = torch.full_like(buffer[:tokens], -1)  # the graph's input, written before each replay
        side = torch.cuda.Stream()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            ids = source + 0  # the graph's own tensor, as vLLM's hashes are
            assert captured.why_not_in_place(ids) is None
            side.wait_stream(torch.cuda.current_stream())
            ids.record_stream(side)
            n_layers = client.geometry.n_layers
            launches = [range(layer, layer + 1) for layer in range(n_layers)] if per_layer \
                else [range(n_layers)]
            events = []
            for layers in launches:
                rows = captured.record(tokens, stream=side, ids=ids, layers=layers)
                events.append(torch.cuda.Event())
                events[-1].record(side)
            parts = []
            for layers, event in zip(launches, events, strict=True):
                torch.cuda.current_stream().wait_event(event)
                parts.append(rows[layers.start:layers.stop].clone())
            out = torch.cat(parts)
        for step in range(10):
            step_ids = random_ids(rng, tokens, reference.rows, reference.heads)
            source.copy_(torch.from_numpy(step_ids))
            graph.replay()
            torch.cuda.synchronize()
            assert rows_match(out.double().cpu().numpy(), reference, step_ids), f"replay {step}"
        assert settled(captured)["replays"] == 10
        captured.check()


@pytest.mark.parametrize("per_layer", [False, True], ids=["one launch", "a launch per layer"])
def test_replays_follow_a_reload_without_a_new_capture(daemon_factory, demo_checkpoint, reference,
                                                       second_checkpoint, second_reference, tmp_path,
                                                       per_layer):
    """With the hot-row cache refreshing every 5 ms under the replays (its grace waits for
    them): each replay's rows are all of one checkpoint, the old until the switch, then the new
    for good, also where a replay gathers a layer a launch, and the old mapping goes once no
    replay can read it."""
    current = tmp_path / "current"
    point(current, demo_checkpoint)
    daemon = daemon_factory(tables=current, extra=CUDA)
    rng = np.random.default_rng(32)
    hot = random_ids(rng, 16, reference.rows, reference.heads, out_of_range=0.0)
    ids = np.concatenate([hot] * 4)
    with EngramClient(daemon.socket, device="cuda", mode="mapped", max_tokens=MAX_TOKENS) as client:
        graph, captured, rows = captured_graph(client, ids.shape[0], per_layer=per_layer)
        for _ in range(100):  # long enough for the keeper to admit rows
            assert rows_match(replay(graph, captured, rows, ids), reference, ids)
        point(current, second_checkpoint)
        status = reload(daemon)
        assert (status["exit"], status["state"]) == (0, "done"), status
        switched, deadline = 0, time.monotonic() + FOLLOW_S
        while switched < 50 and time.monotonic() < deadline:
            kinds = row_kinds(replay(graph, captured, rows, ids), ids, reference, second_reference)
            assert "nan" not in kinds and len(kinds) <= 1, f"a reload switches whole replays: {kinds}"
            assert kinds != {"old"} or switched == 0, "old rows after new ones"
            switched += kinds == {"new"}
        assert switched == 50, "the replays never read the reloaded tables"
        wait_until(lambda: not client._mapped_path.old_mappings, timeout=30)
        captured.check()
        assert settled(captured)["poisoned"] == 0


def test_a_daemon_restart_on_other_tables_gives_nan_replays_then_the_new_rows(
        daemon_factory, reference, second_checkpoint, second_reference):
    first = daemon_factory(instance="cap", extra=CUDA)
    rng = np.random.default_rng(33)
    ids = random_ids(rng, 48, reference.rows, reference.heads)
    client = EngramClient(first.socket, device="cuda", mode="mapped", max_tokens=MAX_TOKENS,
                          reconnect_timeout=120)
    try:
        graph, captured, rows = captured_graph(client, ids.shape[0])
        assert rows_match(replay(graph, captured, rows, ids), reference, ids)
        first.proc.kill()
        first.proc.wait()
        # No daemon: the client keeps its mapping, so replays go on reading it.
        for _ in range(20):
            assert rows_match(replay(graph, captured, rows, ids), reference, ids)
        second = daemon_factory(instance="cap", tables=second_checkpoint, shm_dir=first.shm_dir,
                                workdir=first.workdir, extra=CUDA)
        # Rows of a replay under way when the poison lands may be part old, part NaN.
        seen, deadline = {"old": 0, "nan": 0, "new": 0, "only_new": 0}, time.monotonic() + FOLLOW_S
        while seen["only_new"] < 20 and time.monotonic() < deadline:
            kinds = row_kinds(replay(graph, captured, rows, ids), ids, reference, second_reference)
            assert "old" not in kinds or seen["new"] == 0, f"old rows after new ones: {seen}"
            for kind in kinds:
                seen[kind] += 1
            seen["only_new"] += kinds == {"new"}
        assert seen["only_new"] == 20, f"never the new rows: {seen}"
        assert seen["nan"] >= 1, "the adopting replay after the remap is a poisoned one"
        assert settled(captured)["poisoned"] == seen["nan"]
        with pytest.raises(ReplayFailedError) as failed:
            captured.check()
        assert failed.value.replays == seen["nan"]
        # The error's traceback holds this frame: kept, the pair is a cycle that keeps the graph
        # until the collector runs, which may be during another test's capture (global_capture).
        del failed
        captured.check()  # reported once
        assert second.health()["ready"]
    finally:
        client.close()


def test_captures_in_cudas_default_mode_beside_the_clients_threads(daemon_factory, reference):
    """vLLM and SGLang capture in CUDA's default (global) mode, where a possibly unsafe CUDA call
    from any other thread in the default mode is refused and spoils the capture. A mapped
    client's own threads (its cache keeper, refreshing every 5 ms over the lookups in between,
    and its heartbeat) go on while the engine captures: each capture, held open until the keeper
    has refreshed, must succeed, and its replays equal the reference."""
    daemon = daemon_factory(extra=CUDA)
    rng = np.random.default_rng(43)
    with EngramClient(daemon.socket, device="cuda", mode="mapped", max_tokens=MAX_TOKENS) as client:
        keeper = client._mapped_path.tables.keeper
        assert keeper is not None  # the thread this is about runs
        buffer = torch.full((MAX_TOKENS, client.geometry.n_layers, client.geometry.heads), -1,
                            dtype=torch.int64, device="cuda")
        captured = client.capturable_lookup(buffer)
        hot = random_ids(rng, 64, reference.rows, reference.heads, out_of_range=0.0)
        for capture in range(12):
            for _ in range(4):  # reads for the keeper to count, cache and refresh over
                client.lookup(torch.from_numpy(hot).cuda()).result()
            graph = torch.cuda.CUDAGraph()
            refreshes = keeper.stats.refreshes
            with global_capture(graph):
                rows = captured.record(16)
                # Held open until the keeper has refreshed (its CUDA calls made meanwhile).
                wait_until(lambda since=refreshes: keeper.stats.refreshes > since, timeout=FOLLOW_S)
            ids = random_ids(rng, 16, reference.rows, reference.heads)
            assert rows_match(replay(graph, captured, rows, ids), reference, ids), f"capture {capture}"


def test_captures_in_cudas_default_mode_beside_a_client_without_a_hot_row_cache(daemon_factory,
                                                                               reference):
    """The test above without the keeper: the heartbeat (every DEMO_HEARTBEAT_S here) and the
    captured lookups' upkeep go on while each capture is held open. Beside the test above, it
    says whether the keeper is what spoils a capture in the default mode."""
    daemon = daemon_factory(extra=CUDA)
    rng = np.random.default_rng(44)
    with EngramClient(daemon.socket, device="cuda", mode="mapped", max_tokens=MAX_TOKENS,
                      hot_cache_gib=0) as client:
        assert client._mapped_path.tables.keeper is None
        buffer = torch.full((MAX_TOKENS, client.geometry.n_layers, client.geometry.heads), -1,
                            dtype=torch.int64, device="cuda")
        captured = client.capturable_lookup(buffer)
        for capture in range(4):
            graph = torch.cuda.CUDAGraph()
            with global_capture(graph):
                rows = captured.record(16)
                time.sleep(5 * DEMO_HEARTBEAT_S)  # held open: the client's threads run meanwhile
            ids = random_ids(rng, 16, reference.rows, reference.heads)
            assert rows_match(replay(graph, captured, rows, ids), reference, ids), f"capture {capture}"


def test_a_closed_capture_writes_nothing_and_what_cannot_capture_says_so(daemon_factory, reference):
    daemon = daemon_factory(extra=CUDA)
    ids = random_ids(np.random.default_rng(34), 8, reference.rows, reference.heads)
    with EngramClient(daemon.socket, device="cuda", mode="mapped", max_tokens=MAX_TOKENS) as client:
        graph, captured, rows = captured_graph(client, ids.shape[0])
        assert rows_match(replay(graph, captured, rows, ids), reference, ids)
        slot = captured.slot
        before = rows.clone()
        captured.close()
        got = replay(graph, captured, rows, ids)
        assert np.array_equal(got, before.double().cpu().numpy()), "a closed capture writes nothing"
        with pytest.raises(ReplayFailedError, match="closed"):
            captured.check()
        client.lookup(torch.from_numpy(ids).cuda(), slot=slot).wait()  # the slot is free again
    with EngramClient(daemon.socket, device="cuda", mode="served", max_tokens=MAX_TOKENS) as served:
        buffer = torch.zeros(4, served.geometry.n_layers, served.geometry.heads, dtype=torch.int64,
                             device="cuda")
        with pytest.raises(CaptureUnsupportedError, match="served mode"):
            served.capturable_lookup(buffer)
