"""Chaos soak: client processes look up rows, every one verified, while the daemon is faulted.

    python benchmarks/chaos.py [--seconds 600] [--clients 6] [--vocab 20000] [--seed 0]
                               [--report benchmarks/results/chaos.md] [--json FILE]

The promise under test: no fault ever becomes a wrong row without an error, nothing hangs,
nothing leaks. benchmarks/soak.py holds the daemon steady; this script breaks it, hundreds of
times, and reuses soak.py's clients' draws and its independent reference (rows decoded from the
checkpoints' bytes by tests/reference.py, no engramd code).

Two synthetic checkpoints of one V4.1-shaped geometry (other seeds, so other rows; or --tables
and --second-tables) and a `current` symlink the daemon serves (`engramd serve --backend cpu`).
`--clients` processes, alternately mode="served" and mode="mapped" on the CPU, each loop:
register with a random TP rank / size, slots and token budget; look up waves of up to `slots`
lookups of random T; verify every row; after a while close and register anew. Clients follow
reloads (not pinned), so each lookup's rows must equal, entirely, one of the two checkpoints
(never a mix), and the one `client.tables_id` names (mapped: read around lookup(), the mapping
it gathers from; served: the daemon switches between two lookups and the client learns it from a
notice in order with the replies, so the id read before the lookup or after the next one).

An operator loop injects, at random pauses, the faults of FAULTS in shuffled rounds (every kind
once per round, so even a short run meets each):

  kill_restart   kill -9, then a plain `engramd serve`; the fault lasts until it is ready
  kill_standby   an `engramd serve --standby` waits with the tables mapped; kill -9; until the
                 standby serves
  term_restart   SIGTERM (drain: must exit 0), then a plain restart; until it is ready
  reload         the symlink flipped to the other checkpoint, `engramd reload`; until done
  stop_short     SIGSTOP, SIGCONT after less than the clients' reply timeout (--timeout-s)
  stop_long      SIGSTOP, SIGCONT after more than that timeout (served lookups time out)

Every client call runs under a watchdog: one that takes longer than HANG bounds is a hang
(stacks dumped to the client's log). Errors are allowed only when typed (engramd.client's
EngramError) and only within a fault's window (from the fault until `grace` after it is over);
a lookup's time is when its rows were verified or its error raised. Per fault kind: lookups,
wrong rows, mixed lookups, lookups of other tables than the client named, typed and untyped
errors, hangs, and each client's longest gap without a good lookup (the outage a served and a
mapped client saw). At the end: the daemon stopped cleanly (SIGTERM, exit 0, no client left),
its shared-memory folder holds the served tables and lock files only, the daemon's and the
clients' descriptors have not grown. Exit status 0 when everything passes, 1 otherwise.

`run(ChaosConfig(...))` is the same as a function (tests/reliability/test_chaos_short.py).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak import (  # noqa: E402
    FD_SLACK,
    LazyReference,
    draw_ids,
    draw_registration,
    machine,
    problems_section,
    publish,
    run_kept_on_failure,
    same_rows,
    sample_process,
)
from standby_takeover import Node  # noqa: E402

FAULTS = ("kill_restart", "kill_standby", "term_restart", "reload", "stop_short", "stop_long")
MODES = ("served", "mapped")
TOTALS = ("lookups", "rows_verified", "wrong_rows", "mixed_lookups", "tables_checked",
          "wrong_tables", "registrations")  # what the clients count (Tally.counts)
GAP_MIN_S = 0.25  # gaps between good lookups shorter than this are not reported (load, verification)
BUCKET_S = 0.1  # lookups are counted per bucket of this many seconds, then given to a fault
CLIENT_FD_SLACK = 4  # a client's descriptors after its last close may exceed its first by this
READY_TIMEOUT_S = 300.0  # client processes start (torch imports) on a loaded machine
RELOAD_TIMEOUT_S = 600.0


@dataclass
class ChaosConfig:
    seconds: float = 600.0  # faults are injected this long (and at least one round of FAULTS)
    clients: int = 6
    tables: str | None = None  # checkpoint A; None: synthetic, `vocab`
    second_tables: str | None = None  # checkpoint B, A's geometry with other rows
    vocab: int = 20_000
    seed: int = 0
    timeout_s: float = 5.0  # the clients' reply timeout (EngramClient timeout)
    reconnect_s: float = 30.0  # the clients' reconnect_timeout
    pause_s: tuple[float, float] = (0.5, 3.0)  # quiet between two faults, drawn uniformly
    heartbeat_s: float = 1.0
    gather_workers: int = 2
    workdir: str | None = None  # checkpoints, socket, logs (default: a temp folder)

    @property
    def grace_s(self) -> float:
        """How long after a fault is over its errors may still come: a lookup sent just before
        it ended waits up to the reply timeout."""
        return self.timeout_s + 2.0

    @property
    def hang_s(self) -> float:
        """The longest one client call may take: a lookup() may wait for a previous reply of
        its slot (timeout) and for a restarted daemon (reconnect), its result() another
        timeout; beyond that and a margin for a loaded machine, it hangs."""
        return 2 * self.timeout_s + self.reconnect_s + 15.0


# -- one client process -----------------------------------------------------------------------


class Watch:
    """The client call in progress and since when, watched by a thread: a call past `hang_s`
    is a hang, reported with what was counted so far, and the process ends (a hung call never
    returns to let it report otherwise)."""

    def __init__(self, hang_s: float, report):
        self.hang_s, self.report = hang_s, report
        self.call: tuple[str, float] | None = None
        threading.Thread(target=self._watch, name="chaos-watch", daemon=True).start()

    def __call__(self, what: str, fn, *args, **kwargs):
        self.call = (what, time.monotonic())
        try:
            return fn(*args, **kwargs)
        finally:
            self.call = None

    def _watch(self) -> None:
        while True:
            time.sleep(0.5)
            call = self.call
            if call is not None and time.monotonic() - call[1] > self.hang_s:
                faulthandler.dump_traceback(file=sys.stderr)
                self.report(hang={"t": time.time(), "call": call[0],
                                  "after_s": round(time.monotonic() - call[1], 1)})
                os._exit(0)


class Tally:
    """What one client process saw, as it reports it: lookups per time bucket, gaps between
    good lookups, errors, wrong rows, tables checks, its descriptors."""

    def __init__(self, index: int, mode: str):
        self.index, self.mode = index, mode
        self.buckets: Counter = Counter()
        self.counts: Counter = Counter()
        self.gaps: list[tuple[float, float]] = []
        self.typed: list[tuple[float, str, str]] = []
        self.untyped: list[tuple[float, str]] = []
        self.wrong: list[tuple[float, str]] = []
        self.fds: list[int] = []
        self.last_good: float | None = None

    def good(self, now: float) -> None:
        self.buckets[int(now / BUCKET_S)] += 1
        if self.last_good is not None and now - self.last_good > GAP_MIN_S:
            self.gaps.append((self.last_good, now))
        self.last_good = now

    def error(self, exc: BaseException) -> None:
        from engramd.client import EngramError

        if isinstance(exc, EngramError):
            self.typed.append((time.time(), type(exc).__name__, str(exc)[:300]))
        else:
            self.untyped.append((time.time(), "".join(traceback.format_exception(exc))[-3000:]))

    def bad(self, what: str, **counts: int) -> None:
        self.counts.update(counts)
        self.wrong.append((time.time(), what))

    def as_dict(self, **extra: Any) -> dict[str, Any]:
        now = time.time()
        gaps = self.gaps + ([(self.last_good, now)] if self.last_good and now - self.last_good > GAP_MIN_S else [])
        return {"index": self.index, "mode": self.mode, "counts": dict(self.counts),
                "buckets": dict(self.buckets), "gaps": gaps, "typed": self.typed[:5000],
                "untyped": self.untyped[:50], "wrong": self.wrong[:50], "fds": self.fds,
                "last_good": self.last_good, **extra}


class Checker:
    """Verifies one lookup's rows against both checkpoints: each row must equal one of them,
    all of the lookup's rows the same one (rows equal in both count for either), and that one
    must be the tables the client named."""

    def __init__(self, refs: list[LazyReference], fingerprints: list[str], tally: Tally):
        self.refs, self.fingerprints, self.tally = refs, fingerprints, tally

    def rows(self, rows: np.ndarray, ids: np.ndarray, rank: int, shards: int) -> int | None:
        """Which checkpoint (0, 1) the rows are, None where both agree on every row; counts
        wrong and mixed lookups in the tally."""
        matches = [same_rows(rows, ref.expected(ids, rank, shards)) for ref in self.refs]
        wrong = int((~(matches[0] | matches[1])).sum())
        only = [i for i in (0, 1) if (matches[i] & ~matches[1 - i]).any()]
        self.tally.counts["rows_verified"] += matches[0].size
        if wrong:
            where = np.argwhere(~(matches[0] | matches[1]))[:3].tolist()
            self.tally.bad(f"tp {rank}/{shards}, T={len(ids)}: {wrong} rows of neither checkpoint "
                           f"at [layer, t, head] {where}", wrong_rows=wrong)
        if len(only) == 2:
            self.tally.bad(f"tp {rank}/{shards}, T={len(ids)}: rows of both checkpoints in one lookup",
                           mixed_lookups=1)
        return only[0] if len(only) == 1 else None

    def tables(self, which: int | None, named: set[str | None]) -> None:
        """The rows' checkpoint must be one the client named around the lookup."""
        if which is None:
            return
        self.tally.counts["tables_checked"] += 1
        if self.fingerprints[which] not in named:
            self.tally.bad(f"rows of tables {self.fingerprints[which]}, the client named {sorted(map(str, named))}",
                           wrong_tables=1)


