"""benchmarks/common: the helpers the benchmark scripts share, on the CPU.

The scripts that use them mostly need a GPU; what they take from here (row comparison, ID draws,
the sparse checkpoint and its random tables, the daemon's command, the CPU clock) is checked here
so that a broken helper shows without one.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import shm_tempdir

from engramd.client import EngramClient
from engramd.client.geometry import DEAD_ID, TableGeometry
from engramd.kernels import gather_ref
from engramd.server.checkpoint import EngramCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import cell_profile, daemon, ids, rows, tables, timing, wall_timers  # noqa: E402

DEMO = TableGeometry.named("demo")


def test_bitwise_mismatches_counts_bits_and_takes_nan_as_equal():
    want = torch.tensor([1.0, float("nan"), 3.0, -0.0], dtype=torch.bfloat16)
    assert rows.bitwise_mismatches(want.clone(), want) == (0, [])
    got = torch.tensor([1.0, float("nan"), 4.0, 0.0], dtype=torch.bfloat16)  # -0.0 != 0.0 in bits
    assert rows.bitwise_mismatches(got, want) == (2, [[2], [3]])
    assert rows.bitwise_mismatches(got[:2], want)[0] == -1


def test_assert_exact_names_the_first_differing_index():
    want = rows.poisoned((2, 3), torch.device("cpu"))
    assert bool(torch.isnan(want).all())
    rows.assert_exact(want.clone(), want, "same")
    got = want.clone()
    got[1, 2] = 1.0
    with pytest.raises(rows.NotExactError, match=r"1 of 6 values differ; first: \(1, 2\)"):
        rows.assert_exact(got, want, "one value")
    with pytest.raises(rows.NotExactError, match="want torch.bfloat16"):
        rows.assert_exact(got.float(), want, "dtype")


def test_bucket_ids_fall_in_each_heads_bucket_with_the_dead_share_asked_for():
    generator = torch.Generator().manual_seed(0)
    (batch,) = ids.bucket_ids(DEMO, 2000, 1, torch.device("cpu"), generator, dead_fraction=0.25)
    assert batch.shape == (2000, DEMO.n_layers, DEMO.heads) and batch.dtype == torch.int64
    dead = batch == DEAD_ID
    assert 0.2 < dead.float().mean().item() < 0.3
    lo = torch.tensor(DEMO.offsets).unsqueeze(0).expand_as(batch)
    hi = lo + torch.tensor(DEMO.primes).unsqueeze(0)
    live = ~dead
    assert bool(((batch >= lo) & (batch < hi))[live].all())
    again = ids.bucket_ids(DEMO, 2000, 1, torch.device("cpu"), torch.Generator().manual_seed(0),
                           dead_fraction=0.25)[0]
    assert torch.equal(again, batch)


def test_geometry_for_holds_at_least_the_size_asked_for():
    geometry = tables.geometry_for(0.01)
    assert (geometry.n_layers, geometry.heads, geometry.row_bytes) == (2, 24, tables.ROW_BYTES)
    assert 0.01 * 2**30 <= geometry.total_bytes < 0.012 * 2**30


def test_random_tables_over_a_sparse_checkpoint(tmp_path: Path):
    geometry = tables.v41_geometry(50)
    checkpoint, shm = tmp_path / "ckpt", tmp_path / "shm"
    shm.mkdir()
    specs = tables.fill_tables(geometry, checkpoint, shm, tables.INSTANCE, backend="cpu")
    opened = EngramCheckpoint.open(checkpoint)
    assert opened.geometry.rows == geometry.rows
    assert [s["rows"] for s in specs] == list(geometry.rows)
    for layer, spec in enumerate(specs):
        mapped = tables.MappedTable(spec["path"], spec["data_offset"], spec["rows"],
                                    spec["row_bytes"])
        try:
            expected = np.full_like(mapped.array, 0xA5)  # poison: read_packed must overwrite it all
            tables.CpuRandomRows(opened).read_packed(layer, 0, expected)
            assert (mapped.array == expected).all()
            # What register_for_gpus maps for the GPU (fd, data_offset, nbytes) is the same rows.
            last = os.pread(mapped.fd, mapped.row_bytes, mapped.data_offset + mapped.nbytes
                            - mapped.row_bytes)
            assert last == expected[-1].tobytes()
            assert os.fstat(mapped.fd).st_size >= mapped.data_offset + mapped.nbytes
        finally:
            mapped.close()
        assert mapped.fd == -1
    flags = tables.reattach_flags(checkpoint, shm, tables.INSTANCE)
    assert flags[flags.index("--self-check") + 1] == "false"


def test_a_daemon_reattaches_the_random_tables_instead_of_loading_the_checkpoint(daemon_factory):
    """The benchmarks fill random rows where the daemon keeps its tables, and start it on the
    sparse checkpoint (zeros) with the flags here: it must serve the random rows. When the
    daemon's tables moved into a folder of their own, the fill stayed behind and every GPU
    benchmark would have served zeros."""
    geometry = tables.v41_geometry(50)
    shm = shm_tempdir()
    try:
        checkpoint = shm / "ckpt"
        specs = tables.fill_tables(geometry, checkpoint, shm, tables.INSTANCE, backend="cpu")
        flags = tables.reattach_flags(checkpoint, shm, tables.INSTANCE)
        daemon = daemon_factory(tables=checkpoint, instance=tables.INSTANCE, shm_dir=shm,
                                extra=flags[flags.index("--self-check"):])
        picked = torch.tensor([[[0] * geometry.heads] * geometry.n_layers,
                               [[geometry.rows[0] - 1] * geometry.heads, [geometry.rows[1] - 1] * geometry.heads]])
        with EngramClient(daemon.socket, max_tokens=2) as client:
            served = client.lookup(picked).result()
        mapped = [tables.MappedTable(**spec) for spec in specs]
        try:
            rows_of = [torch.from_numpy(m.array.reshape(m.rows, m.row_bytes)) for m in mapped]
            expected = gather_ref.gather(rows_of, picked, geometry.shard(0, 1))[0]
            assert torch.equal(served.view(torch.int16), expected.view(torch.int16))
            assert bool((served.view(torch.int16) != 0).any())  # not the checkpoint's zeros
        finally:
            del rows_of
            for m in mapped:
                m.close()
        assert "tables re-attached" in daemon.log(), daemon.log()
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_serve_command_runs_this_interpreter_unless_told_otherwise(tmp_path: Path):
    socket = tmp_path / daemon.SOCKET_NAME
    command = daemon.serve_command(socket, ["--backend", "cpu"])
    assert command == [sys.executable, "-m", "engramd.server.cli", "serve", "--socket",
                       str(socket), "--backend", "cpu"]
    assert daemon.serve_command(socket, [], python=["py", "-X"])[:2] == ["py", "-X"]


def test_timed_steps_on_the_cpu_times_every_counted_step_after_the_warm_ones():
    clock = timing.Clock(torch.device("cpu"))
    seen: list[int] = []
    timed = timing.timed_steps(clock, seen.append, count=5, warm=2)
    assert seen == list(range(7))
    assert len(timed) == 5 and min(timed) >= 0  # one non-negative time per counted step


def test_step_profile_reads_each_steps_kernels_from_a_trace():
    """step_profile.step_metrics on a hand-made trace of two steps: each step's kernels are its
    own, timed from the step's start; the rows' wait is the consumer's start after the matmul
    before it."""
    import step_profile

    def x(name, cat, ts, dur):
        return {"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": dur}

    events = []
    for start in (1000.0, 5000.0):
        events += [x("step", "user_annotation", start, 900.0),
                   x("cudaLaunchKernel", "cuda_runtime", start + 5, 3),
                   x("_gather_kernel", "kernel", start + 20, 40),
                   x("nvjet_tst_128x256", "kernel", start + 22, 100),
                   x("nvjet_tst_128x256", "kernel", start + 130, 90),
                   x("cudaLaunchKernel", "cuda_runtime", start + 50, 4),
                   x("reduce_kernel<sum>", "kernel", start + 260, 10),
                   x("nvjet_tst_128x256", "kernel", start + 280, 94)]
    events.append(x("nvjet_tst_128x256", "kernel", 3000.0, 50))  # between the steps: no one's
    steps = step_profile.step_metrics(events)
    assert steps == [{"wall": 900.0, "first_kernel": 20.0, "gpu_end": 374.0, "submitted": 54.0,
                      "gather_start": 20.0, "gather": 40.0, "matmul_first": 100.0,
                      "matmul_rest": 92.0, "rows_wait": 40.0, "consume": 10.0}] * 2
    assert step_profile.medians(steps)["rows_wait"] == 40.0
    assert [step_profile.kind(n) for n in ("_gather_kernel", "sm90_xmma_gemm", "reduce_kernel",
                                           "elementwise")] == ["gather", "matmul", "consume", "other"]


def test_model_step_takes_each_leads_sm_fraction_once_and_only_for_a_timed_lead(capsys):
    import model_step

    args = model_step.parse_args(["--lead", "1", "4", "--mapped-sm-fraction", "1=1.0", "4=0.5"])
    assert args.mapped_sm_fraction == {1: 1.0, 4: 0.5}
    for bad, says in ((["1=1.0", "1=0.5"], "each LEAD once"), (["12=1.0"], "each LEAD once"),
                      (["1=0"], "0 < F <= 1"), (["1:1.0"], "LEAD=F")):
        with pytest.raises(SystemExit):
            model_step.parse_args(["--lead", "1", "4", "--mapped-sm-fraction", *bad])
        assert says in capsys.readouterr().err


def test_parse_cells_reads_t_lead_pairs_and_names_a_malformed_one():
    assert cell_profile.parse_cells(["1:1", "256:12", "1:1"]) == {(1, 1), (256, 12)}
    assert cell_profile.parse_cells(None) == set()
    for bad in ("1-1", "0:1", "1:", ":4", "a:1", "1:-1"):
        with pytest.raises(ValueError, match=repr(bad)):
            cell_profile.parse_cells([bad])


def _a_distinctly_named_step(ids: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(ids.double(), 0)


def test_profile_cell_writes_a_trace_and_names_the_steps_python_and_operators(tmp_path):
    import gzip
    import json

    calls = []

    def step(ids):
        calls.append(int(ids[0]))
        return _a_distinctly_named_step(ids)

    pool = [torch.full((4,), k) for k in range(7)]
    head = cell_profile.profile_cell(timing.Clock(torch.device("cpu")), step, pool, warm=2,
                                     path=tmp_path / "profile" / "cell")
    # warm, profiled, warm again, profiled again: the profiled steps see the pool's last five
    assert calls == [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5, 6]
    trace = json.loads(gzip.decompress((tmp_path / "profile" / "cell.trace.json.gz").read_bytes()))
    names = {event.get("name") for event in trace["traceEvents"]}
    assert "benchmark step" in names and "aten::cumsum" in names
    report = (tmp_path / "profile" / "cell.txt").read_text()
    assert report.startswith("cell: 5 steps")
    assert "aten::cumsum" in report and "_a_distinctly_named_step" in report
    assert head.splitlines()[0] == "cell: 5 steps"  # what the run prints is the report's top
    assert not (tmp_path / "profile" / "cell.trace.json").exists()  # only the packed trace stays


class _Timed:
    """Targets for the wall timers: an outer method calling an inner one and itself."""

    def outer(self, depth: int = 0) -> int:
        return self.inner() + (self.outer(depth - 1) if depth else 0)

    def inner(self) -> int:
        return 1

    @staticmethod
    def static() -> str:
        return "static"

    @property
    def prop(self) -> int:
        return 2


class _TimedChild(_Timed):
    pass


HERE = __name__


def test_the_timeline_places_each_device_operation_of_a_synchronised_step_by_its_median():
    """cell_profile.timeline_table on a hand-made trace of four steps: each operation's start
    and end from its step's first operation, the median over the alike steps (not the mean, not
    the last step's), whichever of two streams' operations starts first; a step with other
    operations and one with none are left out and counted; nothing outside a step's annotation
    (nor the device's copy of it) is anyone's."""
    def x(name, cat, ts, dur, stream=None):
        event = {"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": dur}
        if stream is not None:
            event["args"] = {"stream": stream}
        return event

    events = []
    # The gather and the matmul start 2 us apart, in either order; the gather's ends skewed.
    for start, gather_start, mm_start, gather_end in ((1000.0, 12, 14, 60.0), (5000.0, 14, 12, 80.0),
                                                      (9000.0, 12, 14, 200.0)):
        events += [x("nvjet_mm", "kernel", start + mm_start, 50, stream=7),
                   x(cell_profile._SYNCED, "user_annotation", start, 900.0),
                   x(cell_profile._SYNCED, "gpu_user_annotation", start + 5, 300.0, stream=7),
                   x("_gather_kernel", "kernel", start + gather_start, gather_end - gather_start, stream=20),
                   x("Memcpy DtoD", "gpu_memcpy", start + 10, 2, stream=7)]
    events += [x(cell_profile._SYNCED, "user_annotation", 13000.0, 900.0),
               x("other_kernel", "kernel", 13010.0, 5, stream=7),
               x(cell_profile._SYNCED, "user_annotation", 17000.0, 900.0),
               x("nvjet_mm", "kernel", 1950.0, 50, stream=7)]  # after step 1's annotation
    table = cell_profile.timeline_table(events).splitlines()
    assert table[0].startswith("3 of 5 steps alike (1 with no device operation)")
    rows = [line.split() for line in table[2:5]]
    assert rows[0] == ["7", "0.0", "2.0", "2.0", "Memcpy", "DtoD"]
    assert rows[1] == ["20", "2.0", "70.0", "68.0", "_gather_kernel"]  # ends 50, 70 and 190
    assert rows[2] == ["7", "4.0", "54.0", "50.0", "nvjet_mm"]  # 4, 2 and 4 us after the copy
    assert table[5] == "step span (first start to last end): 70.0 us"
    assert cell_profile.timeline_table([]).startswith("no device operations")


def test_wall_timers_count_the_steps_calls_once_each_and_put_everything_back():
    import threading

    originals = dict(vars(_Timed))
    targets = [f"{HERE}:_Timed.outer", f"{HERE}:_Timed.inner", f"{HERE}:_Timed.static",
               f"{HERE}:_TimedChild.inner", f"{HERE}:_Timed.absent", "no_such_module:f",
               f"{HERE}:_Timed.prop"]
    with wall_timers.WallTimers(targets) as timers:
        child = _TimedChild()
        assert child.outer(depth=2) == 3  # outer once (its own calls nested), inner 3 times
        assert _Timed.static() == "static" and _Timed().static() == "static"
        other = threading.Thread(target=_Timed().outer)  # another thread's calls: not counted
        other.start()
        other.join()
    by_target = {timer.target.rsplit(".", 1)[1]: timer for timer in timers.timers}
    assert by_target["outer"].calls == 1
    # _TimedChild.inner wraps _Timed.inner's wrapper: each layer counts the same 3 calls
    assert [t.calls for t in timers.timers if t.name == "inner"] == [3, 3]
    assert by_target["static"].calls == 2
    assert by_target["outer"].ns >= max(t.ns for t in timers.timers if t.name == "inner")
    assert timers.unresolved == [f"{HERE}:_Timed.absent", "no_such_module:f",
                                 f"{HERE}:_Timed.prop (not a function)"]
    assert child.prop == 2  # a property is left alone
    assert dict(vars(_Timed)) == originals and "inner" not in vars(_TimedChild)
    report = timers.report(steps=2, step_ns=4_000)
    assert report.startswith("Wall time inside functions (2 steps, 2.0 us a step")
    assert "not found: " in report and "no_such_module:f" in report


def test_profile_cell_with_timed_functions_adds_their_wall_time(tmp_path):
    module = sys.modules[HERE]
    pool = [torch.full((4,), k) for k in range(5)]
    head = cell_profile.profile_cell(timing.Clock(torch.device("cpu")),
                                     lambda ids: module._a_distinctly_named_step(ids), pool,
                                     warm=1, path=tmp_path / "cell",
                                     timed=[f"{HERE}:_a_distinctly_named_step"])
    report = (tmp_path / "cell.txt").read_text()
    assert "Wall time inside functions (4 steps" in report and "Wall time inside functions" in head
    line = next(line for line in report.splitlines() if line.endswith(":_a_distinctly_named_step"))
    assert line.split()[1] == "1.0"  # calls a step
    assert module._a_distinctly_named_step is _a_distinctly_named_step  # put back


def test_wall_timers_put_back_what_they_wrapped_when_a_target_fails(monkeypatch):
    originals = dict(vars(_Timed))

    def broken(target):
        if target.endswith("inner"):
            raise RuntimeError("an import that fails otherwise than ImportError")
        return real(target)

    real = wall_timers._resolve
    monkeypatch.setattr(wall_timers, "_resolve", broken)
    with pytest.raises(RuntimeError, match="otherwise"):
        with wall_timers.WallTimers([f"{HERE}:_Timed.outer", f"{HERE}:_Timed.inner"]):
            pass
    assert dict(vars(_Timed)) == originals


def test_lookup_host_compare_pairs_the_rounds_and_takes_the_median_ratio(tmp_path):
    import json

    import lookup_host

    def run(folder: str, p50: dict) -> None:
        (tmp_path / folder).mkdir()
        rows_ = [{"tokens": t, "variant": v, "p50_us": us, "p90_us": us} for (t, v), us in p50.items()]
        (tmp_path / folder / "lookup_host.json").write_text(json.dumps({"rows": rows_}))

    with pytest.raises(SystemExit, match="no round with both"):
        lookup_host.compare(tmp_path)
    for n, (base, current) in zip((1, 3, 4), [(100.0, 110.0), (50.0, 100.0), (80.0, 72.0)], strict=True):
        run(f"base_{n}", {(1, "mapped"): base, (16, "served"): 300.0, (256, "inproc"): 9.0})
        run(f"current_{n}", {(1, "mapped"): current, (16, "served"): 330.0} | (
            {(256, "inproc"): 9.0} if n != 4 else {}))  # a cell one round lacks: left out
    run("base_2", {(1, "mapped"): 1.0, (16, "served"): 1.0})  # round 2's current failed: left out
    table = lookup_host.compare(tmp_path).splitlines()
    assert "3 rounds of each tree" in table[0] and "(rounds 1, 3, 4)" in table[0]
    assert "| 1 | mapped | 100.0 / 50.0 / 80.0 | 110.0 / 100.0 / 72.0 | 1.10 |" in table  # of 1.1, 2.0, 0.9
    assert "| 16 | served | 300.0 / 300.0 / 300.0 | 330.0 / 330.0 / 330.0 | 1.10 |" in table
    assert not any("inproc" in line for line in table)


def test_the_captured_step_report_pairs_each_rounds_two_lookups():
    """Each round's mapped_graph / inproc_graph, the two timed next to each other: their median,
    range and how many were over 1.00, beside the ratio of the two variants' medians."""
    import captured_step

    def cell(variant: str, rounds_us: list[float]) -> dict:
        return {"mps": False, "mode": "pipelined", "variant": variant, "tokens": 16, "lead": 4,
                "steps": 60, "step_us": float(np.median(rounds_us)), "issue_us": 10.0,
                "rounds_us": rounds_us}

    # The reference drifts 100 -> 120 -> 90 between rounds; the captured step is 2% over it,
    # then 2% under, then 2% over.
    cells = [cell("inproc_graph", [100.0, 120.0, 90.0]), cell("mapped_graph", [102.0, 117.6, 91.8]),
             cell("compute_graph", [90.0, 90.0, 90.0]), cell("mapped", [150.0, 150.0, 150.0])]
    report = {"meta": {"date": "today", "command": "cmd"}, "cells": cells,
              "runs": [{"gpu": "GPU", "rounds": 3, "mps": False, "rows_exact": True,
                        "captured_counts": {}, "seconds": 1}]}
    lines = captured_step.markdown(report).splitlines()
    row = next(line for line in lines if line.startswith("| off |"))
    assert "| 1.020 | 1.020 (0.980-1.020), 2 of 3 over 1.00 |" in row, row
    assert captured_step.describe_paired([0.99]) == "0.990, 0 of 1 over 1.00"


def _engine_module(monkeypatch, engine: str, module: str = "bench_report"):
    """benchmarks/<engine>_gpu/<module>.py: both engines' folders name their modules alike, so
    every module of theirs is forgotten before the import and again when the test ends."""
    import importlib

    benchmarks = Path(__file__).resolve().parents[1] / "benchmarks"
    monkeypatch.syspath_prepend(str(benchmarks / f"{engine}_gpu"))
    for name in {path.stem for folder in ("vllm_gpu", "sglang_gpu") for path in (benchmarks / folder).glob("*.py")}:
        monkeypatch.setitem(sys.modules, name, None)  # undone on teardown: dropped or restored
        del sys.modules[name]
    return importlib.import_module(module)


def test_the_sglang_report_holds_each_variant_against_both_of_sglangs_own(monkeypatch):
    bench_report = _engine_module(monkeypatch, "sglang")

    us = {"sglang": 100.0, "sglang_host": 200.0, "plugin_mapped": 300.0}
    steps = [{"mps": False, "variant": v, "tokens": 1, "lead": 1, "mode": mode, "step_us": t}
             for v, t in us.items() for mode in ("pipelined", "synced")]
    header, _, row = bench_report._step_table(steps)[2:5]
    cells = dict(zip(header.strip("| ").split(" | "), row.strip("| ").split(" | "), strict=True))
    assert cells["synced sglang_host / sglang"] == "2.00"
    assert cells["synced plugin_mapped / sglang"] == "3.00"
    assert cells["synced plugin_mapped / sglang_host"] == "1.50"
    assert "synced sglang / sglang_host" not in cells
    lookups = [{"mps": False, "variant": v, "tokens": 1, "mode": "synced", "gpu_us": t, "step_us": t}
               for v, t in us.items() if v != "plugin_mapped"]
    header, _, _, second = bench_report._lookup_table(lookups)[2:6]
    cells = dict(zip(header.strip("| ").split(" | "), second.strip("| ").split(" | "), strict=True))
    assert (cells["variant"], cells["synced gpu / sglang"], cells["synced gpu / sglang_host"]) == (
        "sglang_host", "2.00", "1.00")


def test_the_vllm_report_holds_each_paired_cell_against_the_vllm_step_beside_it(monkeypatch):
    """--paired: vLLM's own step drifts 500 -> 700 us between rounds and the plugin's follows
    it, 2% over then 3% under. Each round's ratio is taken against the vLLM cell timed next to
    it (the `beside` cells), not against vLLM's phase-1 median; the main table's vllm column
    keeps phase 1's cells alone; the summary counts the decode cells whose median is over 1.00;
    vLLM's phase-2 cells (beside a variant, and the brackets) are held against phase 1's."""
    bench_report = _engine_module(monkeypatch, "vllm")

    def cell(variant: str, tokens: int, number: int, step_us: float, **extra) -> dict:
        return {"mps": False, "variant": variant, "tokens": tokens, "lead": 1, "mode": "synced",
                "round": number, "step_us": step_us, "host_us": step_us / 2, "gpu_us": step_us,
                **extra}

    steps = [cell("vllm", 1, 0, 400.0), cell("vllm", 1, 1, 400.0),  # phase 1, its own time
             cell("vllm", 1, 0, 400.0, when="before"), cell("vllm", 1, 1, 440.0, when="before"),
             cell("vllm", 1, 0, 500.0, beside="plugin_mapped"), cell("plugin_mapped", 1, 0, 510.0),
             cell("vllm", 1, 1, 700.0, beside="plugin_mapped"), cell("plugin_mapped", 1, 1, 679.0),
             cell("vllm", 4096, 0, 1000.0, beside="plugin_mapped"),
             cell("plugin_mapped", 4096, 0, 1500.0)]
    table = bench_report.paired_table(steps, "step_us")
    rows = [line for line in table if line.startswith("| off |")]
    assert rows[0] == "| off | 1 | 1 | synced | 0.995 (0.970-1.020), 1 of 2 over 1.00 |", rows
    assert rows[1] == "| off | 4096 | 1 | synced | 1.500, 1 of 1 over 1.00 |", rows
    # The median of 1.02 and 0.97 is under 1.00; T = 4096 is no decode cell.
    assert table[-1] == ("- MPS off, decode cells (T <= 256) with the median over 1.00: "
                         "plugin_mapped 0 of 1 (most 0.995)"), table[-1]
    through = bench_report.vllm_through_the_run(steps)
    assert through[-2:] == ["| off | before | 1.05 (1.00-1.10) | 1.05 (1.00-1.10) | 2 |",
                            "| off | beside plugin_mapped | 1.50 (1.25-1.75) | 1.50 (1.25-1.75) | 2 |"], through
    report = {"meta": {"date": "today", "command": "cmd", "machine": "m"}, "lookups": [],
              "steps": steps, "runs": []}
    text = bench_report.markdown(report)
    main = next(line for line in text.splitlines() if line.startswith("| off | 1 | 1 | synced"))
    assert main.split(" | ")[4:6] == ["400 ±0%", "594 ±14%"], main  # vllm: phase 1's alone
    assert "beside vLLM's own" in text and bench_report.paired_table(steps[:4], "step_us") == []
    assert bench_report.PARTNER_NOTE not in text  # every partner here is vLLM's eager step
    with pytest.raises(ValueError, match="two vLLM cells"):
        bench_report.paired_table([*steps, steps[4]], "step_us")


def test_the_vllm_report_pairs_the_captured_plugin_with_vllms_graph_and_names_that_partner(
        monkeypatch):
    """--paired: plugin_captured's partner is vllm_graph recorded again in phase 2. Its ratio is
    taken against that graph's cell (not vLLM's eager step, nor phase 1's graph), its column
    names the partner, and the partner's cells stay out of vllm_graph's own column; through
    phase 2 each of vLLM's steps is held against its own phase-1 cell."""
    bench_report = _engine_module(monkeypatch, "vllm")

    def cell(variant: str, step_us: float, **extra) -> dict:
        return {"mps": False, "variant": variant, "tokens": 16, "lead": 1, "mode": "pipelined",
                "round": 0, "step_us": step_us, "host_us": 10.0, "gpu_us": step_us, **extra}

    steps = [cell("vllm", 900.0), cell("vllm_graph", 400.0),  # phase 1
             cell("vllm", 1000.0, beside="plugin_mapped"), cell("plugin_mapped", 950.0),
             cell("vllm_graph", 450.0, beside="plugin_captured"), cell("plugin_captured", 441.0)]
    table = bench_report.paired_table(steps, "step_us")
    header = next(line for line in table if line.startswith("| MPS |"))
    assert header.endswith("| plugin_mapped | plugin_captured / vllm_graph |"), header
    row = next(line for line in table if line.startswith("| off |"))
    assert row.endswith("| 0.950, 0 of 1 over 1.00 | 0.980, 0 of 1 over 1.00 |"), row
    through = bench_report.vllm_through_the_run(steps)  # each of vLLM's steps over its own phase 1
    assert through[-2:] == ["| off | beside plugin_mapped | 1.00 (1.00-1.00) | 1.11 (1.11-1.11) | 1 |",
                            "| off | vllm_graph beside plugin_captured | 1.00 (1.00-1.00) | 1.12 (1.12-1.12) | 1 |"], \
        through
    text = bench_report.markdown({"meta": {"date": "today", "command": "cmd", "machine": "m"},
                                  "lookups": [], "steps": steps, "runs": []})
    assert bench_report.PARTNER_NOTE in text
    graph_row = next(line for line in text.splitlines() if line.startswith("| off | 16 | 1 | pipelined"))
    assert "400 " in graph_row and "450 " not in graph_row, graph_row  # phase 1's graph alone


def test_the_vllm_report_holds_the_captured_plugin_against_vllms_own_graph_and_shows_the_keeper(
        monkeypatch):
    bench_report = _engine_module(monkeypatch, "vllm")
    steps = [{"mps": True, "variant": variant, "tokens": 16, "lead": 4, "mode": "pipelined",
              "round": 0, "step_us": step_us, "host_us": 10.0, "gpu_us": step_us}
             for variant, step_us in (("vllm", 1000.0), ("vllm_graph", 800.0),
                                      ("plugin_captured", 760.0), ("compute_graph", 700.0))]
    header, _, row = bench_report._step_table(steps, "step_us", "t")[2:5]
    columns = [c.strip() for c in header.strip("|").split("|")]
    values = [c.strip() for c in row.strip("|").split("|")]
    assert values[columns.index("plugin_captured / vllm_graph")] == "0.95", (header, row)
    assert values[columns.index("plugin_captured / vllm")] == "0.76", (header, row)
    stats = {"refreshes": 62, "refresh_ms_total": 812.4, "refresh_cpu_ms_total": 790.2,
             "hit_rate": [0.0, 0.125]}
    runs = [{"mps": True, "phases": {"vllm": {}, "engramd": {"hot_cache": {
        "plugin_mapped": stats, "plugin_served": None}}}}]
    assert bench_report.keeper_table(runs)[-1] == "| on | plugin_mapped | 62 | 812 | 790 | 0.000, 0.125 |"
    assert bench_report.keeper_table([{"mps": False, "phases": {}}]) == []


def test_the_paired_vllm_benchmark_puts_each_side_first_as_often(monkeypatch):
    """Over two rounds each (T, lead, mode) cell has each side first once, and within a round
    each mode has each side first in every other (T, lead) cell."""
    pair_order = _engine_module(monkeypatch, "vllm", "bench_lookup").pair_order

    firsts = {(number, pair, mode): pair_order(["plugin", "vllm"], number + pair + mode)[0]
              for number in range(2) for pair in range(6) for mode in range(2)}
    for pair in range(6):
        for mode in range(2):
            assert {firsts[(0, pair, mode)], firsts[(1, pair, mode)]} == {"plugin", "vllm"}
    for number in range(2):
        for mode in range(2):
            assert [firsts[(number, pair, mode)] for pair in range(6)].count("plugin") == 3


def _stat_line(pid: int, comm: str, utime: int, stime: int) -> str:
    return f"{pid} ({comm}) S " + " ".join(["0"] * 10 + [str(utime), str(stime)] + ["0"] * 5) + "\n"


def _fake_task(folder: Path, pid: int, comm: str, utime: int, stime: int, cmdline: str | None = None) -> None:
    """A /proc/<pid> (or task/<tid>) entry; its cmdline kept unless given."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "stat").write_text(_stat_line(pid, comm, utime, stime))
    (folder / "comm").write_text(comm + "\n")
    if cmdline is not None or not (folder / "cmdline").exists():
        (folder / "cmdline").write_text(cmdline or "")


def test_cpu_use_counts_each_thread_each_watched_process_and_the_machines_steal(tmp_path, monkeypatch):
    """Over a fake /proc and a fake clock: the ticks each thread, the named daemon and the MPS
    server used in the block, the machine's busy and steal time, the block's wall time; a thread
    and a process that ended inside are named, an idle thread left out, an idle watched process
    kept at 0; the MPS control daemon (whose comm is the server's) and other processes ignored;
    a command name with ') ' parses."""
    from common import cpu_use
    from common.cpu_use import TICK_S, CpuUse, task_seconds

    assert task_seconds(_stat_line(7, "odd) (name", 3, 4)) == 7 * TICK_S
    proc, pid = tmp_path / "proc", 100
    tasks = proc / str(pid) / "task"

    def machine(user: int, system: int, idle: int, steal: int) -> None:
        (proc / "stat").write_text(f"cpu  {user} 0 {system} {idle} 0 0 0 {steal} 0 0\ncpu0 1 2 3\n")

    proc.mkdir()
    machine(1000, 500, 9000, 10)
    _fake_task(tasks / "100", 100, "python3", 50, 10)
    _fake_task(tasks / "101", 101, "keeper", 5, 0)
    _fake_task(tasks / "102", 102, "idle", 1, 1)
    _fake_task(tasks / "103", 103, "ends", 1, 1)
    _fake_task(proc / "200", 200, "engramd", 30, 5, "/usr/bin/python3\0/opt/bin/engramd\0serve\0")
    _fake_task(proc / "201", 201, "engramd", 7, 7, "/usr/bin/python3\0/opt/bin/engramd\0serve\0")
    _fake_task(proc / "300", 300, "nvidia-cuda-mps", 2, 2, "/usr/bin/nvidia-cuda-mps-server\0")
    _fake_task(proc / "301", 301, "nvidia-cuda-mps", 9, 9, "nvidia-cuda-mps-control\0-d\0")
    _fake_task(proc / "302", 302, "nvidia-cuda-mps", 4, 4, "nvidia-cuda-mps-server\0")
    clock = iter([100.0, 102.5])  # the block's start and end
    monkeypatch.setattr(cpu_use, "time", SimpleNamespace(monotonic=lambda: next(clock)))
    with CpuUse({"daemon": 200, "standby": 201, "none": None}, proc, pid) as use:
        machine(1300, 600, 9500, 60)
        _fake_task(tasks / "100", 100, "python3", 80, 20)  # +40 ticks
        _fake_task(tasks / "101", 101, "keeper", 25, 5)  # +25
        shutil.rmtree(tasks / "103")
        _fake_task(tasks / "104", 104, "new", 3, 0)  # begun inside: +3
        _fake_task(proc / "200", 200, "engramd", 40, 5)  # +10
        shutil.rmtree(proc / "201")
        _fake_task(proc / "300", 300, "nvidia-cuda-mps", 2, 6)  # +4
        _fake_task(proc / "301", 301, "nvidia-cuda-mps", 90, 9)
    got = use.result()
    seconds = {name: round(ticks * TICK_S, 3) for name, ticks in
               {"python3 [100]": 40, "keeper [101]": 25, "new [104]": 3}.items()}
    assert got["threads"] == seconds and list(got["threads"]) == list(seconds)  # the busiest first
    assert got["processes"] == {"daemon [200]": round(10 * TICK_S, 3), "mps_server [300]": round(4 * TICK_S, 3),
                                "mps_server [302]": 0.0}
    assert got["machine"] == {"busy": round(400 * TICK_S, 3), "steal": round(50 * TICK_S, 3)}
    assert got["ended"] == ["ends [103]", "standby [201]"] and got["wall_s"] == 2.5


def test_cpu_use_names_this_processes_threads_by_their_python_names():
    """On the real /proc, a reading lists every thread of this process, idle or not, each by its
    Python name and native id (no CPU time needed: the name is what is checked)."""
    import threading

    from common.cpu_use import CpuUse

    done = threading.Event()
    worker = threading.Thread(target=done.wait, name="a-named-worker")
    worker.start()
    try:
        keys = set(CpuUse()._threads())
    finally:
        done.set()
        worker.join()
    here = threading.current_thread()
    assert {f"{here.name} [{here.native_id}]", f"a-named-worker [{worker.native_id}]"} <= keys, keys


def test_the_cpu_use_table_has_a_row_per_rounds_steps_and_tells_an_idle_daemon_from_none():
    from common.cpu_use import table

    use = {"wall_s": 2.0, "threads": {"MainThread [1]": 1.5, "engramd-cache-cuda:0 [4]": 0.4,
                                      "x [5]": 0.3, "y [6]": 0.2, "z [7]": 0.1},
           "processes": {"daemon [9]": 0.0}, "machine": {"busy": 3.0, "steal": 0.5}, "ended": []}
    lines = table([{"mps": True, "cpu_use": [{"variant": "plugin_mapped", "round": 1, **use}]},
                   {"mps": False, "cpu_use": [{"variant": "sglang", **use, "processes": {}}]}])
    assert lines[4] == ("| on | plugin_mapped [round 2] | 2.0 | 1.5 | engramd-cache-cuda:0 [4] 0.4, x [5] 0.3, "
                        "y [6] 0.2 | 0.0 | - | 3.0 | 0.5 |")
    assert lines[5].startswith("| off | sglang | 2.0 | 1.5 |") and "| - | - |" in lines[5]
    assert table([{"mps": True}]) == []
