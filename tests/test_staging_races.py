"""Races against StagingContext under a 1 µs GIL switch interval, with a Barrier start.

Each test prints its seed; rerun one with ``STAGING_RACE_SEED=<seed>``. The planted-bug test
runs the same workload against the unlocked upstream pattern and must see it fail, so these
tests can fail.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable

import pytest

from staging import RoomHandle, StagingContext
from staging.locks import LOCK_KINDS

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("fast_switch")]

JOIN_S = 10.0
ROOMS = 16
SESSIONS = ("d0", "d1", "d2")


def _seed() -> int:
    seed = int(os.environ.get("STAGING_RACE_SEED", random.randrange(2**32)))
    print(f"STAGING_RACE_SEED={seed}")
    return seed


def _run_threads(targets: list[Callable[[], None]]) -> list[BaseException]:
    """Start all targets behind a Barrier, join with a bound, return what they raised."""
    barrier = threading.Barrier(len(targets), timeout=JOIN_S)
    errors: list[BaseException] = []

    def wrap(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                barrier.wait()
                fn()
            except BaseException as exc:  # collected and asserted by the test
                errors.append(exc)

        return run

    threads = [threading.Thread(target=wrap(fn), daemon=True) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
    assert not [t for t in threads if t.is_alive()], "a thread did not finish"
    return errors


@pytest.mark.parametrize("lock", LOCK_KINDS)
def test_workers_and_purger_on_same_rooms(lock: str) -> None:
    """(a) request/cancel/mark from 4 workers while a purger purges and reopens the rooms."""
    seed = _seed()
    ctx = StagingContext(lock=lock)
    for room in range(ROOMS):
        ctx.open_room(room)
    stop = threading.Event()
    ops = [0]

    def worker(wid: int) -> Callable[[], None]:
        rng = random.Random(seed + wid)

        def run() -> None:
            while not stop.is_set():
                room = rng.randrange(ROOMS)
                handle = ctx.handle(room)
                ref: int | RoomHandle = handle if handle and rng.random() < 0.5 else room
                chunk, session = rng.randrange(8), rng.choice(SESSIONS)
                op = rng.random()
                if op < 0.6:
                    ctx.request_prefetch(ref, chunk, session)
                elif op < 0.8:
                    ctx.cancel_prefetch(ref, chunk, session)
                elif op < 0.95:
                    ctx.mark_prefetched(ref)
                else:
                    ctx.snapshot()
                ops[0] += 1

        return run

    def purger() -> None:
        rng = random.Random(seed)
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            room = rng.randrange(ROOMS)
            purge = ctx.purge_room(room)
            # Everything the purge reported belongs to that room only, and is gone now.
            for chunk, session in purge.requests:
                assert not ctx.is_requested(room, chunk, session) or ctx.is_open(room)
            if rng.random() < 0.3:
                ctx.purge_session(rng.choice(SESSIONS))
            if purge.was_open:
                ctx.open_room(room)
        stop.set()

    errors = _run_threads([worker(i) for i in range(4)] + [purger])
    assert errors == []
    assert ops[0] > 0
    for room in range(ROOMS):
        ctx.purge_room(room)
    snap = ctx.snapshot()
    assert snap.open_rooms == snap.prefetched_rooms == snap.prefetch_requested == frozenset()
    s = ctx.stats()
    assert (s.open_rooms, s.prefetched_rooms, s.requested_keys) == (0, 0, 0)


@pytest.mark.parametrize("lock", LOCK_KINDS)
def test_stale_handle_never_writes_into_new_generation(lock: str) -> None:
    """(b) a late writer keeps using its handle while the room is purged and reopened."""
    _seed()
    ctx = StagingContext(lock=lock)
    stale = ctx.open_room(1)
    stop = threading.Event()
    accepted_after_purge: list[int] = []
    purged = threading.Event()

    def late_writer() -> None:
        chunk = 0
        while not stop.is_set():
            was_purged = purged.is_set()
            ok = ctx.request_prefetch(stale, chunk, "late")
            ctx.mark_prefetched(stale)
            if ok and was_purged:
                accepted_after_purge.append(chunk)
            chunk += 1

    records = []

    def purger() -> None:
        time.sleep(0.01)
        records.append(ctx.purge_room(stale))
        purged.set()
        for _ in range(300):
            h = ctx.open_room(1)
            ctx.request_prefetch(h, 0, "fresh")
            records.append(ctx.purge_room(h))
        stop.set()

    assert _run_threads([late_writer, purger]) == []
    assert accepted_after_purge == []
    assert records[0].was_open and records[0].generation == stale.generation
    for record in records[1:]:
        assert record.was_open and not record.was_prefetched
        assert record.requests == {(0, "fresh")}, record
    assert ctx.stats().refused_late_writes > 0
    assert ctx.open_rooms == frozenset()


class UpstreamStaging:
    """The unlocked upstream pattern (planted bug): two bare sets, purge by rebuild."""

    def __init__(self) -> None:
        self.prefetched_rooms: set[int] = set()
        self.prefetch_requested: set[tuple[int, int, str]] = set()

    def request(self, room: int, chunk: int, session: str) -> None:
        self.prefetch_requested.add((room, chunk, session))

    def cancel(self, room: int, chunk: int, session: str) -> None:
        self.prefetch_requested.discard((room, chunk, session))

    def purge(self, room: int) -> None:
        self.prefetched_rooms.discard(room)
        self.prefetch_requested = {k for k in self.prefetch_requested if k[0] != room}


def _upstream_race(seed: int, budget_s: float) -> list[BaseException]:
    """Same workload shape as test (a), against UpstreamStaging; returns escaped errors."""
    state = UpstreamStaging()
    for room in range(ROOMS):
        for chunk in range(64):
            state.request(room, chunk, "d0")
    stop = threading.Event()

    def worker(wid: int) -> Callable[[], None]:
        rng = random.Random(seed + wid)

        def run() -> None:
            while not stop.is_set():
                room, chunk = rng.randrange(ROOMS), rng.randrange(64)
                if rng.random() < 0.5:
                    state.request(room, chunk, "d0")
                else:
                    state.cancel(room, chunk, "d0")

        return run

    def purger() -> None:
        rng = random.Random(seed)
        deadline = time.monotonic() + budget_s
        try:
            while time.monotonic() < deadline:
                state.purge(rng.randrange(ROOMS))
        finally:
            stop.set()

    return _run_threads([worker(0), worker(1), purger])


def test_upstream_set_comprehension_purge_fails_under_same_race() -> None:
    """(c) the planted bug must be caught: 'Set changed size during iteration'."""
    seed = _seed()
    errors: list[BaseException] = []
    for attempt in range(5):
        errors = _upstream_race(seed + attempt, budget_s=1.0)
        if errors:
            break
    assert errors, "the unlocked upstream purge survived the race: the harness is too weak"
    assert any(
        isinstance(e, RuntimeError) and "changed size during iteration" in str(e) for e in errors
    ), errors
