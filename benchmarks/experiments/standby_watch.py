"""What a waiting standby's look at its checkpoint costs, every WATCH_S, at V4.1's index size.

    python benchmarks/experiments/standby_watch.py [--tensors 92000] [--looks 20] [--out DIR]

A standby (server/standby_tables.py) checks every WATCH_S (0.5 s) that its configured checkpoint
is still the one its tables were prepared from. Opening a checkpoint reads its config, its index
(V4.1's names every tensor of the model: ~92,000 of them, ~8 MB of JSON) and the headers of the
shards that hold the Engram tables. The probe builds a sparse checkpoint of V4.1's shape
(common/tables.py) whose index also names --tensors other tensors over 163 shards and whose
Engram shards' headers hold 600 other entries, then times, in CPU and wall time per look:
  open     EngramCheckpoint.open + fingerprint (what every look did before)
  watch    TableWatch._checkpoint on the untouched checkpoint (file stats; opens only on change)
Writes DIR/standby_watch_cpu.json and .md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common
from common.report import machine, write_report  # noqa: E402
from common.tables import geometry_for, write_sparse_checkpoint  # noqa: E402

from engramd.server.checkpoint import INDEX_FILE, EngramCheckpoint  # noqa: E402
from engramd.server.config import load_config  # noqa: E402
from engramd.server.standby_tables import TableWatch  # noqa: E402

SHARDS = 163
HEADER_ENTRIES = 600  # other tensors in each Engram shard's header


def v41_shaped_checkpoint(folder: Path, tensors: int) -> Path:
    checkpoint = folder / "ckpt"
    write_sparse_checkpoint(geometry_for(0.01), checkpoint)
    index_path = checkpoint / INDEX_FILE
    index = json.loads(index_path.read_text())
    engram_shards = set(index["weight_map"].values())
    for i in range(tensors):
        index["weight_map"][f"model.layers.{i // 1500}.mlp.experts.{i % 256}.w{i % 3}.{i}"] = \
            f"model-{i % SHARDS:05d}-of-{SHARDS:05d}.safetensors"
    index_path.write_text(json.dumps(index))
    for name in engram_shards:
        path = checkpoint / name
        raw = path.read_bytes()
        length = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + length])
        data_bytes = path.stat().st_size - 8 - length
        for j in range(HEADER_ENTRIES):
            header[f"model.other.{j}"] = {"dtype": "BF16", "shape": [1], "data_offsets": [0, 0]}
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        with open(path, "wb") as f:
            f.write(len(text).to_bytes(8, "little") + text)
            f.truncate(8 + len(text) + data_bytes)
    return checkpoint


def per_look(look, looks: int) -> dict:
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(looks):
        look()
    return {"cpu_ms": round((time.process_time() - cpu) / looks * 1e3, 3),
            "wall_ms": round((time.perf_counter() - wall) / looks * 1e3, 3)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=92_000)
    parser.add_argument("--looks", type=int, default=20)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="engramd-bench-") as folder:
        checkpoint = v41_shaped_checkpoint(Path(folder), args.tensors)
        config = load_config(None, {"tables": str(checkpoint), "shm_dir": folder,
                                    "socket": str(Path(folder) / "engramd.sock"), "backend": "cpu"})
        watch = TableWatch(config)  # not started: its looks are called here
        watch._checkpoint()
        watch._checkpoint()  # the second look learns the files to watch
        report = {"machine": machine(), "date": time.strftime("%Y-%m-%d"),
                  "command": "python benchmarks/experiments/standby_watch.py " + " ".join(argv or sys.argv[1:]),
                  "index_bytes": (checkpoint / INDEX_FILE).stat().st_size, "looks": args.looks,
                  "open": per_look(lambda: EngramCheckpoint.open(checkpoint).fingerprint(), args.looks),
                  "watch": per_look(watch._checkpoint, args.looks * 10)}
    text = (f"# A standby's look at its checkpoint ({report['date']}, {report['machine']})\n\n"
            f"Index of {report['index_bytes']:,} bytes. Command: `{report['command']}`.\n\n"
            "| look | CPU ms | wall ms |\n|---|---:|---:|\n"
            + "".join(f"| {name} | {report[name]['cpu_ms']} | {report[name]['wall_ms']} |\n"
                      for name in ("open", "watch")))
    write_report(Path(args.out), report, "standby_watch_cpu.json", "standby_watch_cpu.md", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
