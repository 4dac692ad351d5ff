"""The SGLang plugin against SGLang 0.5.23's own Engram modules and a real daemon process.

SGLang is imported in subprocesses only (worker.py, and the probes below): its parallel state
is per process, the plugin is installed the way SGLang installs it, through its plugin loader,
and each needs the torchvision stand-in on its path (conftest.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import free_port, run_client_processes

WORKER = Path(__file__).with_name("worker.py")
GPU_WORKER = Path(__file__).parents[2] / "benchmarks" / "sglang_gpu" / "worker_gpu.py"
WORKER_TIMEOUT_S = 300


def worker(daemon, checkpoint: Path, port: int, rank: int = 0, world: int = 1,
           mode: str = "auto", other_rows: bool = False) -> list[str]:
    return [sys.executable, str(WORKER), "--socket", str(daemon.socket), "--checkpoint",
            str(checkpoint), "--rank", str(rank), "--world", str(world), "--port", str(port),
            "--mode", mode, *(["--other-rows"] if other_rows else [])]


def run_probe(code: str, *argv: str) -> str:
    run = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                         timeout=WORKER_TIMEOUT_S)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["served", "mapped"])
def test_rows_and_forward_are_sglangs_and_the_ids_its_hashes(daemon_factory, demo_checkpoint, mode):
    daemon = daemon_factory()
    run_client_processes([worker(daemon, demo_checkpoint, free_port(), mode=mode)], timeout=WORKER_TIMEOUT_S)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["served", "mapped"])
def test_two_tensor_parallel_ranks_each_get_their_head_shard(daemon_factory, demo_checkpoint, mode):
    daemon = daemon_factory()
    port = free_port()
    run_client_processes([worker(daemon, demo_checkpoint, port, rank, 2, mode) for rank in (0, 1)],
                         timeout=WORKER_TIMEOUT_S)


@pytest.mark.slow
@pytest.mark.parametrize("mode, world", [("served", 1), ("mapped", 2)], ids=["served", "mapped-tp2"])
def test_a_daemon_on_another_checkpoint_of_the_models_geometry_is_refused_at_load(
        daemon_factory, demo_checkpoint, second_checkpoint, mode, world):
    """Same config, same shapes, other rows (another revision of the model): no geometry check
    can tell, the checkpoint's rows can."""
    daemon = daemon_factory(tables=second_checkpoint)
    port = free_port()
    run_client_processes([worker(daemon, demo_checkpoint, port, rank, world, mode, other_rows=True)
                          for rank in range(world)], timeout=WORKER_TIMEOUT_S)


@pytest.mark.slow
def test_the_gpu_recipes_worker_runs_on_the_cpu(daemon_factory, demo_checkpoint):
    """benchmarks/sglang_gpu/worker_gpu.py's dry run: its own code (the reference built under a
    device, the kernel counters, tests/sglang_plugin/worker.py's checks on its device) on the CPU,
    so that it keeps working with this worker's helpers; its CUDA path runs only on a GPU
    (tests/gpu/test_sglang_gpu.py)."""
    daemon = daemon_factory()
    run_client_processes([[sys.executable, str(GPU_WORKER), "--socket", str(daemon.socket),
                           "--checkpoint", str(demo_checkpoint), "--port", str(free_port()),
                           "--mode", "mapped", "--dry-run"]], timeout=WORKER_TIMEOUT_S)


# The probes below import SGLang in a subprocess of their own (the torchvision stand-in is on
# its path there), and print what they found.

ENTRY_POINT_PROBE = """
import os, sys
os.environ.pop("ENGRAMD_SOCKET", None)
from sglang.srt.layers.engram import EngramEmbedding
before = dict(vars(EngramEmbedding))
from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins, load_plugins_by_group
assert "engramd" in load_plugins_by_group(GENERAL_PLUGINS_GROUP), "no engramd entry point"
load_plugins()
assert dict(vars(EngramEmbedding)) == before, "the plugin changed SGLang without ENGRAMD_SOCKET"
assert "engramd.client.engines.sglang_engram" not in sys.modules
print("untouched")
"""


def test_entry_point_loads_through_sglangs_loader_and_does_nothing_without_the_setting():
    assert "untouched" in run_probe(ENTRY_POINT_PROBE)


