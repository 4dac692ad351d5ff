"""The vLLM plugin against vLLM 0.33.0's own Engram modules and a real daemon process.

The comparisons run in worker processes (worker.py): vLLM's parallel state is per process, and
the plugin is installed the way vLLM installs it, through the entry point, in each of them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import vllm
from helpers import free_port, run_client_processes

from engramd.client.engines import vllm as plugin

WORKER = Path(__file__).with_name("worker.py")
WORKER_TIMEOUT_S = 300  # vLLM's kernels under Triton's interpreter: tens of seconds each






def worker(daemon, checkpoint: Path, port: int, rank: int = 0, world: int = 1,
           mode: str = "auto", sp: bool = False, capture: bool = False,
           other_rows: bool = False) -> list[str]:
    return [sys.executable, str(WORKER), "--socket", str(daemon.socket), "--checkpoint",
            str(checkpoint), "--rank", str(rank), "--world", str(world), "--port", str(port),
            "--mode", mode, *(["--sp"] if sp else []), *(["--capture"] if capture else []),
            *(["--other-rows"] if other_rows else [])]


@pytest.mark.slow
@pytest.mark.parametrize("mode, capture", [("served", False), ("mapped", False), ("mapped", True)],
                         ids=["served", "mapped", "mapped-captured"])
def test_rows_embed_and_forward_are_vllms_and_the_ids_its_hashes(daemon_factory, demo_checkpoint,
                                                                  mode, capture):
    daemon = daemon_factory()
    run_client_processes([worker(daemon, demo_checkpoint, free_port(), mode=mode, capture=capture)],
                         timeout=WORKER_TIMEOUT_S)


@pytest.mark.slow
@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_two_tensor_parallel_ranks_each_get_their_head_shard(daemon_factory, demo_checkpoint, sp):
    daemon = daemon_factory()
    port = free_port()
    run_client_processes([worker(daemon, demo_checkpoint, port, rank, 2, sp=sp) for rank in (0, 1)], timeout=WORKER_TIMEOUT_S)


@pytest.mark.slow
@pytest.mark.parametrize("mode, world", [("served", 1), ("mapped", 2)], ids=["served", "mapped-tp2"])
def test_a_daemon_on_another_checkpoint_of_the_models_geometry_is_refused_at_load(
        daemon_factory, demo_checkpoint, second_checkpoint, mode, world):
    """Same config, same shapes, other rows (another revision of the model): no geometry check
    can tell, the checkpoint's rows can."""
    daemon = daemon_factory(tables=second_checkpoint)
    port = free_port()
    run_client_processes([worker(daemon, demo_checkpoint, port, rank, world, mode=mode, other_rows=True)
                          for rank in range(world)], timeout=WORKER_TIMEOUT_S)


ENTRY_POINT_PROBE = """
import os
os.environ.pop("ENGRAMD_SOCKET", None)
from vllm.models.deepseek_v41.common.engram import Engram
before = dict(vars(Engram))
from vllm.plugins import load_general_plugins, load_plugins_by_group
assert "engramd" in load_plugins_by_group("vllm.general_plugins"), "no engramd entry point"
load_general_plugins()
import sys
assert dict(vars(Engram)) == before, "the plugin changed vLLM without ENGRAMD_SOCKET"
assert "engramd.client.engines.vllm_engram" not in sys.modules
print("untouched")
"""


