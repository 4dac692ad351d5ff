"""What the daemon does before it imports torch: its runtime folder, its socket lock, and the
exit statuses that say why it stopped.

`engramd serve` takes the lock first, then starts the table preload (table_loader.TablePreload),
and only then imports the daemon (torch, the backends): a second daemon on the same socket
must never touch the first one's tables. A standby (server/standby.py) imports first and then
waits for the lock, meanwhile only reading (mapping, pinning) the tables the serving daemon
serves: it writes, creates or removes no table file until it holds the lock.
"""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

from engramd.client.errors import ConfigError
from engramd.client.shared.handles import handle_socket_path
from engramd.client.shared.libc import filesystem_type
from engramd.server.config import DaemonConfig
from engramd.server.ownership import LOCK_FILE_MODE, make_own_folder

log = logging.getLogger("engramd.daemon")

# Named exit codes (sysexits.h values, so that service managers show something meaningful).
EXIT_OK = 0
EXIT_TABLES = 66  # EX_NOINPUT: checkpoint or table files unusable
EXIT_INTERNAL = 70  # EX_SOFTWARE
EXIT_SOCKET_IN_USE = 73  # EX_CANTCREAT: another daemon holds the socket
EXIT_DEVICE = 69  # EX_UNAVAILABLE: the requested device backend cannot start
EXIT_CONFIG = 78  # EX_CONFIG

RUNTIME_DIR_MODE = 0o750
# How often a standby tries the lock: the longest a takeover waits after the holder's death.
# A failed flock is one system call; 20 a second cost nothing.
STANDBY_POLL_S = 0.05

# statfs(2) magic numbers: the filesystems shm_dir is meant for, and the disks it is most often
# put on by mistake (named in the warning; others by their number).
TMPFS_MAGIC = 0x01021994
HUGETLBFS_MAGIC = 0x958458F6
DISK_FILESYSTEMS = {0xEF53: "ext2/3/4", 0x58465342: "xfs", 0x9123683E: "btrfs",
                    0x794C7630: "overlayfs", 0x6969: "nfs", 0x2FC12FC1: "zfs",
                    0x65735546: "fuse", 0x01021997: "9p"}


# Fault injection for tests and drills: seconds to stall before the daemon's modules are
# imported, so that a signal can be sent during a start. Never set in production.
START_DELAY_ENV = "ENGRAMD_DEBUG_START_DELAY_S"


def injected_start_delay(early: EarlySignals) -> None:
    """The stall, cut short by a stop signal kept meanwhile."""
    delay = float(os.environ.get(START_DELAY_ENV, "0") or 0)
    if delay > 0:
        log.warning("%s=%s: stalling before the daemon's imports", START_DELAY_ENV, delay)
    deadline = time.monotonic() + delay
    while time.monotonic() < deadline and early.received is None:
        time.sleep(0.05)


class EarlySignals:
    """SIGTERM and SIGINT before the daemon listens (config, lock, imports): kept, for the daemon
    to act on once its own handlers are in (Daemon.start: a stop, exit 0), not the default
    action, which ended the process by the signal (status 143, no log line, the lock file
    left). `install()` again after anything that set other handlers meanwhile (a standby)."""

    def __init__(self) -> None:
        self.received: int | None = None

    def install(self) -> EarlySignals:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self.keep)
        return self

    def keep(self, signum: int, _frame: object = None) -> None:
        if self.received is None:
            self.received = signum


class DaemonHalt(Exception):
    """Stops the daemon with an exit status and a reason."""

    def __init__(self, reason: str, status: int):
        super().__init__(reason)
        self.reason = reason
        self.status = status


FOLDER_LOCK_GRACE_S = 1.0


