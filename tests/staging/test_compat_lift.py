"""``CompatStagingContext.lift_tombstone`` against the scheduler's writes, at every
single-preemption schedule (``tests/interleave.py``; real threads, independent of load).

The contract's sentence (``lift_tombstone``'s docstring): it "lifts the id's tombstone, if it
has one, and drops nothing: a duplicate id arriving while the first request is live leaves
every key of the first as it is". Checked in both orders a live room and a reused one meet
it; a planted lift that also drops what the id holds (``reopen_room``'s body) is caught.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from staging import CompatStagingContext
from staging.compat import _CompatCore
from tests import interleave

pytestmark = pytest.mark.timeout(300)

ROOM, S = 7, "decode-0"
LIVE = {(ROOM, c, S) for c in range(3)}


def _live() -> CompatStagingContext:
    ctx = CompatStagingContext()
    ctx.prefetch_requested.update(LIVE)
    ctx.prefetched_rooms.add(ROOM)
    return ctx


def _scheduler(ctx: CompatStagingContext) -> None:
    """The live request's next chunk: one more key (the scheduler's add)."""
    ctx.prefetch_requested.add((ROOM, 3, S))


def _keeps_everything(ctx: CompatStagingContext) -> str | None:
    keys = {k for k in ctx.prefetch_requested if k[0] == ROOM}
    if keys != LIVE | {(ROOM, 3, S)} or ROOM not in ctx.prefetched_rooms:
        return (
            f"the live room's state changed: {sorted(keys)}, marked={ROOM in ctx.prefetched_rooms}"
        )
    if ctx.stats().refused_late_writes:
        return "a write of the live request was refused"
    return None


def _lift(ctx: CompatStagingContext) -> None:
    ctx.lift_tombstone(ROOM)


@pytest.mark.slow
def test_a_duplicate_lift_while_the_room_is_live_drops_nothing() -> None:
    result = interleave.explore(_live, _lift, _scheduler, _keeps_everything, block_s=0.2)
    assert result.schedules > 1 and not result.failures, result.failures[:3]


def _reused() -> CompatStagingContext:
    ctx = _live()
    ctx.purge_room(ROOM)  # the first request ended: tombstoned
    return ctx


def _new_request(ctx: CompatStagingContext) -> None:
    ctx.lift_tombstone(ROOM)  # the new sender is made (scheduler thread) ...
    ctx.prefetch_requested.add((ROOM, 0, S))  # ... then its first prefetch


def _late_old_write(ctx: CompatStagingContext) -> None:
    ctx.prefetched_rooms.add(ROOM)  # a late write of the ended request (another thread)


def _reused_consistent(ctx: CompatStagingContext) -> str | None:
    if (ROOM, 0, S) not in ctx.prefetch_requested:
        return "the new request's key was refused or dropped"
    s = ctx.stats()
    if s.tombstones != 0 or s.reopens != 1:
        return f"tombstones={s.tombstones} reopens={s.reopens}"
    return None


@pytest.mark.slow  # 10.9 s in a make test run: a DPOR exploration near 15 s (issue 34)
def test_a_reused_id_is_accepted_whatever_the_late_write_does() -> None:
    result = interleave.explore(
        _reused, _new_request, _late_old_write, _reused_consistent, block_s=0.2
    )
    assert result.schedules > 1 and not result.failures, result.failures[:3]


def test_planted_lift_that_drops_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """PLANTED: lift_tombstone with reopen_room's body (lift AND drop what the id holds),
    the placement that would wipe a live duplicate's keys."""
    planted: Callable[[Any, int], Any] = lambda core, room: bool(core.reopen(room).was_open)  # noqa: E731
    monkeypatch.setattr(_CompatCore, "lift", planted)
    result = interleave.explore(
        _live, _lift, _scheduler, _keeps_everything, block_s=0.2, stop_on_first=True
    )
    assert result.failures, "the planted drop was not caught"
