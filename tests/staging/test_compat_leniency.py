"""``CompatStagingContext`` is as lenient as the set it replaces where that is safe, has the
``set`` methods an engine may call, and decides what a reused room id means.

Each leniency is checked side by side with a real ``set`` fed the same operations (the
parity tables below), so that "behaves like a set" is a comparison, not a claim.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from staging import RoomPurgedError
from staging.compat import CompatStagingContext, PrefetchRequestedView
from staging.locks import LOCK_KINDS

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=LOCK_KINDS)
def ctx(request: pytest.FixtureRequest) -> CompatStagingContext:
    return CompatStagingContext(lock=request.param, debug=True)


class Index:
    """An integer-like object that is not an int (only ``__index__``)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value

    def __hash__(self) -> int:
        return hash(self.value)

    def __eq__(self, other: object) -> bool:
        return other == self.value


class Session(str):
    """A ``str`` subclass, as some engines use for typed ids."""


def _writes(ctx: CompatStagingContext) -> int:
    return ctx.lock.stats().write_acquisitions


# ------------------------------------------------------------------ integer-like ids, str subclass


def test_numpy_and_index_ids_are_normalised_to_exact_ints(ctx: CompatStagingContext) -> None:
    keys, rooms = ctx.prefetch_requested, ctx.prefetched_rooms
    keys.add((np.int64(5), np.int32(0), "s"))
    keys.add((Index(5), np.uint8(1), np.str_("s")))
    rooms.add(np.int64(5))
    assert keys.test_and_add((5, np.int16(0), "s")) is False  # the same key
    stored = sorted(keys)
    assert stored == [(5, 0, "s"), (5, 1, "s")]
    assert all(type(r) is int and type(c) is int and type(s) is str for r, c, s in stored)
    assert rooms.snapshot() == {5} and type(next(iter(rooms))) is int
    # Membership matches equal values, as with a set (no normalisation needed for `in`).
    assert (np.int64(5), np.int64(1), "s") in keys and np.uint64(5) in rooms
    purge = ctx.purge_room(np.int64(5))
    assert purge.was_open and purge.requests == {(0, "s"), (1, "s")}
    rooms.add(5)  # the tombstone is the plain id: refused
    assert 5 not in rooms and ctx.stats().refused_late_writes == 1
    assert ctx.reopen_room(np.int32(5)).was_open is False


def test_str_subclass_session_ids_are_normalised(ctx: CompatStagingContext) -> None:
    ctx.prefetch_requested.add((1, 0, Session("decode-0")))
    ((_, _, session),) = ctx.prefetch_requested.snapshot()
    assert type(session) is str and session == "decode-0"
    assert (1, 0, Session("decode-0")) in ctx.prefetch_requested
    assert ctx.purge_session(Session("decode-0")) == {1}


@pytest.mark.parametrize(
    ("element", "exc"),
    [
        ((True, 0, "s"), TypeError),  # bool as a room id: a caller bug
        ((1, False, "s"), TypeError),
        ((np.bool_(True), 0, "s"), TypeError),
        ((1.0, 0, "s"), TypeError),
        (("1", 0, "s"), TypeError),
        ((1, 0, 7), TypeError),
        ((1, 0, b"s"), TypeError),
        ((1, 0, ""), ValueError),  # names no decode peer; purge_session cannot reach it
        ((-1, 0, "s"), ValueError),
        ((np.int64(-1), 0, "s"), ValueError),
        ((1, 0), TypeError),
        ([1, 0, "s"], TypeError),
    ],
)
def test_add_still_refuses_non_keys_clearly(
    ctx: CompatStagingContext, element: Any, exc: type[Exception]
) -> None:
    with pytest.raises(exc):
        ctx.prefetch_requested.add(element)
    with pytest.raises(exc):
        ctx.prefetch_requested.update([(2, 0, "ok"), element])  # checked before any change
    assert not ctx.prefetch_requested and ctx.stats().open_rooms == 0


