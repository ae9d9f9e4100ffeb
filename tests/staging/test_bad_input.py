"""The staging rows of issue 10's bad-input table, and strict mode.

Each row was accepted silently (or blew up later, far from the cause); each must now give a
clear ``TypeError``/``ValueError`` at the call that is wrong, or work. Every check here was
run against the old code and failed there (the row's "today" column).
"""

from __future__ import annotations

import math
import threading
from fractions import Fraction

import pytest

from staging import (
    RoomHandle,
    RoomNotOpenError,
    RoomPurgedError,
    StagingContext,
    StagingError,
)
from staging.locks import LOCK_KINDS, check_lock_timeout, make_lock

pytestmark = pytest.mark.timeout(30)


# ------------------------------------------------------------------ lock_timeout


@pytest.mark.parametrize("kind", LOCK_KINDS)
def test_infinite_lock_timeout_means_no_limit(kind: str) -> None:
    """Was: constructed, then every call (even repr) raised OverflowError."""
    ctx = StagingContext(lock=kind, lock_timeout=math.inf)
    assert ctx.lock.timeout is None
    h = ctx.open_room(1)
    assert ctx.request_prefetch(h, 0, "d0") and "keys=1" in repr(ctx)
    assert ctx.purge_room(h).was_open


@pytest.mark.parametrize("kind", LOCK_KINDS)
@pytest.mark.parametrize(
    "timeout",
    [1e12, threading.TIMEOUT_MAX * 2, 10**400, Fraction(10**400)],
    ids=["1e12", "2xTIMEOUT_MAX", "10**400", "Fraction(10**400)"],
)
def test_lock_timeout_beyond_timeout_max_is_refused_at_construction(
    kind: str, timeout: float
) -> None:
    with pytest.raises(ValueError, match="TIMEOUT_MAX"):
        StagingContext(lock=kind, lock_timeout=timeout)


@pytest.mark.parametrize("kind", LOCK_KINDS)
def test_lock_timeout_at_timeout_max_works(kind: str) -> None:
    ctx = StagingContext(lock=kind, lock_timeout=threading.TIMEOUT_MAX)
    ctx.open_room(3)
    assert repr(ctx) and ctx.lock.timeout == threading.TIMEOUT_MAX


@pytest.mark.parametrize("timeout", [math.nan, 0, 0.0, -1, -math.inf])
def test_lock_timeout_nan_or_not_positive_is_a_value_error(timeout: float) -> None:
    with pytest.raises(ValueError, match="> 0"):
        StagingContext(lock_timeout=timeout)


@pytest.mark.parametrize("timeout", [True, False, "5", b"5", [1], object()])
def test_lock_timeout_of_the_wrong_type_is_a_type_error(timeout: object) -> None:
    """Was: ``True`` -> ValueError, ``"5"`` -> a raw comparison TypeError."""
    with pytest.raises(TypeError, match="lock timeout must be None or a number of seconds"):
        StagingContext(lock_timeout=timeout)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        make_lock("mutex", "t", 1, timeout=timeout)  # type: ignore[arg-type]


def test_check_lock_timeout_accepts_ints_floats_and_none() -> None:
    assert check_lock_timeout(None) is None and check_lock_timeout(math.inf) is None
    assert check_lock_timeout(5) == 5.0 and isinstance(check_lock_timeout(5), float)
    assert check_lock_timeout(Fraction(1, 4)) == 0.25


# ------------------------------------------------------------------ debug and strict flags


@pytest.mark.parametrize("debug", ["no", "", 0, 1, "false"])
def test_debug_must_be_a_bool_or_none(debug: object) -> None:
    """Was: ``debug="no"`` turned debug mode ON (any truthy object did)."""
    with pytest.raises(TypeError, match="debug must be True, False or None"):
        StagingContext(debug=debug)  # type: ignore[arg-type]


