"""Host table layouts and ID ordering for the GPU gather+dequant, timed on one GPU.

    python benchmarks/experiments/gather_layouts.py [--table-gib 16] [--out DIR]
    TRITON_INTERPRET=1 python benchmarks/experiments/gather_layouts.py --smoke --out DIR   # CPU, tiny

One V4.1-shaped table (2 layers x 24 heads, rows of 256 E4M3 bytes + 8 UE8M0 scale bytes, --table-gib
of rows in all), the same random content in each of three host layouts, registered with CUDA and
read over UVA by a persistent Triton gather+dequant to BF16:
  packed  one 264-byte row per ID (what engramd stores; kernels/gather_triton's GatherPlan),
  padded  rows of 272 bytes (weights, scales, 8 zero bytes), so every row starts 16-byte aligned,
  split   weights [rows, 256] and scales [rows, 8] in two arrays (the checkpoint's own layout).
The padded and split layouts are read by a kernel local to this file that differs from GatherPlan's
only in where it finds a row's weights and scales; it also reads the packed layout, as a control
that separates the layout's effect from the kernel's. Then ID ordering on the packed layout:
unsorted IDs, against IDs sorted per layer before the gather (sort + gather + putting rows back in
request order, either with index_copy_ or by a scattered store in the local kernel), and the gather
alone on IDs sorted beforehand (what sorting could buy at best).

Every variant is first checked bit for bit against kernels/gather_ref (zeros for DEAD_ID, a TP
shard) and the script stops if one differs. Timing: fresh random IDs every iteration (uniform in each
head's bucket, drawn on the device before timing), CUDA events around each iteration, p50 per point.
Only one layout's table is held at a time. The kernels are no product code: what wins here is then
built into kernels/gather_triton.

The host layouts, geometry and run metadata here are shared with sm_cap.py; IDs, clock and exact
comparison come from benchmarks/common.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor

from engramd.client.geometry import DEAD_ID, ShardView, TableGeometry
from engramd.client.shared import cuda as cuda_calls
from engramd.kernels import gather_ref
from engramd.kernels.gather_triton import GatherPlan, LayerTable, _bf16_bits

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common
from common.ids import bucket_ids  # noqa: E402
from common.rows import assert_exact, poisoned  # noqa: E402
from common.tables import v41_geometry  # noqa: E402
from common.timing import Clock, timed_steps  # noqa: E402

WEIGHT_BYTES = 256
SCALE_BYTES = 8
PACKED_ROW = WEIGHT_BYTES + SCALE_BYTES  # 264
PADDED_ROW = 272  # 17 x 16 bytes
LAYOUTS = ("packed", "padded", "split")
TOKENS = (256, 4096, 16384)
ITERATIONS = {256: 200, 4096: 60, 16384: 30}
WARM_UP = 3
CHECK_TOKENS = 64
CHECK_SHARDS = ((0, 1), (1, 4))  # the whole table, and TP rank 1 of 4 (heads 6-11)
FILL_ROWS = 1 << 22  # rows generated on the device per step while filling a table (~1.1 GB)
KEEP_THRESHOLD = 0.03  # a change of layout or ordering has to win by more than this to be kept
_DEAD = tl.constexpr(DEAD_ID)  # a kernel may read module globals only as constexpr


# ---------------------------------------------------------------------------------------------
# The benchmark-local kernel: GatherPlan's loop, with weights and scales found at two strides.


@triton.jit(do_not_specialize=[
    "n_items", "tokens", "local_heads", "owned_heads", "head_start",
    "ids_stride_t", "ids_stride_l", "ids_stride_h",
])
def _layout_gather_kernel(
    ids_ptr, meta_ptr, out_ptr, dest_ptr,
    n_items, tokens, local_heads, owned_heads, head_start,
    ids_stride_t, ids_stride_l, ids_stride_h,
    HEAD_DIM: tl.constexpr, WEIGHT_STRIDE: tl.constexpr, SCALE_STRIDE: tl.constexpr,
    ALIGN16: tl.constexpr, BLOCK_ROWS: tl.constexpr, SCATTER: tl.constexpr,
):
    """Work items (layer, token, local head) in blocks of BLOCK_ROWS over a persistent grid.

    Per layer, meta holds (weights address, scales address, first owned row, end of owned rows);
    row r's weights start at weights + r * WEIGHT_STRIDE and its 8 scale bytes, one aligned
    little-endian word, at scales + r * SCALE_STRIDE. Item i's row is stored to output row i, or
    to output row dest[i] when SCATTER (the put-back of a sorted gather, fused into the store).
    """
    cols = tl.arange(0, HEAD_DIM)
    col_ok = cols < HEAD_DIM
    per_layer = tokens * local_heads
    n_blocks = (n_items + BLOCK_ROWS - 1) // BLOCK_ROWS
    for block in range(tl.program_id(0), n_blocks, tl.num_programs(0)):
        item = block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        live = item < n_items
        layer = item // per_layer
        token = (item - layer * per_layer) // local_heads
        j = item - layer * per_layer - token * local_heads
        owned = live & (j < owned_heads)
        id_offset = (token.to(tl.int64) * ids_stride_t + layer.to(tl.int64) * ids_stride_l
                     + (head_start + j).to(tl.int64) * ids_stride_h)
        row = tl.load(ids_ptr + id_offset, mask=owned, other=_DEAD).to(tl.int64)
        meta = meta_ptr + layer * 4
        hit = (owned & (row >= tl.load(meta + 2, mask=live, other=0))
               & (row < tl.load(meta + 3, mask=live, other=0)))
        weights = (tl.load(meta, mask=live, other=0) + row * WEIGHT_STRIDE).to(
            tl.pointer_type(tl.uint8))
        # The launcher checked these alignments; they let the loads vectorise (16 or 8 bytes).
        if ALIGN16:
            weights = tl.multiple_of(weights, 16)
        else:
            weights = tl.multiple_of(weights, 8)
        scales = (tl.load(meta + 1, mask=live, other=0) + row * SCALE_STRIDE).to(
            tl.pointer_type(tl.int64))
        load_mask = hit[:, None] & col_ok[None, :]
        raw = tl.load(weights[:, None] + cols[None, :], mask=load_mask, other=0)
        word = tl.load(scales, mask=hit, other=0)
        shift = ((cols // 32) * 8).to(tl.int64)
        scale = (word[:, None] >> shift[None, :]) & 0xFF
        bits = _bf16_bits(raw.to(tl.int32), scale.to(tl.int32))
        bits = tl.where(load_mask, bits, 0)
        if SCATTER:
            out_row = tl.load(dest_ptr + item, mask=live, other=0)
        else:
            out_row = item.to(tl.int64)
        dst = out_ptr + out_row[:, None] * HEAD_DIM + cols[None, :]
        tl.store(dst, bits.to(tl.int16), mask=live[:, None] & col_ok[None, :])


def kernels_interpreted() -> bool:
    """Whether this module's kernel and the dequant it calls both run in Triton's interpreter."""
    return type(_layout_gather_kernel).__name__ == "InterpretedFunction"


def _check_same_mode() -> None:
    # An interpreted kernel cannot call a compiled helper (or the reverse): both modules must have
    # been imported under the same TRITON_INTERPRET.
    if kernels_interpreted() != (type(_bf16_bits).__name__ == "InterpretedFunction"):
        raise RuntimeError(
            "gather_layouts' kernel and engramd.kernels.gather_triton._bf16_bits were defined in "
            "different Triton modes; import both with the same TRITON_INTERPRET"
        )


@dataclass(frozen=True)
class LayerArrays:
    """One layer's rows as the local kernel reads them: weights and scales at their own strides."""

    weights: int  # device-visible address of row 0's weights
    scales: int  # address of row 0's scale word
    rows: int
    weight_stride: int
    scale_stride: int