# ------------------------------------------------------------------ discard and remove, like a set


_ODD: list[Any] = [
    "bad",
    7,
    (1, 0),
    (1, 0, "s", 0),
    (-1, 0, "s"),
    (1, -3, "s"),
    (1.5, 0, "s"),
    (True, 0, "s"),
    (1, 0, ""),
    None,
    [1, 0, "s"],  # unhashable: a set raises TypeError
    (1, [0], "s"),  # unhashable too
    {1},
]
_ODD_ROOMS: list[Any] = ["7", -1, 1.5, (1,), None, [1], {1}, True, np.int64(-2)]


def _outcome(op: Callable[[], object]) -> str:
    try:
        op()
    except Exception as exc:  # the type is what is compared
        return type(exc).__name__
    return "ok"


@pytest.mark.parametrize("value", _ODD, ids=repr)
def test_discard_and_remove_of_non_members_match_a_set(
    ctx: CompatStagingContext, value: Any
) -> None:
    bare: set[Any] = {(1, 0, "s")}
    ctx.prefetch_requested.add((1, 0, "s"))
    assert _outcome(lambda: ctx.prefetch_requested.discard(value)) == _outcome(
        lambda: bare.discard(value)
    )
    assert _outcome(lambda: ctx.prefetch_requested.remove(value)) == _outcome(
        lambda: bare.remove(value)
    )
    assert _outcome(lambda: ctx.prefetch_requested.difference_update([value])) == _outcome(
        lambda: bare.difference_update([value])
    )
    assert ctx.prefetch_requested.snapshot() == bare  # (True, 0, "s") finds (1, 0, "s")


@pytest.mark.parametrize("value", _ODD_ROOMS, ids=repr)
def test_room_view_discard_of_non_members_matches_a_set(
    ctx: CompatStagingContext, value: Any
) -> None:
    bare: set[Any] = {1}
    ctx.prefetched_rooms.add(1)
    for name in ("discard", "remove"):
        ours, theirs = getattr(ctx.prefetched_rooms, name), getattr(bare, name)
        assert _outcome(lambda f=ours: f(value)) == _outcome(lambda f=theirs: f(value)), name
    # True == 1: a set discards room 1 for it, and so does the view (only add refuses bools).
    assert ctx.prefetched_rooms.snapshot() == bare == ({1} if value is not True else set())


# ------------------------------------------------------------------ MutableSet methods


def _seeded(ctx: CompatStagingContext) -> tuple[PrefetchRequestedView, set[Any]]:
    start = {(1, 0, "s"), (1, 1, "s"), (2, 0, "s")}
    ctx.prefetch_requested.update(start)
    return ctx.prefetch_requested, set(start)


_UPDATES: list[tuple[str, Callable[[Any, Any], object]]] = [
    ("update", lambda s, o: s.update(o, [(4, 0, "s")])),
    ("difference_update", lambda s, o: s.difference_update(o, [(2, 0, "s")])),
    ("intersection_update", lambda s, o: s.intersection_update(o, o | {(9, 9, "s")})),
    ("symmetric_difference_update", lambda s, o: s.symmetric_difference_update(o)),
    ("|=", lambda s, o: s.__ior__(o)),
    ("-=", lambda s, o: s.__isub__(o)),
    ("&=", lambda s, o: s.__iand__(o)),
    ("^=", lambda s, o: s.__ixor__(o)),
]


@pytest.mark.parametrize(("name", "op"), _UPDATES, ids=[n for n, _ in _UPDATES])
def test_updates_match_a_set_and_take_the_lock_once(
    ctx: CompatStagingContext, name: str, op: Callable[[Any, Any], object]
) -> None:
    view, bare = _seeded(ctx)
    other = {(1, 1, "s"), (3, 0, "s"), (3, 1, "s")}
    before = _writes(ctx)
    op(view, other)
    op(bare, other)
    assert _writes(ctx) - before == 1, f"{name} took the write lock more than once"
    assert view.snapshot() == bare
    s = ctx.stats()
    assert s.requested_keys == len(bare) and s.open_rooms == len({k[0] for k in bare})