@pytest.mark.parametrize("debug", [True, False, None])
def test_debug_bool_or_none_works(debug: bool | None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NIXL_STAGING_DEBUG_LOCKS", raising=False)
    assert StagingContext(debug=debug).lock.debug is bool(debug)


def test_strict_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="strict"):
        StagingContext(strict=1)  # type: ignore[arg-type]


# ------------------------------------------------------------------ default lock


def test_default_lock_is_mutex_and_rw_stays_available() -> None:
    assert StagingContext().lock_kind == "mutex"
    assert StagingContext(lock="rw").lock_kind == "rw"


# ------------------------------------------------------------------ handles


@pytest.mark.parametrize("kind", LOCK_KINDS)
def test_handle_accepts_a_handle_like_every_other_method(kind: str) -> None:
    """Was: ``handle(RoomHandle)`` raised TypeError, unlike every other method."""
    ctx = StagingContext(lock=kind)
    h = ctx.open_room(4)
    assert ctx.handle(h) == h and ctx.handle(4) == h
    ctx.purge_room(h)
    h2 = ctx.open_room(4)
    assert ctx.handle(h) is None  # stale: that opening is gone
    assert ctx.handle(h2) == h2 and ctx.handle(4) == h2
    with pytest.raises(TypeError):
        ctx.handle("4")  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", LOCK_KINDS)
def test_a_handle_of_another_context_never_touches_this_one(kind: str) -> None:
    """Was: generations counted per context, so A's handle for room 5 matched B's room 5 and
    purged it. Generations are process-unique now."""
    a = StagingContext(lock=kind)
    b = StagingContext(lock=kind)
    ha = a.open_room(5)
    hb = b.open_room(5)
    assert ha.generation != hb.generation
    b.request_prefetch(hb, 0, "d0")
    assert b.purge_room(ha).was_open is False
    assert b.request_prefetch(ha, 1, "d0") is False and b.mark_prefetched(ha) is False
    assert b.handle(ha) is None and not b.is_open(ha)
    assert b.is_open(hb) and b.room_requests(hb) == {(0, "d0")}
    assert b.stats().refused_late_writes == 2
    assert a.purge_room(ha).was_open is True