def _alignment(values: Sequence[int]) -> int:
    """The largest power of two, at most 16, dividing every value."""
    align = 16
    while align > 1 and any(v % align for v in values):
        align //= 2
    return align


class LayoutPlan:
    """Launcher of the local kernel for one shard: validated and staged once, like GatherPlan."""

    def __init__(self, layers: Sequence[LayerArrays], shard: ShardView, device: torch.device):
        _check_same_mode()
        if len(layers) != len(shard.row_ranges):
            raise ValueError(f"{len(layers)} layers given, the shard has {len(shard.row_ranges)}")
        strides = {(a.weight_stride, a.scale_stride) for a in layers}
        if len(strides) != 1:
            raise ValueError(f"all layers need the same strides, got {sorted(strides)}")
        self.weight_stride, self.scale_stride = next(iter(strides))
        scale_words = [a.scales for a in layers] + [self.scale_stride]
        if _alignment(scale_words) < 8:
            raise ValueError(f"scale words must be 8-byte aligned: addresses and stride {scale_words}")
        align = _alignment([a.weights for a in layers] + [self.weight_stride])
        if align < 8:
            raise ValueError(f"weights must be at least 8-byte aligned, got {align}")
        self.align16 = align == 16
        self.vector_bytes = align  # widest load the kernel may issue for a row's weights
        self.shard = shard
        self.device = device
        meta = []
        for i, (arrays, (lo, hi)) in enumerate(zip(layers, shard.row_ranges, strict=True)):
            if not 0 <= lo <= hi <= arrays.rows:
                raise ValueError(f"shard rows [{lo}, {hi}) of layer {i} exceed {arrays.rows} rows")
            meta.append([arrays.weights, arrays.scales, lo, hi])
        self.meta = torch.tensor(meta, dtype=torch.int64).to(device)
        self.layers = tuple(layers)

    def output_shape(self, tokens: int) -> tuple[int, int, int, int]:
        return (len(self.layers), tokens, self.shard.local_heads, WEIGHT_BYTES)

    def __call__(self, ids: Tensor, out: Tensor, *, num_programs: int, block_rows: int,
                 num_warps: int, dest: Tensor | None = None) -> Tensor:
        """Gather `ids` [T, n_layers, heads] into `out` bf16 [n_layers, T, local_heads, 256].

        With `dest` (int64 [n_layers * T * heads], whole-table shards only), item i goes to output
        row dest[i] instead of row i.
        """
        self._check(ids, out, dest)
        n_items = out.numel() // WEIGHT_BYTES
        if n_items == 0:
            return out
        grid = (min(num_programs, triton.cdiv(n_items, block_rows)),)
        _layout_gather_kernel[grid](
            ids, self.meta, out.view(torch.int16), dest if dest is not None else ids,
            n_items, ids.shape[0], self.shard.local_heads, self.shard.owned_heads,
            self.shard.head_start, ids.stride(0), ids.stride(1), ids.stride(2),
            HEAD_DIM=WEIGHT_BYTES, WEIGHT_STRIDE=self.weight_stride,
            SCALE_STRIDE=self.scale_stride,
            ALIGN16=self.align16, BLOCK_ROWS=block_rows, SCATTER=dest is not None,
            num_warps=num_warps,
        )
        return out

    def _check(self, ids: Tensor, out: Tensor, dest: Tensor | None) -> None:
        if ids.dtype not in (torch.int32, torch.int64) or ids.device != self.device:
            raise TypeError(f"ids must be int32/int64 on {self.device}, got {ids.dtype} on {ids.device}")
        if ids.dim() != 3 or ids.shape[1] != len(self.layers) or ids.shape[2] < self.shard.head_end:
            raise ValueError(f"ids must be [T, {len(self.layers)}, >= {self.shard.head_end}], "
                             f"got {tuple(ids.shape)}")
        shape = self.output_shape(ids.shape[0])
        if (out.dtype != torch.bfloat16 or tuple(out.shape) != shape or not out.is_contiguous()
                or out.device != self.device):
            raise ValueError(f"out must be contiguous bf16 {shape} on {self.device}, got "
                             f"{out.dtype} {tuple(out.shape)} on {out.device}")
        if dest is None:
            return
        if self.shard.head_start != 0 or self.shard.local_heads != ids.shape[2]:
            raise ValueError("dest (a scattered store) needs a shard that owns every head")
        if dest.dtype != torch.int64 or dest.shape != (out.numel() // WEIGHT_BYTES,):
            raise ValueError(f"dest must be int64 [{out.numel() // WEIGHT_BYTES}], got "
                             f"{dest.dtype} {tuple(dest.shape)}")


# ---------------------------------------------------------------------------------------------
# Host tables: one layout at a time, registered with CUDA, same random rows in every layout.


def geometry_for(table_gib: float) -> TableGeometry:
    """V4.1's shape with buckets sized to `table_gib` of rows in all (rounded down, unlike
    common.tables.geometry_for: this script's committed results were measured so)."""
    rows_per_bucket = max(2, int(table_gib * 2**30 / PACKED_ROW / 48))
    return v41_geometry(rows_per_bucket, source=f"{table_gib} GiB benchmark geometry")


def random_rows(layer: int, chunk: int, rows: int, seed: int, device: torch.device) -> Tensor:
    """Packed rows [rows, 264] of one fill step; the same bytes whatever the layout."""
    generator = torch.Generator(device=device).manual_seed(seed * 1_000_003 + layer * 65_537 + chunk)
    return torch.randint(0, 256, (rows, PACKED_ROW), dtype=torch.uint8, device=device,
                         generator=generator)


class HostLayout:
    """One layout's per-layer host arrays, filled with the benchmark's random rows.

    On a GPU every array is registered with CUDA (read over UVA at its host address); close()
    unregisters and drops them, so the next layout can take the memory. On the CPU (smoke runs
    under the interpreter) they are plain tensors.
    """

    def __init__(self, name: str, geometry: TableGeometry, device: torch.device, seed: int):
        if name not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {name!r}")
        self.name = name
        self.device = device
        self.arrays: list[dict[str, Tensor]] = []
        self._registered: list[int] = []
        try:
            for layer, rows in enumerate(geometry.rows):
                self.arrays.append(self._allocate(rows))
                for array in self.arrays[-1].values():
                    self._register(array)
                self._fill(layer, seed)
        except BaseException:
            self.close()
            raise

    def _allocate(self, rows: int) -> dict[str, Tensor]:
        if self.name == "split":
            return {"weights": torch.empty(rows, WEIGHT_BYTES, dtype=torch.uint8),
                    "scales": torch.empty(rows, SCALE_BYTES, dtype=torch.uint8)}
        width = PACKED_ROW if self.name == "packed" else PADDED_ROW
        return {"rows": torch.empty(rows, width, dtype=torch.uint8)}

    def _register(self, array: Tensor) -> None:
        # cudaHostRegister (as the daemon's PinnedTables does) rather than pin_memory=True:
        # torch's pinned allocator rounds each allocation up to a power of two and keeps freed
        # blocks cached, so the layouts would neither cost the same nor give memory back.
        if self.device.type != "cuda":
            return
        cudart, check = cuda_calls.cudart, cuda_calls.check
        if cudart is None:
            raise RuntimeError("registering host tables needs cuda-python (cuda.bindings)")
        address, what = array.data_ptr(), f"the {self.name} layout's {tuple(array.shape)} array"
        flags = cudart.cudaHostRegisterPortable | cudart.cudaHostRegisterMapped
        check(f"cudaHostRegister of {what}", cudart.cudaHostRegister(address, array.nbytes, flags))
        self._registered.append(address)
        device_ptr = int(check("cudaHostGetDevicePointer", cudart.cudaHostGetDevicePointer(address, 0)))
        if device_ptr != address:
            raise RuntimeError(f"{what} at {address:#x} maps to device address {device_ptr:#x}; "
                               "the kernels read host rows at their host address (UVA)")

    def _fill(self, layer: int, seed: int) -> None:
        arrays = self.arrays[layer]
        rows = next(iter(arrays.values())).shape[0]
        for chunk, start in enumerate(range(0, rows, FILL_ROWS)):
            end = min(rows, start + FILL_ROWS)
            packed = random_rows(layer, chunk, end - start, seed, self.device)
            if self.name == "packed":
                arrays["rows"][start:end].copy_(packed)
            elif self.name == "padded":
                padded = torch.zeros(end - start, PADDED_ROW, dtype=torch.uint8, device=self.device)
                padded[:, :PACKED_ROW] = packed
                arrays["rows"][start:end].copy_(padded)
            else:
                arrays["weights"][start:end].copy_(packed[:, :WEIGHT_BYTES])
                arrays["scales"][start:end].copy_(packed[:, WEIGHT_BYTES:])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for arrays in self.arrays for a in arrays.values())

    def layer_arrays(self) -> list[LayerArrays]:
        out = []
        for arrays in self.arrays:
            if self.name == "split":
                w, s = arrays["weights"], arrays["scales"]
                out.append(LayerArrays(w.data_ptr(), s.data_ptr(), w.shape[0], WEIGHT_BYTES,
                                       SCALE_BYTES))
            else:
                t = arrays["rows"]
                out.append(LayerArrays(t.data_ptr(), t.data_ptr() + WEIGHT_BYTES, t.shape[0],
                                       t.shape[1], t.shape[1]))
        return out

    def packed_tables(self) -> list[Tensor]:
        """The packed layout's [rows, 264] tables (for gather_ref and GatherPlan)."""
        if self.name != "packed":
            raise ValueError(f"the {self.name} layout has no packed rows")
        return [arrays["rows"] for arrays in self.arrays]

    def layer_tables(self) -> list[LayerTable]:
        return [LayerTable(t.data_ptr(), t.shape[0], t.shape[1], owner=t)
                for t in self.packed_tables()]

    def close(self) -> None:
        if self._registered:
            torch.cuda.synchronize(self.device)  # no kernel may still be reading the rows
        for address in self._registered:
            try:
                cuda_calls.check("cudaHostUnregister", cuda_calls.cudart.cudaHostUnregister(address))
            except cuda_calls.CudaError as exc:
                print(f"warning: {exc} at {address:#x}", file=sys.stderr)
        self._registered.clear()
        self.arrays.clear()

    def __enter__(self) -> HostLayout:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------
