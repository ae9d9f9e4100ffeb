"""One behavioural contract for StagingContext, run over every lock implementation.

Like CPython's ``lock_tests.py``, the same suite is rerun per lock kind: ``lock="rw"`` and
``lock="mutex"`` must be indistinguishable to a caller.
"""

from __future__ import annotations

import pytest

from staging import (
    RoomAlreadyOpenError,
    RoomHandle,
    RoomPurge,
    StagingContext,
)
from staging.locks import LOCK_KINDS

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(params=LOCK_KINDS)
def ctx(request: pytest.FixtureRequest) -> StagingContext:
    return StagingContext(lock=request.param)


def test_open_returns_frozen_handle(ctx: StagingContext) -> None:
    h = ctx.open_room(7)
    assert h == RoomHandle(7, h.generation)
    with pytest.raises(AttributeError):
        h.room = 8  # type: ignore[misc]
    assert ctx.is_open(7) and ctx.is_open(h)
    assert ctx.open_rooms == frozenset({7})


def test_open_twice_raises_and_changes_nothing(ctx: StagingContext) -> None:
    h = ctx.open_room(1)
    ctx.request_prefetch(h, 0, "d0")
    with pytest.raises(RoomAlreadyOpenError) as info:
        ctx.open_room(1)
    assert info.value.room == 1
    assert ctx.handle(1) == h
    assert ctx.prefetch_requested == frozenset({(1, 0, "d0")})


def test_request_prefetch_is_test_and_add(ctx: StagingContext) -> None:
    h = ctx.open_room(3)
    assert ctx.request_prefetch(h, 0, "d0") is True
    assert ctx.request_prefetch(h, 0, "d0") is False
    assert ctx.request_prefetch(3, 0, "d0") is False
    assert ctx.request_prefetch(3, 0, "d1") is True
    assert ctx.request_prefetch(3, 1, "d0") is True
    assert ctx.is_requested(3, 0, "d0") and ctx.is_requested(h, 0, "d1")
    assert not ctx.is_requested(3, 2, "d0")
    assert ctx.prefetch_requested == {(3, 0, "d0"), (3, 0, "d1"), (3, 1, "d0")}
    assert ctx.stats().refused_late_writes == 0


def test_batch_request_matches_single_requests(ctx: StagingContext) -> None:
    h = ctx.open_room(3)
    ctx.request_prefetch(h, 1, "d0")
    assert ctx.request_prefetches(h, [0, 1, 2, 2], "d0") == frozenset({0, 2})
    assert ctx.room_requests(3) == {(0, "d0"), (1, "d0"), (2, "d0")}
    assert ctx.stats().requested_keys == 3
    ctx.purge_room(h)
    assert ctx.request_prefetches(h, [5], "d0") == frozenset()
    assert ctx.stats().refused_late_writes == 1


def test_cancel_prefetch(ctx: StagingContext) -> None:
    h = ctx.open_room(3)
    ctx.request_prefetch(h, 0, "d0")
    assert ctx.cancel_prefetch(h, 0, "d0") is True
    assert ctx.cancel_prefetch(h, 0, "d0") is False
    assert ctx.prefetch_requested == frozenset()
    assert ctx.request_prefetch(h, 0, "d0") is True  # can be requested again


def test_mark_prefetched(ctx: StagingContext) -> None:
    h = ctx.open_room(3)
    assert not ctx.is_prefetched(3)
    assert ctx.mark_prefetched(h) is True
    assert ctx.mark_prefetched(3) is False
    assert ctx.is_prefetched(3) and ctx.is_prefetched(h)
    assert ctx.prefetched_rooms == frozenset({3})




def test_purge_removes_both_collections_atomically(ctx: StagingContext) -> None:
    a, b = ctx.open_room(1), ctx.open_room(2)
    ctx.request_prefetch(a, 0, "d0")
    ctx.request_prefetch(a, 1, "d1")
    ctx.mark_prefetched(a)
    ctx.request_prefetch(b, 0, "d0")
    ctx.mark_prefetched(b)
    purge = ctx.purge_room(1)
    assert purge == RoomPurge(1, True, True, frozenset({(0, "d0"), (1, "d1")}), a.generation)
    snap = ctx.snapshot()
    assert snap.open_rooms == {2}
    assert snap.prefetched_rooms == {2}
    assert snap.prefetch_requested == {(2, 0, "d0")}
    s = ctx.stats()
    assert (s.open_rooms, s.prefetched_rooms, s.requested_keys, s.purges) == (1, 1, 1, 1)