def test_read_methods_match_a_set(ctx: CompatStagingContext) -> None:
    view, bare = _seeded(ctx)
    other = [(1, 1, "s"), (3, 0, "s")]
    for name in ("union", "intersection", "difference", "symmetric_difference"):
        assert getattr(view, name)(other) == getattr(bare, name)(other), name
        assert isinstance(getattr(view, name)(other), frozenset)
    assert view.union(other, [(5, 0, "s")]) == bare.union(other, [(5, 0, "s")])
    assert view.issubset(bare | {(7, 0, "s")}) and not view.issubset(other)
    assert view.issuperset([(1, 0, "s")]) and not view.issuperset(other)
    assert view.isdisjoint([(8, 0, "s")])
    copied = view.copy()
    assert type(copied) is set and copied == bare
    copied.add((6, 0, "s"))  # detached, as set.copy
    assert (6, 0, "s") not in view
    rooms = ctx.prefetched_rooms
    rooms.update([1, np.int64(2)])
    assert rooms.copy() == {1, 2} and rooms.union([3]) == {1, 2, 3}
    rooms.symmetric_difference_update([2, 3])
    assert rooms.snapshot() == {1, 3}
    rooms.intersection_update([3])
    assert rooms.snapshot() == {3} and ctx.stats().prefetched_rooms == 1


def test_updates_refuse_tombstoned_rooms_element_by_element() -> None:
    ctx = CompatStagingContext()
    ctx.prefetch_requested.add((1, 0, "s"))
    ctx.purge_room(1)
    ctx.prefetch_requested.update([(1, 0, "s"), (1, 1, "s"), (2, 0, "s")])
    ctx.prefetched_rooms.update([1, 2])
    assert ctx.prefetch_requested.snapshot() == {(2, 0, "s")}
    assert ctx.prefetched_rooms.snapshot() == {2}
    assert ctx.stats().refused_late_writes == 3


def test_strict_updates_are_all_or_nothing() -> None:
    ctx = CompatStagingContext(strict=True)
    ctx.purge_room(1)
    with pytest.raises(RoomPurgedError):
        ctx.prefetch_requested.update([(2, 0, "s"), (1, 0, "s")])
    with pytest.raises(RoomPurgedError):
        ctx.prefetched_rooms |= {2, 1}
    with pytest.raises(RoomPurgedError):
        ctx.prefetched_rooms.symmetric_difference_update([3, 1])
    assert not ctx.prefetch_requested and not ctx.prefetched_rooms
    assert ctx.stats().open_rooms == 0


@pytest.mark.usefixtures("fast_switch")
@pytest.mark.parametrize("lock", LOCK_KINDS)
def test_update_is_seen_whole_by_locked_readers(lock: str) -> None:
    """Threads: writers update whole rooms at once while a reader takes snapshots; every
    snapshot holds each room with all of its keys or none (bounded, joined)."""
    ctx = CompatStagingContext(lock=lock, debug=True)
    rooms, chunks = 300, 6
    broken: list[str] = []
    stop = threading.Event()

    def writer(offset: int) -> None:
        for room in range(offset, rooms, 2):
            ctx.prefetch_requested.update((room, c, "s") for c in range(chunks))
            ctx.prefetch_requested -= {(room, c, "s") for c in range(chunks)}

    def reader() -> None:
        while not stop.is_set():
            per_room: dict[int, int] = {}
            for room, _, _ in ctx.prefetch_requested:
                per_room[room] = per_room.get(room, 0) + 1
            broken.extend(f"room {r}: {n} keys" for r, n in per_room.items() if n != chunks)

    threads = [threading.Thread(target=writer, args=(i,), daemon=True) for i in (0, 1)]
    watcher = threading.Thread(target=reader, daemon=True)
    for t in [watcher, *threads]:
        t.start()
    for t in threads:
        t.join(30)
    stop.set()
    watcher.join(30)
    assert not any(t.is_alive() for t in [watcher, *threads])
    assert not broken, broken[:5]
    assert ctx.stats().requested_keys == 0


