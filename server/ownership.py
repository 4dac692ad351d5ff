"""Folders the daemon trusts must be its own: checked before anything is created in them.

A local attacker who creates the daemon's runtime folder first (the non-root default is
/tmp/engramd-<uid>) could replace the socket and answer clients, or plant a symlink where the
lock file goes; one who creates the demo cache folder first could plant the tables. So such a
folder must be a real directory (not a symlink), owned by the daemon's user or by root, and
writable by no one else but its owner and group.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from engramd.client.errors import ConfigError

# The daemon's lock files (the socket's, the instance's) are its user's alone: flock needs no more
# than a descriptor, so a member of the folders' group (the engines' users) who could open one
# took it the moment the daemon let go, and no later daemon or standby could start.
LOCK_FILE_MODE = 0o600


def check_own_folder(path: Path, what: str) -> None:
    """Raise ConfigError naming `path` and its owner unless the daemon may trust it."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return  # the caller creates it
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"{what} {path} is not a directory (a symlink or a file is there); "
                          "remove it or choose another folder")
    if info.st_uid not in (os.geteuid(), 0):
        raise ConfigError(f"{what} {path} belongs to uid {info.st_uid}, not to this daemon's user "
                          f"({os.geteuid()}): someone else made it first; remove it or choose "
                          "another folder")
    if info.st_mode & stat.S_IWOTH and not info.st_mode & stat.S_ISVTX:
        raise ConfigError(f"{what} {path} is writable by every user (mode "
                          f"{stat.S_IMODE(info.st_mode):o}); make it 0750 or choose another folder")


def make_own_folder(path: Path, what: str, mode: int = 0o770) -> bool:
    """Create `path` (and its parents) for the daemon, or check the one that is there; whether
    it was made here."""
    check_own_folder(path, what)
    if path.exists():
        return False
    path.mkdir(mode=mode, parents=True, exist_ok=True)
    check_own_folder(path, what)  # a race may have put someone else's there meanwhile
    return True
