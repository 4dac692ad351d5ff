"""The layout benchmark's own gather kernel (benchmarks/experiments/gather_layouts.py) under Triton's interpreter.

Its padded (272-byte rows) and split (weights and scales in two arrays) layouts, and the packed one
with the put-back of a sorted gather fused into the store, must give exactly what the plain-torch
reference gives on the packed rows: bit for bit, NaN by position. The benchmark module is loaded
afresh with TRITON_INTERPRET=1, next to an interpreted copy of engramd.kernels.gather_triton (whose
dequant it calls), so compiled copies imported elsewhere in the session are left alone.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from reference import assert_same, exec_fresh, small_geometry, triton_interpreter

from engramd.client.geometry import DEAD_ID, ShardView, TableGeometry
from engramd.kernels import gather_ref

pytest.importorskip("triton")

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "experiments" / "gather_layouts.py"
BLOCK_ROWS = 64  # the interpreter's cost is per block
LAUNCH = {"num_programs": 3, "block_rows": BLOCK_ROWS, "num_warps": 4}
GATHER_TRITON = "engramd.kernels.gather_triton"


@pytest.fixture(scope="module")
def gl():
    """benchmarks/experiments/gather_layouts.py with its kernel and gather_triton's dequant interpreted."""
    saved_module = sys.modules.get(GATHER_TRITON)
    names = ("engramd_gather_triton_interpreted_for_layouts", "gather_layouts_interpreted")
    try:
        with triton_interpreter():
            # The benchmark imports _bf16_bits from gather_triton: give it the interpreted copy.
            sys.modules[GATHER_TRITON] = exec_fresh(names[0], importlib.util.find_spec(
                GATHER_TRITON).origin)
            module = exec_fresh(names[1], str(BENCHMARK))
    finally:
        if saved_module is None:
            sys.modules.pop(GATHER_TRITON, None)
        else:
            sys.modules[GATHER_TRITON] = saved_module
    assert module.kernels_interpreted()
    _skip_if_interpreter_too_old(module)
    yield module
    for name in names:
        sys.modules.pop(name, None)


def _skip_if_interpreter_too_old(module) -> None:
    # Older interpreters (seen with Triton 3.6) turn a program id into a 1-element array that
    # NumPy 2 refuses as a loop bound; the compiled kernel is unaffected.
    table = torch.zeros(1, 264, dtype=torch.uint8)
    arrays = module.LayerArrays(table.data_ptr(), table.data_ptr() + 256, 1, 264, 264)
    plan = module.LayoutPlan([arrays], ShardView(0, 1, 0, 1, 1, ((0, 1),)), torch.device("cpu"))
    try:
        plan(torch.zeros(1, 1, 1, dtype=torch.int64), torch.empty(1, 1, 1, 256, dtype=torch.bfloat16),
             num_programs=1, block_rows=8, num_warps=4)
    except Exception as exc:  # the interpreter wraps the NumPy error in its own type
        if "0-dimensional" not in str(exc):
            raise
        pytest.skip(f"this Triton's interpreter cannot run the kernel: {exc}")