# Ordering.


def sort_per_layer(ids: Tensor) -> tuple[Tensor, Tensor]:
    """IDs sorted within each layer, as a [T, n_layers, heads] view, and where each row goes back.

    Item k of layer l of the sorted view came from flat position dest[l * T * heads + k] of the
    output [n_layers, T, heads, ...].
    """
    tokens, layers, heads = ids.shape
    per_layer = ids.permute(1, 0, 2).reshape(layers, tokens * heads)
    values, order = torch.sort(per_layer, dim=1)
    base = torch.arange(layers, dtype=torch.int64, device=ids.device)[:, None] * (tokens * heads)
    return values.view(layers, tokens, heads).permute(1, 0, 2), (order + base).reshape(-1)


def put_back(gathered: Tensor, dest: Tensor, out: Tensor) -> Tensor:
    """Rows gathered in sorted order -> `out` in request order (a row copy per item)."""
    out.view(-1, WEIGHT_BYTES).index_copy_(0, dest, gathered.view(-1, WEIGHT_BYTES))
    return out


# ---------------------------------------------------------------------------------------------
# Results and metadata.


def summarize(section: str, variant: str, layout: str, tokens: int, rows: int,
              seconds: Sequence[float]) -> dict:
    lat = np.asarray(seconds) * 1e6
    p50 = float(np.percentile(lat, 50))
    return {"section": section, "variant": variant, "layout": layout, "tokens": tokens,
            "rows": rows, "iters": len(lat), "p50_us": p50,
            "p10_us": float(np.percentile(lat, 10)), "p90_us": float(np.percentile(lat, 90)),
            "rows_per_s": rows / p50 * 1e6}