FAIL_CLOSED_PROBE = """
import importlib, json, os, sys, types
os.environ["ENGRAMD_SOCKET"] = "/nonexistent/engramd.sock"
from engramd.client.engines import sglang as plugin
import sglang.version
errors = {}

def refused(name, call):
    try:
        call()
    except plugin.SglangPluginError as exc:
        errors[name] = str(exc)

engram = importlib.import_module(plugin.ENGRAM_MODULE)
plugin.check_seams(engram)

class EngramEmbedding(engram.EngramEmbedding):
    def _owned_rows(self, indices, out):  # a new parameter
        raise AssertionError
    def _lookup(self, indices):  # no longer reads rows through _owned_rows
        return self._gather(indices)

changed = types.SimpleNamespace(**{**vars(engram), "EngramEmbedding": EngramEmbedding})
del changed.eager_on_graph
refused("seams", lambda: plugin.check_seams(changed))
os.environ["SGLANG_OPT_DSV41_ENGRAM_HOST_STAGING"] = "1"
refused("staging", plugin.register)
del os.environ["SGLANG_OPT_DSV41_ENGRAM_HOST_STAGING"]
sglang.version.__version__ = "0.5.24"
refused("version", plugin.register)
# SGLang's loader swallows the error: building a table must then fail with it
refused("table", lambda: engram.EngramEmbedding(10, 256, 1, (0, 10)))
print(json.dumps(errors))
"""


def test_another_version_a_changed_seam_or_sglangs_own_table_placement_fail_closed():
    errors = json.loads(run_probe(FAIL_CLOSED_PROBE).splitlines()[-1])
    assert "SGLang 0.5.24 is installed; the engramd plugin supports SGLang 0.5.23 only" in \
        errors["version"], errors
    assert errors["table"] == errors["version"], errors
    assert "SGLANG_OPT_DSV41_ENGRAM_HOST_STAGING asks for rows staged by SGLang's scheduler" in \
        errors["staging"], errors
    for expected in ("EngramEmbedding._owned_rows takes (self, indices, out), expected (self, indices)",
                     "EngramEmbedding._lookup no longer calls _owned_rows",
                     "eager_on_graph is missing"):
        assert expected in errors["seams"], errors


MISSING_DEPENDENCY_PROBE = """
import os, sys
os.environ["ENGRAMD_SOCKET"] = "/nonexistent/engramd.sock"
from sglang.srt.layers import engram
from sglang.srt.plugins import load_plugins
sys.modules["msgpack"] = None  # engramd's client needs it: absent beside this SGLang
load_plugins()  # SGLang's loader: logs a plugin's exception and goes on
try:
    engram.EngramEmbedding(10, 256, 1, (0, 10))
except Exception as exc:
    print(type(exc).__name__, exc)
"""


def test_an_engramd_client_that_cannot_be_imported_stops_sglang_at_its_engram_table():
    """SGLang's loader logs any exception of the entry point (its import, or register()) and
    goes on: building an Engram table must then fail with the reason, not build SGLang's own."""
    out = run_probe(MISSING_DEPENDENCY_PROBE).splitlines()[-1]
    assert out.startswith("SglangPluginError ENGRAMD_SOCKET is set but engramd's client cannot be "
                          "imported") and "msgpack" in out, out


GEOMETRY_PROBE = """
import json, sys
from engramd.client.geometry import TableGeometry
from engramd.client.engines import sglang_engram
from sglang.srt.layers.engram import EngramLayout
import types
config = json.load(open(sys.argv[1]))
served = TableGeometry.from_config(config)
layout = EngramLayout.from_config(types.SimpleNamespace(**config))
for index, layer_id in enumerate(layout.layer_ids):
    assert sglang_engram.check_layer(served, layer_id, layout.num_embeddings[index], layout.head_dim,
                                     layout.column_bounds(index), "sock") == index
del config["engram_num_embeddings"]
other = TableGeometry.from_config({**config, "engram_vocab_size": served.vocab_size + 100})
try:
    sglang_engram.check_layer(other, layout.layer_ids[0], layout.num_embeddings[0], layout.head_dim,
                              layout.column_bounds(0), "sock")
except sglang_engram.SglangPluginError as exc:
    print(exc)
"""


def test_a_daemon_serving_other_tables_is_refused(demo_checkpoint):
    out = run_probe(GEOMETRY_PROBE, str(demo_checkpoint / "config.json"))
    assert "start the daemon on this model's checkpoint" in out, out

