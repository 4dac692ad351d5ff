"""`engramd` command line: serve, health, stats, drain, reload, make-tables.

    engramd serve [--config FILE] [--tables DIR|demo] [--socket PATH] [--backend cpu|cuda|auto] ...
    engramd health [--socket PATH] [--json] [--timeout S] [--live]
                   exit 0 ready (with --live: answering at all), 1 otherwise
    engramd stats  [--socket PATH] [--json] [--timeout S]
    engramd drain  [--socket PATH] [--timeout S] [--wait S] [--json]
                   stop accepting, finish in-flight lookups, exit; waits --wait for the exit
    engramd reload [--socket PATH] [--timeout S] [--wait S] [--json]
                   serve the configured checkpoint's tables anew (as SIGHUP does); exit 0
                   once it is served (or unchanged), 1 if the reload failed
    engramd make-tables --geometry demo|v4.1-flash|CONFIG.json --out DIR [--seed N]
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import math
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from engramd.client.errors import (
    ConfigError,
    DaemonUnavailableError,
    EngramError,
    ReplyTimeoutError,
)
from engramd.client.geometry import GeometryError, TableGeometry
from engramd.client.shared.connection import (
    SOCKET_ENV,
    check_daemon_socket,
    check_listening,
    default_socket_path,
    probe,
)

if TYPE_CHECKING:
    from engramd.server.config import DaemonConfig

EXIT_READY, EXIT_NOT_READY = 0, 1


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def cmd_serve(args: argparse.Namespace) -> NoReturn:
    status = _serve(args)
    # The daemon has let go of all it holds (sockets, locks, tables, GPU memory) in its close().
    # The interpreter's teardown would only add native libraries' static destructors, and one of
    # them aborted a daemon stopped during its start: SIGABRT ("terminate called without an
    # active exception") after its last log line, "stopped (exit status 0)".
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(status)


def _serve(args: argparse.Namespace) -> int:
    # SIGHUP is a reload, and a start has nothing to reload yet: its default action ended a
    # daemon that was importing or loading its tables (no log line, the lock file left). The
    # daemon installs its handler once it listens (Daemon.start), a standby keeps ignoring it.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    from engramd.server.startup import EarlySignals

    early = EarlySignals().install()  # a SIGTERM during the start: a stop once listening, exit 0
    # Before anything initialises CUDA: a lazily loaded kernel, launched while one of our streams
    # waits on a client process, would block the host until that client delivers
    # (docs/architecture.md, "Cross-process waits and lazy module loading").
    os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
    from engramd.server.config import dump_toml, load_config, overrides_from_args
    from engramd.server.startup import (
        EXIT_CONFIG,
        EXIT_OK,
        DaemonHalt,
        SocketLock,
        check_folders,
        injected_start_delay,
        prepare_runtime_dir,
    )
    from engramd.server.table_loader import TablePreload

    try:
        config = load_config(args.config, overrides_from_args(args))
    except ConfigError as exc:
        print(f"engramd: {exc.message}", file=sys.stderr)
        return EXIT_CONFIG
    if args.print_config:
        print(dump_toml(config, settings_in_effect(config)))
        return 0
    _setup_logging(config.log_level)
    # `kill -USR1 <pid>` writes every thread's stack to the log: what a stuck daemon is doing;
    # a crash (SIGSEGV, SIGBUS, SIGABRT in a driver or library call) writes them before it ends.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    faulthandler.enable(all_threads=True)
    # The lock, then the tables' first stage (map, pin) on a thread, then the heavy imports:
    # pinning tables already in shared memory overlaps importing torch (table_loader.py). A
    # standby has done the imports, and mapped and pinned the tables, before it took the lock.
    lock = SocketLock(config.socket_path)
    try:
        check_folders(config)
        prepare_runtime_dir(config.runtime_dir)
        prepared = None
        if args.standby:  # imports and CUDA first, then wait for the serving daemon to go
            from engramd.server.standby import wait_as_standby

            prepared = wait_as_standby(config, lock, early)
        else:
            lock.acquire()
    except DaemonHalt as halt:
        log = logging.getLogger("engramd.daemon")
        (log.info if halt.status == EXIT_OK else log.error)("%s", halt.reason)
        return halt.status
    preload = TablePreload.start(config, prepared)
    injected_start_delay(early)
    started = time.monotonic()
    from engramd.server.daemon import run_daemon

    logging.getLogger("engramd.daemon").info("daemon modules imported in %.2f s (beside the preload)",
                                             time.monotonic() - started)
    return run_daemon(config, lock, preload, early)


def settings_in_effect(config: DaemonConfig) -> dict[str, tuple[Any, str]]:
    """For --print-config: the settings whose value is decided at start, as (the value this
    start would use, why). Resolving `auto` asks the CUDA driver, not torch, which is not
    imported for this (a torch that cannot use the GPU still makes the start fall back to cpu)."""
    from engramd.server.table_loader import choose_backend_name

    resolved: dict[str, tuple[Any, str]] = {}
    if not config.socket:
        from_env = os.environ.get(SOCKET_ENV)
        why = f"empty: ${SOCKET_ENV}" if from_env else "empty: this user's default"
        resolved["socket"] = (str(config.socket_path), why)
    if config.backend == "auto":
        name = choose_backend_name("auto")
        resolved["backend"] = (name, f"auto: {'a' if name == 'cuda' else 'no'} GPU visible here")
    return resolved


def _probe(args: argparse.Namespace, op: str) -> dict[str, Any] | None:
    try:
        reply = probe(args.socket or default_socket_path(), op, args.timeout)
    except EngramError as exc:
        if args.json:
            print(json.dumps({"live": False, "ready": False, "error": exc.message}))
        else:
            print(f"engramd {op}: {exc.message}", file=sys.stderr)
        return None
    return {**reply.body.encode(), "epoch": reply.epoch}


def cmd_health(args: argparse.Namespace) -> int:
    fields = _probe(args, "health")
    if fields is None:
        return EXIT_NOT_READY
    if args.json:
        print(json.dumps(fields, sort_keys=True))
    else:
        reload = fields.get("reload") or {}
        reloading = (f", reloading {reload.get('progress', 0):.0%}" if reload.get("state") == "loading"
                     else "")
        print(f"{'ready' if fields['ready'] else 'not ready'}: state {fields['state']}, "
              f"tables {fields['progress']:.0%}{reloading}, pid {fields['pid']}, epoch {fields['epoch']}")
    if args.live:
        return EXIT_READY  # it answered: the process and its loop are alive
    return EXIT_READY if fields.get("ready") else EXIT_NOT_READY


def cmd_stats(args: argparse.Namespace) -> int:
    fields = _probe(args, "stats")
    if fields is None:
        return EXIT_NOT_READY
    _add_identities(args, fields.get("clients", []))
    if args.json:
        print(json.dumps(fields, sort_keys=True))
        return 0
    fields = _escaped(fields)  # what clients said (names, tables) must not drive the terminal
    print(f"state {fields.get('state')}  epoch {fields['epoch']}  uptime {fields.get('uptime', 0):.0f} s")
    reload = fields.get("reload") or {}
    print(f"tables {fields.get('tables')}" + (f"  last reload {reload.get('state')}"
                                              f"{': ' + reload['error'] if reload.get('error') else ''}"
                                              if reload else ""))
    print(f"lookups {fields.get('lookups', 0)}  rows {fields.get('rows', 0)}  "
          f"out-of-range ids {fields.get('out_of_range', 0)}  errors {fields.get('errors', {})}")
    clients = fields.get("clients", [])
    print(f"clients {len(clients)}")
    for c in clients:
        who = f"pid {c['pid']} {c['name'] or '-'} uid {c['uid']}" if "pid" in c else "(who: admins only)"
        other = "" if c.get("tables") in (None, fields.get("tables")) else f" on tables {c['tables']}"
        print(f"  #{c['client_id']} {who} {c['device']} tp {c['tp_rank']}/{c['tp_size']} "
              f"lookups {c['lookups']} rows {c['rows']} errors {c['errors']}{other}")
    return 0


def _escaped(value: Any) -> Any:
    """`value` with every string's non-printable characters written as escapes."""
    if isinstance(value, str):
        return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in value)
    if isinstance(value, dict):
        return {_escaped(k): _escaped(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_escaped(v) for v in value]
    return value


def _add_identities(args: argparse.Namespace, clients: list[dict[str, Any]]) -> None:
    """An admin also sees who each client is (pid, name, uid): the daemon tells only them, over
    the handle socket where it knows who asks. Anyone else gets the counts alone."""
    from engramd.client.shared.handles import admin_request, handle_socket_path

    try:
        reply = admin_request(handle_socket_path(args.socket or default_socket_path()), "clients",
                              args.timeout)
    except EngramError:
        return
    identities = {c["client_id"]: c for c in reply.clients}
    for client in clients:
        client.update(identities.get(client["client_id"], {}))


def cmd_drain(args: argparse.Namespace) -> int:
    """Ask the daemon to stop accepting, finish in-flight lookups and exit; wait until it has.
    An admin operation: it goes over the handle socket, where the daemon sees who asks."""
    from engramd.client.shared.handles import admin_request, handle_socket_path

    socket = args.socket or default_socket_path()
    try:
        epoch = probe(socket, "health", args.timeout).epoch  # which daemon run this drains
        drained = admin_request(handle_socket_path(socket), "drain", args.timeout)
    except EngramError as exc:
        if args.json:
            print(json.dumps({"drained": False, "error": exc.message}))
        else:
            print(f"engramd drain: {exc.message}", file=sys.stderr)
        return EXIT_NOT_READY
    deadline = time.monotonic() + args.wait
    while not (gone := _drained_gone(socket, epoch))[0] and time.monotonic() < deadline:
        time.sleep(0.1)
    exited, serving_now = gone
    if exited:
        if args.json:
            print(json.dumps({"drained": True, "epoch": epoch, "in_flight": drained.in_flight,
                              "serving_now": serving_now}))
        else:
            after = f"; daemon epoch {serving_now} serves now" if serving_now is not None else ""
            print(f"drained: daemon epoch {epoch} finished {drained.in_flight} lookups and exited{after}")
        return 0
    message = f"daemon epoch {epoch} has not exited after {args.wait:.0f} s (its socket is still there)"
    if args.json:
        print(json.dumps({"drained": False, "epoch": epoch, "error": message}))
    else:
        print(f"engramd drain: {message}", file=sys.stderr)
    return EXIT_NOT_READY


def _drained_gone(socket: str, epoch: str) -> tuple[bool, str | None]:
    """(whether the drained daemon has exited, the epoch of the daemon that answers in its
    place): exited once its socket is gone, or once another daemon answers there (a standby's
    takeover, a restart); not while it answers, or is silent (busy finishing its lookups:
    silence is no exit)."""
    try:
        serving = probe(socket, "health", 1.0).epoch
    except ReplyTimeoutError:  # a DaemonUnavailableError, but the daemon may be there
        return False, None
    except DaemonUnavailableError:  # no socket
        return True, None
    except EngramError:
        return False, None
    return serving != epoch, (serving if serving != epoch else None)


# A draining daemon finishes its lookups for at most DRAIN_TIMEOUT_S (30 s, server/daemon.py),
# then exits regardless: drain waits that long and a margin for the exit.
DRAIN_WAIT_S = 40.0
RELOAD_POLL_S = 0.5
RELOAD_PRINT_S = 5.0


def cmd_reload(args: argparse.Namespace) -> int:
    """Ask the daemon to reload its tables (an admin operation, over the handle socket), then
    follow it through `health` for up to --wait seconds, saying how far it is."""
    from engramd.client.shared.handles import admin_request, handle_socket_path

    socket = args.socket or default_socket_path()
    try:
        check_daemon_socket(Path(socket))  # said as health, stats and drain say it
        check_listening(Path(socket))
        started = admin_request(handle_socket_path(socket), "reload", args.timeout)
    except EngramError as exc:
        print(f"engramd reload: {exc.message}", file=sys.stderr)
        return EXIT_NOT_READY
    if args.wait <= 0:
        print(json.dumps({"state": started.state, "tables": started.tables}) if args.json else
              f"reload {started.state} (follow it with `engramd health --json`)")
        return 0
    status: dict[str, Any] = {"state": started.state}
    deadline, next_print = time.monotonic() + args.wait, 0.0
    while status.get("state") == "loading" and time.monotonic() < deadline:
        time.sleep(RELOAD_POLL_S)
        try:
            status = probe(socket, "health", args.timeout).body.reload or status
        except EngramError as exc:  # stopped (a drain cancels a reload) or died meanwhile
            print(f"engramd reload: the daemon stopped answering during the reload, which did not "
                  f"finish: {exc.message}", file=sys.stderr)
            return EXIT_NOT_READY
        if not args.json and time.monotonic() >= next_print and status.get("state") == "loading":
            print(f"reloading: {status.get('progress', 0):.0%} after {status.get('seconds', 0):.0f} s",
                  file=sys.stderr)
            next_print = time.monotonic() + RELOAD_PRINT_S
    if args.json:
        print(json.dumps(status, sort_keys=True))
    elif status.get("state") == "loading":
        print(f"engramd reload: still loading after {args.wait:.0f} s (follow it with "
              "`engramd health --json`)", file=sys.stderr)
    elif status.get("state") == "failed":
        print(f"engramd reload failed: {status.get('error')}", file=sys.stderr)
    else:
        print(f"reload {status.get('state')}: serving tables {status.get('tables')} "
              f"({status.get('seconds', 0):.1f} s)")
    return 0 if status.get("state") in ("done", "unchanged") else EXIT_NOT_READY


def cmd_make_tables(args: argparse.Namespace) -> int:
    from engramd.server.checkpoint import CheckpointError

    try:
        geometry = TableGeometry.resolve(args.geometry)
    except GeometryError as exc:
        print(f"engramd make-tables: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        print(f"engramd make-tables: {out} exists and is not an empty folder; choose a new one",
              file=sys.stderr)
        return 2
    made = not out.exists()
    # SIGTERM (timeout, systemd, a container's stop) cleans up as Ctrl-C does: a V4.1 checkpoint
    # left half-written is up to 189 GB, and the folder is refused by the next run.
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        return _write_tables(geometry, args)
    except (CheckpointError, OSError, KeyboardInterrupt, Terminated) as exc:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the clean-up short
        if made:
            shutil.rmtree(out, ignore_errors=True)  # nothing half-written stays behind
        elif out.is_dir():  # it was empty: empty it again
            for entry in out.iterdir():
                if entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
        if type(exc) in STOPPED_BY:
            word, status = STOPPED_BY[type(exc)]
            print(f"\nengramd make-tables: {word}; nothing was left behind", file=sys.stderr)
            return status
        reason = f"{exc.filename}: {exc.strerror}" if isinstance(exc, OSError) and exc.strerror else exc
        print(f"\nengramd make-tables: {reason}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)


class Terminated(Exception):
    """SIGTERM, raised where the main thread runs (make-tables)."""


def _raise_terminated(_signum: int, _frame: Any) -> None:
    raise Terminated


# A signal that stopped make-tables: what it says, and its exit status (128 + the signal).
STOPPED_BY: dict[type[BaseException], tuple[str, int]] = {
    KeyboardInterrupt: ("interrupted", 128 + signal.SIGINT), Terminated: ("terminated", 128 + signal.SIGTERM)}


def _write_tables(geometry: TableGeometry, args: argparse.Namespace) -> int:
    """Write the checkpoint with a progress line (GB and GB/s) on stderr."""
    from engramd.server.synthetic import write_synthetic_checkpoint
    from engramd.server.units import size

    started = time.monotonic()
    last = [0.0]

    def progress(done: int, total: int) -> None:
        now = time.monotonic()
        if now - last[0] >= 1.0 or done == total:
            last[0] = now
            rate = done / 1e9 / max(now - started, 1e-9)
            print(f"\r{done / 1e9:8.2f} / {total / 1e9:.2f} GB  {rate:.2f} GB/s", end="",
                  file=sys.stderr, flush=True)

    out = write_synthetic_checkpoint(geometry, args.out, seed=args.seed, progress=progress)
    print(file=sys.stderr)
    print(f"wrote {size(geometry.total_bytes)} of tables ({list(geometry.rows)} rows) to {out}")
    return 0


# The longest --timeout or --wait: a socket's timeout of about 1e10 s overflows (OverflowError
# from settimeout), and no wait of a command is years long but by a slip of the finger.
LONGEST_WAIT_S = 1e8


def seconds(text: str) -> float:
    """A --timeout or --wait: a finite number of seconds, >= 0 (argparse's usage error otherwise).
    float() reads 'nan', with which a health check waited forever for a stuck daemon."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not (math.isfinite(value) and 0 <= value <= LONGEST_WAIT_S):
        raise argparse.ArgumentTypeError(f"expected a number of seconds from 0 to "
                                         f"{LONGEST_WAIT_S:.0e}, got {text!r}")
    return value


def seed(text: str) -> int:
    """A --seed: an integer >= 0 (numpy's seeds are; argparse's usage error otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def answer_seconds(text: str) -> float:
    """A --timeout: seconds > 0. No answer comes in 0 s, and the check would then blame the
    daemon ("is it running?") for a wait it was never given."""
    value = seconds(text)
    if value == 0:
        raise argparse.ArgumentTypeError("expected seconds > 0 to wait for the daemon's answer, got 0")
    return value


def build_parser() -> argparse.ArgumentParser:
    from engramd.server.config import add_setting_flags

    parser = argparse.ArgumentParser(prog="engramd", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the daemon")
    serve.add_argument("--config", help="TOML config file (flags override its values)")
    serve.add_argument("--print-config", action="store_true", help="print the merged config and exit")
    serve.add_argument("--standby", action="store_true",
                       help="import and start CUDA now, then wait for the daemon on this socket to "
                            "exit and take over from it (server/standby.py)")
    add_setting_flags(serve)
    serve.set_defaults(func=cmd_serve)

    for name, func, text in (("health", cmd_health, "exit 0 when the daemon is ready, 1 otherwise"),
                             ("stats", cmd_stats, "clients, lookups, rows, errors"),
                             ("drain", cmd_drain, "stop accepting, finish in-flight lookups, exit"),
                             ("reload", cmd_reload, "serve the configured checkpoint's tables anew")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--socket", help=f"daemon socket (default: {default_socket_path()})")
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.add_argument("--timeout", type=answer_seconds, default=5.0,
                       help="seconds to wait for the daemon's answer (default: 5)")
        if name == "health":
            p.add_argument("--live", action="store_true",
                           help="exit 0 when the daemon answers at all (liveness), ready or not")
        if name == "reload":
            p.add_argument("--wait", type=seconds, default=3600.0,
                           help="seconds to follow the reload (0: only start it; default: 3600)")
        if name == "drain":
            p.add_argument("--wait", type=seconds, default=DRAIN_WAIT_S,
                           help=f"seconds to wait for the daemon's exit (default: {DRAIN_WAIT_S:.0f})")
        p.set_defaults(func=func)

    make = sub.add_parser("make-tables", help="write a synthetic Engram checkpoint")
    make.add_argument("--geometry", default="demo",
                      help="demo, v4.1-flash, or a config.json path (default: demo)")
    make.add_argument("--out", required=True, help="output folder")
    make.add_argument("--seed", type=seed, default=0, help="seed of the table values (default: 0)")
    make.set_defaults(func=cmd_make_tables)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        status = args.func(args)
        sys.stdout.flush()  # here, where a reader gone is caught, not at the interpreter's exit
        return status
    except BrokenPipeError:  # `engramd stats | head`: the reader left, which is no error of ours
        if args.func is cmd_serve:
            raise  # a daemon's is a fault to see, not a reader gone
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to flush at exit
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