class Looker:
    """One client process's lookups through one registration after another, each call watched.
    Served lookups' tables are checked once the client's next lookup() has read the daemon's
    notices (`unresolved`)."""

    def __init__(self, cfg: dict[str, Any], checker: Checker, tally: Tally, watch: Watch):
        self.cfg, self.checker, self.tally, self.watch = cfg, checker, tally, watch
        self.unresolved: list[tuple[int | None, set]] = []  # (checkpoint, ids named so far)

    def session(self, client, rng: np.random.Generator, shape: dict[str, int], stop) -> None:
        lookups = int(rng.integers(50, 1000))
        while lookups > 0 and not stop():
            wave = self.submit(client, rng, shape, min(client.slots, lookups))
            for ids, future, named in wave:
                self.collect(client, ids, future, named, shape)
            lookups -= max(1, len(wave))

    def submit(self, client, rng, shape, count: int) -> list:
        import torch

        wave = []
        for _ in range(count):
            ids = draw_ids(rng, client.max_tokens, self.checker.refs[0])
            before, resolving, self.unresolved = client.tables_id, self.unresolved, []
            try:
                future = self.watch("lookup", client.lookup, torch.from_numpy(ids))
            except Exception as exc:  # noqa: BLE001 (every exception is counted, typed or not)
                self.tally.error(exc)
                self.unresolved = resolving + self.unresolved
                time.sleep(0.05)  # a daemon that is gone: do not spin
                break
            for which, named in resolving:
                self.checker.tables(which, named | {client.tables_id})
            wave.append((ids, future, {before, client.tables_id}))
        return wave

    def collect(self, client, ids, future, named: set, shape: dict[str, int]) -> None:
        try:
            rows = self.watch("result", future.result, timeout=self.cfg["timeout_s"])
            rows = rows.double().numpy()
        except Exception as exc:  # noqa: BLE001
            self.tally.error(exc)
            return
        which = self.checker.rows(rows, ids, shape["tp_rank"], shape["tp_size"])
        if client.mode == "mapped":
            self.checker.tables(which, named)
        else:
            self.unresolved.append((which, named))
        self.tally.counts["lookups"] += 1
        self.tally.good(time.time())