def command_line(script: str, argv: Sequence[str]) -> str:
    """The command as run, with the --out folder (a path of the machine) written as DIR."""
    args, skip = [], False
    for arg in argv:
        if skip:
            args.append("DIR")
            skip = False
        elif arg == "--out":
            args.append(arg)
            skip = True
        elif arg.startswith("--out="):
            args.append("--out=DIR")
        else:
            args.append(arg)
    return " ".join([f"python benchmarks/experiments/{script}", *args])


def run_meta(script: str, device: torch.device, geometry: TableGeometry, smoke: bool) -> dict:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)"
    return {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
            "date": time.strftime("%Y-%m-%d"), "smoke": smoke,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
            "table_gib": round(geometry.total_bytes / 2**30, 3), "rows": list(geometry.rows),
            "command": command_line(script, sys.argv[1:])}


def device_programs(device: torch.device) -> int:
    """One program per SM, as GatherPlan's default; two under the interpreter."""
    if device.type != "cuda":
        return 2
    return torch.cuda.get_device_properties(device).multi_processor_count


# ---------------------------------------------------------------------------------------------
# The benchmark.


@dataclass
class Settings:
    device: torch.device
    tokens: tuple[int, ...]
    iterations: dict[int, int]
    programs: int
    block_rows: int
    num_warps: int
    seed: int


