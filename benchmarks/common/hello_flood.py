"""A flood of short connections to a daemon's handle socket, as a process of its own:

    python benchmarks/common/hello_flood.py HANDLE_SOCKET COUNTER_FILE THREADS

Each of THREADS threads connects, asks `hello` and closes before the answer, as fast as it can:
the daemon's queue of connections not yet accepted stays full, and a Unix socket refuses a
connect to a full queue at once (EAGAIN). Every 50 ms COUNTER_FILE is replaced, whole, by the
number of connects refused so far. Runs until killed. Used by
benchmarks/experiments/handle_flood.py and tests/reliability/test_round3.py.
"""

from __future__ import annotations

import os
import socket
import sys
import threading

from engramd.client.shared.handles import HANDLE_REQUESTS, _send_request


def flood(path: str, refused: list[int]) -> None:
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.connect(path)
            _send_request(sock, HANDLE_REQUESTS["hello"]())
        except BlockingIOError:  # the daemon's queue of unaccepted connections is full
            refused[0] += 1
        except OSError:
            pass
        sock.close()  # before the answer


def main() -> None:
    path, counter, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
    refused = [0]
    for _ in range(threads):
        threading.Thread(target=flood, args=(path, refused), daemon=True).start()
    while True:
        threading.Event().wait(0.05)
        with open(counter + ".new", "w") as f:
            f.write(str(refused[0]))
        os.replace(counter + ".new", counter)  # whole, for a reader at any time


if __name__ == "__main__":
    main()