# ------------------------------------------------------------------ reused room ids


def test_late_writer_is_refused_and_logged_once(
    ctx: CompatStagingContext, caplog: pytest.LogCaptureFixture
) -> None:
    ctx.prefetch_requested.add((7, 0, "s"))
    ctx.purge_room(7)
    with caplog.at_level(logging.WARNING, logger="staging.compat"):
        ctx.prefetch_requested.add((7, 1, "s"))  # the late writer
        ctx.prefetched_rooms.add(7)
        ctx.prefetch_requested.update([(7, 2, "s")])
    assert ctx.prefetch_requested.snapshot() == frozenset() and 7 not in ctx.prefetched_rooms
    assert ctx.stats().refused_late_writes == 3
    lines = [r.getMessage() for r in caplog.records if r.name == "staging.compat"]
    assert len(lines) == 1 and "room 7" in lines[0] and "reopen_room(7)" in lines[0]
    ctx.purge_room(7)  # a new purge of the id: its first refusal is logged again
    with caplog.at_level(logging.WARNING, logger="staging.compat"):
        ctx.prefetched_rooms.add(7)
    assert len([r for r in caplog.records if r.name == "staging.compat"]) == 2


def test_reused_id_without_reopen_is_refused_like_a_late_writer(
    ctx: CompatStagingContext,
) -> None:
    """The documented cost of an id window: a new request that reuses a recently purged
    id and does not call reopen_room gets nothing recorded."""
    ctx.prefetch_requested.add((9, 0, "old"))
    ctx.purge_room(9)
    assert ctx.prefetch_requested.test_and_add((9, 0, "new")) is False
    assert 9 not in ctx.prefetched_rooms and ctx.stats().refused_late_writes == 1


def test_reopen_room_starts_a_new_opening_of_the_id(ctx: CompatStagingContext) -> None:
    ctx.prefetch_requested.add((9, 0, "old"))
    ctx.prefetched_rooms.add(9)
    ctx.purge_room(9)
    assert ctx.stats().tombstones == 1
    dropped = ctx.reopen_room(9)  # the new request is admitted
    assert dropped.was_open is False and ctx.stats().tombstones == 0
    assert ctx.prefetch_requested.test_and_add((9, 0, "new")) is True
    ctx.prefetched_rooms.add(9)
    s = ctx.stats()
    assert (s.reopens, s.purges, s.refused_late_writes) == (1, 1, 0)
    # What an id cannot do: a late write of the OLD request now lands in the new one.
    ctx.prefetch_requested.add((9, 3, "old"))
    assert (9, 3, "old") in ctx.prefetch_requested
    # Reopening an id that still holds state (a request never purged) drops that state.
    leftover = ctx.reopen_room(9)
    assert leftover.was_open and leftover.requests == {(0, "new"), (3, "old")}
    assert 9 not in ctx.prefetched_rooms and not ctx.prefetch_requested
    s = ctx.stats()
    assert (s.reopens, s.purges, s.open_rooms) == (2, 1, 0)
    assert ctx.reopen_room(10).was_open is False and ctx.stats().reopens == 2  # nothing to do
    ctx.purge_room(9)  # the new opening ends: tombstoned again
    ctx.prefetched_rooms.add(9)
    assert 9 not in ctx.prefetched_rooms


def test_reopen_room_refuses_bad_ids(ctx: CompatStagingContext) -> None:
    for bad, exc in (("9", TypeError), (-1, ValueError), (True, TypeError), (1.0, TypeError)):
        with pytest.raises(exc):
            ctx.reopen_room(bad)
        with pytest.raises(exc):
            ctx.purge_room(bad)


# ------------------------------------------------------------- ids of 2**63 and more (issue 34)

