"""Where each thread of a profiled process spends its samples (py-spy raw stacks).

    python benchmarks/stack_summary.py STACKS [--top 8]

STACKS: `py-spy record --idle --threads --native --format raw` output (benchmarks/floods.py
--py-spy writes OUT/stacks_<phase>.txt). Per thread: its share of samples in each state, and its
most sampled Python lines. A sample's state, from the native frames after its last Python frame:
- gil: a wait on the GIL (a condition wait reached from a C call, not from threading's wait);
- waiting: blocked on purpose (threading's Condition/Event/Lock, poll, select, accept, sleep:
  by the last Python frame, or by a sleeping, polling or semaphore call among the native ones);
- running: anything else (Python, or C work such as a torch kernel).
"""

from __future__ import annotations

import argparse
from collections import Counter, defaultdict

IDLE_PYTHON = {"Condition.wait", "Event.wait", "Poller.poll", "_PollLikeSelector.select",
               "socket.accept", "Thread.join", "Queue.get", "sleep"}
# Native calls that block on purpose (time.sleep, zmq_poll, a threading.Lock's semaphore).
IDLE_NATIVE = ("clock_nanosleep", "nanosleep", "select", "poll", "epoll_wait", "sem_clockwait",
               "sem_timedwait", "sem_wait")


def state(frames: list[str]) -> tuple[str, str]:
    python = [i for i, f in enumerate(frames) if ".py:" in f]
    last = frames[python[-1]] if python else "(no Python frame)"
    native_after = frames[python[-1] + 1:] if python else frames
    if last.split(" (", 1)[0] in IDLE_PYTHON:
        return "waiting", last
    natives = [f.split(" (", 1)[0] for f in native_after]
    if any(name in IDLE_NATIVE for name in natives):
        return "waiting", last
    if any("pthread_cond_timedwait" in f or "take_gil" in f for f in native_after):
        return "gil", last
    return "running", last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("stacks")
    parser.add_argument("--top", type=int, default=8)
    args = parser.parse_args()
    states: dict[str, Counter] = defaultdict(Counter)
    lines: dict[str, Counter] = defaultdict(Counter)
    with open(args.stacks) as stacks:
        for line in stacks:
            stack, count = line.rstrip("\n").rsplit(" ", 1)
            frames = stack.split(";")
            thread = frames[0].split(": ", 1)[-1]
            what, where = state(frames[1:])
            states[thread][what] += int(count)
            lines[thread][f"{what:8} {where}"] += int(count)
    for thread, counts in sorted(states.items(), key=lambda item: -item[1].total()):
        total = counts.total()
        shares = ", ".join(f"{what} {100 * n / total:.0f}%" for what, n in counts.most_common())
        print(f"{thread}: {total} samples: {shares}")
        for where, n in lines[thread].most_common(args.top):
            print(f"  {100 * n / total:5.1f}%  {where}")


if __name__ == "__main__":
    main()