def test_purge_is_idempotent(ctx: StagingContext) -> None:
    h = ctx.open_room(1)
    ctx.request_prefetch(h, 0, "d0")
    assert ctx.purge_room(h).was_open
    second = ctx.purge_room(h)
    assert second == RoomPurge(1, False, False, frozenset())
    assert ctx.purge_room(1).was_open is False
    assert ctx.stats().purges == 1






def test_purge_session_drops_only_that_session(ctx: StagingContext) -> None:
    a, b, c = ctx.open_room(1), ctx.open_room(2), ctx.open_room(3)
    ctx.request_prefetch(a, 0, "dead")
    ctx.request_prefetch(a, 1, "alive")
    ctx.request_prefetch(b, 0, "dead")
    ctx.request_prefetch(c, 0, "alive")
    assert ctx.purge_session("dead") == frozenset({1, 2})
    assert ctx.prefetch_requested == {(1, 1, "alive"), (3, 0, "alive")}
    assert ctx.open_rooms == {1, 2, 3}  # rooms stay open: the sender fails them
    assert ctx.purge_session("dead") == frozenset()
    assert ctx.purge_room(1).requests == {(1, "alive")}
    assert ctx.stats().requested_keys == 1


def test_views_are_snapshots_not_live_collections(ctx: StagingContext) -> None:
    h = ctx.open_room(1)
    view = ctx.prefetch_requested
    ctx.request_prefetch(h, 0, "d0")
    assert view == frozenset()
    assert isinstance(ctx.prefetched_rooms, frozenset)
    assert isinstance(ctx.open_rooms, frozenset)
    assert isinstance(ctx.room_requests(1), frozenset)


def test_stats_are_frozen_and_consistent(ctx: StagingContext) -> None:
    h = ctx.open_room(1)
    ctx.request_prefetches(h, range(4), "d0")
    ctx.mark_prefetched(h)
    s = ctx.stats()
    with pytest.raises(AttributeError):
        s.open_rooms = 0  # type: ignore[misc]
    assert (s.open_rooms, s.prefetched_rooms, s.requested_keys, s.rooms_opened) == (1, 1, 4, 1)
    assert s.lock.kind == ctx.lock_kind
    assert s.lock.write_acquisitions >= 3
    assert len(ctx) == 1


def test_purge_cost_is_independent_of_live_rooms(ctx: StagingContext) -> None:
    """Structural check (not wall-clock): purge touches only that room's keys."""
    for room in range(2000):
        ctx.request_prefetches(ctx.open_room(room), range(4), f"d{room % 3}")
    target = ctx.handle(1999)
    assert target is not None
    purge = ctx.purge_room(target)
    assert len(purge.requests) == 4
    assert ctx.stats().requested_keys == 1999 * 4


BAD_ROOMS: list[tuple[object, type[Exception]]] = [
    (-1, ValueError),
    (True, TypeError),
    (False, TypeError),
    (1.0, TypeError),
    ("1", TypeError),
    (None, TypeError),
]


@pytest.mark.parametrize(("room", "exc"), BAD_ROOMS)
def test_bad_room_rejected_without_state_change(
    ctx: StagingContext, room: object, exc: type[Exception]
) -> None:
    h = ctx.open_room(1)
    ctx.request_prefetch(h, 0, "d0")
    before = ctx.snapshot()
    before_stats = ctx.stats()
    calls = [
        lambda: ctx.open_room(room),  # type: ignore[arg-type]
        lambda: ctx.request_prefetch(room, 0, "d0"),  # type: ignore[arg-type]
        lambda: ctx.cancel_prefetch(room, 0, "d0"),  # type: ignore[arg-type]
        lambda: ctx.mark_prefetched(room),  # type: ignore[arg-type]
        lambda: ctx.purge_room(room),  # type: ignore[arg-type]
        lambda: ctx.is_open(room),  # type: ignore[arg-type]
        lambda: ctx.request_prefetch(RoomHandle(room, 1), 0, "d0"),  # type: ignore[arg-type]
    ]
    for call in calls:
        with pytest.raises(exc, match="room"):
            call()
    assert ctx.snapshot() == before
    after = ctx.stats()
    assert after.refused_late_writes == before_stats.refused_late_writes
    assert after.purges == before_stats.purges