class References:
    """Check batches and gather_ref's answers for them, computed once from the packed layout."""

    def __init__(self, geometry: TableGeometry, settings: Settings):
        generator = torch.Generator(device="cpu").manual_seed(settings.seed + 17)
        self.ids_cpu = bucket_ids(geometry, CHECK_TOKENS, 1, torch.device("cpu"), generator,
                                  dead_fraction=0.1)[0]
        self.ids = self.ids_cpu.to(settings.device)
        self.shards = [geometry.shard(rank, shards) for rank, shards in CHECK_SHARDS]
        self.sorted_ids = sort_per_layer(self.ids)[0].contiguous()
        self.expected: dict[tuple[int, int], Tensor] = {}
        self.expected_sorted: Tensor | None = None

    def compute(self, packed: HostLayout) -> None:
        tables = packed.packed_tables()
        for shard in self.shards:
            self.expected[(shard.rank, shard.shards)], _ = gather_ref.gather(
                tables, self.ids_cpu, shard)
        self.expected_sorted, _ = gather_ref.gather(tables, self.sorted_ids.cpu(), self.shards[0])


def check_layout(layout: HostLayout, refs: References, s: Settings) -> None:
    """Every gather variant of this layout against gather_ref, bit for bit; raises NotExactError."""
    launch = {"num_programs": s.programs, "block_rows": s.block_rows, "num_warps": s.num_warps}
    for shard in refs.shards:
        want = refs.expected[(shard.rank, shard.shards)]
        label = f"shard {shard.rank}/{shard.shards}"
        plan = LayoutPlan(layout.layer_arrays(), shard, s.device)
        got = plan(refs.ids, poisoned(plan.output_shape(CHECK_TOKENS), s.device), **launch)
        assert_exact(got, want, f"{layout.name} layout, local kernel, {label}")
        if layout.name == "packed":
            gp = GatherPlan(layout.layer_tables(), shard, s.device)
            got = gp(refs.ids, poisoned(gp.output_shape(CHECK_TOKENS), s.device), **launch)
            assert_exact(got, want, f"packed layout, GatherPlan, {label}")
    if layout.name == "packed":
        check_ordering(layout, refs, s)
    print(f"{layout.name}: every variant matches gather_ref bit for bit", flush=True)