def test_generations_are_unique_across_contexts_and_threads() -> None:
    contexts = [StagingContext() for _ in range(4)]
    seen: list[list[int]] = [[] for _ in contexts]

    def opener(i: int) -> None:
        for room in range(200):
            seen[i].append(contexts[i].open_room(room).generation)

    threads = [threading.Thread(target=opener, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    flat = [g for gens in seen for g in gens]
    assert len(flat) == 800 and len(set(flat)) == 800


# ------------------------------------------------------------------ strict mode


@pytest.mark.parametrize("kind", LOCK_KINDS)
def test_strict_writes_to_a_room_never_opened_raise(kind: str) -> None:
    """Was (and still, without strict): ``False``, the same answer as "duplicate"."""
    ctx = StagingContext(lock=kind, strict=True)
    assert ctx.strict
    with pytest.raises(RoomNotOpenError, match="room 9 is not open") as info:
        ctx.request_prefetch(9, 0, "d0")
    assert isinstance(info.value, StagingError) and info.value.room == 9
    assert not isinstance(info.value, RoomPurgedError)
    with pytest.raises(RoomNotOpenError):
        ctx.request_prefetches(9, [0, 1], "d0")
    with pytest.raises(RoomNotOpenError):
        ctx.cancel_prefetch(9, 0, "d0")
    with pytest.raises(RoomNotOpenError):
        ctx.mark_prefetched(9)
    assert ctx.stats().refused_late_writes == 4 and ctx.open_rooms == frozenset()


@pytest.mark.parametrize("kind", LOCK_KINDS)
def test_strict_stale_handle_raises_room_purged_and_duplicates_do_not(kind: str) -> None:
    ctx = StagingContext(lock=kind, strict=True)
    h = ctx.open_room(2)
    assert ctx.request_prefetch(h, 0, "d0") is True
    assert ctx.request_prefetch(h, 0, "d0") is False  # a duplicate is not an error
    assert ctx.mark_prefetched(h) is True and ctx.mark_prefetched(h) is False
    assert ctx.cancel_prefetch(h, 5, "d0") is False  # absent key of an open room
    ctx.purge_room(h)
    h2 = ctx.open_room(2)
    with pytest.raises(RoomPurgedError, match=r"generation \d+") as info:
        ctx.request_prefetch(h, 1, "d0")
    assert info.value.generation == h.generation
    assert ctx.room_requests(h2) == frozenset()  # nothing leaked into the new opening
    assert ctx.purge_room(h).was_open is False  # purge stays idempotent, never raises
    assert ctx.handle(RoomHandle(2, h.generation)) is None


def test_non_strict_refusals_are_unchanged() -> None:
    ctx = StagingContext()
    assert ctx.strict is False
    assert ctx.request_prefetch(9, 0, "d0") is False
    assert ctx.request_prefetches(9, [0], "d0") == frozenset()
    assert ctx.stats().refused_late_writes == 2


# ------------------------------------------------------------------ id bound (2**63)


@pytest.mark.parametrize(
    "chunks",
    [[0, 2**63], range(2**63 - 1, 2**63 + 1), range(0, 2**64, 2**62), (2**63,)],
    ids=["list", "range-past-the-bound", "range-stepping-past", "tuple"],
)
def test_request_prefetches_refuses_chunk_indices_past_the_id_bound(chunks: object) -> None:
    """Chunk indices are below ``staging.validate.MAX_ID`` at every entry point, as
    ``request_prefetch`` has them (one shared rule, ``check_chunk_idx``): the batched form
    and its ``range`` fast path too. Nothing changes when one is refused."""
    ctx = StagingContext()
    h = ctx.open_room(1)
    with pytest.raises(ValueError, match=r"chunk_idx must be < 2\*\*63"):
        ctx.request_prefetch(h, 2**63, "s")
    with pytest.raises(ValueError, match=r"chunk_idx must be < 2\*\*63"):
        ctx.request_prefetches(h, chunks, "s")  # type: ignore[arg-type]
    assert ctx.room_requests(h) == frozenset()
    assert ctx.request_prefetches(h, range(2**63 - 2, 2**63), "s") == {2**63 - 2, 2**63 - 1}


# ------------------------------------------------------------------ integer-like ids (issue 34)


@pytest.mark.parametrize("kind", LOCK_KINDS)
def test_integer_likes_are_accepted_and_stored_as_plain_ints(kind: str) -> None:
    """THREADING.md, "Key types": every entry point takes what ``operator.index`` takes
    (``numpy.int64`` included), never a ``bool``, and stores the plain ``int``. The document
    said the opposite for ``StagingContext`` in one paragraph (a ``TypeError``); this pins
    what the code does, which the document now says."""
    np = pytest.importorskip("numpy")
    ctx = StagingContext(lock=kind)
    handle = ctx.open_room(np.int64(7))
    assert handle.room == 7 and type(handle.room) is int
    assert ctx.request_prefetch(handle, np.uint32(3), "d0")
    assert ctx.request_prefetches(handle, np.arange(4, 6), "d0") == {4, 5}
    assert ctx.is_requested(np.int64(7), 3, "d0") and ctx.is_open(handle)
    assert {type(r) for r, _, _ in ctx.prefetch_requested} == {int}
    assert type(RoomHandle(np.int32(7), handle.generation).room) is int
    assert ctx.purge_room(np.int64(7)).was_open
    for bad in (True, np.bool_(True)):
        with pytest.raises(TypeError):
            ctx.open_room(bad)
    with pytest.raises(ValueError, match=r"room must be < 2\*\*63"):
        ctx.open_room(np.uint64(2**63))