class SocketLock:
    """Flocks beside the socket, released by the kernel on death: one daemon per socket path,
    and one per folder (its handle socket, engramd.handles, has the one name in every folder:
    a second daemon there would replace the first one's)."""

    def __init__(self, socket_path: Path):
        self.path = socket_path.with_name(socket_path.name + ".lock")
        handles = handle_socket_path(socket_path)
        self.folder_path = handles.with_name(handles.name + ".lock")
        self._fd: int | None = None
        self._folder_fd: int | None = None

    def acquire(self, stop: threading.Event | None = None,
                on_held: Callable[[str], None] | None = None,
                on_poll: Callable[[], None] | None = None) -> None:
        """Take the lock. Held by another engramd: DaemonHalt, or, with `stop` (a standby), try
        again every STANDBY_POLL_S until it is free (`on_held(holder pid)` is told once, and
        `on_poll()` at every try) or `stop` is set (DaemonHalt with EXIT_OK)."""
        fd = _open_lock(self.path)
        told = False
        while True:
            if stop is not None and stop.is_set():
                os.close(fd)
                raise DaemonHalt("stopped while standing by", EXIT_OK)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            if stop is None:
                os.close(fd)
                raise DaemonHalt(f"socket {self.path.with_suffix('')} is in use by another engramd "
                                 f"(pid {holder}, lock {self.path})", EXIT_SOCKET_IN_USE) from None
            if not told and on_held is not None:
                on_held(holder)
                told = True
            if on_poll is not None:
                on_poll()
            stop.wait(STANDBY_POLL_S)
        self._fd = fd
        # A standby that took the socket's lock from a killed daemon may find the folder's not let
        # go yet: the kernel closes a dead process's files one by one.
        self._take_folder(FOLDER_LOCK_GRACE_S if stop is not None else 0.0)
        _write_pid(fd)  # only once both are ours: a refused start leaves no pid of its own

    def _take_folder(self, grace: float) -> None:
        """The folder's lock, once the socket's is ours, waiting up to `grace` seconds for it:
        held by a daemon of another socket in this folder, DaemonHalt (a configuration error),
        and the socket's lock let go."""
        try:
            fd = _open_lock(self.folder_path)
        except DaemonHalt:
            self.release()
            raise
        deadline = time.monotonic() + grace
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() < deadline:
                    time.sleep(0.01)
                    continue
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            self.release()
            raise DaemonHalt(
                f"another engramd (pid {holder}, lock {self.folder_path}) serves a socket in "
                f"{self.folder_path.parent}: one daemon a folder, since each one's handle socket "
                f"is {self.folder_path.with_suffix('').name} there; give this daemon's socket a "
                "folder of its own", EXIT_CONFIG) from None
        _write_pid(fd)
        self._folder_fd = fd

    def release(self) -> None:
        for fd in (self._folder_fd, self._fd):
            if fd is not None:
                os.close(fd)
        self._fd = self._folder_fd = None


def _open_lock(path: Path) -> int:
    try:  # never through a symlink planted where the lock goes (it would overwrite its target)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, LOCK_FILE_MODE)
    except OSError as exc:
        raise DaemonHalt(f"cannot open the lock file {path}: {exc.strerror} (a symlink or a "
                         "folder there? remove it)", EXIT_CONFIG) from None
    try:
        os.fchmod(fd, LOCK_FILE_MODE)  # one made by an earlier version was the group's too
    except OSError as exc:
        os.close(fd)
        raise DaemonHalt(f"cannot set the lock file {path}'s mode: {exc.strerror} (another "
                         "user's? remove it)", EXIT_CONFIG) from None
    return fd


def _write_pid(fd: int) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)


def prepare_runtime_dir(path: Path) -> None:
    """Create the runtime folder 0750 (its group may reach the sockets, 0660, but not replace
    them: connecting needs write permission on a socket, not on its folder), or check that
    the one there is ours; DaemonHalt naming it and its owner otherwise."""
    try:
        made = make_own_folder(path, "runtime folder", mode=RUNTIME_DIR_MODE)
    except ConfigError as exc:
        raise DaemonHalt(exc.message, EXIT_CONFIG) from None
    info = os.lstat(path)
    if info.st_uid != os.geteuid() or info.st_mode & stat.S_ISVTX:
        return  # root's, or a shared sticky folder: not ours to change
    if made:
        os.chmod(path, RUNTIME_DIR_MODE)  # mkdir met the umask
        return
    # A folder that was there (/run, or the working folder for a relative socket path) is
    # someone's choice: its group and others keep what they may read and enter (the mode was
    # set to 0750, locking every other user out of /run). Only the write that would let the
    # group replace a socket goes.
    if info.st_mode & 0o022:
        narrowed = stat.S_IMODE(info.st_mode) & ~0o022
        log.warning("runtime folder %s: mode %o lets its group replace the sockets; made it %o",
                    path, stat.S_IMODE(info.st_mode), narrowed)
        os.chmod(path, narrowed)


