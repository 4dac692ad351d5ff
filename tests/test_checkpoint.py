"""Checkpoint reading (server/checkpoint.py) and synthetic checkpoint writing (server/synthetic.py).

The `safetensors` library is the independent reference: files our writer produces must load with
it, files it produces must load with our reader, and `read_packed` must return exactly its bytes.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engramd.client.geometry import TableGeometry
from engramd.server.checkpoint import (
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointError,
    EngramCheckpoint,
    scale_name,
    weight_name,
)
from engramd.server.synthetic import (
    BLOCK_ROWS,
    DiskSpaceError,
    synthetic_packed_rows,
    total_checkpoint_bytes,
    write_synthetic_checkpoint,
)

# Two layers, 4 columns of ~1.5 K rows: > BLOCK_ROWS rows per layer, head_dim 64 (2 scale bytes).
SMALL_CONFIG = {
    "engram_layer_ids": [2, 5],
    "engram_max_ngram_size": 3,
    "engram_n_heads": 2,
    "engram_head_dim": 64,
    "engram_vocab_size": 1500,
    "engram_compressed_vocab_size": 1000,
    "engram_pad_token_id": 2,
}


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> Path:
    return write_synthetic_checkpoint(TableGeometry.named("demo"),
                                      tmp_path_factory.mktemp("demo"), seed=3)


@pytest.fixture
def small_geometry() -> TableGeometry:
    return TableGeometry.from_config(SMALL_CONFIG, "SMALL_CONFIG")


@pytest.fixture
def small_dir(tmp_path, small_geometry) -> Path:
    return write_synthetic_checkpoint(small_geometry, tmp_path / "small", seed=1)


def assert_bytes_equal(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    bad = np.argwhere(got != want)
    assert bad.size == 0, f"{what}: {len(bad)} bytes differ, first [row, col]: {bad[:5].tolist()}"


def reference_tensors(directory: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """Load tensors with the safetensors library, through the index if there is one."""
    index = directory / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
    else:
        weight_map = dict.fromkeys(names, SINGLE_FILE)
    out = {}
    for name in names:
        with safe_open(directory / weight_map[name], framework="pt") as f:
            out[name] = f.get_tensor(name)
    return out


def reference_packed(geometry: TableGeometry, tensors: dict[str, torch.Tensor],
                     layer_index: int) -> np.ndarray:
    layer_id = geometry.layer_ids[layer_index]
    weight = tensors[weight_name(layer_id)].view(torch.uint8).numpy()
    scale = tensors[scale_name(layer_id)].view(torch.uint8).numpy()
    return np.concatenate([weight, scale], axis=1)


def row_ranges(rows: int) -> list[tuple[int, int]]:
    return [(0, 1), (0, 100), (BLOCK_ROWS - 3, BLOCK_ROWS + 5), (rows // 2, rows // 2 + 777),
            (rows - 1, rows), (rows - 300, rows), (17, 17), (0, rows)]


def check_read_packed(ckpt: EngramCheckpoint, tensors: dict[str, torch.Tensor]) -> None:
    g = ckpt.geometry
    for layer in range(g.n_layers):
        want = reference_packed(g, tensors, layer)
        for lo, hi in row_ranges(g.rows[layer]):
            out = np.full((hi - lo, g.row_bytes), 0xAA, dtype=np.uint8)
            ckpt.read_packed(layer, lo, out)
            assert_bytes_equal(out, want[lo:hi], f"layer {layer} rows [{lo}, {hi})")


def engram_names(geometry: TableGeometry) -> list[str]:
    return [n for lid in geometry.layer_ids for n in (weight_name(lid), scale_name(lid))]


# --- the synthetic writer, checked with the safetensors library ------------------------------

def test_synthetic_demo_loads_with_safetensors(demo_dir):
    ckpt = EngramCheckpoint.open(demo_dir)
    g = ckpt.geometry
    assert g == TableGeometry.named("demo")
    tensors = reference_tensors(demo_dir, engram_names(g))
    for i, lid in enumerate(g.layer_ids):
        weight, scale = tensors[weight_name(lid)], tensors[scale_name(lid)]
        assert weight.dtype == torch.float8_e4m3fn and tuple(weight.shape) == (g.rows[i], 256)
        assert scale.dtype == torch.float8_e8m0fnu and tuple(scale.shape) == (g.rows[i], 8)
        assert ckpt.weight(i).shape == (g.rows[i], 256) and ckpt.weight(i).dtype == "F8_E4M3"
        assert ckpt.scale(i).shape == (g.rows[i], 8) and ckpt.scale(i).dtype == "F8_E8M0"
    check_read_packed(ckpt, tensors)


def test_synthetic_non_engram_tensors_are_valid(demo_dir):
    # Every tensor of every shard loads, so the files are whole safetensors files, not just the
    # ranges our reader looks at; and some of them are not Engram tables.
    weight_map = json.loads((demo_dir / INDEX_FILE).read_text())["weight_map"]
    others = [n for n in weight_map if n not in engram_names(TableGeometry.named("demo"))]
    assert "layers.0.attn.wq.weight" in others and len(others) >= 2
    for name, shard in weight_map.items():
        with safe_open(demo_dir / shard, framework="pt") as f:
            tensor = f.get_tensor(name)
        if name in others:
            assert tensor.dtype == torch.bfloat16 and torch.isfinite(tensor).all()


def test_engram_table_does_not_start_the_data_section(demo_dir):
    ckpt = EngramCheckpoint.open(demo_dir)
    with open(ckpt.weight(0).path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
    assert ckpt.weight(0).offset > 8 + header_len  # a non-Engram tensor is stored before it


def test_synthetic_packed_rows_matches_files(demo_dir):
    g = TableGeometry.named("demo")
    tensors = reference_tensors(demo_dir, engram_names(g))
    for layer in range(g.n_layers):
        want = reference_packed(g, tensors, layer)
        for lo, hi in row_ranges(g.rows[layer]):
            got = synthetic_packed_rows(g, layer, lo, hi, seed=3)
            assert_bytes_equal(got, want[lo:hi], f"layer {layer} rows [{lo}, {hi})")


def test_synthetic_packed_rows_into_out(small_geometry):
    g = small_geometry
    want = synthetic_packed_rows(g, 1, 0, g.rows[1], seed=4)
    table = np.zeros((g.rows[1], g.row_bytes), dtype=np.uint8)
    for lo in range(0, g.rows[1], 1000):  # uneven pieces, as a parallel filler would do
        hi = min(g.rows[1], lo + 1000)
        got = synthetic_packed_rows(g, 1, lo, hi, seed=4, out=table[lo:hi])
        assert np.shares_memory(got, table)
    assert_bytes_equal(table, want, "filled in pieces")
    with pytest.raises(ValueError, match="out must be"):
        synthetic_packed_rows(g, 1, 0, 10, out=np.empty((11, g.row_bytes), np.uint8))
    with pytest.raises(IndexError, match=str(g.rows[1])):
        synthetic_packed_rows(g, 1, 0, g.rows[1] + 1)


def test_synthetic_values(demo_dir):
    g = TableGeometry.named("demo")
    tensors = reference_tensors(demo_dir, engram_names(g))
    for lid in g.layer_ids:
        weight = tensors[weight_name(lid)].view(torch.uint8).numpy()
        counts = np.bincount(weight.ravel(), minlength=256)
        assert counts[0x7F] == 0 and counts[0xFF] == 0, "NaN bit patterns written"
        valid = np.delete(counts, [0x7F, 0xFF])
        mean = weight.size / 254
        assert np.all(np.abs(valid - mean) < 0.05 * mean), "weight bytes far from uniform"
        assert not torch.isnan(tensors[weight_name(lid)].float()).any()
        scale = tensors[scale_name(lid)].view(torch.uint8).numpy()
        assert scale.min() == 107 and scale.max() == 147
        assert len(np.unique(scale)) == 41
        varying_rows = np.mean(scale.min(axis=1) != scale.max(axis=1))
        assert varying_rows > 0.9, "scale bytes do not vary across a row's blocks"
        exponents = tensors[scale_name(lid)].float().log2().numpy()
        np.testing.assert_array_equal(exponents, scale.astype(np.float64) - 127)


def test_layers_and_seeds_differ(tmp_path, small_geometry):
    a = synthetic_packed_rows(small_geometry, 0, 0, 500, seed=0)
    assert not np.array_equal(a, synthetic_packed_rows(small_geometry, 1, 0, 500, seed=0))
    assert not np.array_equal(a, synthetic_packed_rows(small_geometry, 0, 0, 500, seed=1))
    assert not np.array_equal(a[:, :64], synthetic_packed_rows(small_geometry, 0, 500, 1000)[:, :64])


def test_deterministic_across_chunk_sizes(tmp_path, small_geometry):
    dirs = [write_synthetic_checkpoint(small_geometry, tmp_path / f"c{rows}", seed=5,
                                       chunk_rows=rows)
            for rows in (1, 777, BLOCK_ROWS, 100_000)]
    first = sorted(p.name for p in dirs[0].iterdir())
    assert len([n for n in first if n.endswith(".safetensors")]) >= 3
    for other in dirs[1:]:
        assert sorted(p.name for p in other.iterdir()) == first
        for name in first:
            assert (dirs[0] / name).read_bytes() == (other / name).read_bytes(), (other, name)


def test_progress_reports_every_chunk(tmp_path, small_geometry):
    calls = []
    write_synthetic_checkpoint(small_geometry, tmp_path / "p", chunk_rows=1000,
                               progress=lambda done, total: calls.append((done, total)))
    total = total_checkpoint_bytes(small_geometry)
    assert all(t == total for _, t in calls)
    done = [d for d, _ in calls]
    assert done == sorted(done) and done[-1] == total
    per_layer_chunks = sum(-(-rows // 1000) for rows in small_geometry.rows)
    assert len(calls) >= 2 * per_layer_chunks  # weight and scale tensors, chunk by chunk


def test_writer_refuses_without_free_space(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 10**12 - 12345, 12345))
    geometry = TableGeometry.named("v4.1-flash")
    with pytest.raises(DiskSpaceError) as info:
        write_synthetic_checkpoint(geometry, tmp_path / "big")
    message = str(info.value)
    assert "12345 bytes" in message and str(tmp_path / "big") in message
    needed = int(message.split(" needs ")[1].split(" bytes")[0])
    assert needed >= geometry.total_bytes
    assert not any((tmp_path / "big").iterdir())


# --- reading checkpoints written by the safetensors library -----------------------------------

def random_tables(geometry: TableGeometry, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i, lid in enumerate(geometry.layer_ids):
        rows = geometry.rows[i]
        out[weight_name(lid)] = torch.randint(0, 256, (rows, geometry.head_dim), generator=gen,
                                              dtype=torch.uint8).view(torch.float8_e4m3fn)
        out[scale_name(lid)] = torch.randint(0, 256, (rows, geometry.scale_bytes), generator=gen,
                                             dtype=torch.uint8).view(torch.float8_e8m0fnu)
    return out


def write_config(directory: Path, geometry: TableGeometry) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(geometry.to_config()))


def save_sharded(directory: Path, shards: dict[str, dict[str, torch.Tensor]]) -> None:
    weight_map = {}
    for file_name, tensors in shards.items():
        save_file(tensors, directory / file_name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file_name))
    (directory / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_reads_sharded_checkpoint_from_safetensors(tmp_path, small_geometry):
    g = small_geometry
    tables = random_tables(g, seed=11)
    (w0, s0, w1, s1) = engram_names(g)
    extra = {"embed.weight": torch.randn(50, 32, dtype=torch.bfloat16),
             f"layers.{g.layer_ids[0]}.engram.embed.bias": torch.randn(64),
             "layers.3.ffn.w1.weight": torch.randn(16, 8)}
    write_config(tmp_path, g)
    save_sharded(tmp_path, {
        "a.safetensors": {w0: tables[w0], "embed.weight": extra["embed.weight"]},
        "b.safetensors": {s0: tables[s0], w1: tables[w1], s1: tables[s1],
                          f"layers.{g.layer_ids[0]}.engram.embed.bias":
                              extra[f"layers.{g.layer_ids[0]}.engram.embed.bias"]},
        "c.safetensors": {"layers.3.ffn.w1.weight": extra["layers.3.ffn.w1.weight"]},
    })
    ckpt = EngramCheckpoint.open(tmp_path)
    assert ckpt.geometry == g
    assert ckpt.weight(0).path.name == "a.safetensors" and ckpt.scale(1).path.name == "b.safetensors"
    check_read_packed(ckpt, tables)


def test_reads_single_file_checkpoint(tmp_path, small_geometry):
    tables = random_tables(small_geometry, seed=12)
    write_config(tmp_path, small_geometry)
    save_file({**tables, "norm.weight": torch.ones(64)}, tmp_path / SINGLE_FILE)
    ckpt = EngramCheckpoint.open(tmp_path)
    assert {ckpt.weight(i).path.name for i in range(2)} == {SINGLE_FILE}
    check_read_packed(ckpt, tables)


def test_read_packed_into_strided_view(small_dir, small_geometry):
    ckpt = EngramCheckpoint.open(small_dir)
    g = small_geometry
    big = np.zeros((3 * 40, g.row_bytes + 8), dtype=np.uint8)
    view = big[::3, 4:4 + g.row_bytes]  # strided rows inside a larger buffer
    ckpt.read_packed(1, 1000, view)
    assert_bytes_equal(view, synthetic_packed_rows(g, 1, 1000, 1040, seed=1), "view")
    assert not big[:, :4].any() and not big[:, 4 + g.row_bytes:].any() and not big[1::3].any()


def test_read_packed_in_small_chunks(small_dir, small_geometry, monkeypatch):
    # Force many bounce-buffer rounds, including a short last one.
    monkeypatch.setattr("engramd.server.checkpoint.READ_CHUNK_BYTES", 64 * 7)
    ckpt = EngramCheckpoint.open(small_dir)
    out = np.empty((1000, small_geometry.row_bytes), dtype=np.uint8)
    ckpt.read_packed(0, 333, out)
    assert_bytes_equal(out, synthetic_packed_rows(small_geometry, 0, 333, 1333, seed=1), "chunks")


def test_read_packed_bounds(small_dir, small_geometry):
    ckpt = EngramCheckpoint.open(small_dir)
    rows, row_bytes = small_geometry.rows[0], small_geometry.row_bytes
    with pytest.raises(IndexError, match=str(rows)):
        ckpt.read_packed(0, rows - 1, np.empty((2, row_bytes), np.uint8))
    with pytest.raises(IndexError):
        ckpt.read_packed(0, -1, np.empty((1, row_bytes), np.uint8))
    with pytest.raises(IndexError, match="layer index 2"):
        ckpt.read_packed(2, 0, np.empty((1, row_bytes), np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        ckpt.read_packed(0, 0, np.empty((1, row_bytes - 1), np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        ckpt.read_packed(0, 0, np.empty((1, row_bytes), np.int16))


# --- errors -------------------------------------------------------------------------------------

def edit_index(directory: Path, edit) -> None:
    index = directory / INDEX_FILE
    doc = json.loads(index.read_text())
    edit(doc["weight_map"])
    index.write_text(json.dumps(doc))


def shard_of(directory: Path, tensor: str) -> Path:
    return directory / json.loads((directory / INDEX_FILE).read_text())["weight_map"][tensor]


def open_error(directory: Path) -> str:
    with pytest.raises(CheckpointError) as info:
        EngramCheckpoint.open(directory)
    return str(info.value)


def test_error_tensor_missing_from_index(small_dir, small_geometry):
    name = scale_name(small_geometry.layer_ids[1])
    edit_index(small_dir, lambda wm: wm.pop(name))
    message = open_error(small_dir)
    assert name in message and INDEX_FILE in message


def test_error_tensor_missing_from_shard(small_dir, small_geometry):
    name = weight_name(small_geometry.layer_ids[1])
    other = shard_of(small_dir, scale_name(small_geometry.layer_ids[0])).name
    edit_index(small_dir, lambda wm: wm.update({name: other}))
    message = open_error(small_dir)
    assert name in message and other in message and "missing" in message


def test_error_shard_file_missing(small_dir, small_geometry):
    shard = shard_of(small_dir, weight_name(small_geometry.layer_ids[0]))
    shard.unlink()
    message = open_error(small_dir)
    assert shard.name in message and weight_name(small_geometry.layer_ids[0]) in message


def test_error_wrong_dtype(tmp_path, small_geometry):
    tables = random_tables(small_geometry, seed=13)
    name = weight_name(small_geometry.layer_ids[1])
    tables[name] = tables[name].view(torch.uint8).view(torch.float8_e5m2)
    write_config(tmp_path, small_geometry)
    save_file(tables, tmp_path / SINGLE_FILE)
    message = open_error(tmp_path)
    assert name in message and "F8_E5M2" in message and "F8_E4M3" in message


def test_error_wrong_shape(tmp_path, small_geometry):
    tables = random_tables(small_geometry, seed=14)
    name = scale_name(small_geometry.layer_ids[0])
    tables[name] = tables[name][:-1].clone()
    write_config(tmp_path, small_geometry)
    save_file(tables, tmp_path / SINGLE_FILE)
    message = open_error(tmp_path)
    assert name in message and "shape" in message and str(small_geometry.rows[0]) in message


def test_error_truncated_shard(small_dir, small_geometry):
    shard = shard_of(small_dir, weight_name(small_geometry.layer_ids[1]))
    os.truncate(shard, shard.stat().st_size - 1)
    message = open_error(small_dir)
    assert shard.name in message and "truncated" in message
    os.truncate(shard, 5)
    message = open_error(small_dir)
    assert shard.name in message and "truncated" in message


def test_error_truncated_after_open(small_dir, small_geometry):
    ckpt = EngramCheckpoint.open(small_dir)
    ref = ckpt.scale(0)
    os.truncate(ref.path, ref.offset + 10)
    with pytest.raises(CheckpointError, match="truncated") as info:
        ckpt.read_packed(0, 0, np.empty((100, small_geometry.row_bytes), np.uint8))
    assert ref.path.name in str(info.value) and ref.name in str(info.value)


def test_error_bad_header(small_dir, small_geometry):
    shard = shard_of(small_dir, scale_name(small_geometry.layer_ids[0]))
    data = bytearray(shard.read_bytes())
    data[8] = ord("[")  # header JSON no longer parses
    shard.write_bytes(bytes(data))
    message = open_error(small_dir)
    assert shard.name in message and "bad header" in message
    shard.write_bytes((2**40).to_bytes(8, "little") + bytes(100))
    message = open_error(small_dir)
    assert shard.name in message and "bad header" in message


def test_error_bad_index_json(small_dir):
    (small_dir / INDEX_FILE).write_text("{not json")
    message = open_error(small_dir)
    assert INDEX_FILE in message and "bad index json" in message
    (small_dir / INDEX_FILE).write_text(json.dumps({"metadata": {}}))
    assert "weight_map" in open_error(small_dir)


def test_error_shard_name_outside_directory(small_dir, small_geometry):
    name = weight_name(small_geometry.layer_ids[0])
    edit_index(small_dir, lambda wm: wm.update({name: "../elsewhere.safetensors"}))
    message = open_error(small_dir)
    assert name in message and "elsewhere" in message


def test_error_no_tables_or_config(tmp_path, small_geometry):
    assert "config.json" in open_error(tmp_path)
    write_config(tmp_path, small_geometry)
    message = open_error(tmp_path)
    assert INDEX_FILE in message and SINGLE_FILE in message


def test_non_engram_shards_are_never_read(small_dir, small_geometry):
    engram_shards = {shard_of(small_dir, n) for n in engram_names(small_geometry)}
    weight_map = json.loads((small_dir / INDEX_FILE).read_text())["weight_map"]
    others = {small_dir / s for s in weight_map.values()} - engram_shards
    assert others, "the synthetic layout should have a shard without Engram tensors"
    for path in others:
        path.write_bytes(b"garbage")
    EngramCheckpoint.open(small_dir).read_packed(
        0, 0, np.empty((10, small_geometry.row_bytes), np.uint8))


# --- fingerprint ---------------------------------------------------------------------------------

def test_fingerprint_stable_and_sensitive(small_dir, small_geometry, tmp_path):
    first = EngramCheckpoint.open(small_dir).fingerprint()
    assert len(first) == 16 and int(first, 16) >= 0
    assert EngramCheckpoint.open(small_dir).fingerprint() == first
    copy = shutil.copytree(small_dir, tmp_path / "copy")  # copy2 keeps mtimes
    assert EngramCheckpoint.open(copy).fingerprint() == first

    shard = shard_of(copy, weight_name(small_geometry.layer_ids[0]))
    stat = shard.stat()
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    touched = EngramCheckpoint.open(copy).fingerprint()
    assert touched != first

    with open(shard, "ab") as f:  # a longer shard (data unchanged) is a different file
        f.write(b"\0" * 8)
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert EngramCheckpoint.open(copy).fingerprint() not in (first, touched)


def test_a_checkpoint_behind_a_symlink_is_read_where_the_link_pointed_at_open(tmp_path, small_geometry):
    """The link repointed to another revision after open: reads still come from the files found
    at open, never a mix of the two; the next open follows the link."""
    first = write_synthetic_checkpoint(small_geometry, tmp_path / "a", seed=1)
    second = write_synthetic_checkpoint(small_geometry, tmp_path / "b", seed=2)
    link = tmp_path / "current"
    link.symlink_to(first)
    checkpoint = EngramCheckpoint.open(link)
    link.unlink()
    link.symlink_to(second)
    rows = np.empty((8, small_geometry.row_bytes), np.uint8)
    checkpoint.read_packed(0, 0, rows)
    expected = np.empty_like(rows)
    EngramCheckpoint.open(first).read_packed(0, 0, expected)
    assert np.array_equal(rows, expected)
    EngramCheckpoint.open(link).read_packed(0, 0, rows)
    EngramCheckpoint.open(second).read_packed(0, 0, expected)
    assert np.array_equal(rows, expected)


def test_fingerprint_changes_with_rewritten_tables(tmp_path, small_geometry):
    directory = write_synthetic_checkpoint(small_geometry, tmp_path / "x", seed=1)
    first = EngramCheckpoint.open(directory).fingerprint()
    mtimes = {p: p.stat().st_mtime_ns for p in directory.glob("*.safetensors")}
    write_synthetic_checkpoint(small_geometry, directory, seed=2)
    # File timestamps can be coarser than a fast rewrite; make sure each moved forward.
    for path, old in mtimes.items():
        if path.stat().st_mtime_ns == old:
            os.utime(path, ns=(old, old + 1))
    assert EngramCheckpoint.open(directory).fingerprint() != first