def check_ordering(layout: HostLayout, refs: References, s: Settings) -> None:
    shard = refs.shards[0]
    want = refs.expected[(shard.rank, shard.shards)]
    gp = GatherPlan(layout.layer_tables(), shard, s.device)
    local = LayoutPlan(layout.layer_arrays(), shard, s.device)
    launch = {"num_programs": s.programs, "block_rows": s.block_rows, "num_warps": s.num_warps}
    shape = gp.output_shape(CHECK_TOKENS)
    presorted = gp(refs.sorted_ids, poisoned(shape, s.device), **launch)
    assert_exact(presorted, refs.expected_sorted, "packed, GatherPlan on pre-sorted IDs")
    steps = ordering_steps(gp, local, shape, s)
    for name in ("sort_gather_putback", "sort_fused_scatter"):
        assert_exact(steps[name](refs.ids), want, f"packed, {name}")


def ordering_steps(gp: GatherPlan, local: LayoutPlan, shape, s: Settings) -> dict:
    """The sorted pipelines as functions of a batch of IDs, each returning rows in request order."""
    launch = {"num_programs": s.programs, "block_rows": s.block_rows, "num_warps": s.num_warps}
    gathered = torch.empty(shape, dtype=torch.bfloat16, device=s.device)
    out = torch.empty(shape, dtype=torch.bfloat16, device=s.device)

    def sort_gather_putback(ids: Tensor) -> Tensor:
        sorted_ids, dest = sort_per_layer(ids)
        return put_back(gp(sorted_ids, gathered, **launch), dest, out)

    def sort_fused_scatter(ids: Tensor) -> Tensor:
        sorted_ids, dest = sort_per_layer(ids)
        return local(sorted_ids, out, dest=dest, **launch)

    return {"sort_gather_putback": sort_gather_putback, "sort_fused_scatter": sort_fused_scatter}


def time_layout(layout: HostLayout, geometry: TableGeometry, s: Settings,
                generator: torch.Generator) -> list[dict]:
    shard = geometry.shard(0, 1)
    clock = Clock(s.device)
    local = LayoutPlan(layout.layer_arrays(), shard, s.device)
    gp = GatherPlan(layout.layer_tables(), shard, s.device) if layout.name == "packed" else None
    results = []
    for tokens in s.tokens:
        count = s.iterations[tokens]
        batches = bucket_ids(geometry, tokens, count + WARM_UP, s.device, generator)
        rows = tokens * geometry.n_layers * geometry.heads
        for name, step in layout_variants(gp, local, batches, s).items():
            section = "ordering" if name.startswith(("sort", "presorted")) else "layout"
            results.append(summarize(section, name, layout.name, tokens, rows,
                                     timed_steps(clock, step, count, WARM_UP)))
            if "gatherplan" not in name and name != "sort_only":
                results[-1]["weight_load_bytes"] = local.vector_bytes
            print(_row_text(results[-1]), flush=True)
    return results


def layout_variants(gp: GatherPlan | None, local: LayoutPlan, batches: list[Tensor],
                    s: Settings) -> dict:
    """Step functions (iteration k gathers batches[k]) of every variant this layout has."""
    launch = {"num_programs": s.programs, "block_rows": s.block_rows, "num_warps": s.num_warps}
    out = torch.empty(local.output_shape(batches[0].shape[0]), dtype=torch.bfloat16,
                      device=s.device)
    variants = {"local_kernel": lambda k: local(batches[k], out, **launch)}
    if gp is None:
        return variants
    return {"gatherplan": lambda k: gp(batches[k], out, **launch), **variants,
            **ordering_variants(gp, local, batches, s)}


def ordering_variants(gp: GatherPlan, local: LayoutPlan, batches: list[Tensor],
                      s: Settings) -> dict:
    launch = {"num_programs": s.programs, "block_rows": s.block_rows, "num_warps": s.num_warps}
    shape = gp.output_shape(batches[0].shape[0])
    steps = ordering_steps(gp, local, shape, s)
    presorted = [sort_per_layer(ids)[0].contiguous() for ids in batches]
    out = torch.empty(shape, dtype=torch.bfloat16, device=s.device)
    return {
        "sort_only": lambda k: sort_per_layer(batches[k]),
        "sort_gather_putback": lambda k: steps["sort_gather_putback"](batches[k]),
        "sort_fused_scatter": lambda k: steps["sort_fused_scatter"](batches[k]),
        "presorted_gatherplan": lambda k: gp(presorted[k], out, **launch),
    }


def _row_text(r: dict) -> str:
    return (f"{r['layout']:>6} {r['variant']:<22} T={r['tokens']:<6} p50 {r['p50_us']:10.1f} us  "
            f"{r['rows_per_s'] / 1e6:7.2f} M rows/s  ({r['iters']} iters)")


# ---------------------------------------------------------------------------------------------
# Report.


BASELINES = {  # each variant against the same kernel on packed rows and unsorted IDs
    "gatherplan": ("packed", "gatherplan"),
    "local_kernel": ("packed", "local_kernel"),
    "sort_gather_putback": ("packed", "gatherplan"),
    "presorted_gatherplan": ("packed", "gatherplan"),
    "sort_fused_scatter": ("packed", "local_kernel"),
}


