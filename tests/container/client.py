"""The engine side of the container test: an engramd client that runs in a container of its own
(the image's python, this folder mounted read-only) or on the host.

    client.py lookups --socket S --out F.npz --mode served|mapped --seed N
    client.py idle --socket S --out F.txt     register, write the client id, sleep until killed
    client.py loop --socket S --out F.txt     look up until killed, one line per second:
                                              "<time> ok <lookups>" or "<time> error <what>"

Needs only the engramd package (no test helpers, no pytest): the host compares what it saved
with a reference computed from the checkpoint (check.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

from engramd.client import EngramClient

TOKENS = (1, 16, 200)


def random_ids(rng: np.random.Generator, tokens: int, rows: list[int], heads: int) -> np.ndarray:
    """[T, layers, heads] int64: uniform rows, some -1 (dead), some past the table or negative."""
    ids = np.stack([rng.integers(0, r, size=(tokens, heads)) for r in rows], axis=1)
    roll = rng.random(ids.shape)
    ids[roll < 0.05] = -1
    bad = (roll >= 0.05) & (roll < 0.07)
    ids[bad] = rng.choice([-7, max(rows) + 3, 2**40], size=int(bad.sum()))
    return ids


def lookups(args: argparse.Namespace) -> None:
    rng = np.random.default_rng(args.seed)
    saved: dict[str, np.ndarray] = {}
    with EngramClient(args.socket, max_tokens=max(TOKENS), timeout=60, mode=args.mode) as client:
        saved["mode"] = np.array(client.mode)
        saved["pid"] = np.array(os.getpid())  # 1 in a container's PID namespace
        rows, heads = list(client.geometry.rows), client.geometry.heads
        for n, tokens in enumerate(TOKENS):
            ids = random_ids(rng, tokens, rows, heads)
            saved[f"ids{n}"] = ids
            saved[f"rows{n}"] = client.lookup(torch.from_numpy(ids)).result().float().numpy().copy()
    np.savez(args.out, **saved)


def idle(args: argparse.Namespace) -> None:
    client = EngramClient(args.socket, max_tokens=64, timeout=60, mode=args.mode)
    with open(args.out + ".tmp", "w") as f:
        f.write(f"{client.client_id}\n")
    os.rename(args.out + ".tmp", args.out)
    time.sleep(3600)


def loop(args: argparse.Namespace) -> None:
    """Lookups across a daemon restart: errors while it is away, rows again once it is back."""
    rng = np.random.default_rng(args.seed)
    client = EngramClient(args.socket, max_tokens=16, timeout=60, mode=args.mode)
    rows, heads = list(client.geometry.rows), client.geometry.heads
    done, last = 0, 0.0
    with open(args.out, "a", buffering=1) as out:
        while True:
            try:
                client.lookup(torch.from_numpy(random_ids(rng, 16, rows, heads))).result()
                done += 1
                state = f"ok {done}"
            except Exception as e:  # noqa: BLE001 - reported, and the loop goes on as an engine's would
                state = f"error {type(e).__name__}"
            if time.time() - last >= 1.0 or not state.startswith("ok"):
                out.write(f"{time.time():.3f} {state}\n")
                last = time.time()
            time.sleep(0.02)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=("lookups", "idle", "loop"))
    parser.add_argument("--socket", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", choices=("auto", "served", "mapped"), default="auto")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    {"lookups": lookups, "idle": idle, "loop": loop}[args.what](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