@pytest.mark.parametrize(
    ("chunk_idx", "session_id", "exc", "match"),
    [
        (-1, "d0", ValueError, "chunk_idx"),
        (True, "d0", TypeError, "chunk_idx"),
        (0.5, "d0", TypeError, "chunk_idx"),
        (0, "", ValueError, "session_id"),
        (0, 3, TypeError, "session_id"),
        (0, None, TypeError, "session_id"),
    ],
)
def test_bad_key_rejected_without_state_change(
    ctx: StagingContext, chunk_idx: object, session_id: object, exc: type[Exception], match: str
) -> None:
    h = ctx.open_room(1)
    before = ctx.snapshot()
    with pytest.raises(exc, match=match):
        ctx.request_prefetch(h, chunk_idx, session_id)  # type: ignore[arg-type]
    with pytest.raises(exc, match=match):
        ctx.cancel_prefetch(h, chunk_idx, session_id)  # type: ignore[arg-type]
    with pytest.raises(exc, match=match):
        ctx.is_requested(h, chunk_idx, session_id)  # type: ignore[arg-type]
    with pytest.raises(exc, match=match):
        ctx.request_prefetches(h, [0, chunk_idx], session_id)  # type: ignore[list-item,arg-type]
    assert ctx.snapshot() == before
    assert ctx.stats().refused_late_writes == 0


def test_purge_session_bad_input(ctx: StagingContext) -> None:
    with pytest.raises(ValueError):
        ctx.purge_session("")
    with pytest.raises(TypeError):
        ctx.purge_session(None)  # type: ignore[arg-type]


def test_bad_constructor_arguments() -> None:
    with pytest.raises(ValueError, match="lock kind"):
        StagingContext(lock="spin")
    with pytest.raises(ValueError, match="timeout"):
        StagingContext(lock_timeout=0)
    with pytest.raises(ValueError, match="timeout"):
        StagingContext(lock_timeout=-1.0)


def test_point_reads_answer_the_current_state_after_every_write(ctx: StagingContext) -> None:
    """``is_open``/``is_prefetched``/``is_requested`` agree with the locked views after each
    kind of write, also when the same question was asked before the write (an answer
    remembered from an earlier read fails this)."""
    keys = [(0, "d0"), (1, "d0"), (0, "d1")]

    def agree(handle: RoomHandle) -> None:
        current = ctx.handle(handle.room) == handle
        requested = ctx.room_requests(handle)
        assert ctx.is_open(handle) is current
        assert ctx.is_prefetched(handle) is (current and handle.room in ctx.prefetched_rooms)
        for chunk, session in keys:
            assert ctx.is_requested(handle, chunk, session) is ((chunk, session) in requested)
            if current:
                assert ctx.is_requested(handle.room, chunk, session) is (
                    (chunk, session) in requested
                )

    h = ctx.open_room(4)
    agree(h)
    ctx.request_prefetch(h, 0, "d0")
    agree(h)
    ctx.request_prefetches(h, [1], "d0")
    agree(h)
    ctx.request_prefetch(4, 0, "d1")
    agree(h)
    ctx.cancel_prefetch(h, 1, "d0")
    agree(h)
    ctx.mark_prefetched(h)
    agree(h)
    ctx.purge_session("d1")
    agree(h)
    assert ctx.room_requests(h) == {(0, "d0")}
    ctx.purge_room(h)
    agree(h)
    fresh = ctx.open_room(4)
    ctx.request_prefetch(fresh, 1, "d0")
    agree(fresh)
    agree(h)  # the stale handle reads closed and sees none of the new opening's keys
    assert not ctx.is_requested(h, 1, "d0") and ctx.is_requested(fresh, 1, "d0")