def _rate(results: list[dict], layout: str, variant: str, tokens: int) -> float | None:
    for r in results:
        if r["layout"] == layout and r["variant"] == variant and r["tokens"] == tokens:
            return r["rows_per_s"]
    return None


def gain_over_baseline(results: list[dict], r: dict) -> float | None:
    """rows/s of result `r` over its BASELINES entry at the same T, minus 1 (None: no baseline)."""
    if r["variant"] not in BASELINES or (r["layout"], r["variant"]) == BASELINES[r["variant"]]:
        return None
    base = _rate(results, *BASELINES[r["variant"]], r["tokens"])
    return r["rows_per_s"] / base - 1 if base else None


def _geomean_gain(results: list[dict], tokens: Sequence[int], new: tuple[str, str],
                  base: tuple[str, str]) -> dict:
    """{"geomean": gain, "per_tokens": {T: gain}}: rows/s(new) / rows/s(base) - 1."""
    per_t = {}
    for t in tokens:
        a, b = _rate(results, *new, t), _rate(results, *base, t)
        if a and b:
            per_t[t] = a / b - 1
    geomean = (math.exp(sum(math.log1p(g) for g in per_t.values()) / len(per_t)) - 1
               if per_t else None)
    return {"geomean": geomean, "per_tokens": per_t}


def decide(results: list[dict], tokens: Sequence[int]) -> dict:
    """The layout and ordering to keep: the best change, if it wins by more than the threshold.

    Layouts are compared with one kernel (the local one) on each, so the gain is the layout's;
    orderings against the same kernel on unsorted IDs.
    """
    local = ("packed", "local_kernel")
    layouts = {name: _geomean_gain(results, tokens, (name, "local_kernel"), local)
               for name in ("padded", "split")}
    orders = {name: _geomean_gain(results, tokens, ("packed", name), BASELINES[name])
              for name in ("sort_gather_putback", "sort_fused_scatter", "presorted_gatherplan")}
    control = _geomean_gain(results, tokens, local, ("packed", "gatherplan"))

    def best(candidates: dict, names: Sequence[str], default: str) -> str:
        scored = [(candidates[n]["geomean"], n) for n in names if candidates[n]["geomean"] is not None]
        top = max(scored, default=(None, default))
        return top[1] if top[0] is not None and top[0] > KEEP_THRESHOLD else default

    return {"layout": best(layouts, ("padded", "split"), "packed"),
            "ordering": best(orders, ("sort_gather_putback", "sort_fused_scatter"), "unsorted"),
            "threshold": KEEP_THRESHOLD, "layout_gain_vs_packed_same_kernel": layouts,
            "ordering_gain_vs_unsorted_same_kernel": orders,
            "local_kernel_vs_gatherplan_on_packed": control}


def _pct(gain: float | None) -> str:
    return "n/a" if gain is None else f"{gain * 100:+.1f}%"


def markdown(meta: dict, results: list[dict], kept: dict) -> str:
    lines = [
        "# Gather layouts and ID ordering",
        "",
        f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}; "
        f"{meta['table_gib']} GiB of rows (2 layers x 24 heads, "
        f"{' + '.join(f'{r:,}' for r in meta['rows'])} rows in each layout); fresh random IDs every iteration; bf16 output; "
        f"{meta['programs']} programs of {meta['block_rows']} rows, {meta['num_warps']} warps; "
        f"`{meta['command']}`",
        "",
        "Baseline of each row: the same kernel on packed rows and unsorted IDs (GatherPlan for "
        "`gatherplan`, `sort_gather_putback`, `presorted_gatherplan`; the local kernel for "
        "`local_kernel` and `sort_fused_scatter`). `sort_only` is the sort alone.",
        "",
        "| section | layout | variant | T | rows | p50 us | p10-p90 us | M rows/s | vs baseline |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        rate = "-" if r["variant"] == "sort_only" else f"{r['rows_per_s'] / 1e6:.2f}"
        lines.append(
            f"| {r['section']} | {r['layout']} | {r['variant']} | {r['tokens']} | {r['rows']:,} | "
            f"{r['p50_us']:.1f} | {r['p10_us']:.0f}-{r['p90_us']:.0f} | {rate} | "
            f"{_pct(gain_over_baseline(results, r))} |")
    widths = {r["layout"]: r["weight_load_bytes"] for r in results if "weight_load_bytes" in r}
    lines += ["", "Widest weight load the local kernel may issue per row (the alignment it can prove): "
              + ", ".join(f"{k} {v} B" for k, v in widths.items()) + ".",
              "", *kept_lines(kept), ""]
    return "\n".join(lines)