class Layouts:
    """Packed tables and the same rows padded and split, built here with plain torch."""

    def __init__(self, geometry: TableGeometry, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.packed = [torch.randint(0, 256, (rows, 264), dtype=torch.uint8, generator=gen)
                       for rows in geometry.rows]
        self.padded = []
        for table in self.packed:
            padded = torch.full((table.shape[0], 272), 0xFF, dtype=torch.uint8)  # pad bytes: NaN
            padded[:, :264] = table
            self.padded.append(padded)
        self.weights = [t[:, :256].contiguous() for t in self.packed]
        self.scales = [t[:, 256:].contiguous() for t in self.packed]

    def arrays(self, gl, layout: str) -> list:
        if layout == "packed":
            return [gl.LayerArrays(t.data_ptr(), t.data_ptr() + 256, len(t), 264, 264)
                    for t in self.packed]
        if layout == "padded":
            return [gl.LayerArrays(t.data_ptr(), t.data_ptr() + 256, len(t), 272, 272)
                    for t in self.padded]
        return [gl.LayerArrays(w.data_ptr(), s.data_ptr(), len(w), 256, 8)
                for w, s in zip(self.weights, self.scales, strict=True)]


@pytest.fixture(scope="module")
def world():
    geometry = small_geometry()
    return geometry, Layouts(geometry, seed=5)


def mixed_ids(geometry: TableGeometry, tokens: int, seed: int, dtype=torch.int64) -> torch.Tensor:
    """Valid rows, other shards' rows, DEAD, rows past the table, negatives; repeats, a sorted head."""
    gen = torch.Generator().manual_seed(seed)
    top = max(geometry.rows)
    ids = torch.randint(-4, top + 8, (tokens, geometry.n_layers, geometry.heads), generator=gen)
    ids[torch.rand(ids.shape, generator=gen) < 0.15] = DEAD_ID
    ids[1::3] = ids[0]
    ids[:, :, 1] = ids[:, :, 1].sort(dim=0).values
    return ids.to(dtype)


def with_boundaries(ids: torch.Tensor, shard: ShardView) -> torch.Tensor:
    """One more token whose owned heads hold lo - 1, lo, hi - 1, hi of each layer's row range."""
    extra = torch.full((1, *ids.shape[1:]), DEAD_ID, dtype=ids.dtype)
    for layer, (lo, hi) in enumerate(shard.row_ranges):
        for k, head in enumerate(range(shard.head_start, shard.head_end)):
            extra[0, layer, head] = (lo - 1, lo, hi - 1, hi)[k % 4]
    return torch.cat([ids, extra])


def poisoned(shape) -> torch.Tensor:
    return torch.full(tuple(shape), float("nan"), dtype=torch.bfloat16)


@pytest.mark.parametrize("layout", ["packed", "padded", "split"])
@pytest.mark.parametrize("shards,id_dtype", [(1, torch.int64), (4, torch.int32), (5, torch.int64)])
def test_layouts_match_reference_for_every_shard(gl, world, layout, shards, id_dtype):
    geometry, tables = world
    for rank in range(shards):
        shard = geometry.shard(rank, shards)
        ids = with_boundaries(mixed_ids(geometry, 6, seed=10 * shards + rank, dtype=id_dtype), shard)
        plan = gl.LayoutPlan(tables.arrays(gl, layout), shard, torch.device("cpu"))
        got = plan(ids, poisoned(plan.output_shape(len(ids))), **LAUNCH)
        want, _ = gather_ref.gather(tables.packed, ids, shard)
        assert_same(got, want, f"{layout} layout, shard {rank}/{shards}")


@pytest.mark.parametrize("layout", ["padded", "split"])
def test_dequantizes_every_byte_under_every_scale(gl, layout):
    # Row s: all 256 E4M3 bytes (NaN included) under scale byte s, for every s.
    packed = torch.empty(256, 264, dtype=torch.uint8)
    packed[:, :256] = torch.arange(256, dtype=torch.uint8)
    packed[:, 256:] = torch.arange(256, dtype=torch.uint8)[:, None]
    if layout == "padded":
        padded = torch.zeros(256, 272, dtype=torch.uint8)
        padded[:, :264] = packed
        keep = [padded]
        arrays = [gl.LayerArrays(padded.data_ptr(), padded.data_ptr() + 256, 256, 272, 272)]
    else:
        keep = [packed[:, :256].contiguous(), packed[:, 256:].contiguous()]
        arrays = [gl.LayerArrays(keep[0].data_ptr(), keep[1].data_ptr(), 256, 256, 8)]
    ids = torch.arange(256, dtype=torch.int64).reshape(32, 1, 8)
    plan = gl.LayoutPlan(arrays, ShardView(0, 1, 0, 8, 8, ((0, 256),)), torch.device("cpu"))
    got = plan(ids, poisoned(plan.output_shape(32)), **LAUNCH)
    assert_same(got, gather_ref.dequantize_rows(packed, 256).reshape(1, 32, 8, 256),
                f"{layout}: every E4M3 byte x every scale byte")
    del keep


@pytest.mark.parametrize("num_programs,block_rows", [(1, 64), (2, 8), (1000, 16)])
def test_any_grid_size_gives_the_same_rows(gl, world, num_programs, block_rows):
    geometry, tables = world
    shard = geometry.shard(1, 4)
    ids = with_boundaries(mixed_ids(geometry, 5, seed=3), shard)
    plan = gl.LayoutPlan(tables.arrays(gl, "split"), shard, torch.device("cpu"))
    got = plan(ids, poisoned(plan.output_shape(len(ids))), num_programs=num_programs,
               block_rows=block_rows, num_warps=4)
    want, _ = gather_ref.gather(tables.packed, ids, shard)
    assert_same(got, want, f"{num_programs} programs of {block_rows} rows")


def test_sorted_gathers_put_rows_back_in_request_order(gl, world):
    geometry, tables = world
    shard = geometry.shard(0, 1)
    ids = mixed_ids(geometry, 7, seed=21)
    want, _ = gather_ref.gather(tables.packed, ids, shard)
    sorted_ids, dest = gl.sort_per_layer(ids)
    for layer in range(geometry.n_layers):  # the sorted view holds each layer's IDs, in order
        flat = sorted_ids[:, layer].reshape(-1)
        assert torch.equal(flat, ids[:, layer].reshape(-1).sort().values)
    plan = gl.LayoutPlan(tables.arrays(gl, "packed"), shard, torch.device("cpu"))
    fused = plan(sorted_ids, poisoned(want.shape), dest=dest, **LAUNCH)
    assert_same(fused, want, "sorted gather with the put-back in the store")
    gathered = plan(sorted_ids, poisoned(want.shape), **LAUNCH)
    assert_same(gl.put_back(gathered, dest, poisoned(want.shape)), want, "sorted gather + put_back")


def test_host_layouts_hold_the_same_rows(gl):
    geometry = small_geometry()
    cpu = torch.device("cpu")
    with (gl.HostLayout("packed", geometry, cpu, seed=3) as packed,
          gl.HostLayout("padded", geometry, cpu, seed=3) as padded,
          gl.HostLayout("split", geometry, cpu, seed=3) as split):
        for layer, table in enumerate(packed.packed_tables()):
            assert table.shape == (geometry.rows[layer], 264)
            rows = padded.arrays[layer]["rows"]
            assert torch.equal(rows[:, :264], table), f"padded layer {layer}"
            assert not rows[:, 264:].any(), f"padded layer {layer}: pad bytes not zero"
            assert torch.equal(split.arrays[layer]["weights"], table[:, :256]), f"split {layer}"
            assert torch.equal(split.arrays[layer]["scales"], table[:, 256:]), f"split {layer}"
        other = gl.HostLayout("packed", geometry, cpu, seed=4)
        assert not torch.equal(other.packed_tables()[0], packed.packed_tables()[0])
        other.close()
    assert packed.arrays == []


def test_plan_rejects_what_it_cannot_read(gl, world):
    geometry, tables = world
    cpu = torch.device("cpu")
    arrays = tables.arrays(gl, "packed")
    skewed = [gl.LayerArrays(a.weights, a.scales + 4, a.rows, a.weight_stride, a.scale_stride)
              for a in arrays]
    with pytest.raises(ValueError, match="8-byte aligned"):
        gl.LayoutPlan(skewed, geometry.shard(0, 1), cpu)
    plan = gl.LayoutPlan(arrays, geometry.shard(1, 2), cpu)
    ids = mixed_ids(geometry, 2, seed=1)
    with pytest.raises(ValueError, match="owns every head"):
        plan(ids, poisoned(plan.output_shape(2)), dest=torch.zeros(2 * 2 * 12, dtype=torch.int64),
             **LAUNCH)
    with pytest.raises(ValueError, match="out must be contiguous bf16"):
        plan(ids, torch.empty(2, 2, 12, 256), **LAUNCH)
    with pytest.raises(ValueError, match="exceed"):
        gl.LayoutPlan([arrays[0], gl.LayerArrays(arrays[1].weights, arrays[1].scales, 3, 264, 264)],
                      geometry.shard(0, 1), cpu)
    assert gl.LayoutPlan(tables.arrays(gl, "padded"), geometry.shard(0, 1), cpu).vector_bytes == 16
    assert plan.vector_bytes == 8


def _result(layout, variant, tokens, rate):
    return {"section": "layout", "layout": layout, "variant": variant, "tokens": tokens,
            "rows": 1, "iters": 1, "p50_us": 1.0, "p10_us": 1.0, "p90_us": 1.0, "rows_per_s": rate}


@pytest.mark.parametrize("padded_rate,kept", [(110.0, "padded"), (102.0, "packed")])
def test_keeps_a_layout_only_when_it_wins_by_more_than_the_threshold(gl, padded_rate, kept):
    results = []
    for t in (256, 4096):
        results += [_result("packed", "gatherplan", t, 100.0),
                    _result("packed", "local_kernel", t, 100.0),
                    _result("padded", "local_kernel", t, padded_rate),
                    _result("split", "local_kernel", t, 80.0),
                    _result("packed", "sort_gather_putback", t, 90.0),
                    _result("packed", "sort_fused_scatter", t, 101.0),
                    _result("packed", "presorted_gatherplan", t, 120.0)]
    decision = gl.decide(results, (256, 4096))
    assert decision["layout"] == kept
    assert decision["ordering"] == "unsorted"
    gain = decision["layout_gain_vs_packed_same_kernel"]["padded"]["geomean"]
    assert gain == pytest.approx(padded_rate / 100 - 1)
    text = "\n".join(gl.kept_lines(decision))
    assert f"kept layout: {kept}" in text


def test_recorded_command_has_no_output_path(gl):
    line = gl.command_line("gather_layouts.py", ["--table-gib", "8", "--out", "/some/where"])
    assert line == "python benchmarks/experiments/gather_layouts.py --table-gib 8 --out DIR"
    assert gl.command_line("sm_cap.py", ["--out=/x/y"]) == "python benchmarks/experiments/sm_cap.py --out=DIR"
