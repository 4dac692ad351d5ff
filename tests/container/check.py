"""Host-side checks of the container test (run.sh): rows against the checkpoint, and the
daemon's client listing.

    check.py rows --checkpoint DIR A.npz [B.npz ...]   every lookup equals the reference, and
                                                        files of the same seed equal each other
    check.py retired --socket S --client-id N --deadline D -- KILL-COMMAND...
                                                        run the command, then wait until the
                                                        daemon lists no client N; fail past D
                                                        seconds after the command started
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from engramd.client.shared.connection import probe


def same_bits(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    """Bit-exact, NaN by position: a gather is a copy."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    wrong = np.argwhere((actual != expected) & ~(np.isnan(actual) & np.isnan(expected)))
    assert wrong.size == 0, f"{what}: {len(wrong)} wrong values, first at {wrong[:5].tolist()}"


def rows(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from reference import ReferenceTables  # the tests' own: imports torch, not needed to watch

    reference = ReferenceTables(Path(args.checkpoint))
    loaded = [(Path(f), np.load(f)) for f in args.files]
    for path, data in loaded:
        n = sum(1 for k in data.files if k.startswith("ids"))
        values = sum(data[f"rows{i}"].size for i in range(n))
        for i in range(n):
            same_bits(data[f"rows{i}"].astype(np.float64), reference.expected(data[f"ids{i}"]),
                      f"{path.name} lookup {i}")
        print(f"  {path.name}: mode {data['mode']}, pid {data['pid']} in its namespace, "
              f"{n} lookups, {values} values equal the checkpoint's")
    first_path, first = loaded[0]
    for path, data in loaded[1:]:
        for key in (k for k in first.files if k.startswith(("ids", "rows"))):
            assert np.array_equal(first[key].view(np.uint32 if key.startswith("rows") else np.int64),
                                  data[key].view(np.uint32 if key.startswith("rows") else np.int64)), \
                f"{path.name} {key} differs from {first_path.name}'s"
        print(f"  {path.name}: bit for bit {first_path.name}'s ids and rows")


def retired(args: argparse.Namespace) -> None:
    """Timed from just before the kill, this process already running: no start-up in the figure."""
    assert args.client_id in listed_clients(args.socket), "the client to kill is not registered"
    started = time.time()
    subprocess.run(args.kill, check=True, stdout=subprocess.DEVNULL)
    print(f"  {' '.join(args.kill)}: returned after {time.time() - started:.2f} s")
    while True:
        listed = listed_clients(args.socket)
        took = time.time() - started
        if args.client_id not in listed:
            print(f"  client {args.client_id} retired {took:.2f} s after the kill "
                  f"(deadline {args.deadline:.2f} s); clients listed now: {listed}")
            return
        if took > args.deadline:
            sys.exit(f"client {args.client_id} still listed {took:.2f} s after the kill "
                     f"(deadline {args.deadline:.2f} s): {listed}")
        time.sleep(0.01)


def listed_clients(socket: str) -> list[int]:
    return [c["client_id"] for c in probe(socket, "stats", 5.0).body.clients]


def main() -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="what", required=True)
    r = sub.add_parser("rows")
    r.add_argument("--checkpoint", required=True)
    r.add_argument("files", nargs="+")
    d = sub.add_parser("retired")
    d.add_argument("--socket", required=True)
    d.add_argument("--client-id", type=int, required=True)
    d.add_argument("--deadline", type=float, required=True)
    d.add_argument("kill", nargs="+", help="the command that kills the client")
    args = parser.parse_args()
    {"rows": rows, "retired": retired}[args.what](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
