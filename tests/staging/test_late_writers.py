"""Late writers are refused (docs/THREADING.md, "Room lifecycle and late writers", and the
compat views' tombstones): a write to a room that is not open (never opened, purged, or an older
opening through a stale handle) is refused and counted, never re-creates the room, and a
tombstone refusal is logged after the lock is released.

The exhaustive explorations of purge against a late writer are in
``tests/staging/test_dpor_room_lifecycle.py`` (and ``tests/staging/test_dpor_compat.py``); the
threaded races in ``tests/staging/test_races.py``."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from staging import (
    StagingContext,
)
from staging.compat import CompatStagingContext
from staging.locks import LOCK_KINDS
from tests.interleave import explore

pytestmark = [pytest.mark.timeout(120)]


JOIN_S = 10.0


READ_S = 5.0


class ReadingHandler(logging.Handler):
    """A handler that reads the context for each record: on the logging thread (a second
    acquisition by the writer's thread if it still holds the lock: a deadlock with a
    non-reentrant lock) and on another thread, joined with a bound (the lock still held by
    the writer, whatever its kind)."""

    def __init__(self, ctx: CompatStagingContext) -> None:
        super().__init__(logging.WARNING)
        # No handler lock: a writer deadlocked inside emit() would hold it, and
        # logging.shutdown() at interpreter exit would then wait for it forever.
        self.lock = None
        self.ctx = ctx
        self.records = 0
        self.blocked: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records += 1
        len(self.ctx.prefetch_requested)
        self.ctx.stats()
        done = threading.Event()

        def other() -> None:
            self.ctx.snapshot()
            done.set()

        reader = threading.Thread(target=other, daemon=True, name="handler-reader")
        reader.start()
        if not done.wait(READ_S):
            self.blocked.append(record.getMessage()[:60])
        reader.join(JOIN_S)


@pytest.fixture
def compat_log() -> Iterator[Callable[[CompatStagingContext], ReadingHandler]]:
    logger = logging.getLogger("staging.compat")
    made: list[ReadingHandler] = []
    old_level = logger.level

    def attach(ctx: CompatStagingContext) -> ReadingHandler:
        handler = ReadingHandler(ctx)
        logger.addHandler(handler)
        made.append(handler)
        return handler

    logger.setLevel(logging.WARNING)
    try:
        yield attach
    finally:
        for handler in made:
            logger.removeHandler(handler)
        logger.setLevel(old_level)


REFUSED_WRITES: dict[str, Callable[[CompatStagingContext, int], Any]] = {
    "keys.add": lambda c, r: c.prefetch_requested.add((r, 0, "s")),
    "keys.test_and_add": lambda c, r: c.prefetch_requested.test_and_add((r, 0, "s")),
    "keys.update": lambda c, r: c.prefetch_requested.update([(r, 0, "s"), (r, 1, "s")]),
    "keys.|=": lambda c, r: c.prefetch_requested.__ior__({(r, 0, "s")}),
    "keys.^=": lambda c, r: c.prefetch_requested.__ixor__({(r, 0, "s")}),
    "rooms.add": lambda c, r: c.prefetched_rooms.add(r),
    "rooms.test_and_add": lambda c, r: c.prefetched_rooms.test_and_add(r),
    "rooms.update": lambda c, r: c.prefetched_rooms.update([r]),
    "rooms.|=": lambda c, r: c.prefetched_rooms.__ior__({r}),
    "rooms.symmetric_difference_update": (
        lambda c, r: c.prefetched_rooms.symmetric_difference_update([r])
    ),
}


@pytest.mark.parametrize("lock", LOCK_KINDS)
@pytest.mark.parametrize("path", sorted(REFUSED_WRITES))
def test_a_tombstone_refusal_is_logged_after_the_lock_is_released(
    lock: str, path: str, compat_log: Callable[[CompatStagingContext], ReadingHandler]
) -> None:
    """THREADING.md, the compat views: "the first refusal of each tombstoned id is logged ...
    on the writer's thread after the lock is released"; the lock model: "While holding a
    lock: no user callbacks, no logging". A handler is user code: here it reads the context
    on the logging thread and on another one. The refused write runs on a thread joined with
    a bound (a deadlock fails the test instead of hanging it).

    Found by issue 33, item 0 (sentence (f): planted bugs an outside set got past).
    """
    ctx = CompatStagingContext(lock=lock)
    ctx.prefetch_requested.add((9, 0, "s"))
    ctx.prefetched_rooms.add(9)
    ctx.purge_room(9)  # room 9 is tombstoned now
    handler = compat_log(ctx)
    errors: list[BaseException] = []

    def write() -> None:
        try:
            REFUSED_WRITES[path](ctx, 9)
        except BaseException as exc:
            errors.append(exc)

    writer = threading.Thread(target=write, daemon=True, name=f"refused-{path}")
    writer.start()
    writer.join(JOIN_S)
    assert not writer.is_alive(), (
        f"{path} deadlocked: its refusal was logged while it held the context's lock"
    )
    assert not errors, errors
    assert handler.records == 1, f"{path}: {handler.records} refusals logged (expected 1)"
    assert not handler.blocked, (
        f"{path}: a reader on another thread waited for the lock while the refusal was "
        f"logged: {handler.blocked}"
    )
    assert ctx.stats().refused_late_writes >= 1
    assert 9 not in ctx.prefetched_rooms and (9, 0, "s") not in ctx.prefetch_requested


@pytest.fixture(params=LOCK_KINDS)
def ctx(request: pytest.FixtureRequest) -> StagingContext:
    return StagingContext(lock=request.param)


BLOCK_S = 0.05


def _ran(result: Any, label: str) -> None:
    print(f"{label}: {result.schedules} schedules, {result.blocked} blocked")
    assert result.schedules > 1, "the explorer ran no preempted schedule"
    assert not result.failures, result.failures[:3]


class ReopenVsLateWrite:
    """Room 1 was purged (tombstoned); a new request reopens it while a late writer of the
    earlier request writes a key and the mark."""

    lock = "mutex"

    def __init__(self) -> None:
        self.ctx = CompatStagingContext(lock=self.lock, debug=False)
        self.ctx.prefetch_requested.add((1, 0, "a"))
        self.ctx.purge_room(1)

    def reopen(self) -> None:
        self.ctx.reopen_room(1)

    def late_writer(self) -> None:
        self.ctx.prefetch_requested.add((1, 5, "late"))
        self.ctx.prefetched_rooms.add(1)

    def check(self) -> str | None:
        refused = self.ctx.stats().refused_late_writes
        kept = ((1, 5, "late") in self.ctx.prefetch_requested) + (1 in self.ctx.prefetched_rooms)
        if refused + kept != 2:
            return (
                f"{refused} late writes refused and {kept} kept of 2: a write was accepted "
                "and then dropped (the tombstone lifted before the keys were dropped)"
            )
        return None


@pytest.mark.timeout(30)
def test_writes_to_unopened_room_are_refused_and_counted(ctx: StagingContext) -> None:
    assert ctx.request_prefetch(9, 0, "d0") is False
    assert ctx.cancel_prefetch(9, 0, "d0") is False
    assert ctx.mark_prefetched(9) is False
    assert ctx.open_rooms == frozenset()
    assert ctx.snapshot().prefetch_requested == frozenset()
    assert ctx.stats().refused_late_writes == 3


@pytest.mark.timeout(30)
def test_late_writer_cannot_resurrect_purged_room(ctx: StagingContext) -> None:
    h = ctx.open_room(5)
    ctx.request_prefetch(h, 0, "d0")
    ctx.purge_room(5)
    assert ctx.request_prefetch(h, 1, "d0") is False
    assert ctx.request_prefetch(5, 1, "d0") is False
    assert ctx.mark_prefetched(h) is False
    assert not ctx.is_open(5)
    assert ctx.snapshot() == ctx.snapshot().__class__(frozenset(), frozenset(), frozenset())
    assert ctx.stats().refused_late_writes == 3


@pytest.mark.timeout(30)
def test_reopen_gets_new_generation_and_stale_handle_is_refused(ctx: StagingContext) -> None:
    old = ctx.open_room(5)
    ctx.purge_room(old)
    new = ctx.open_room(5)
    assert new.generation != old.generation
    assert ctx.is_open(new) and not ctx.is_open(old)
    assert ctx.request_prefetch(old, 0, "d0") is False
    assert ctx.mark_prefetched(old) is False
    assert not ctx.is_requested(new, 0, "d0")
    assert not ctx.is_prefetched(new)
    # A stale handle never purges the newer generation.
    assert ctx.purge_room(old).was_open is False
    assert ctx.is_open(new)
    assert ctx.request_prefetch(new, 0, "d0") is True
    assert ctx.purge_room(new).requests == {(0, "d0")}


@pytest.mark.parametrize("lock", LOCK_KINDS)
def test_reopen_room_is_one_critical_section(lock: str) -> None:
    rig = type("Rig", (ReopenVsLateWrite,), {"lock": lock})
    result = explore(rig, rig.reopen, rig.late_writer, rig.check, block_s=BLOCK_S)
    _ran(result, f"reopen_room vs late writer [{lock}]")