def check_folders(config: DaemonConfig) -> None:
    """The folders the settings name, before the lock, the preload and the heavy imports: a
    typo is then reported at once, naming its setting (DaemonHalt with EXIT_CONFIG), not as a
    missing file seconds after the daemon said it was listening."""
    try:
        check_socket_path(config.socket_path)
        check_tables_folder(config.tables)
        check_shm_dir(Path(config.shm_dir))
    except ConfigError as exc:
        raise DaemonHalt(exc.message, EXIT_CONFIG) from None


# What a Unix socket's path may hold (sockaddr_un.sun_path, less its terminating NUL), on Linux.
UNIX_PATH_MAX = 107


def check_socket_path(path: Path) -> None:
    """ConfigError unless both sockets the daemon binds there fit a Unix socket's path: the
    ZeroMQ socket, and the handle socket beside it, whose name is 3 bytes longer. One too long
    was bound, or not, and the start died with a traceback after taking the lock."""
    longest = max((path, handle_socket_path(path)), key=lambda p: len(os.fsencode(p)))
    if len(os.fsencode(longest)) > UNIX_PATH_MAX:
        raise ConfigError(f"socket = {str(path)!r}: {longest} is {len(os.fsencode(longest))} "
                          f"bytes, more than a Unix socket's path holds ({UNIX_PATH_MAX}); "
                          "choose a shorter socket path")
    for bound in (path, handle_socket_path(path)):
        check_nothing_but_a_socket(bound, path)


def check_nothing_but_a_socket(bound: Path, setting: Path) -> None:
    """ConfigError if something other than a socket (a dead daemon's, which the start replaces)
    is at `bound`: the start would delete a user's file there, or fail on a folder."""
    try:
        mode = os.lstat(bound).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ConfigError(f"socket = {str(setting)!r}: cannot look at {bound}: {exc.strerror}") from None
    if not stat.S_ISSOCK(mode):
        kind = "a folder" if stat.S_ISDIR(mode) else "a symlink" if stat.S_ISLNK(mode) else "a file"
        raise ConfigError(f"socket = {str(setting)!r}: {bound} is {kind}, not a socket; the daemon "
                          "would replace it: remove it or choose another socket path")


def check_tables_folder(tables: str) -> None:
    """ConfigError unless `tables` is "demo" or a folder (what is in it is the checkpoint's
    to check: a broken checkpoint is a tables error, EXIT_TABLES)."""
    path = Path(tables)
    if tables == "demo" or path.is_dir():
        return
    what = "is not a folder" if path.exists() else "does not exist"
    raise ConfigError(f"tables = {tables!r}: the checkpoint folder {path.absolute()} {what} "
                      "(a folder with config.json and safetensors shards, or \"demo\" for the "
                      "built-in demo table)")


def check_shm_dir(shm_dir: Path) -> None:
    """ConfigError when shm_dir's parent is missing, a warning when it is not on tmpfs or
    hugetlbfs. The daemon creates shm_dir itself (a folder in a mount, such as
    /dev/hugepages/engramd), so a typo was made, parents and all, on whatever disk it named."""
    parent = shm_dir.absolute().parent
    if not parent.is_dir():
        raise ConfigError(f"shm_dir = {str(shm_dir)!r}: its parent folder {parent} does not "
                          "exist (the daemon creates shm_dir, not the folders above it); shm_dir "
                          "belongs on tmpfs (/dev/shm) or hugetlbfs")
    if shm_dir.exists() and not shm_dir.is_dir():
        raise ConfigError(f"shm_dir = {str(shm_dir)!r} is a file, not a folder: the tables go in "
                          "a folder of their own there (on tmpfs, /dev/shm, or hugetlbfs)")
    try:
        kind = filesystem_type(shm_dir if shm_dir.exists() else parent)
    except OSError:
        return  # what is wrong there is reported where the table folder is made
    if kind not in (TMPFS_MAGIC, HUGETLBFS_MAGIC):
        name = DISK_FILESYSTEMS.get(kind, f"a filesystem of type {kind:#x}")
        log.warning("shm_dir %s is on %s, not tmpfs or hugetlbfs: the tables are written to it, "
                    "and what memory evicts is read back from it, so loads and lookups can wait "
                    "on it (a mistyped --shm-dir? /dev/shm is tmpfs)", shm_dir, name)