def kept_lines(kept: dict) -> list[str]:
    lg, og = kept["layout_gain_vs_packed_same_kernel"], kept["ordering_gain_vs_unsorted_same_kernel"]

    def per_t(entry: dict) -> str:
        return ", ".join(f"T={t}: {_pct(g)}" for t, g in entry["per_tokens"].items())

    threshold = f"{kept['threshold'] * 100:.0f}%"
    layout = kept["layout"]
    if layout == "packed":
        layout_text = (f"packed 264 B rows: no other layout beats them by more than {threshold} "
                       f"(geometric mean over T, same kernel: padded {_pct(lg['padded']['geomean'])}"
                       f", split {_pct(lg['split']['geomean'])})")
    else:
        memory = ", at +3.0% host memory (272/264 B)" if layout == "padded" else ""
        layout_text = (f"{layout} rows{memory}: {_pct(lg[layout]['geomean'])} rows/s over packed "
                       f"rows, same kernel, geometric mean over T ({per_t(lg[layout])})")
    order = kept["ordering"]
    if order == "unsorted":
        order_text = (f"unsorted IDs: sort + gather + put back {_pct(og['sort_gather_putback']['geomean'])}"
                      f", with the put-back fused into the store "
                      f"{_pct(og['sort_fused_scatter']['geomean'])}; the gather alone on pre-sorted "
                      f"IDs, the most sorting could buy, {_pct(og['presorted_gatherplan']['geomean'])}")
    else:
        order_text = (f"IDs sorted per layer ({order}): {_pct(og[order]['geomean'])} rows/s over "
                      f"unsorted, geometric mean over T ({per_t(og[order])}); the gather alone on "
                      f"pre-sorted IDs {_pct(og['presorted_gatherplan']['geomean'])}")
    control = kept["local_kernel_vs_gatherplan_on_packed"]
    return [f"- kept layout: {layout_text}",
            f"- kept ordering: {order_text}",
            f"- control: the local kernel on packed rows vs GatherPlan {_pct(control['geomean'])} "
            f"({per_t(control)})",
            f"- rule: a change is kept only if it wins by more than {threshold} of rows/s"]


def write_report(out: Path, meta: dict, results: list[dict], kept: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    payload = {"meta": meta, "results": results, "kept": kept}
    (out / "gather_layouts.json").write_text(json.dumps(payload, indent=2) + "\n")
    (out / "gather_layouts.md").write_text(markdown(meta, results, kept))


def settings_from(args: argparse.Namespace) -> Settings:
    if args.smoke:
        if not kernels_interpreted():
            raise SystemExit("--smoke runs on the CPU under Triton's interpreter: "
                             "set TRITON_INTERPRET=1")
        device = torch.device("cpu")
        return Settings(device, (4, 16), {4: 3, 16: 3}, 2, args.block_rows or 32,
                        args.num_warps, args.seed)
    if not torch.cuda.is_available() or kernels_interpreted():
        raise SystemExit("needs a CUDA GPU and TRITON_INTERPRET unset (or --smoke on the CPU)")
    device = torch.device("cuda", torch.cuda.current_device())
    return Settings(device, TOKENS, ITERATIONS, device_programs(device), args.block_rows or 8,
                    args.num_warps, args.seed)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table-gib", type=float, default=16.0,
                        help="GiB of rows in all (both layers), in every layout")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results"))
    parser.add_argument("--block-rows", type=int, default=None,
                        help="rows per block, both kernels (default 8, GatherPlan's; smoke 32)")
    parser.add_argument("--num-warps", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny table, T in (4, 16), on the CPU under TRITON_INTERPRET=1")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    s = settings_from(args)
    geometry = geometry_for(0.001 if args.smoke else args.table_gib)
    refs = References(geometry, s)
    generator = torch.Generator(device=s.device).manual_seed(s.seed)
    results: list[dict] = []
    for name in LAYOUTS:  # packed first: the references come from it
        started = time.monotonic()
        with HostLayout(name, geometry, s.device, s.seed) as layout:
            print(f"{name}: {layout.nbytes / 2**30:.2f} GiB built in "
                  f"{time.monotonic() - started:.1f} s", flush=True)
            if name == "packed":
                refs.compute(layout)
            check_layout(layout, refs, s)
            results += time_layout(layout, geometry, s, generator)
    kept = decide(results, s.tokens)
    meta = run_meta("gather_layouts.py", s.device, geometry, args.smoke)
    meta.update({"programs": s.programs, "block_rows": s.block_rows, "num_warps": s.num_warps,
                 "check": f"{CHECK_TOKENS} tokens, 10% DEAD, shards {list(CHECK_SHARDS)}"})
    write_report(Path(args.out), meta, results, kept)
    print("\n".join(kept_lines(kept)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