_HUGE = 10**5000  # str() of it raises (Python's int-to-str digit limit)
_OUT_OF_RANGE_ELEMENTS: dict[str, tuple[str, Any]] = {
    "room-2**63": ("prefetched_rooms", 2**63),
    "room-2**64": ("prefetched_rooms", 2**64),
    "room-uint64": ("prefetched_rooms", np.uint64(2**63)),
    "room-huge": ("prefetched_rooms", _HUGE),
    "key-room-2**63": ("prefetch_requested", (2**63, 0, "s")),
    "key-chunk-2**63": ("prefetch_requested", (0, 2**63, "s")),
    "key-room-huge": ("prefetch_requested", (_HUGE, 0, "s")),
    "key-chunk-huge-index": ("prefetch_requested", (0, Index(_HUGE), "s")),
}


@pytest.mark.parametrize(
    "case", list(_OUT_OF_RANGE_ELEMENTS.values()), ids=list(_OUT_OF_RANGE_ELEMENTS)
)
def test_out_of_range_ids_are_refused_as_staging_context_refuses_them(
    ctx: CompatStagingContext, case: tuple[str, Any]
) -> None:
    """Ids are below 2**63 at every entry point, compat too (THREADING.md, "Key types"):
    every write refuses a larger one with StagingContext's ValueError, before any change;
    membership answers False and discard does nothing, as for any value that cannot be a
    member. The old views stored them, and a 5,000-digit id then broke repr(view)."""
    name, value = case
    view = getattr(ctx, name)
    writes: list[Callable[[], object]] = [
        lambda: view.add(value),
        lambda: view.test_and_add(value),
        lambda: view.update([value]),
        lambda: view.symmetric_difference_update([value]),
        lambda: view.__ior__({value}),
    ]
    for write in writes:
        with pytest.raises(ValueError, match=r"must be < 2\*\*63, got "):
            write()
    assert not view and ctx.stats().open_rooms == 0
    assert value not in view
    view.discard(value)
    with pytest.raises(KeyError):
        view.remove(value)
    repr(view), repr(ctx)  # never raise


def test_out_of_range_room_ids_are_refused_by_the_context_calls(
    ctx: CompatStagingContext,
) -> None:
    for call in (ctx.purge_room, ctx.reopen_room, ctx.lift_tombstone):
        for bad in (2**63, _HUGE):
            with pytest.raises(ValueError, match=r"room must be < 2\*\*63"):
                call(bad)
    assert ctx.stats().tombstones == 0


def test_the_error_is_the_one_staging_context_gives() -> None:
    from staging import StagingContext

    native = StagingContext()
    with pytest.raises(ValueError) as theirs:
        native.open_room(2**63)
    with pytest.raises(ValueError) as ours:
        CompatStagingContext().prefetched_rooms.add(2**63)
    assert str(ours.value) == str(theirs.value)


def test_a_tombstone_window_of_2_63_or_more_is_refused() -> None:
    """The window is formatted into repr() and into the refusal WARNING: bounded as an id."""
    for bad in (2**63, _HUGE):
        with pytest.raises(ValueError, match=r"tombstones must be < 2\*\*63"):
            CompatStagingContext(tombstones=bad)
    ctx = CompatStagingContext(tombstones=np.int64(3))
    assert type(ctx.stats().tombstone_capacity) is int and "tombstones=0/3" in repr(ctx)


def test_refusal_warning_and_repr_format_at_the_largest_id(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The largest id accepted, 2**63 - 1, logs its refusal and shows in repr()."""
    ctx = CompatStagingContext()
    top = 2**63 - 1
    ctx.prefetch_requested.add((top, top, "s"))
    assert str(top) in repr(ctx.prefetch_requested)
    ctx.purge_room(top)
    with caplog.at_level(logging.WARNING, logger="staging.compat"):
        ctx.prefetched_rooms.add(top)
    lines = [r.getMessage() for r in caplog.records if r.name == "staging.compat"]
    assert len(lines) == 1 and f"room {top}" in lines[0]
