"""Where a lookup's host time goes: cProfile of the client loop and of the daemon process.

    python benchmarks/profile_lookup.py [--tokens 1] [--iters 2000] [--mode served] [--out DIR]

Starts `engramd serve --backend cuda` on the demo table under cProfile, runs `--iters` lookups of
`--tokens` tokens (lookup + wait + synchronize) under cProfile in this process, as a client of
`--mode` (served by default: `auto` is granted mapped on a GPU, whose gathers never reach the
daemon), stops the daemon, and prints both profiles' top entries by own time. Host overhead
only: the table is tiny.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

from engramd.client import EngramClient

sys.path.insert(0, str(Path(__file__).parent))
from common.daemon import bench_folders, start_daemon  # noqa: E402


def top(stats: pstats.Stats, n: int = 30, min_calls: int = 0) -> str:
    """The `n` entries of most own time among those called at least `min_calls` times (the
    daemon's profile covers its start too: its per-lookup functions are the ones called once
    per lookup or more)."""
    out = io.StringIO()
    stats.stream = out
    stats.stats = {key: value for key, value in stats.stats.items() if value[1] >= min_calls}
    stats.sort_stats("tottime").print_stats(n)
    return out.getvalue()


def run(args: argparse.Namespace, work: Path, shm: Path, out: Path) -> cProfile.Profile:
    """The profiled lookups against a daemon of its own, profiled too (its profile in `out`)."""
    daemon, socket = start_daemon(work, ["--backend", "cuda", "--shm-dir", str(shm),
                                         "--cache-dir", str(work)], timeout=120,
                                  python=[sys.executable, "-m", "cProfile", "-o", str(out / "daemon.prof")])
    try:
        with EngramClient(socket, device="cuda", max_tokens=args.tokens, slots=2,
                          mode=args.mode) as client:
            ids = torch.zeros((args.tokens, 2, 24), dtype=torch.int64, device="cuda")
            stream = torch.cuda.current_stream()
            for _ in range(50):
                client.lookup(ids).wait()
            stream.synchronize()
            profile = cProfile.Profile()
            start = time.perf_counter()
            profile.enable()
            for _ in range(args.iters):
                client.lookup(ids, stream).wait(stream)
                stream.synchronize()
            profile.disable()
            print(f"{(time.perf_counter() - start) / args.iters * 1e6:.1f} us per lookup (profiled)")
            print(f"mode {client.mode}; daemon dispatch us:", client.stats().get("dispatch_us"))
    finally:
        daemon.terminate()  # SIGTERM: the profiled daemon writes daemon.prof as it exits
        daemon.wait(60)
    return profile


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--top", type=int, default=30, help="entries of each profile to print")
    parser.add_argument("--mode", choices=("served", "mapped"), default="served")
    parser.add_argument("--out", help="folder for daemon.prof (default: a new temporary folder)")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="engramd-prof-"))
    out.mkdir(parents=True, exist_ok=True)
    with bench_folders(show_log=False) as (work, shm):  # removed however the run ends
        profile = run(args, work, shm, out)
    print("=== client ===")
    print(top(pstats.Stats(profile), args.top))
    print("=== daemon ===")
    print(top(pstats.Stats(str(out / "daemon.prof")), args.top, min_calls=args.iters))
    return 0


if __name__ == "__main__":
    sys.exit(main())