@pytest.mark.slow
def test_the_gpu_recipes_benchmark_runs_on_the_cpu(tmp_path):
    """benchmarks/vllm_gpu/bench_lookup.py's dry run, one cell: its own daemon, vLLM's step eager
    and recorded (vllm_graph), the plugin's mapped build paired with vLLM's step and its captured
    build with vLLM's graph recorded again, every row check exact and each table in the report;
    on a GPU the same code records graphs."""
    bench = Path(__file__).parents[2] / "benchmarks" / "vllm_gpu" / "bench_lookup.py"
    run = subprocess.run([sys.executable, str(bench), "--dry-run", "--paired", "--parts", "step",
                          "--tokens", "1", "--lead", "1", "--plugin-modes", "mapped", "captured",
                          "--plugin-gather-at", "wait", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=WORKER_TIMEOUT_S)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "bench_lookup.json").read_text())
    checks = report["runs"][0]["checks"]
    assert {"vllm_graph", "plugin_mapped", "plugin_captured"} <= {c["variant"] for c in checks}
    assert all(c["mismatches"] == 0 for c in checks), checks
    variants = {cell["variant"] for cell in report["steps"]}
    assert {"vllm", "vllm_graph", "plugin_mapped", "plugin_captured", "compute_graph"} <= variants
    partners = {(cell["variant"], cell["beside"]) for cell in report["steps"] if "beside" in cell}
    assert partners == {("vllm", "plugin_mapped"), ("vllm_graph", "plugin_captured")}, partners
    text = (tmp_path / "bench_lookup.md").read_text()
    paired = text[text.index("## Model step beside vLLM's own (--paired)"):]
    assert "| plugin_mapped | plugin_captured / vllm_graph |" in paired, paired[:1500]


