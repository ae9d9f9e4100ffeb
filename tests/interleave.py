"""Deterministic preemption of real threads at Python-event granularity.

``frontrun`` (DPOR) schedules threads at the operations it instruments; a check-then-act split
by a plain Python call (read a lock's state, then acquire it) is not among them, and a
real-thread race at a 1 µs switch interval depends on the machine's load to be seen. This
explorer does not: two real threads run the same object's code, and the *first* is stopped,
for each ``k`` in turn, at its ``k``-th *scheduling point* — every ``line`` and ``return``
event of a frame whose code is in this repository's ``sender/``, ``staging/`` or
``stress/harness/`` packages (the harness's decode peer is explored too)
(a ``return`` event comes after the returned value was computed, so stopping there splits a
call from whatever its caller does next). While the first thread is stopped the second runs
to its end; then the first finishes. ``k = 0`` runs the second thread first. That is every
schedule with one preemption of the first thread, at every point of the library's code it
passes, in an order that does not depend on the machine.

The second thread may need something the stopped first thread holds (a lock taken before the
point): it is then given ``block_s`` seconds, after which the first is released and both
finish concurrently. That schedule is still a legal one, so a property that fails there is a
real violation; the count of such schedules is reported (``blocked``).

Used by the claim, poll/release, close/open_room and sweep checks (docs/THREADING.md, the
guarantee table); not a test module.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Generic, TypeVar

ROOT = Path(__file__).resolve().parents[1]
TRACED_DIRS = tuple(
    str(ROOT.joinpath(*parts)) + os.sep
    for parts in (("sender",), ("staging",), ("stress", "harness"))
)
"""Frames whose code file is under one of these are traced (the library's own code and the
harness's decode peer)."""

T = TypeVar("T")

Tracer = Callable[[FrameType, str, Any], Any]


class _Stopper:
    """Counts one thread's scheduling points and stops it at the ``stop_at``-th (``None``:
    never), until :meth:`resume` or ``wait_s`` seconds (then :func:`explore`'s join reports
    the deadlock). ``traced``: the code files (prefixes) whose frames have points."""

    def __init__(
        self, stop_at: int | None, wait_s: float = 60.0, traced: tuple[str, ...] = TRACED_DIRS
    ) -> None:
        self.stop_at = stop_at
        self._traced = traced
        self._wait_s = wait_s
        self.points = 0
        self.stopped = threading.Event()
        self._resume = threading.Event()

    def resume(self) -> None:
        self._resume.set()

    def tracer(self) -> Tracer:
        def local(frame: FrameType, event: str, arg: Any) -> Tracer | None:
            if event in ("line", "return"):
                self.points += 1
                if self.points == self.stop_at:
                    self.stopped.set()
                    self._resume.wait(self._wait_s)
            return local

        def global_(frame: FrameType, event: str, arg: Any) -> Tracer | None:
            if frame.f_code.co_filename.startswith(self._traced):
                return local
            return None

        return global_


@dataclass
class Exploration:
    """What :func:`explore` ran and found."""

    points: int
    """Scheduling points of the first thread run alone (so ``points + 1`` schedules)."""
    schedules: int = 0
    blocked: int = 0
    """Schedules whose second thread waited ``block_s`` for the stopped first one."""
    failures: list[tuple[int, str]] = field(default_factory=list)
    """``(k, why)`` for every schedule whose check failed or whose thread raised."""


class _Runner(Generic[T]):
    def __init__(self, target: Callable[[T], object], obj: T, stopper: _Stopper | None) -> None:
        self.error: BaseException | None = None
        self._target, self._obj, self._stopper = target, obj, stopper
        self.thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        if self._stopper is not None:
            sys.settrace(self._stopper.tracer())
        try:
            self._target(self._obj)
        except BaseException as exc:  # reported by explore
            self.error = exc
        finally:
            sys.settrace(None)


def _join(runner: _Runner[Any], timeout_s: float, what: str) -> None:
    runner.thread.join(timeout_s)
    if runner.thread.is_alive():
        raise AssertionError(f"{what} did not finish within {timeout_s:g} s")


def from_asserts(holds: Callable[[T], object]) -> Callable[[T], str | None]:
    """A ``check`` for :func:`explore` from an invariant that asserts (as the frontrun rigs'
    ``holds`` do): the assertion's message, or ``None``."""

    def check(obj: T) -> str | None:
        try:
            holds(obj)
        except AssertionError as exc:
            return str(exc) or "assertion failed"
        return None

    return check


def explore(
    setup: Callable[[], T],
    first: Callable[[T], object],
    second: Callable[[T], object],
    check: Callable[[T], str | None],
    *,
    block_s: float = 2.0,
    join_s: float = 60.0,
    max_points: int = 5_000,
    stop_on_first: bool = False,
) -> Exploration:
    """Run ``first`` and ``second`` on a fresh ``setup()`` object in every single-preemption
    schedule (module docstring); ``check(obj)`` returns ``None`` or why the property failed.

    ``stop_on_first``: stop at the first failing schedule (a planted bug's check).

    Raises:
        AssertionError: a thread did not finish within ``join_s`` (a deadlock), or the
            first thread passes more than ``max_points`` scheduling points.
    """
    dry = setup()
    counter = _Stopper(None)
    alone = _Runner(first, dry, counter)
    alone.thread.start()
    _join(alone, join_s, "the first thread run alone")
    if alone.error is not None:
        raise alone.error
    if counter.points > max_points:
        raise AssertionError(f"{counter.points} scheduling points (max {max_points})")
    result = Exploration(points=counter.points)
    for k in range(counter.points + 1):
        obj = setup()
        stopper = _Stopper(k if k > 0 else None, join_s)
        a = _Runner(first, obj, stopper)
        b = _Runner(second, obj, None)
        if k == 0:
            b.thread.start()
            _join(b, join_s, "the second thread")
            a.thread.start()
            _join(a, join_s, "the first thread")
        else:
            a.thread.start()
            deadline = time.monotonic() + join_s
            while not stopper.stopped.wait(0.01):  # stopped at its k-th point, or ended
                if not a.thread.is_alive():
                    break
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"the first thread neither stopped nor ended in {join_s:g} s"
                    )
            b.thread.start()
            b.thread.join(block_s)
            if b.thread.is_alive():
                result.blocked += 1
            stopper.resume()
            _join(a, join_s, "the first thread")
            _join(b, join_s, "the second thread")
        result.schedules += 1
        errors = [f"{name} raised {r.error!r}" for name, r in (("first", a), ("second", b))
                  if r.error is not None]  # fmt: skip
        why = "; ".join(errors) or check(obj)
        if why:
            result.failures.append((k, why))
            if stop_on_first:
                break
    return result
