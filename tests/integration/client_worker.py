"""A client process for integration tests: seeded lookups against a daemon, results saved to .npz.

    python client_worker.py --socket S --out F.npz [--tp-rank R --tp-size N --seed K
                            --tokens T [T ...] --rounds N --dtype int32|int64 --mode M]

Random IDs include -1 (DEAD), IDs past the table and negative IDs. The test compares the saved
rows with an independent reference computed from the checkpoint.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from reference import random_ids  # noqa: E402

from engramd.client import EngramClient  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tp-rank", type=int, default=0)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--dtype", choices=("int32", "int64"), default="int64")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--mode", choices=("auto", "served", "mapped"), default="auto")
    args = parser.parse_args()

    rng = np.random.default_rng(args.seed)
    saved: dict[str, np.ndarray] = {}
    with EngramClient(args.socket, device=args.device, tp_rank=args.tp_rank, tp_size=args.tp_size,
                      max_tokens=max(args.tokens), slots=args.slots, timeout=60,
                      mode=args.mode) as client:
        saved["mode"] = np.array(client.mode)
        saved["pid"] = np.array(os.getpid())  # 1 in a PID namespace of its own
        saved["shm_entries"] = np.array(len(os.listdir("/dev/shm")))
        saved["mps_shared"] = np.array(bool(client.mps and client.mps["shared"]))
        rows = list(client.geometry.rows)
        heads = client.geometry.heads
        batches = [list(args.tokens) for _ in range(args.rounds)]
        todo = [t for batch in batches for t in batch]
        n = 0
        while todo:
            # Keep up to `slots` lookups in flight at once, as a model runner would; a result view
            # stays valid until `slots` further lookups are submitted, so collect before that.
            wave, todo = todo[:args.slots], todo[args.slots:]
            pending = []
            for tokens in wave:
                ids = random_ids(rng, tokens, rows, heads)
                if args.dtype == "int32":
                    ids = np.where(np.abs(ids) < 2**31 - 1, ids, rows[0] + 11).astype(np.int32)
                pending.append((ids, client.lookup(torch.from_numpy(ids).to(args.device))))
            for ids, future in pending:
                saved[f"ids{n}"] = ids
                saved[f"rows{n}"] = future.result().float().cpu().numpy()
                saved[f"oor{n}"] = np.array(future.out_of_range)
                n += 1
    np.savez(args.out, **saved)
    return 0


if __name__ == "__main__":
    sys.exit(main())
