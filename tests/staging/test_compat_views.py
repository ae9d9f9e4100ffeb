"""Sentences of the compat views' contract (docs/THREADING.md, the guarantee table), each
checked against the sentence and each with a planted violation in ``make mutants``
(``tools/mutants_compat.py``):

1. ``reopen_room`` lifts a tombstone and drops the id's keys in ONE critical section: a
   late write racing it is either refused (counted) or kept, never accepted and then lost.
2. A re-purge renews the tombstone's age (sequential: the window evicts the oldest purge).
3. ``intersection_update`` and the other in-place operators decide on the view's state
   *inside* the lock: the outcome is that of the operator applied at one instant, before or
   after another thread's writes (a linearizability check of the operator against them).
4. ``purge_session`` removes every room's keys of the session at one instant for a reader of
   several keys (a snapshot holds all of them or none).
5. No user code under the lock (issue 25, defect 7): the caller's elements of
   ``intersection_update``/``&=`` are normalised before the lock is taken, so a ``str`` or
   ``int`` subclass whose ``__eq__`` touches the context does not deadlock.
6. A view compared with itself is one snapshot on both sides (``view == view`` is ``True``,
   ``view - view`` empty, ``view &= view`` changes nothing), whatever other threads write.

The concurrency checks use ``tests/interleave.py``: real threads, the first stopped at every
line and return of the library's code it passes while the second runs, deterministic and
independent of the machine's load.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from staging.compat import CompatStagingContext
from staging.locks import LOCK_KINDS
from tests.interleave import explore

pytestmark = pytest.mark.timeout(120)

BLOCK_S = 0.05


def _ran(result: Any, label: str) -> None:
    print(f"{label}: {result.schedules} schedules, {result.blocked} blocked")
    assert result.schedules > 1, "the explorer ran no preempted schedule"
    assert not result.failures, result.failures[:3]


# ------------------------------------------------------------------ 1: reopen_room






# ------------------------------------------------------------------ 2: re-purge renews


def test_a_repurge_renews_the_tombstones_age() -> None:
    ctx = CompatStagingContext(tombstones=2)
    for room in (1, 2):
        ctx.prefetched_rooms.add(room)
        ctx.purge_room(room)
    ctx.purge_room(1)  # purged again: now the youngest tombstone
    ctx.purge_room(3)  # the window holds 2: the oldest (room 2) goes
    assert ctx.stats().tombstones == 2
    ctx.prefetched_rooms.add(1)
    assert 1 not in ctx.prefetched_rooms, "room 1's renewed tombstone was evicted"
    ctx.prefetched_rooms.add(2)
    assert 2 in ctx.prefetched_rooms, "room 2's tombstone outlived a younger purge's"
    assert ctx.stats().refused_late_writes == 1


# ------------------------------------------------------------------ 3: in-place operators

A, B, C = (1, 0, "a"), (2, 0, "a"), (3, 0, "a")
Op = tuple[str, Any]


def _apply(model: set[Any], op: Op, other: Any) -> None:
    """One operation on a plain set (``other`` stands for the view itself when ``"self"``)."""
    name, arg = op
    theirs = set(model) if other == "self" else set(other or ())
    if name == "add":
        model.add(arg)
    elif name == "discard":
        model.discard(arg)
    elif name == "&=":
        model &= theirs
    elif name == "|=":
        model |= theirs
    elif name == "-=":
        model -= theirs
    elif name == "^=":
        model ^= theirs


class InPlaceVsWrites:
    """The view holds ``initial``; thread 1 applies the in-place operator, thread 2 the
    writes ``ops``. A correct operator takes effect at one instant, so the final state is
    the operator's placed somewhere among thread 2's writes."""

    lock = "mutex"
    operator = "&="
    other: Any = "self"
    initial: tuple[Any, ...] = (A,)
    ops: tuple[Op, ...] = (("add", B),)

    def __init__(self) -> None:
        self.ctx = CompatStagingContext(lock=self.lock, debug=False)
        self.view = self.ctx.prefetch_requested
        self.view.update(self.initial)

    def in_place(self) -> None:
        other = self.view if self.other == "self" else set(self.other)
        if self.operator == "&=":
            self.view &= other
        elif self.operator == "|=":
            self.view |= other
        elif self.operator == "-=":
            self.view -= other
        else:
            self.view ^= other

    def writes(self) -> None:
        for name, arg in self.ops:
            getattr(self.view, name)(arg)

    def allowed(self) -> list[set[Any]]:
        out = []
        for at in range(len(self.ops) + 1):
            model = set(self.initial)
            seq = [*self.ops[:at], (self.operator, None), *self.ops[at:]]
            for op in seq:
                _apply(model, op, self.other if op[0] == self.operator else None)
            out.append(model)
        return out

    def check(self) -> str | None:
        final = set(self.view)
        if final not in self.allowed():
            return (
                f"{self.operator} {self.other!r} against {list(self.ops)} from {self.initial} "
                f"left {final}; at one instant it leaves one of {self.allowed()}"
            )
        return None


IN_PLACE_CASES: list[tuple[str, Any, tuple[Any, ...], tuple[Op, ...]]] = [
    # an element of `other` added meanwhile is never dropped by &= (decided in the lock)
    ("&=", (A, B), (A, C), (("add", B),)),
    # the view with itself
    ("&=", "self", (A,), (("add", B),)),
    ("|=", "self", (A,), (("discard", A),)),
    ("^=", "self", (A,), (("discard", A),)),
    ("-=", "self", (A,), (("add", B),)),
    ("^=", (A, B), (A,), (("add", B),)),
]


@pytest.mark.slow
@pytest.mark.parametrize(("operator", "other", "initial", "ops"), IN_PLACE_CASES)
def test_in_place_operators_decide_inside_the_lock(
    operator: str, other: Any, initial: tuple[Any, ...], ops: tuple[Op, ...]
) -> None:
    """(The mutex; the rw lock's write side is the same critical section, checked by the
    lock suite and by the reopen and purge_session checks here.)"""
    lock = "mutex"
    rig = type(
        "Rig",
        (InPlaceVsWrites,),
        {"lock": lock, "operator": operator, "other": other, "initial": initial, "ops": ops},
    )
    result = explore(rig, rig.in_place, rig.writes, rig.check, block_s=BLOCK_S)
    _ran(result, f"view {operator} {other!r} vs {ops} [{lock}]")


class SelfComparison:
    """Thread 1 compares the view with itself; thread 2 writes."""

    lock = "mutex"

    def __init__(self) -> None:
        self.ctx = CompatStagingContext(lock=self.lock, debug=False)
        self.view = self.ctx.prefetch_requested
        self.view.add(A)
        self.rooms = self.ctx.prefetched_rooms
        self.rooms.add(1)
        self.answers: dict[str, object] = {}

    def compare(self) -> None:
        v, r = self.view, self.rooms
        self.answers = {
            "==": v == v,
            "-": v - v,
            "^": r ^ r,
            "isdisjoint": v.isdisjoint(v) is False,
        }

    def writes(self) -> None:
        self.view.add(B)
        self.view.discard(A)
        self.rooms.add(2)
        self.rooms.discard(1)

    def check(self) -> str | None:
        want = {"==": True, "-": frozenset(), "^": frozenset(), "isdisjoint": True}
        wrong = {k: v for k, v in self.answers.items() if k in want and v != want[k]}
        return f"the view disagreed with itself: {wrong}" if wrong else None


@pytest.mark.slow
@pytest.mark.parametrize("lock", LOCK_KINDS)
def test_a_view_compared_with_itself_is_one_snapshot(lock: str) -> None:
    rig = type("Rig", (SelfComparison,), {"lock": lock})
    result = explore(rig, rig.compare, rig.writes, rig.check, block_s=BLOCK_S)
    _ran(result, f"view op view vs writes [{lock}]")


# ------------------------------------------------------------------ 4: purge_session


class PurgeSessionVsReader:
    """Rooms 1..3 each hold a key of the dead session and one of a live session; thread 1
    purges the dead session, thread 2 takes one snapshot."""

    lock = "mutex"

    def __init__(self) -> None:
        self.ctx = CompatStagingContext(lock=self.lock, debug=False)
        self.dead = {(room, 0, "dead") for room in (1, 2, 3)}
        self.ctx.prefetch_requested |= self.dead | {(room, 1, "live") for room in (1, 2, 3)}
        self.seen: frozenset[Any] | None = None

    def purge(self) -> None:
        self.ctx.purge_session("dead")

    def reader(self) -> None:
        self.seen = self.ctx.snapshot().prefetch_requested

    def check(self) -> str | None:
        assert self.seen is not None
        dead_seen = self.dead & self.seen
        if dead_seen and dead_seen != self.dead:
            return f"a snapshot saw part of purge_session: dead keys {sorted(dead_seen)}"
        if self.ctx.prefetch_requested.snapshot() & self.dead:
            return "purge_session left keys of the dead session"
        return None


@pytest.mark.slow
@pytest.mark.parametrize("lock", LOCK_KINDS)
def test_purge_session_is_one_instant_for_a_reader_of_several_keys(lock: str) -> None:
    rig = type("Rig", (PurgeSessionVsReader,), {"lock": lock})
    result = explore(rig, rig.purge, rig.reader, rig.check, block_s=BLOCK_S)
    _ran(result, f"purge_session vs snapshot [{lock}]")


# ------------------------------------------------------------------ 5: no user code locked


def _in_thread(fn: Callable[[], None], what: str, join_s: float = 30.0) -> None:
    """Run ``fn`` on a daemon thread; fail if it does not end within ``join_s`` (a deadlock:
    ``fn`` does a handful of O(1) operations, so 30 s is a deadlock on any machine)."""
    errors: list[BaseException] = []

    def main() -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=main, daemon=True, name=what)
    thread.start()
    thread.join(join_s)
    assert not thread.is_alive(), f"{what} deadlocked: user code ran under the context's lock"
    assert not errors, errors


@pytest.mark.parametrize("lock", LOCK_KINDS)
def test_intersection_update_runs_no_user_code_under_the_lock(lock: str) -> None:
    """A ``str``/``int`` subclass whose ``__eq__``/``__hash__`` reads the context (takes its
    lock) does not deadlock ``&=``/``intersection_update`` (issue 25, defect 7): the caller's
    elements are made plain before the lock is taken. Fails on 3a76f2e (a deadlock)."""
    ctx = CompatStagingContext(lock=lock)
    calls: list[str] = []

    class Session(str):
        __slots__ = ()

        def __eq__(self, other: object) -> bool:
            calls.append("eq")
            len(ctx.prefetch_requested)  # takes the read lock
            return str.__eq__(self, other)

        def __hash__(self) -> int:
            calls.append("hash")
            len(ctx.prefetch_requested)
            return str.__hash__(self)

    class Room(int):
        __slots__ = ()

        def __eq__(self, other: object) -> bool:
            calls.append("eq")
            len(ctx.prefetched_rooms)
            return int.__eq__(self, other)

        def __hash__(self) -> int:
            calls.append("hash")
            len(ctx.prefetched_rooms)
            return int.__hash__(self)

    ctx.prefetch_requested |= {A, B}
    ctx.prefetched_rooms |= {1, 2}

    def intersect() -> None:
        ctx.prefetch_requested &= {(1, 0, Session("a")), (3, 0, Session("a"))}
        ctx.prefetched_rooms.intersection_update([Room(1)], {Room(1), 5})

    _in_thread(intersect, "intersection_update with user __eq__")
    assert set(ctx.prefetch_requested) == {A}
    assert set(ctx.prefetched_rooms) == {1}
    assert calls, "the subclasses' methods never ran: the test tests nothing"


def test_intersection_update_stays_as_lenient_as_a_set() -> None:
    """Normalising ``&=``'s elements keeps a set's matches: ``numpy``-style integers, ``str``
    subclasses and built-in values equal to an element (``1.0`` and room ``1``)."""
    ctx = CompatStagingContext()
    ctx.prefetched_rooms |= {1, 2, 3}
    ctx.prefetched_rooms &= {1.0, 2, "x", (1,)}
    assert set(ctx.prefetched_rooms) == {1, 2}
    ctx.prefetch_requested |= {A, B, C}
    ctx.prefetch_requested.intersection_update([(1.0, 0, "a"), (2, 0, type("S", (str,), {})("a"))])
    assert set(ctx.prefetch_requested) == {A, B}
    assert set(ctx.prefetch_requested) & {(1.0, 0, "a")} == {A}


A, C, D, E = (1, 0, "a"), (3, 0, "a"), (4, 0, "a"), (5, 0, "a")


def _model(initial: tuple[Any, ...], ops: tuple[Op, ...], keep: frozenset[Any],
           at: int) -> set[Any]:  # fmt: skip
    """The view after ``ops`` with ``&= keep`` placed before ``ops[at]``."""
    model = set(initial)
    for name, arg in [*ops[:at], ("&=", None), *ops[at:]]:
        if name == "&=":
            model.intersection_update(keep)
        elif name == "add":
            model.add(arg)
        else:
            model.discard(arg)
    return model


class IntersectVsChurn:
    """The view holds ``initial``; thread 1 applies ``&= other`` (or ``intersection_update``);
    thread 2 writes ``ops``: an element outside ``other`` is added, and another (outside
    ``other`` as well) discarded and re-added. At one instant the operator drops whatever is
    outside ``other`` *then*: never an element re-added after it, never keeping one added
    before it."""

    lock = "mutex"
    method = "&="
    initial: tuple[Any, ...] = (A, C)
    other: frozenset[Any] = frozenset({A})
    ops: tuple[Op, ...] = (("add", D), ("discard", C), ("add", C))

    def __init__(self) -> None:
        self.ctx = CompatStagingContext(lock=self.lock, debug=False)
        self.view = self.ctx.prefetch_requested
        self.view.update(self.initial)

    def intersect(self) -> None:
        if self.method == "&=":
            self.view &= set(self.other)  # type: ignore[misc]  # (the view returns itself)
        else:
            self.view.intersection_update(list(self.other), {*self.other, E})

    def churn(self) -> None:
        for name, arg in self.ops:
            getattr(self.view, name)(arg)

    def check(self) -> str | None:
        final = set(self.view)
        allowed = [
            _model(self.initial, self.ops, self.other, at) for at in range(len(self.ops) + 1)
        ]
        if final not in allowed:
            return (
                f"{self.method} {set(self.other)} against {list(self.ops)} from "
                f"{set(self.initial)} left {final}; at one instant it leaves one of {allowed}"
            )
        return None


G_CASES: list[tuple[str, str, tuple[Op, ...]]] = [
    ("&=", "mutex", (("add", D), ("discard", C), ("add", C))),
    ("&=", "rw", (("add", D), ("discard", C), ("add", C))),
    ("intersection_update", "mutex", (("discard", C), ("add", D), ("add", C))),
]


@pytest.mark.slow
@pytest.mark.parametrize(("method", "lock", "ops"), G_CASES)
def test_intersection_is_decided_on_the_state_inside_the_lock(
    method: str, lock: str, ops: tuple[Op, ...]
) -> None:
    """THREADING.md, the compat views' table (``intersection_update``, ``view &= other``:
    "decided against the set as it is inside that section"). The operator stopped at every
    line and return of the library's code it passes while thread 2 adds an element outside
    ``other`` and discards and re-adds another; the final set must be the operator's at one
    instant among those writes (``tests/interleave.py``: deterministic).

    Found by issue 33, item 0 (sentence (g): planted bugs an outside set got past).
    """
    rig: Any = type("Rig", (IntersectVsChurn,), {"lock": lock, "method": method, "ops": ops})
    result = explore(rig, rig.intersect, rig.churn, rig.check, block_s=0.05)
    print(f"{method} vs {ops} [{lock}]: {result.schedules} schedules, {result.blocked} blocked")
    assert result.schedules > 1, "the explorer ran no preempted schedule"
    assert not result.failures, result.failures[:3]
