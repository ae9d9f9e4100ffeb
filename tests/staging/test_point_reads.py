"""The lock-free point reads (``is_open``/``is_prefetched``/``is_requested``) under threads.

Two checks, each shown to catch a planted stale-cache bug:

* **Read your own writes while others read** (:func:`read_your_writes`): one writer owns a
  room and is its only writer; after each of its writes returns, its own point reads must
  show it (a key it just added reads True, one it just cancelled reads False, a purged
  handle reads closed), while reader threads hammer the same point reads under a 1 µs switch
  interval. A read cache that can be refilled *during* a write (so that it keeps the state
  from before the write under the stamp of after it) fails this within a few hundred writes.
* **staging-race's quiescent point-read check** (the ``point-reads`` invariant): at every
  epoch, with every thread parked, each point read must answer what the snapshot says. An
  ``is_requested`` that answers from a per-opening cache filled at its first read (correct
  in every sequential test that reads only after writing) fails it at once.

Each run prints its seed; rerun one with ``STAGING_RACE_SEED=<seed>``.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from staging import RoomHandle, StagingContext
from staging.context import PrefetchKey
from staging.locks import LOCK_KINDS
from staging.validate import check_chunk_idx, check_session_id
from stress.framework import StressConfig, find_scenario, run_scenario
from tests.staging.test_races import run_threads, seed_from_env

PLANT_ATTEMPTS = 10
"""Runs (seeds seed, seed+1, ...) a planted race gets to show itself; the first that shows it
ends the test. A run rarely misses it on a quiet machine, more often beside CPU hogs."""

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("fast_switch")]

CHUNKS = 4
WRITER_SESSION = "w"
READERS = 2
WRITES = 2000
BUDGET_S = 1.0


class _Model:
    """The single writer's view of its room. Only the writer thread changes it, and only
    between ``started += 1`` and ``finished += 1``; a reader that saw ``started == finished``
    before reading it and ``started`` unchanged after its point read read it with no write in
    flight, so its point read must agree with it."""

    def __init__(self, handle: RoomHandle) -> None:
        self.started = 0
        self.finished = 0
        self.handle = handle
        self.keys: frozenset[int] = frozenset()
        self.prefetched = False
        self.old: RoomHandle | None = None  # the last purged handle: reads closed


def read_your_writes(ctx: StagingContext, seed: int) -> tuple[list[str], int]:
    """Run the workload; return (what was seen wrong, reads checked with no write in flight).

    One writer owns room 0: it requests, cancels and marks with its handle, and now and then
    purges and reopens the room, keeping :class:`_Model` up to date. After each write it
    reads its own writes back. Reader threads hammer the same point reads and check every
    answer they got with no write in flight against the model.
    """
    rng = random.Random(seed)
    wrong: list[str] = []
    checked = [0]
    stop = threading.Event()
    model = _Model(ctx.open_room(0))

    def writer() -> None:
        deadline = time.monotonic() + BUDGET_S
        try:
            for _ in range(WRITES):
                if wrong or time.monotonic() > deadline:
                    return
                h, chunk, op = model.handle, rng.randrange(CHUNKS), rng.random()
                model.started += 1
                if op < 0.45:
                    ctx.request_prefetch(h, chunk, WRITER_SESSION)
                    model.keys |= {chunk}
                elif op < 0.9:
                    ctx.cancel_prefetch(h, chunk, WRITER_SESSION)
                    model.keys -= {chunk}
                elif op < 0.95:
                    ctx.mark_prefetched(h)
                    model.prefetched = True
                else:
                    ctx.purge_room(h)
                    model.old, model.handle = h, ctx.open_room(0)
                    model.keys, model.prefetched = frozenset(), False
                model.finished += 1
                time.sleep(0)  # an idle window: let the readers read with no write in flight
                if ctx.is_requested(model.handle, chunk, WRITER_SESSION) != (chunk in model.keys):
                    wrong.append(f"writer: is_requested(chunk {chunk}) misses its own write")
                if ctx.is_prefetched(model.handle) != model.prefetched:
                    wrong.append("writer: is_prefetched misses its own write")
        finally:
            stop.set()

    def reader(k: int) -> Callable[[], None]:
        r = random.Random(seed + 1 + k)

        def run() -> None:
            while not stop.is_set():
                before = model.started
                if before != model.finished:
                    continue  # a write is in flight: nothing to compare with
                h, keys, prefetched, old = model.handle, model.keys, model.prefetched, model.old
                chunk, pick = r.randrange(CHUNKS), r.random()
                ref: int | RoomHandle = h if r.random() < 0.7 else 0
                if pick < 0.8:
                    got, want = ctx.is_requested(ref, chunk, WRITER_SESSION), chunk in keys
                elif pick < 0.9:
                    got, want = ctx.is_prefetched(ref), prefetched
                else:
                    got, want = ctx.is_open(ref if old is None else old), old is None
                if model.started == before:  # no write began during the read
                    checked[0] += 1
                    if got != want:
                        wrong.append(f"reader: {pick=:.2f} on {ref} read {got}, model {want}")
                        stop.set()

        return run

    errors = run_threads([writer] + [reader(k) for k in range(READERS)], stop)
    assert errors == [], errors
    return wrong, checked[0]


@pytest.mark.parametrize("lock", LOCK_KINDS)
def test_point_reads_show_own_writes_while_others_read(lock: str) -> None:
    seed = seed_from_env()
    wrong, checked = read_your_writes(StagingContext(lock=lock), seed)
    assert wrong == []
    assert checked > 100  # the readers did compare answers with no write in flight


# ---------------------------------------------------------------------------- planted bugs


def _racy_cached_is_requested(
    self: StagingContext, room: int | RoomHandle, chunk_idx: int, session_id: str
) -> bool:
    """PLANTED BUG: answers from a cached snapshot of every key, stamped with the lock's
    write count. The snapshot is taken under the read lock, but the stamp is read after the
    lock is released: a writer that gets in between leaves the old keys under its new stamp,
    stale until the next write. Sequentially exact."""
    room_id = room.room if isinstance(room, RoomHandle) else room
    check_chunk_idx(chunk_idx)
    check_session_id(session_id)
    cache: tuple[int, frozenset[PrefetchKey]] | None = self.__dict__.get("_planted_cache")
    if cache is None or cache[0] != self.lock.stats().write_acquisitions:
        keys = self.prefetch_requested
        cache = (self.lock.stats().write_acquisitions, keys)
        self.__dict__["_planted_cache"] = cache
    state = self._rooms.get(room_id)
    if state is None or (isinstance(room, RoomHandle) and state.generation != room.generation):
        return False
    return (room_id, chunk_idx, session_id) in cache[1]


def _first_read_cached_is_requested(
    self: StagingContext, room: int | RoomHandle, chunk_idx: int, session_id: str
) -> bool:
    """PLANTED BUG: caches an opening's keys at its first ``is_requested`` and never again.
    Passes every contract test (they read only after writing)."""
    room_id = room.room if isinstance(room, RoomHandle) else room
    check_chunk_idx(chunk_idx)
    check_session_id(session_id)
    state = self._rooms.get(room_id)
    if state is None or (isinstance(room, RoomHandle) and state.generation != room.generation):
        return False
    cache: dict[tuple[int, int], frozenset[tuple[int, str]]]
    cache = self.__dict__.setdefault("_planted_cache", {})
    keys = cache.get((room_id, state.generation))
    if keys is None:
        keys = cache[(room_id, state.generation)] = frozenset(state.requests)
    return (chunk_idx, session_id) in keys


@pytest.fixture
def racy_cache(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(StagingContext, "is_requested", _racy_cached_is_requested)
    yield


def test_planted_racy_cache_is_sequentially_exact() -> None:
    """The planted race is invisible without threads (so only the race can catch it)."""
    ctx = StagingContext()
    h = ctx.open_room(0)
    for chunk in range(CHUNKS):
        assert not _racy_cached_is_requested(ctx, h, chunk, "s")
        ctx.request_prefetch(h, chunk, "s")
        assert _racy_cached_is_requested(ctx, h, chunk, "s")
        assert _racy_cached_is_requested(ctx, 0, chunk, "s")
        ctx.cancel_prefetch(h, chunk, "s")
        assert not _racy_cached_is_requested(ctx, h, chunk, "s")


@pytest.mark.usefixtures("racy_cache")
def test_read_your_writes_catches_a_racy_is_requested_cache() -> None:
    seed = seed_from_env()
    wrong: list[str] = []
    for attempt in range(PLANT_ATTEMPTS):
        wrong, _ = read_your_writes(StagingContext(lock="mutex"), seed + attempt)
        if wrong:
            break
    assert wrong, "the racy cache survived: the workload is too weak"


def test_quiescent_point_reads_catch_a_stale_is_requested_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(StagingContext, "is_requested", _first_read_cached_is_requested)
    seed = seed_from_env()
    scenario = find_scenario("staging-race")
    assert scenario is not None
    config = StressConfig(seed=seed, threads=3, duration=0.6, watchdog_s=10.0)
    result = run_scenario(scenario, config, progress=False)
    counts = {inv.name: inv.violations for inv in result.invariants}
    assert counts["point-reads"] > 0, counts
    epochs = result.extra.get("epochs")
    assert isinstance(epochs, int) and epochs > 0  # the quiescent checks did run
