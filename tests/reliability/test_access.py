"""Access control: file modes decide who may talk to the daemon; credentials who may register.

The daemon (running as the test's user, root) makes its runtime folder 0750, its two sockets
0660 and its table files 0640, all owned by its own group; slabs have no name at all (they are
passed as descriptors). A process of another user outside that group must get nothing: no
connection (a permission error, or the client library's DaemonUnavailableError), no table bytes.
A member of the group is let in; that positive control shows the refusals come from the modes
and not from a broken test. With `allowed_uids`, a member whose uid is not listed is refused at
attach by its kernel credentials (SO_PEERCRED), with a typed error and nothing allocated.

The outsider is `nobody`. Its checks run two ways:
- `setpriv --reuid=nobody --regid=<nobody's group> --clear-groups` runs a stdlib-only script
  (socket connect, open of each file) with any Python interpreter `nobody` may execute;
- the client library itself runs in a process that starts as root, warms up (imports, one
  lookup), then drops to `nobody` with setgroups/setgid/setuid before connecting: the library
  may be installed where `nobody` cannot read it.

The test's temporary folders are created 0700 by tempfile; they are opened to 0755 here so that
only the modes of the runtime folder, the socket and the files themselves decide.

Skipped unless running as root with setpriv available.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from helpers import slab_files
from reference import random_ids

from engramd.client import EngramClient
from engramd.client.shared.connection import probe
from engramd.client.shared.handles import handle_socket_path

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                reason="needs root and setpriv to run a process as nobody")

OUTSIDER = "nobody"

PROBE = textwrap.dedent("""
    import errno, json, os, socket, sys
    out = {}
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(sys.argv[1])
        out["connect"] = "ok"
    except OSError as exc:
        out["connect"] = errno.errorcode.get(exc.errno, str(exc.errno))
    finally:
        s.close()
    for path in sys.argv[2:]:
        for mode, flags in (("r", os.O_RDONLY), ("rw", os.O_RDWR)):
            try:
                os.close(os.open(path, flags))
                out[path + ":" + mode] = "ok"
            except OSError as exc:
                out[path + ":" + mode] = errno.errorcode.get(exc.errno, str(exc.errno))
    print(json.dumps(out))
""")

CLIENT = textwrap.dedent("""
    import json, os, sys
    import numpy as np, torch
    from engramd.client import DaemonUnavailableError, EngramClient
    from engramd.client.errors import PermissionDeniedError
    socket, uid, gid, groups, ids = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]), np.array(json.loads(sys.argv[5]))
    with EngramClient(socket, max_tokens=len(ids), timeout=10) as warm:  # every lazy import, as root
        warm.lookup(torch.from_numpy(ids)).result()
    os.setgroups(groups)
    os.setgid(gid)
    os.setuid(uid)
    try:
        with EngramClient(socket, max_tokens=len(ids), timeout=2, reconnect_timeout=0) as client:
            rows = client.lookup(torch.from_numpy(ids)).result().float().numpy()
        print(json.dumps({"outcome": "rows", "rows": rows.tolist()}))
    except DaemonUnavailableError as exc:
        print(json.dumps({"outcome": "unavailable", "error": str(exc)}))
    except PermissionDeniedError as exc:
        print(json.dumps({"outcome": "refused", "error": str(exc)}))
    except PermissionError as exc:
        print(json.dumps({"outcome": "permission", "error": str(exc)}))