def test_entry_point_loads_and_does_nothing_without_the_setting():
    run = subprocess.run([sys.executable, "-c", ENTRY_POINT_PROBE], capture_output=True, text=True,
                         timeout=WORKER_TIMEOUT_S, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    assert run.returncode == 0 and "untouched" in run.stdout, run.stdout + run.stderr


MISSING_DEPENDENCY_PROBE = """
import os, sys
os.environ["ENGRAMD_SOCKET"] = "/nonexistent/engramd.sock"
from vllm.models.deepseek_v41.common.engram import Engram
before = dict(vars(Engram))
sys.modules["msgpack"] = None  # engramd's client needs it; vLLM does not: absent beside this vLLM
from vllm.plugins import load_general_plugins
try:
    load_general_plugins()
except Exception as exc:
    print(type(exc).__name__, exc)
else:
    print("untouched" if dict(vars(Engram)) == before else "installed")
"""


def test_an_engramd_client_that_cannot_be_imported_stops_vllm_not_its_plugin_loader():
    """vLLM's loader logs an entry point whose import fails and goes on with vLLM's own Engram
    tables: the entry point imports nothing of the client, whose failure then stops register()."""
    from engramd.client.engines import shared
    from engramd.client.shared import connection

    assert shared.SOCKET_ENV == connection.SOCKET_ENV  # the entry point's own copy of the name
    run = subprocess.run([sys.executable, "-c", MISSING_DEPENDENCY_PROBE], capture_output=True,
                         text=True, timeout=WORKER_TIMEOUT_S, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    assert run.returncode == 0, run.stdout + run.stderr
    assert "VllmPluginError ENGRAMD_SOCKET is set but engramd's client cannot be imported" in run.stdout \
        and "msgpack" in run.stdout, run.stdout + run.stderr


def test_the_hot_cache_cap_is_read_from_the_environment_and_a_bad_one_named():
    assert plugin.hot_cache_cap(None) is None and plugin.hot_cache_cap("") is None
    assert plugin.hot_cache_cap("0") == 0.0 and plugin.hot_cache_cap("1.5") == 1.5
    for bad in ("-1", "nan", "two", "1e9"):
        with pytest.raises(plugin.VllmPluginError, match=f"ENGRAMD_HOT_CACHE_GIB='{bad}'"):
            plugin.hot_cache_cap(bad)


def test_capture_is_read_from_the_environment_and_a_bad_value_named():
    from engramd.client.engines import shared

    assert not shared.capture(None, plugin.VllmPluginError)
    assert not shared.capture("off", plugin.VllmPluginError)
    assert shared.capture("on", plugin.VllmPluginError)
    with pytest.raises(plugin.VllmPluginError, match="ENGRAMD_CAPTURE='yes'"):
        shared.capture("yes", plugin.VllmPluginError)


def test_the_gather_point_is_read_from_the_environment_and_a_bad_one_named():
    assert plugin.gather_at(None) == plugin.gather_at("") == plugin.gather_at("wait") == "wait"
    assert plugin.gather_at("lookup") == "lookup"
    for bad in ("Wait", "soon", " lookup"):
        with pytest.raises(plugin.VllmPluginError, match=f"ENGRAMD_GATHER_AT='{bad}'"):
            plugin.gather_at(bad)


def test_the_mode_is_read_from_the_environment_and_a_bad_one_named_before_any_worker_registers(
        monkeypatch):
    """As the other settings: checked at register(), unset or empty is the default, and a bad one
    is named by its setting (not first at the first worker's registration, as a client's mode)."""
    from engramd.client.engines import shared

    monkeypatch.setenv("ENGRAMD_SOCKET", "/nonexistent/engramd.sock")
    for value, expected in (("", "auto"), ("auto", "auto"), ("served", "served"), ("mapped", "mapped")):
        monkeypatch.setenv("ENGRAMD_MODE", value)
        assert shared.Settings.from_environment(plugin.VllmPluginError).mode == expected
    for bad in ("Served", " mapped", "mapped\n", "gpu"):
        monkeypatch.setenv("ENGRAMD_MODE", bad)
        with pytest.raises(plugin.VllmPluginError,
                           match=re.escape(f"ENGRAMD_MODE={bad!r}: expected one of auto, served, mapped")):
            shared.Settings.from_environment(plugin.VllmPluginError)


def test_another_vllm_version_fails_closed(monkeypatch):
    monkeypatch.setenv("ENGRAMD_SOCKET", "/nonexistent/engramd.sock")
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    with pytest.raises(plugin.VllmPluginError, match=r"vLLM 0\.34\.0 is installed.*supports vLLM 0\.33\.0"):
        plugin.register()


def engram_module():
    import importlib

    return importlib.import_module(plugin.ENGRAM_MODULE)


def test_vllm_0_33_has_every_seam():
    plugin.check_seams(engram_module())


def test_vllm_0_33s_worker_has_the_step_seam_and_a_changed_one_fails_closed():
    import importlib

    worker = importlib.import_module(plugin.WORKER_MODULE)
    plugin.check_worker_seams(worker)

    class Worker(worker.Worker):
        def execute_model(self, scheduler_output, intermediate_tensors):  # a new parameter
            raise AssertionError

    with pytest.raises(plugin.VllmPluginError,
                       match=r"ENGRAMD_CAPTURE=on .*Worker\.execute_model takes \(self, scheduler_output, "
                             r"intermediate_tensors\), expected \(self, scheduler_output\)"):
        plugin.check_worker_seams(types.SimpleNamespace(Worker=Worker))


def test_changed_seams_fail_closed_naming_each():
    real = engram_module()

    class Engram(real.Engram):
        def _ready_rows(self, num_tokens, stream):  # a new parameter
            raise AssertionError

        def _start_prefetch(self, hash_ids, rows):  # lost its eager-break wrapper
            raise AssertionError

        def embed(self, hash_ids):  # reads its rows some other way
            raise AssertionError

    changed = types.SimpleNamespace(**{**vars(real), "Engram": Engram})
    del changed._engram_head_shard_weight_loader
    with pytest.raises(plugin.VllmPluginError) as error:
        plugin.check_seams(changed)
    message = str(error.value)
    for expected in ("Engram._ready_rows takes (self, num_tokens, stream), expected (self, num_tokens)",
                     "_engram_head_shard_weight_loader is missing",
                     "Engram.embed no longer calls _ready_rows",
                     "Engram._start_prefetch is no longer wrapped by eager_break_during_capture"):
        assert expected in message, message


def test_a_daemon_serving_other_tables_is_refused(demo_checkpoint):
    from engramd.client.engines import vllm_engram
    from engramd.client.geometry import TableGeometry

    config = json.loads((demo_checkpoint / "config.json").read_text())
    served = TableGeometry.from_config(config)
    layout = engram_module().EngramLayout
    vllm_engram._check_geometry(served, layout(types.SimpleNamespace(**config)), "sock")
    del config["engram_num_embeddings"]
    other = TableGeometry.from_config({**config, "engram_vocab_size": served.vocab_size + 100})
    with pytest.raises(plugin.VllmPluginError, match="start the daemon on this model's checkpoint"):
        vllm_engram._check_geometry(served, layout(types.SimpleNamespace(**other.to_config())), "sock")


def test_a_steps_ids_are_one_view_where_every_layer_hands_in_a_column_of_one_tensor():
    import torch

    from engramd.client.engines.vllm_engram import columns_view

    ids = torch.arange(5 * 2 * 3, dtype=torch.int64).reshape(5, 2, 3)
    parts = {layer: ids[:, layer] for layer in (1, 0)}  # handed in any order
    view = columns_view(parts, 2)
    assert view is not None and view.data_ptr() == ids.data_ptr() and view.is_contiguous()
    assert torch.equal(view, torch.stack([parts[0], parts[1]], dim=1))
    assert torch.equal(columns_view({0: ids[:2, 0], 1: ids[:2, 1]}, 2), ids[:2])  # a step's first tokens
    assert torch.equal(columns_view({0: ids[3:4, 0], 1: ids[3:4, 1]}, 2), ids[3:4])  # one token
    # Anything else is built anew: a layer missing (another pipeline stage's), columns of two
    # tensors, columns swapped, other strides, other dtypes.
    assert columns_view({0: ids[:, 0]}, 2) is None
    assert columns_view({0: ids[:, 0], 1: ids.clone()[:, 1]}, 2) is None
    assert columns_view({0: ids[:, 1], 1: ids[:, 0]}, 2) is None
    wide = torch.zeros(5, 3, 3, dtype=torch.int64)
    assert columns_view({0: wide[:, 0], 1: wide[:, 1]}, 2) is None
    assert columns_view({0: ids[::2, 0], 1: ids[::2, 1]}, 2) is None
    assert columns_view({0: ids[:, 0], 1: ids[:, 1].int()}, 2) is None


def test_a_step_whose_layers_hand_in_columns_of_one_tensor_looks_that_tensor_up():
    """ProcessRows hands the client the view (no new IDs tensor); a step that misses a layer
    (another pipeline stage's) still gets its DEAD columns."""
    import torch

    from engramd.client.engines.vllm_engram import ProcessRows
    from engramd.client.geometry import DEAD_ID, TableGeometry

    class Client:
        geometry = TableGeometry.named("demo")
        rows_generation, registrations, tables_id = 0, 1, "t"

        def __init__(self):
            self.looked_up = []

        def slot_rows(self, slot):
            return [torch.zeros(8, self.geometry.heads, self.geometry.head_dim)
                    for _ in range(self.geometry.n_layers)]

        def lookup(self, ids, slot=None):
            self.looked_up.append(ids)

    client = Client()
    n_layers, heads = client.geometry.n_layers, client.geometry.heads
    rows = ProcessRows(client)
    for layer in range(n_layers):
        rows.staging(layer)
    hashes = torch.arange(4 * n_layers * heads, dtype=torch.int64).reshape(4, n_layers, heads)
    for layer in range(n_layers):
        rows.hand(layer, hashes[:, layer])
    assert client.looked_up[-1].data_ptr() == hashes.data_ptr()
    assert torch.equal(client.looked_up[-1], hashes)
    del rows.staged[n_layers - 1]  # this stage's layers: all but the last
    for layer in range(n_layers - 1):
        rows.hand(layer, hashes[:, layer])
    got = client.looked_up[-1]
    assert got.data_ptr() != hashes.data_ptr()
    assert torch.equal(got[:, :-1], hashes[:, :-1]) and bool((got[:, -1] == DEAD_ID).all())


@pytest.mark.parametrize("capturing, breakable, mode, forks", [
    (False, False, None, False),         # an eager step: in line
    (False, True, "PIECEWISE", False),   # an eager break of a breakable graph runs eagerly
    (True, False, None, True),           # a capture from outside vLLM: taken as the whole step
    (True, False, "NONE", True),         # model runner V2's full graph (captured with mode NONE)
    (True, False, "FULL", True),         # V1's full graph: vLLM's own prefetch forks there too
    (True, False, "PIECEWISE", False),   # a piece of a piecewise graph
    (True, True, "FULL", True),          # a breakable capture of a full graph: one segment
    (True, True, "PIECEWISE", False),    # a breakable capture in pieces
    (True, True, None, False),
], ids=lambda value: str(value))
def test_the_captured_gather_forks_only_in_a_graph_its_reader_is_part_of(
        monkeypatch, capturing, breakable, mode, forks):
    import types

    from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture
    from vllm.config import CUDAGraphMode

    from engramd.client.engines import vllm_engram

    monkeypatch.setattr(vllm_engram, "_capturing", lambda: capturing)
    monkeypatch.setattr(vllm_engram, "is_forward_context_available", lambda: mode is not None)
    context = types.SimpleNamespace(cudagraph_runtime_mode=mode and CUDAGraphMode[mode])
    monkeypatch.setattr(vllm_engram, "get_forward_context", lambda: context)
    monkeypatch.setattr(BreakableCUDAGraphCapture._tls, "active", object() if breakable else None,
                        raising=False)
    assert vllm_engram._graph_holds_the_step() is forks


class _Streams:
    """Where a captured step's work goes, as a log: the plugin's side stream and its events'
    stand-ins (an event per layer, named by it), torch's current stream and stream context
    swapped for ones that log."""

    def __init__(self, monkeypatch, vllm_engram):
        import torch

        self.log: list[str] = []
        self.on_side = False
        streams = self

        class Side:
            def wait_stream(self, other):
                streams.log.append(f"side waits for {other.name}")

        class Current:
            name = "current"

            def wait_event(self, event):
                streams.log.append(f"current joins {event.name}")

        class Event:
            def __init__(self, name):
                self.name = name

            def record(self, stream):
                streams.log.append(f"{self.name} recorded")

        class OnSide:
            def __enter__(self):
                streams.on_side = True

            def __exit__(self, *exc):
                streams.on_side = False

        self.side = (Side(), [Event(f"event {layer}") for layer in range(8)])
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Current())
        monkeypatch.setattr(torch.cuda, "stream", lambda stream: OnSide())
        monkeypatch.setattr(torch.Tensor, "record_stream", lambda tensor, stream: None)
        self.capturing = self.holds_step = False
        monkeypatch.setattr(vllm_engram, "_capturing", lambda: self.capturing)
        monkeypatch.setattr(vllm_engram, "_graph_holds_the_step",
                            lambda: self.capturing and self.holds_step)


def _captured_rows(streams: _Streams, split_layers: bool = True):
    """A ProcessRows over a CPU stand-in client whose captured lookup logs its copies' and
    gathers' streams; its side stream is _Streams'; its forked gathers a launch per layer,
    unless `split_layers` is False."""
    import torch

    from engramd.client.captured import CapturedLookup
    from engramd.client.engines.vllm_engram import ProcessRows
    from engramd.client.geometry import TableGeometry

    class Ids(torch.Tensor):  # the lookup's IDs buffer: each copy logs where it ran
        def copy_(self, source, non_blocking=False):
            streams.log.append("copy on side" if streams.on_side else "copy in line")
            return self

    class Captured:
        def __init__(self, geometry):
            self.ids = torch.zeros(8, geometry.n_layers, geometry.heads, dtype=torch.int32).as_subclass(Ids)

        why_not_in_place = CapturedLookup.why_not_in_place

        def record(self, tokens, stream=None, ids=None, layers=None):
            assert ids is None or self.why_not_in_place(ids) is None
            span = "" if layers is None else f" of layers {list(layers)}"
            streams.log.append(f"gather{span} " + ("on side" if stream is not None else "in line")
                               + (", in place" if ids is not None else ""))

        def check(self):
            pass

    class Client:
        geometry, device, max_tokens = TableGeometry.named("demo"), torch.device("cpu"), 8
        rows_generation, registrations, tables_id = 0, 1, "t"

        def slot_rows(self, slot):
            return [torch.zeros(8, self.geometry.heads, self.geometry.head_dim)
                    for _ in range(self.geometry.n_layers)]

    client = Client()
    rows = ProcessRows(client)
    rows.captured, rows._side = Captured(client.geometry), streams.side
    rows.split_layers = split_layers
    for layer in range(client.geometry.n_layers):
        rows.staging(layer)
    return rows


def _step(rows, tokens: int, layers=None, dtype=None) -> None:
    """A step's hands: each layer's column of one [T, layers, heads] tensor of hashes, int32
    as vLLM's (unless `dtype`)."""
    import torch

    geometry = rows.geometry
    hashes = torch.zeros(tokens, geometry.n_layers, geometry.heads, dtype=dtype or torch.int32)
    for layer in range(geometry.n_layers) if layers is None else layers:
        rows.hand(layer, hashes[:, layer])


def _forked(n_layers: int, how: str = ", in place") -> list[str]:
    """A forked gather's launches, a layer each, and their events."""
    return [entry for layer in range(n_layers)
            for entry in (f"gather of layers [{layer}] on side{how}", f"event {layer} recorded")]


def test_in_a_graph_that_holds_the_step_the_gather_forks_reading_the_hashes_in_place(monkeypatch):
    """The gather alone goes to the side stream, after the hashes, a launch per layer, and reads
    them where they are (the first matmuls wait for nothing of it); each layer's reader joins
    its own layer's launch. Hashes it cannot read in place (another dtype than its buffer's) are
    copied on the side stream first; elsewhere (an eager step, a graph in pieces) each hand
    copies in line and one gather of every layer follows in line."""
    import torch

    from engramd.client.engines import vllm_engram

    streams = _Streams(monkeypatch, vllm_engram)
    rows = _captured_rows(streams)
    n_layers = rows.geometry.n_layers
    streams.capturing = streams.holds_step = True
    _step(rows, 4)
    rows.ready(0, 4)
    assert streams.log[-1] == "current joins event 0", "the first reader waits for its own layer only"
    rows.ready(1, 4)
    forked = ["side waits for current"]  # at the last hand: after every layer's hashes
    assert streams.log == forked + _forked(n_layers) + [f"current joins event {layer}"
                                                        for layer in range(n_layers)]
    streams.log.clear()
    _step(rows, 4, dtype=torch.int64)
    for layer in range(n_layers):
        rows.ready(layer, 4)
    assert streams.log == (forked + ["copy on side"] * n_layers + _forked(n_layers, "")
                           + [f"current joins event {layer}" for layer in range(n_layers)])
    for capturing, holds_step in ((False, False), (True, False)):
        streams.log.clear()
        streams.capturing, streams.holds_step = capturing, holds_step
        _step(rows, 4)
        rows.ready(0, 4)
        assert streams.log == ["copy in line"] * n_layers + ["gather in line"]


def test_a_forked_gather_of_one_launch_is_joined_once(monkeypatch):
    """With split_layers off, or where some layers are other pipeline
    stages' (their IDs DEAD in the lookup's buffer, so not one tensor to read in place), the
    forked gather is one launch of every layer, which the first reader joins; the other readers
    wait for nothing more."""
    from engramd.client.engines import vllm_engram

    streams = _Streams(monkeypatch, vllm_engram)
    rows = _captured_rows(streams, split_layers=False)
    n_layers = rows.geometry.n_layers
    every, last = list(range(n_layers)), n_layers - 1
    streams.capturing = streams.holds_step = True
    _step(rows, 4)
    for layer in range(n_layers):
        rows.ready(layer, 4)
    assert streams.log == ["side waits for current"] + [
        f"gather of layers {every} on side, in place", f"event {last} recorded",
        f"current joins event {last}"]
    streams.log.clear()
    rows.split_layers = True
    rows.staged = {last: rows.staged[last]}  # this stage's one layer
    _step(rows, 4, layers=[last])
    rows.ready(last, 4)
    assert streams.log == ["side waits for current"] + [
        "copy on side", f"gather of layers {every} on side", f"event {last} recorded",
        f"current joins event {last}"]


def test_a_step_left_by_a_failed_capture_is_dropped_and_the_next_one_runs_where_it_is_captured(
        monkeypatch):
    """A full capture that failed after its first layer's hand leaves that step behind, its
    hashes uncopied and perhaps in the failed capture's memory. The next step drops it (its rows
    would be written over before any layer read them) and runs as its own capture says: in line
    in a capture in pieces or eagerly (a fork there would end the capture unjoined), forked in a
    full graph."""
    from engramd.client.engines import vllm_engram

    streams = _Streams(monkeypatch, vllm_engram)
    rows = _captured_rows(streams)
    n_layers = rows.geometry.n_layers
    for capturing, holds_step in ((True, False), (False, False), (True, True)):
        streams.capturing = streams.holds_step = True
        _step(rows, 4, layers=[0])  # ... and the capture fails here
        streams.log.clear()
        streams.capturing, streams.holds_step = capturing, holds_step
        _step(rows, 4)
        rows.ready(0, 4)
        if holds_step:
            assert streams.log == (["side waits for current"] + _forked(n_layers)
                                   + ["current joins event 0"])
        else:
            assert streams.log == ["copy in line"] * n_layers + ["gather in line"]


def test_a_capture_that_ends_between_a_steps_hands_records_no_gather_and_the_step_is_refused(
        monkeypatch):
    """The side stream forks at a step's last hand, so a capture that ends between its hands
    records nothing of its gather (a stream that had only waited would not have made CUDA refuse
    to end the capture, measured on an H100: benchmarks/results/h100/2026-12-07-e/). The rest of
    that step, run after it, is refused by name (its hashes are the ended capture's memory); the
    next step runs."""
    import pytest

    from engramd.client.engines import vllm_engram

    streams = _Streams(monkeypatch, vllm_engram)
    rows = _captured_rows(streams)
    n_layers = rows.geometry.n_layers
    streams.capturing = streams.holds_step = True
    _step(rows, 4, layers=range(n_layers - 1))
    assert streams.log == [], "nothing forked before the step's last hand"
    streams.capturing = False
    with pytest.raises(vllm_engram.VllmPluginError, match="ended before its last layer handed in"):
        _step(rows, 4, layers=[n_layers - 1])
    assert not any("gather" in entry or "copy" in entry for entry in streams.log)
    streams.log.clear()
    _step(rows, 4)
    rows.ready(0, 4)
    assert streams.log == ["copy in line"] * n_layers + ["gather in line"]


def test_a_step_of_no_tokens_in_a_graph_that_holds_the_step_forks_nothing(monkeypatch):
    """No tokens: nothing to gather, so nothing forked, and nothing for a reader to join."""
    from engramd.client.engines import vllm_engram

    streams = _Streams(monkeypatch, vllm_engram)
    rows = _captured_rows(streams)
    streams.capturing = streams.holds_step = True
    _step(rows, 0)
    assert not any("side" in entry for entry in streams.log)


def test_a_worker_that_splits_batches_into_microbatches_keeps_its_lookups_in_eager_breaks(
        monkeypatch, caplog):
    """Each microbatch of a step would take the captured lookup's one IDs buffer and slot."""
    import types

    import torch
    import vllm.config

    from engramd.client.engines.vllm_engram import STAGED_SLOT, ProcessRows
    from engramd.client.geometry import TableGeometry

    class Client:
        geometry, max_tokens, device = TableGeometry.named("demo"), 4, torch.device("cpu")

        def capturable_lookup(self, ids, slot=None):
            return "captured", slot

    for use_ubatching in (True, False):
        config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(use_ubatching=use_ubatching))
        monkeypatch.setattr(vllm.config, "get_current_vllm_config", lambda config=config: config)
        made = ProcessRows._capture(Client())
        assert made == (None if use_ubatching else ("captured", STAGED_SLOT))
    assert "microbatches" in caplog.text