def worker(index: int, mode: str, socket: str, tables: list[str], fingerprints: list[str],
           seed: int, work: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """A client process's whole life: registrations one after another until the stop file."""
    import torch

    from engramd.client import EngramClient

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    _start_zmq_collector()
    tally = Tally(index, mode)
    emit = _emitter(tally)
    watch = Watch(cfg["hang_s"], emit)
    checker = Checker([LazyReference(Path(t)) for t in tables], fingerprints, tally)
    looker = Looker(cfg, checker, tally, watch)
    rng = np.random.default_rng(seed)
    stop_file, ready_file = Path(work) / "stop", Path(work) / f"ready-{index}"

    def stop() -> bool:
        """Once the stop file names the last fault's end: after this client's first good lookup
        past it (however long a loaded machine takes; a client that never gets one hangs)."""
        if tally.last_good is not None and not ready_file.exists():
            ready_file.touch()
        if not stop_file.exists() or not (text := stop_file.read_text()):
            return False
        return tally.last_good is not None and tally.last_good > float(text)

    while not stop():
        shape = draw_registration(rng)
        try:
            client = watch("register", EngramClient, socket, **shape, mode=mode,
                           timeout=cfg["timeout_s"], reconnect_timeout=cfg["reconnect_s"],
                           name=f"chaos-{index}")
        except Exception as exc:  # noqa: BLE001
            tally.error(exc)
            time.sleep(0.1)
            continue
        tally.counts["registrations"] += 1
        try:
            looker.session(client, rng, shape, stop)
        finally:
            watch("close", client.close)
        tally.fds.append(_open_fds(tally.fds[0] if tally.fds else None))
    return emit()


def _start_zmq_collector() -> None:
    """pyzmq sends large frames without copying them through a collector thread with a ZeroMQ
    context of its own (7 descriptors), made at the first such frame and kept for the process's
    life: made here, before the first count of descriptors, so that it is not taken for a leak."""
    import zmq

    zmq.Frame(bytes(1 << 17), copy=False)  # starts it; the frame itself goes at once


def _open_fds(first: int | None) -> int:
    """This process's descriptor count; where it grew past `first`, what they are goes to the
    log (a leak names itself)."""
    import gc

    gc.collect()  # an object in a reference cycle lets its descriptors go when collected
    fds = os.listdir("/proc/self/fd")
    if first is not None and len(fds) > first + CLIENT_FD_SLACK:
        names = Counter()
        for fd in fds:
            try:
                names[os.readlink(f"/proc/self/fd/{fd}").split("[")[0]] += 1
            except OSError:
                pass
        print(f"{len(fds)} descriptors open after close (first: {first}): {dict(names)}",
              file=sys.stderr, flush=True)
    return len(fds)


def _emitter(tally: Tally):
    """Prints the tally as the process's one line of JSON, once (the watchdog's hang report or
    the end, whichever comes first)."""
    lock = threading.Lock()
    done: list[dict[str, Any]] = []

    def emit(**extra: Any) -> dict[str, Any]:
        with lock:
            if not done:
                done.append(tally.as_dict(**extra))
                print(json.dumps(done[0]), flush=True)
            return done[0]

    return emit


# -- the operator -------------------------------------------------------------------------------


@dataclass
class Fault:
    kind: str
    start: float  # time.time() of the fault
    over: float = 0.0  # the daemon ready again, the reload done, SIGCONT sent
    detail: dict[str, Any] = field(default_factory=dict)
    problem: str | None = None  # what went wrong with the operation itself (a failure)


class Operator(Node):
    """The daemon (standby_takeover.Node: spawn, serve, stand by, wait ready) and the faults
    done to it, one at a time."""

    def __init__(self, work: Path, flags: list[str], cfg: ChaosConfig, checkpoints: list[Path],
                 fingerprints: list[str]):
        super().__init__(work, flags)
        self.cfg, self.checkpoints, self.fingerprints = cfg, checkpoints, fingerprints
        self.current = 0  # the checkpoint the symlink names
        self.rng = np.random.default_rng(cfg.seed + 7)

    def inject(self, kind: str) -> Fault:
        fault = Fault(kind, time.time())
        try:
            getattr(self, kind)(fault)
        except (Exception, SystemExit) as exc:  # noqa: BLE001 (the run reports it and ends)
            fault.problem = f"{type(exc).__name__}: {str(exc)[-2000:]}"
        fault.over = time.time()
        return fault

    def kill_restart(self, fault: Fault) -> None:
        fault.detail["exit"] = self._end(signal.SIGKILL)
        self.serve()

    def kill_standby(self, fault: Fault) -> None:
        fault.detail["ahead_s"] = self.stand_by()
        fault.start = time.time()  # the fault is the kill, not the standby's start
        fault.detail["exit"] = self._end(signal.SIGKILL)
        self.serving, self.standby = self.standby, None
        self.wait_ready(self.serving)

    def term_restart(self, fault: Fault) -> None:
        fault.detail["exit"] = code = self._end(signal.SIGTERM)
        if code != 0:
            fault.problem = f"the daemon exited with {code} on SIGTERM (a drain exits 0)"
        self.serve()

    def reload(self, fault: Fault) -> None:
        self.current = 1 - self.current
        link = self.work / "current"
        staged = self.work / "current.new"
        staged.unlink(missing_ok=True)
        staged.symlink_to(self.checkpoints[self.current])
        os.replace(staged, link)
        done = subprocess.run([sys.executable, "-m", "engramd.server.cli", "reload", "--socket",
                               str(self.socket), "--json", "--wait", str(RELOAD_TIMEOUT_S)],
                              capture_output=True, text=True, timeout=RELOAD_TIMEOUT_S + 60)
        status = json.loads(done.stdout) if done.stdout.strip() else {}
        fault.detail.update(exit=done.returncode, state=status.get("state"), tables=status.get("tables"))
        if done.returncode != 0 or status.get("tables") != self.fingerprints[self.current]:
            fault.problem = f"reload to checkpoint {self.current}: {done.returncode} {status} {done.stderr[-500:]}"

    def stop_short(self, fault: Fault) -> None:
        self._stop_for(fault, float(self.rng.uniform(0.2, 0.6 * self.cfg.timeout_s)))

    def stop_long(self, fault: Fault) -> None:
        self._stop_for(fault, float(self.rng.uniform(1.2, 1.6) * self.cfg.timeout_s))

    def _stop_for(self, fault: Fault, seconds: float) -> None:
        fault.detail["stopped_s"] = round(seconds, 2)
        self.serving.send_signal(signal.SIGSTOP)
        time.sleep(seconds)
        self.serving.send_signal(signal.SIGCONT)

    def _end(self, sig: int) -> int:
        self.serving.send_signal(sig)
        return self.serving.wait(60)

    @property
    def work(self) -> Path:
        return self.socket.parent


# -- the run --------------------------------------------------------------------------------------


def _checkpoints(cfg: ChaosConfig, work: Path) -> list[Path]:
    """Checkpoints A and B: given, or synthetic of `vocab` (seeds `seed` and `seed` + 1)."""
    if cfg.tables:
        return [Path(cfg.tables).resolve(), Path(cfg.second_tables).resolve()]
    from common.tables import v41_geometry

    from engramd.server.synthetic import write_synthetic_checkpoint

    geometry = v41_geometry(cfg.vocab, source="chaos")
    print(f"writing two {geometry.total_bytes / 1e9:.2f} GB synthetic checkpoints", file=sys.stderr)
    return [write_synthetic_checkpoint(geometry, work / f"ckpt-{i}", seed=cfg.seed + i) for i in (0, 1)]


def _fingerprint(checkpoint: Path) -> str:
    """The tables id a daemon serving `checkpoint` names (server/checkpoint.py fingerprint)."""
    from engramd.server.checkpoint import EngramCheckpoint

    return EngramCheckpoint.open(checkpoint).fingerprint()


def _start_clients(cfg: ChaosConfig, socket: Path, checkpoints: list[Path], fingerprints: list[str],
                   work: Path) -> list[subprocess.Popen]:
    shared = {"timeout_s": cfg.timeout_s, "reconnect_s": cfg.reconnect_s, "hang_s": cfg.hang_s}
    procs = []
    for i in range(cfg.clients):
        args = json.dumps({"index": i, "mode": MODES[i % 2], "socket": str(socket),
                           "tables": [str(c) for c in checkpoints], "fingerprints": fingerprints,
                           "seed": cfg.seed * 1000 + i, "work": str(work), "cfg": shared})
        with open(work / f"client{i}.log", "ab") as log:
            procs.append(subprocess.Popen([sys.executable, __file__, "--worker", args],
                                          stdout=subprocess.PIPE, stderr=log))
    return procs


def _wait_clients_ready(procs: list[subprocess.Popen], work: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not all((work / f"ready-{i}").exists() for i in range(len(procs))):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise SystemExit("client processes did not all look up within "
                             f"{READY_TIMEOUT_S:.0f} s (logs in {work})")
        time.sleep(0.2)


def _operate(op: Operator, cfg: ChaosConfig, procs: list[subprocess.Popen]) -> list[Fault]:
    """Faults at random pauses until `seconds` have passed and every kind has come once; stops
    at the first fault whose operation failed (the daemon's state is unknown then)."""
    rng = np.random.default_rng(cfg.seed)
    faults: list[Fault] = []
    deadline = time.monotonic() + cfg.seconds
    while time.monotonic() < deadline or len(faults) < len(FAULTS):
        for kind in rng.permutation(FAULTS):
            time.sleep(float(rng.uniform(*cfg.pause_s)))
            faults.append(op.inject(str(kind)))
            print(f"{faults[-1].kind}: {faults[-1].over - faults[-1].start:.2f} s "
                  f"{faults[-1].detail} {faults[-1].problem or ''}", file=sys.stderr, flush=True)
            if faults[-1].problem or any(p.poll() is not None for p in procs):
                return faults
            if time.monotonic() >= deadline and len(faults) >= len(FAULTS):
                return faults
    return faults


def _collect(procs: list[subprocess.Popen], work: Path, timeout: float) -> list[dict[str, Any]]:
    results = []
    for i, proc in enumerate(procs):
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            results.append({"index": i, "hang": {"t": time.time(), "call": "the whole process",
                                                 "after_s": timeout}})
            continue
        line = out.decode(errors="replace").strip().splitlines()
        if proc.returncode != 0 or not line:
            log = (work / f"client{i}.log").read_text(errors="replace")[-2000:]
            results.append({"index": i, "untyped": [[time.time(), f"client process exited "
                                                     f"{proc.returncode}: {log}"]]})
        else:
            results.append(json.loads(line[-1]))
    return results


def run(cfg: ChaosConfig) -> dict[str, Any]:
    """Run the chaos soak; returns the summary (see `judge` for what passes), its folder kept
    only after a failing run (run_kept_on_failure)."""
    return run_kept_on_failure("chaos", cfg.workdir, lambda work: _run_in(cfg, work))


def _run_in(cfg: ChaosConfig, work: Path) -> dict[str, Any]:
    from common.daemon import shm_scratch

    from engramd.client.shared.connection import probe

    shm = shm_scratch("engramd-chaos-")
    op, procs, end = None, [], {}
    try:
        checkpoints = _checkpoints(cfg, work)
        fingerprints = [_fingerprint(c) for c in checkpoints]
        (work / "current").unlink(missing_ok=True)
        (work / "current").symlink_to(checkpoints[0])
        flags = ["--tables", str(work / "current"), "--shm-dir", str(shm), "--instance", "chaos",
                 "--backend", "cpu", "--workers", str(cfg.gather_workers),
                 "--heartbeat-interval", str(cfg.heartbeat_s), "--metrics-address", "127.0.0.1:0"]
        op = Operator(work, flags, cfg, checkpoints, fingerprints)
        op.serve()
        before = sample_process(op.serving.pid)
        procs = _start_clients(cfg, op.socket, checkpoints, fingerprints, work)
        _wait_clients_ready(procs, work)
        started = time.time()
        faults = _operate(op, cfg, procs)
        time.sleep(cfg.grace_s)  # the last fault's window: its errors are due to it
        last_over = max((f.over for f in faults), default=0.0)
        (work / "stop.part").write_text(repr(last_over))
        (work / "stop.part").rename(work / "stop")  # whole, for the clients that read it
        results = _collect(procs, work, cfg.hang_s + 60)
        procs = []
        time.sleep(2 * cfg.heartbeat_s)  # anything a client left is reaped by now
        end["fds"] = sample_process(op.serving.pid)["fds"]
        end["clients_left"] = len(probe(op.socket, "stats", 30.0).body.clients)
        end["exit"] = op._end(signal.SIGTERM)
        op.serving = None
        end["shm"] = sorted(str(p.relative_to(shm)) for p in shm.rglob("*") if p.is_file())
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        if op is not None:
            op.close()
        shutil.rmtree(shm, ignore_errors=True)
    n_layers = len(json.loads((checkpoints[0] / "config.json").read_text())["engram_layer_ids"])
    return judge(cfg, faults, results, before, end, n_layers, time.time() - started)


# -- judging ----------------------------------------------------------------------------------------


def _window(faults: list[Fault], t: float, grace: float) -> Fault | None:
    """The latest fault begun by `t` whose window (until `grace` after it is over) holds `t`."""
    for fault in reversed(faults):
        if fault.start <= t:
            return fault if t <= fault.over + grace else None
    return None


def _per_kind(cfg: ChaosConfig, faults: list[Fault], results: list[dict[str, Any]]) -> dict[str, Counter]:
    """Counts per fault kind ("none": outside every fault's window), and the failures no
    window excuses."""
    kinds: dict[str, Counter] = defaultdict(Counter)
    for fault in faults:
        kinds[fault.kind]["faults"] += 1
    for r in results:
        for bucket, count in r.get("buckets", {}).items():
            fault = _window(faults, (int(bucket) + 0.5) * BUCKET_S, cfg.grace_s)
            kinds[fault.kind if fault else "none"]["lookups"] += count
        for t, name, _ in r.get("typed", []):
            fault = _window(faults, t, cfg.grace_s)
            kinds[fault.kind if fault else "none"][f"typed:{name}"] += 1
        for key, problems in (("untyped", r.get("untyped", [])), ("bad", r.get("wrong", []))):
            for t, _ in problems:
                fault = _window(faults, t, cfg.grace_s)
                kinds[fault.kind if fault else "none"][key] += 1
        if "hang" in r:
            fault = _window(faults, r["hang"]["t"], cfg.grace_s)
            kinds[fault.kind if fault else "none"]["hangs"] += 1
    return kinds


def _cause(faults: list[Fault], a: float, b: float, grace: float) -> Fault | None:
    """The fault a gap between two good lookups (a, b) belongs to: the first one begun inside
    it, else the one whose window holds its start (a client still catching up after it)."""
    inside = [f for f in faults if a < f.start <= b]
    return inside[0] if inside else _window(faults, a, grace)


def _outages(cfg: ChaosConfig, faults: list[Fault], results: list[dict[str, Any]]) -> dict[str, dict[str, list[float]]]:
    """Per fault kind and mode: each fault's outage, the longest gap without a good lookup that
    a client of that mode had because of it (GAP_MIN_S where none was longer); "none": gaps no
    fault explains."""
    for fault in faults:
        fault.detail["outage_s"] = {mode: GAP_MIN_S for mode in {r["mode"] for r in results if "mode" in r}}
    spare: dict[str, float] = {}
    for r in results:
        for a, b in r.get("gaps", []):
            fault = _cause(faults, a, b, cfg.grace_s)
            held = fault.detail["outage_s"] if fault else spare
            held[r["mode"]] = round(max(held.get(r["mode"], GAP_MIN_S), b - a), 2)
    out: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for fault in faults:
        for mode, seconds in fault.detail["outage_s"].items():
            out[fault.kind][mode].append(seconds)
    for mode, seconds in spare.items():
        out["none"][mode].append(seconds)
    return {kind: dict(modes) for kind, modes in out.items()}


def judge(cfg: ChaosConfig, faults: list[Fault], results: list[dict[str, Any]], before: dict[str, int],
          end: dict[str, Any], n_layers: int, duration: float) -> dict[str, Any]:
    totals: Counter = Counter({k: 0 for k in TOTALS})
    for r in results:
        totals.update(r.get("counts", {}))
    kinds = _per_kind(cfg, faults, results)
    outages = _outages(cfg, faults, results)
    tables = [p for p in end.get("shm", []) if p.endswith(".tbl")]
    others = [p for p in end.get("shm", []) if not p.endswith((".tbl", ".lock"))]
    last_over = max((f.over for f in faults), default=0.0)
    client_fds = {r["index"]: r["fds"] for r in results if r.get("fds")}
    summary = {
        "config": {**asdict(cfg), "grace_s": cfg.grace_s, "hang_s": cfg.hang_s},
        "duration_s": round(duration, 1), "totals": dict(totals),
        "per_kind": {k: dict(v) for k, v in kinds.items()}, "outage_s": dict(outages),
        "faults": [asdict(f) for f in faults], "end": end, "daemon_fds_start": before["fds"],
        "client_fds": client_fds, "machine": machine(),
        "problems": [p for r in results for p in
                     [w for _, w in r.get("wrong", [])] + [u for _, u in r.get("untyped", [])]
                     + ([f"hang: {r['hang']}"] if "hang" in r else [])]
                    + [f"{f.kind}: {f.problem}" for f in faults if f.problem],
        "results": [{k: v for k, v in r.items() if k != "buckets"} for r in results],
    }
    summary["checks"] = {
        "every fault kind injected": all(kinds[k]["faults"] > 0 for k in FAULTS),
        "every fault done as asked": not any(f.problem for f in faults),
        "no wrong rows": totals["wrong_rows"] == 0 and totals["lookups"] > 0,
        "no lookup of both tables": totals["mixed_lookups"] == 0,
        "rows of the tables the client named": totals["wrong_tables"] == 0,
        "no untyped errors": not any(r.get("untyped") for r in results),
        "no hangs": not any("hang" in r for r in results),
        "typed errors only around a fault": not any(k.startswith("typed:") for k in kinds["none"]),
        "every client looked up after the last fault": all(
            (r.get("last_good") or 0) > last_over for r in results),
        "clean stop, no client left": end.get("exit") == 0 and end.get("clients_left") == 0,
        "shared memory: the served tables only": len(tables) == n_layers and not others,
        "daemon fds back to start": end.get("fds", 1 << 30) <= before["fds"] + FD_SLACK,
        "client fds not grown": all(f[-1] <= f[0] + CLIENT_FD_SLACK for f in client_fds.values())
        and len(client_fds) == len(results),
    }
    summary["ok"] = all(summary["checks"].values())
    return summary


# -- report -------------------------------------------------------------------------------------------


def _kind_row(kind: str, counts: dict[str, int], outage: dict[str, float], faults: list[dict]) -> str:
    typed = {k[6:]: v for k, v in counts.items() if k.startswith("typed:")}
    over = sorted(f["over"] - f["start"] for f in faults if f["kind"] == kind)
    took = f"{np.median(over):.2f} / {max(over):.2f}" if over else ""
    shown = {m: " / ".join(f"{x:.2f}" if x > GAP_MIN_S else f"< {GAP_MIN_S}"
                           for x in (float(np.median(outage[m])), max(outage[m]))) for m in outage}
    return (f"| {kind} | {counts.get('faults', 0)} | {took} | {counts.get('lookups', 0):,} | "
            f"{counts.get('bad', 0)} | {sum(typed.values())}"
            f"{' (' + ', '.join(f'{k} {v}' for k, v in sorted(typed.items())) + ')' if typed else ''} | "
            f"{counts.get('untyped', 0)} | {counts.get('hangs', 0)} | {shown.get('served', '')} | "
            f"{shown.get('mapped', '')} |")


def report(summary: dict[str, Any], command: str) -> str:
    cfg, totals, end = summary["config"], summary["totals"], summary["end"]
    lines = [
        f"# Chaos soak: {cfg['clients']} client processes, CPU backend, faults every "
        f"{cfg['pause_s'][0]:g}-{cfg['pause_s'][1]:g} s ({time.strftime('%Y-%m-%d')})", "",
        f"Machine: {summary['machine']}.", f"Command: `{command}`", "",
        f"Result: **{'pass' if summary['ok'] else 'FAIL'}** "
        f"({', '.join(k for k, v in summary['checks'].items() if v) or 'no check passed'}"
        f"{'; failed: ' + ', '.join(k for k, v in summary['checks'].items() if not v) if not summary['ok'] else ''}).",
        "", f"{summary['duration_s']:.0f} s, {len(summary['faults'])} faults; "
        f"{totals.get('lookups', 0):,} lookups, {totals.get('rows_verified', 0):,} rows verified, "
        f"{totals.get('wrong_rows', 0)} wrong, {totals.get('mixed_lookups', 0)} lookups of both tables, "
        f"{totals.get('tables_checked', 0):,} lookups' tables checked against `tables_id` "
        f"({totals.get('wrong_tables', 0)} other), {totals.get('registrations', 0):,} registrations.", "",
        "| fault | count | fault over, median / max s | lookups in its windows | wrong / mixed / "
        "other-tables lookups | typed errors | untyped | hangs | outage, served: median / max s | "
        "outage, mapped: median / max s |", "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for kind in (*FAULTS, "none"):
        lines.append(_kind_row(kind, summary["per_kind"].get(kind, {}), summary["outage_s"].get(kind, {}),
                               summary["faults"]))
    lines += [
        "", f"A fault's window runs from the fault until {cfg['grace_s']:g} s after it is over "
        "(the daemon ready again, the reload done, SIGCONT sent); \"none\" is the time outside every "
        "window, where no error is allowed. A fault's outage for a mode is the longest time a "
        "client of that mode went without a good lookup because of it (a gap between two good "
        "lookups in which the fault began, or which began in its window); the median and the "
        f"most over the faults of a kind; gaps under {GAP_MIN_S} s are not recorded. For \"none\" "
        "it is the longest gap no fault explains (a loaded machine). A hang is a client call "
        f"past {cfg['hang_s']:g} s.", "",
        f"End: daemon exit status after SIGTERM {end.get('exit')}, clients left {end.get('clients_left')}, "
        f"daemon fds {summary['daemon_fds_start']} at the first start / {end.get('fds')} at the end; "
        f"client fds first / last close: "
        f"{', '.join(f'{f[0]}/{f[-1]}' for f in summary['client_fds'].values())}; "
        f"shared memory left: {', '.join(end.get('shm', [])) or 'nothing'}.", "",
    ]
    lines += problems_section(summary["problems"][:30])
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--tables", help="checkpoint A (default: write two synthetic ones)")
    parser.add_argument("--second-tables", help="checkpoint B: A's geometry, other rows")
    parser.add_argument("--vocab", type=int, default=20_000, help="synthetic buckets' base size")
    parser.add_argument("--timeout-s", type=float, default=5.0, help="the clients' reply timeout")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--report", help="write the result as markdown here")
    parser.add_argument("--json", help="write the full summary here")
    args = parser.parse_args()
    if args.worker:
        worker(**json.loads(args.worker))
        return 0
    if bool(args.tables) != bool(args.second_tables):
        parser.error("--tables and --second-tables go together")
    cfg = ChaosConfig(seconds=args.seconds, clients=args.clients, tables=args.tables,
                      second_tables=args.second_tables, vocab=args.vocab, timeout_s=args.timeout_s,
                      seed=args.seed)
    summary = run(cfg)
    text = report(summary, "python benchmarks/chaos.py " + " ".join(sys.argv[1:]))
    return publish(summary, text, args.report, args.json)


if __name__ == "__main__":
    sys.exit(main())