""")


def outsider_ids() -> tuple[int, int]:
    user = pwd.getpwnam(OUTSIDER)
    return user.pw_uid, user.pw_gid


def setpriv(groups: list[int] | None) -> list[str]:
    uid, gid = outsider_ids()
    group_flag = "--clear-groups" if not groups else f"--groups={','.join(map(str, groups))}"
    return ["setpriv", f"--reuid={uid}", f"--regid={gid}", group_flag]


def outsider_python() -> str:
    """An interpreter `nobody` may execute (the test's own may live in a private home)."""
    for candidate in (sys.executable, shutil.which("python3"), "/usr/bin/python3"):
        if candidate and subprocess.run([*setpriv(None), candidate, "-c", "import socket"],
                                        capture_output=True).returncode == 0:
            return candidate
    pytest.skip(f"no Python interpreter that {OUTSIDER} may execute")


def run_probe(socket: Path, files: list[Path], groups: list[int] | None) -> dict[str, str]:
    result = subprocess.run([*setpriv(groups), outsider_python(), "-c", PROBE, str(socket),
                             *map(str, files)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture
def served(daemon_factory):
    """A daemon with one registered client (so a slab exists), its folders opened to 0755."""
    daemon = daemon_factory()
    for folder in (daemon.workdir, daemon.shm_dir):
        os.chmod(folder, 0o755)
    with EngramClient(daemon.socket, max_tokens=4) as client:
        yield daemon, client


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_runtime_folder_sockets_and_tables_have_the_documented_modes(served):
    daemon, _ = served
    tables = sorted(daemon.tables_dir.glob("*.tbl"))
    assert len(tables) == 2 and not [p for p in daemon.tables_dir.iterdir() if p.suffix not in (".tbl", ".lock")]
    assert len(slab_files(daemon.proc.pid)) == 1  # the client's slab: a descriptor, not a file
    found = {"runtime folder": mode(daemon.socket.parent), "socket": mode(daemon.socket),
             "handle socket": mode(handle_socket_path(daemon.socket)),
             **{p.name: mode(p) for p in tables}}
    wanted = {"runtime folder": 0o750, "socket": 0o660, "handle socket": 0o660,
              **{p.name: 0o640 for p in tables}}
    assert found == wanted, {k: oct(v) for k, v in found.items()}


def test_outsider_cannot_connect_or_open_tables(served):
    daemon, _ = served
    files = sorted(daemon.tables_dir.glob("*.tbl"))
    for socket_path in (daemon.socket, handle_socket_path(daemon.socket)):
        denied = run_probe(socket_path, files, groups=None)
        assert denied == {"connect": "EACCES", **{f"{p}:{m}": "EACCES" for p in files for m in ("r", "rw")}}

    runtime = daemon.socket.parent
    os.chmod(runtime, 0o771)  # the folder may be passed: only the socket's own mode decides
    try:
        assert run_probe(daemon.socket, [], groups=None) == {"connect": "EACCES"}
        assert run_probe(handle_socket_path(daemon.socket), [], groups=None) == {"connect": "EACCES"}
    finally:
        os.chmod(runtime, 0o750)


def test_member_of_the_daemons_group_may_connect_and_read_tables(served):
    daemon, _ = served
    group = daemon.socket.stat().st_gid
    tables = sorted(daemon.tables_dir.glob("*.tbl"))
    allowed = run_probe(daemon.socket, tables, groups=[group])
    wanted = {"connect": "ok", **{f"{p}:r": "ok" for p in tables},
              **{f"{p}:rw": "EACCES" for p in tables}}  # tables are read-only for the group
    assert allowed == wanted


def run_client_as_outsider(daemon, ids: np.ndarray, groups: list[int]) -> dict:
    uid, gid = outsider_ids()
    result = subprocess.run([sys.executable, "-c", CLIENT, str(daemon.socket), str(uid), str(gid),
                             json.dumps(groups), json.dumps(ids.tolist())],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_outsider_client_gets_no_rows_and_a_member_gets_correct_ones(served, reference):
    daemon, _ = served
    ids = random_ids(np.random.default_rng(9), 4, reference.rows, reference.heads)
    outsider = run_client_as_outsider(daemon, ids, groups=[])
    assert outsider["outcome"] in ("unavailable", "permission"), outsider
    runtime = daemon.socket.parent
    os.chmod(runtime, 0o771)  # the socket path is visible; only the socket's mode refuses
    try:
        past_folder = run_client_as_outsider(daemon, ids, groups=[])
    finally:
        os.chmod(runtime, 0o750)
    assert past_folder["outcome"] in ("unavailable", "permission"), past_folder

    member = run_client_as_outsider(daemon, ids, groups=[daemon.socket.stat().st_gid])
    assert member["outcome"] == "rows", member
    rows = np.array(member["rows"], dtype=np.float64)
    wrong = np.argwhere(rows != reference.expected(ids))
    assert wrong.size == 0, f"{len(wrong)} wrong values, first at {wrong[:5].tolist()}"
    assert len(slab_files(daemon.proc.pid)) == 1, "the member released its slab"


def test_member_whose_uid_is_not_allowed_is_refused_at_attach(daemon_factory, reference):
    """allowed_uids = root only: the group lets `nobody` connect, its credentials do not let it
    register; it gets a typed error and the daemon allocates nothing for it."""
    daemon = daemon_factory(extra=["--allowed-uids", "0"])
    for folder in (daemon.workdir, daemon.shm_dir):
        os.chmod(folder, 0o755)
    ids = random_ids(np.random.default_rng(10), 4, reference.rows, reference.heads)
    refused = run_client_as_outsider(daemon, ids, groups=[daemon.socket.stat().st_gid])
    assert refused["outcome"] == "refused" and "may not use this daemon" in refused["error"], refused
    assert not slab_files(daemon.proc.pid)
    stats = probe(daemon.socket, "stats", 5.0).body.encode()
    assert stats["clients"] == [] and stats["errors"].get("permission_denied") == 1, stats


ZMQ_AS = textwrap.dedent("""
    import json, os, sys
    import msgpack, zmq
    from engramd.client.shared.connection import probe
    from engramd.client.errors import EngramError
    from engramd.client.shared.protocol import PROTOCOL_VERSION
    socket, uid, gid, groups = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
    os.setgroups(groups)
    os.setgid(gid)
    os.setuid(uid)
    peer = zmq.Context.instance().socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect(f"ipc://{socket}")
    peer.send(msgpack.packb({"v": PROTOCOL_VERSION, "op": "health", "rid": 1}))
    raw = "answered" if peer.poll(3000) else "silent"
    peer.close(0)
    try:
        probed = "ready" if probe(socket, "health", 3.0).body.ready else "not ready"
    except EngramError as exc:
        probed = exc.code
    print(json.dumps({"raw": raw, "probe": probed}))
""")


def zmq_as_outsider(daemon, groups: list[int]) -> dict:
    uid, gid = outsider_ids()
    result = subprocess.run([sys.executable, "-c", ZMQ_AS, str(daemon.socket), str(uid), str(gid),
                             json.dumps(groups)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_with_allowed_ids_the_zeromq_socket_is_closed_to_everyone_else(daemon_factory):
    """A member of the socket's group whose uid is not allowed used to reach the request loop
    (floods, a huge message, `stats` naming every client). libzmq now drops its connection at
    accept, by its kernel credentials: a raw request gets no answer at all, and `probe` says why
    (permission_denied, from the handle socket). Allowing its group lets the same process in."""
    outsider_gid = outsider_ids()[1]
    for allowed, wanted in (("--allowed-uids", {"raw": "silent", "probe": "permission_denied"}),
                            ("--allowed-gids", {"raw": "answered", "probe": "ready"})):
        value = "0" if allowed == "--allowed-uids" else str(outsider_gid)
        daemon = daemon_factory(extra=[allowed, value])
        for folder in (daemon.workdir, daemon.shm_dir):
            os.chmod(folder, 0o755)
        seen = zmq_as_outsider(daemon, groups=[daemon.socket.stat().st_gid])
        assert seen == wanted, (allowed, seen)
        assert probe(daemon.socket, "health", 5.0).body.ready  # the daemon's own user passes
        assert daemon.stop() == 0, daemon.log()
