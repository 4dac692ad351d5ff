"""Which process a client belongs to. A child made by fork() inherits its parent's clients as
memory only: their connections' I/O threads, the watchdog and every lock a parent's thread held
at the fork stay behind, so a call there could wait for ever. The child's copy refuses instead.

A counter bumped in every child at the fork marks what a client or lookup was made before it:
one compare of two ints on each call, no system call.
"""

from __future__ import annotations

import os

from engramd.client.errors import BadRequestError

_forks = 0  # forks between this process's start and now, counted in the child


def _count_fork_in_child() -> None:
    global _forks
    _forks += 1


os.register_at_fork(after_in_child=_count_fork_in_child)


def generation() -> int:
    """This process's count of forks: what a client made now records, to tell a child later."""
    return _forks


def made_here(born: int) -> bool:
    return born == _forks


def check_made_here(born: int, what: str) -> None:
    """BadRequestError in a child for `what` made (`born`) before its fork."""
    if born != _forks:
        raise BadRequestError(
            f"{what} was made before this process was forked from its parent: its connection, "
            f"threads and locks stayed there; make a new EngramClient in this process")
