"""Wall time inside named functions over a profiled cell's steps: the third pass of
common/cell_profile.py.

cProfile slows every Python call alike, so a step that is host-bound only by a few hundred
microseconds reads the same under it whatever holds it back (the vLLM plugin's decode step and
vLLM's took 35 ms each for 20 steps under cProfile, and 1.16 and 0.78 ms a step unprofiled). Here only the
named functions are wrapped, each with two clock reads (well under a microsecond a call), so the
step runs at nearly its own speed and each function's inclusive time, a wait for a lock or the
GIL inside it included, is what it costs the step.

A target is "module:Owner.name" or "module:name" (a function, a method, a staticmethod); one
that does not resolve is reported, not fatal (an engine variant without the plugin has none of
its functions). Only calls on the thread that opened the timers count (the step's); a function
that calls itself counts once, at its outermost call. The originals are back on exit.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

_MISSING = object()


@dataclass
class _Timer:
    target: str
    owner: object
    name: str
    raw: object  # the attribute as found in the owner's __dict__ (_MISSING: inherited)
    calls: int = 0
    ns: int = 0
    depth: int = field(default=0, repr=False)


class WallTimers:
    """`with WallTimers(targets) as timers: ...steps...`; then `timers.report(steps, step_ns)`."""

    def __init__(self, targets: Sequence[str]):
        self.targets = tuple(targets)
        self.timers: list[_Timer] = []
        self._installed: list[_Timer] = []  # wrapped now, put back on exit
        self.unresolved: list[str] = []
        self._thread: threading.Thread | None = None

    def __enter__(self) -> WallTimers:
        self._thread = threading.current_thread()
        try:
            for target in self.targets:
                self._install(target)
        except BaseException:  # what was wrapped so far is put back
            self.__exit__()
            raise
        return self

    def _install(self, target: str) -> None:
        found = _resolve(target)
        if found is None:
            self.unresolved.append(target)
            return
        owner, name = found
        raw = inspect.getattr_static(owner, name)
        if not inspect.isfunction(raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw):
            self.unresolved.append(f"{target} (not a function)")  # a property, a builtin: left alone
            return
        timer = _Timer(target, owner, name, vars(owner).get(name, _MISSING))
        setattr(owner, name, self._wrap(timer, raw))
        self.timers.append(timer)
        self._installed.append(timer)

    def __exit__(self, *exc_info) -> None:
        installed, self._installed = self._installed, []
        for timer in reversed(installed):  # the last wrapped first: one owner's name twice unwinds
            if timer.raw is _MISSING:
                delattr(timer.owner, timer.name)
            else:
                setattr(timer.owner, timer.name, timer.raw)

    def _wrap(self, timer: _Timer, raw):
        if isinstance(raw, (staticmethod, classmethod)):
            return type(raw)(self._timed(timer, raw.__func__))
        return self._timed(timer, raw)

    def _timed(self, timer: _Timer, function: Callable) -> Callable:
        thread = self._thread

        @functools.wraps(function)
        def timed(*args, **kwargs):
            if timer.depth or threading.current_thread() is not thread:
                return function(*args, **kwargs)
            timer.depth = 1
            started = time.perf_counter_ns()
            try:
                return function(*args, **kwargs)
            finally:
                timer.ns += time.perf_counter_ns() - started
                timer.calls += 1
                timer.depth = 0
        return timed

    def report(self, steps: int, step_ns: int) -> str:
        """The functions by inclusive wall time per step, beside the steps' own wall time."""
        lines = [f"Wall time inside functions ({steps} steps, {step_ns / steps / 1e3:.1f} us a step "
                 "in all, inclusive: a function's callees and waits are in its time):",
                 f"{'us/step':>9} {'calls/step':>10} {'us/call':>8}  function"]
        for timer in sorted(self.timers, key=lambda t: -t.ns):
            if timer.calls:
                lines.append(f"{timer.ns / steps / 1e3:9.1f} {timer.calls / steps:10.1f} "
                             f"{timer.ns / timer.calls / 1e3:8.1f}  {timer.target}")
        never = [t.target for t in self.timers if not t.calls]
        if never:
            lines.append("not called: " + ", ".join(never))
        if self.unresolved:
            lines.append("not found: " + ", ".join(self.unresolved))
        return "\n".join(lines) + "\n"


def _resolve(target: str) -> tuple[object, str] | None:
    """(owner, attribute name) of "module:Owner.name", or None where any part is missing."""
    module_name, _, path = target.partition(":")
    try:
        owner: object = importlib.import_module(module_name)
    except ImportError:
        return None
    *owners, name = path.split(".")
    for part in owners:
        owner = getattr(owner, part, None)
        if owner is None:
            return None
    try:
        inspect.getattr_static(owner, name)
    except AttributeError:
        return None
    return owner, name
