"""``staging.compat.CompatStagingContext``: the upstream two-set shape, made thread-safe.

The threaded tests run engine-shaped code as it is written upstream -- a scheduler that
checks and adds to ``prefetched_rooms`` / ``prefetch_requested``, four transfer workers
whose last chunk purges with ``discard`` + the set-comprehension rebind, late workers that
write after the purge, and an observer that iterates both sets while everyone mutates --
at a 1 µs switch interval. Each prints its seed (``COMPAT_SEED=<seed>`` replays it). The
planted-bug tests rerun the same workload with a bug put back (purge without tombstone;
iteration over the live structure) and must see it fail, so the checks can fail.
"""

from __future__ import annotations

import logging
import os
import queue
import random
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from bench import compat as compat_bench
from bench._registry import BY_NAME
from staging import RoomPurgedError, StagingError
from staging.compat import (
    DEFAULT_TOMBSTONES,
    CompatStagingContext,
    PrefetchRequestedView,
    _CompatCore,
)
from staging.context import PrefetchKey, RoomPurge
from staging.locks import LOCK_KINDS

pytestmark = pytest.mark.timeout(60)

JOIN_S = 20.0
CHUNKS = 8
SESSION = "decode-0"
ROOMS = 1000
FAIL_SHARE = 0.1
LATE_WRITES_PER_ROOM = 3  # add to each view + one test_and_add, all after the purge


def _seed() -> int:
    seed = int(os.environ.get("COMPAT_SEED", random.randrange(2**32)))
    print(f"COMPAT_SEED={seed}")
    return seed


@pytest.fixture(params=LOCK_KINDS)
def ctx(request: pytest.FixtureRequest) -> CompatStagingContext:
    return CompatStagingContext(lock=request.param, debug=True)


# ------------------------------------------------------------------ set behaviour


def test_views_behave_like_the_two_sets(ctx: CompatStagingContext) -> None:
    rooms, keys = ctx.prefetched_rooms, ctx.prefetch_requested
    assert len(rooms) == 0 and len(keys) == 0 and not keys and keys == set()
    keys.add((7, 0, "d0"))
    keys.add((7, 1, "d0"))
    keys.add((7, 1, "d0"))  # duplicate: no change
    rooms.add(7)
    assert (7, 0, "d0") in keys and (7, 2, "d0") not in keys and 7 in rooms
    assert len(keys) == 2 and len(rooms) == 1
    assert keys == {(7, 0, "d0"), (7, 1, "d0")} and rooms == {7}
    assert sorted(keys) == [(7, 0, "d0"), (7, 1, "d0")]
    assert keys.test_and_add((7, 2, "d0")) is True
    assert keys.test_and_add((7, 2, "d0")) is False
    keys.discard((7, 2, "d0"))
    keys.discard((7, 2, "d0"))  # absent: no-op
    with pytest.raises(KeyError):
        keys.remove((7, 5, "d0"))
    keys.remove((7, 1, "d0"))
    assert keys == {(7, 0, "d0")}
    # Set algebra returns frozen snapshots; comparisons use one snapshot.
    assert keys | {(8, 0, "d1")} == frozenset({(7, 0, "d0"), (8, 0, "d1")})
    assert keys & {(7, 0, "d0"), 3} == {(7, 0, "d0")}
    assert {(7, 0, "d0"), 3} - keys == {3}
    assert keys <= {(7, 0, "d0"), 1} and keys < {(7, 0, "d0"), 1} and keys > set()
    assert keys >= {(7, 0, "d0")} and not keys > {(7, 0, "d0")}
    assert rooms.isdisjoint({1, 2}) and not rooms.isdisjoint([7])
    # Non-keys are simply not members, as with a set.
    odd: list[object] = [7, "x", (7, 0), (7, 0, "d0", 1), None, [7, 0, "d0"]]
    assert not any(o in keys for o in odd[:-1]) and not any(o in rooms for o in odd[1:-1])
    with pytest.raises(TypeError):  # unhashable, as with a set
        assert odd[-1] in rooms
    maybe: object = 7.0
    assert maybe in rooms and (7.0, 0, "d0") in keys  # equal values match, as with a set
    assert (True, 0, "d0") not in keys  # True == 1, and room 1 is not open
    rooms.discard(7)
    assert 7 not in rooms and (7, 0, "d0") in keys  # the room keeps its key
    assert keys.pop() == (7, 0, "d0")
    assert not keys and ctx.stats().open_rooms == 0  # a room holding nothing closes
    with pytest.raises(KeyError):
        keys.pop()
    with pytest.raises(KeyError):
        rooms.pop()


def test_in_place_operators_and_clear(ctx: CompatStagingContext) -> None:
    ctx.prefetch_requested |= {(1, 0, "d0"), (1, 1, "d0"), (2, 0, "d0")}
    ctx.prefetched_rooms |= {1, 2}
    ctx.prefetch_requested -= {(1, 1, "d0")}
    assert ctx.prefetch_requested == {(1, 0, "d0"), (2, 0, "d0")}
    ctx.prefetch_requested.clear()
    assert len(ctx.prefetch_requested) == 0 and ctx.prefetched_rooms == {1, 2}
    assert ctx.stats().open_rooms == 2  # still marked
    ctx.prefetched_rooms.clear()
    s = ctx.stats()
    assert (s.open_rooms, s.prefetched_rooms, s.requested_keys) == (0, 0, 0)
    ctx.prefetch_requested.add((3, 0, "d0"))
    ctx.prefetched_rooms.add(3)
    assert ctx.prefetched_rooms.pop() == 3 and (3, 0, "d0") in ctx.prefetch_requested


def test_bad_elements_raise_clearly(ctx: CompatStagingContext) -> None:
    with pytest.raises(TypeError, match="tuples"):
        ctx.prefetch_requested.add((1, 0))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ctx.prefetch_requested.add((1, 0, 5))  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ctx.prefetch_requested.add((-1, 0, "d0"))
    with pytest.raises(TypeError):
        ctx.prefetched_rooms.add(True)
    ctx.prefetched_rooms.discard("7")  # not a member: nothing happens, as with set.discard
    with pytest.raises(KeyError):
        ctx.prefetched_rooms.remove("7")  # as set.remove (tests/staging/test_compat_leniency.py)
    assert ctx.snapshot().open_rooms == frozenset()


def test_iterating_while_mutating_never_raises(ctx: CompatStagingContext) -> None:
    for room in range(5):
        ctx.prefetched_rooms.add(room)
        ctx.prefetch_requested.add((room, 0, "d0"))
    for room in ctx.prefetched_rooms:  # a bare set raises "Set changed size" here
        ctx.purge_room(room)
        ctx.prefetched_rooms.add(room + 100)
    for key in ctx.prefetch_requested:
        ctx.prefetch_requested.discard(key)
    assert ctx.prefetched_rooms == set(range(100, 105)) and not ctx.prefetch_requested


def test_membership_is_lock_free_and_never_copies(
    ctx: CompatStagingContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    for room in range(200):
        ctx.prefetch_requested.add((room, 0, "d0"))
        ctx.prefetched_rooms.add(room)

    def no_copy(self: object) -> frozenset[object]:
        raise AssertionError("`in` took a snapshot")

    monkeypatch.setattr(PrefetchRequestedView, "snapshot", no_copy)
    before = ctx.lock.stats()
    for room in range(400):
        assert ((room, 0, "d0") in ctx.prefetch_requested) is (room < 200)
        assert (room in ctx.prefetched_rooms) is (room < 200)
    after = ctx.lock.stats()
    assert (after.read_acquisitions, after.write_acquisitions) == (
        before.read_acquisitions,
        before.write_acquisitions,
    )


# ------------------------------------------------------------------ rebind, purge, tombstones


def test_rebinding_either_view_raises_and_names_purge_room(ctx: CompatStagingContext) -> None:
    ctx.prefetch_requested.add((4, 0, "d0"))
    ctx.prefetched_rooms.add(4)
    keys_view = ctx.prefetch_requested
    with pytest.raises(TypeError, match=r"purge_room\(room\)"):
        ctx.prefetch_requested = {k for k in ctx.prefetch_requested if k[0] != 4}  # type: ignore[assignment]
    with pytest.raises(TypeError, match=r"purge_room\(room\)"):
        ctx.prefetched_rooms = set()  # type: ignore[assignment]
    with pytest.raises(TypeError, match="purge_room"):
        del ctx.prefetch_requested
    assert ctx.prefetch_requested is keys_view
    assert ctx.prefetch_requested == {(4, 0, "d0")} and ctx.prefetched_rooms == {4}
    with pytest.raises(AttributeError):
        ctx.other = 1


def test_purge_room_purges_both_views_and_refuses_late_adds(ctx: CompatStagingContext) -> None:
    for chunk in range(3):
        ctx.prefetch_requested.add((9, chunk, "d0"))
    ctx.prefetched_rooms.add(9)
    ctx.prefetch_requested.add((10, 0, "d0"))
    got = ctx.purge_room(9)
    assert isinstance(got, RoomPurge) and got.was_open and got.was_prefetched
    assert got.requests == {(0, "d0"), (1, "d0"), (2, "d0")}
    assert 9 not in ctx.prefetched_rooms and ctx.prefetch_requested == {(10, 0, "d0")}
    assert ctx.purge_room(9).was_open is False  # idempotent
    # Late writers (a worker finishing after the purge): refused, returns normally.
    ctx.prefetch_requested.add((9, 0, "d0"))
    ctx.prefetched_rooms.add(9)
    assert ctx.prefetch_requested.test_and_add((9, 1, "d0")) is False
    assert (9, 0, "d0") not in ctx.prefetch_requested and 9 not in ctx.prefetched_rooms
    s = ctx.stats()
    assert (s.refused_late_writes, s.purges, s.tombstones) == (3, 1, 1)
    assert s.tombstone_capacity == DEFAULT_TOMBSTONES
    # A purge of a room that never had state still tombstones the id.
    ctx.purge_room(11)
    ctx.prefetched_rooms.add(11)
    assert 11 not in ctx.prefetched_rooms and ctx.stats().refused_late_writes == 4


def test_tombstones_are_bounded_and_can_be_turned_off() -> None:
    ctx = CompatStagingContext(tombstones=2)
    for room in (1, 2, 3):
        ctx.prefetched_rooms.add(room)
        ctx.purge_room(room)
    assert ctx.stats().tombstones == 2
    ctx.prefetched_rooms.add(1)  # evicted from the window: a new room again
    ctx.prefetched_rooms.add(2)  # still remembered: refused
    assert ctx.prefetched_rooms == {1} and ctx.stats().refused_late_writes == 1
    ctx.purge_room(3)  # re-purging refreshes the id's place in the window
    ctx.purge_room(1)
    assert ctx.stats().tombstones == 2
    ctx.prefetched_rooms.add(3)
    assert 3 not in ctx.prefetched_rooms
    off = CompatStagingContext(tombstones=0)
    off.prefetched_rooms.add(5)
    off.purge_room(5)
    off.prefetched_rooms.add(5)  # upstream semantics: the late add re-creates the room
    assert 5 in off.prefetched_rooms
    s = off.stats()
    assert (s.tombstones, s.tombstone_capacity, s.refused_late_writes) == (0, 0, 0)


def test_strict_mode_raises_a_staging_error_for_late_adds() -> None:
    ctx = CompatStagingContext(strict=True, lock="rw")
    assert ctx.strict and ctx.lock_kind == "rw"
    ctx.prefetch_requested.add((3, 0, "d0"))
    ctx.purge_room(3)
    with pytest.raises(RoomPurgedError, match="room 3") as info:
        ctx.prefetch_requested.add((3, 0, "d0"))
    assert isinstance(info.value, StagingError) and info.value.room == 3
    with pytest.raises(RoomPurgedError):
        ctx.prefetched_rooms.add(3)
    with pytest.raises(RoomPurgedError):
        ctx.prefetch_requested.test_and_add((3, 1, "d0"))
    assert ctx.stats().refused_late_writes == 3 and ctx.snapshot().open_rooms == frozenset()
    ctx.prefetch_requested.discard((3, 0, "d0"))  # discards are never refused
    assert ctx.prefetch_requested.test_and_add((4, 0, "d0")) is True
    assert ctx.prefetch_requested.test_and_add((4, 0, "d0")) is False  # duplicate: no raise


@pytest.mark.parametrize(
    ("kwargs", "exc"),
    [
        ({"tombstones": -1}, ValueError),
        ({"tombstones": True}, TypeError),
        ({"tombstones": 1.5}, TypeError),
        ({"strict": "yes"}, TypeError),
        ({"lock": "spin"}, ValueError),
        ({"lock_timeout": True}, TypeError),
        ({"lock_timeout": 1e12}, ValueError),
        ({"debug": "no"}, TypeError),
    ],
)
def test_bad_constructor_arguments(kwargs: dict[str, object], exc: type[Exception]) -> None:
    with pytest.raises(exc):
        CompatStagingContext(**kwargs)  # type: ignore[arg-type]


def test_repr_and_snapshot(ctx: CompatStagingContext) -> None:
    ctx.prefetch_requested.add((1, 0, "d0"))
    ctx.prefetched_rooms.add(1)
    snap = ctx.snapshot()
    assert snap.prefetched_rooms == {1} and snap.prefetch_requested == {(1, 0, "d0")}
    assert "keys=1" in repr(ctx) and "(1, 0, 'd0')" in repr(ctx.prefetch_requested)
    assert ctx.purge_session("d0") == {1} and not ctx.prefetch_requested


# ------------------------------------------------------------------ upstream-shaped threads


@dataclass
class Outcome:
    """What one upstream-shaped run saw."""

    errors: list[BaseException] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    rebinds_refused: int = 0
    late_done: int = 0
    observed_snapshots: int = 0


def upstream_shaped_run(ctx: CompatStagingContext, seed: int, rooms: int = ROOMS) -> Outcome:
    """Scheduler + 4 workers + late writers + an observer, written as upstream code is.

    Room ids are random 63-bit ints; ``FAIL_SHARE`` of the rooms fail at once (the
    scheduler purges them while their late writers are queued). Every other room is purged
    by the worker that finishes its last chunk, with upstream's discard + rebind (the rebind
    must raise TypeError) followed by ``purge_room``. After each purge, a late writer adds
    to both views. The returned violations must be empty.
    """
    rng = random.Random(seed)
    room_ids = rng.sample(range(1, 2**63), rooms)
    failing = {r for r in room_ids if rng.random() < FAIL_SHARE}
    work: queue.Queue[tuple[str, int, int] | None] = queue.Queue()
    out = Outcome()
    book = threading.Lock()  # guards the test's own counters, not the context
    left = dict.fromkeys(room_ids, CHUNKS)
    stop = threading.Event()

    def scheduler() -> None:
        for room in room_ids:
            # Upstream scheduler: check, then add each key; then mark the room.
            if room not in ctx.prefetched_rooms:
                for chunk in range(CHUNKS):
                    key = (room, chunk, SESSION)
                    if key not in ctx.prefetch_requested:
                        ctx.prefetch_requested.add(key)
                ctx.prefetched_rooms.add(room)
            if room in failing:
                ctx.purge_room(room)  # the request failed: its state goes now
                work.put(("late", room, 0))
            else:
                for chunk in range(CHUNKS):
                    work.put(("chunk", room, chunk))

    def worker() -> None:
        while True:
            item = work.get(timeout=JOIN_S)
            if item is None:
                return
            kind, room, chunk = item
            if kind == "late":  # a writer that did not see the purge
                ctx.prefetch_requested.add((room, chunk, SESSION))
                ctx.prefetched_rooms.add(room)
                if ctx.prefetch_requested.test_and_add((room, chunk + 1, SESSION)):
                    raise AssertionError(f"late write to purged room {room} accepted")
                with book:
                    out.late_done += 1
                continue
            if (room, chunk, SESSION) not in ctx.prefetch_requested:
                raise AssertionError(f"key of live room {room} chunk {chunk} missing")
            with book:
                left[room] -= 1
                last = left[room] == 0
            if last:  # upstream worker purge: discard, then the racy rebind
                ctx.prefetched_rooms.discard(room)
                try:
                    ctx.prefetch_requested = {  # type: ignore[assignment]
                        k for k in ctx.prefetch_requested if k[0] != room
                    }
                except TypeError:
                    with book:
                        out.rebinds_refused += 1
                ctx.purge_room(room)
                work.put(("late", room, 0))

    def observer() -> None:
        while not stop.is_set():
            for key in ctx.prefetch_requested:  # iterate while everyone mutates
                assert len(key) == 3
            sorted(ctx.prefetched_rooms)
            len(ctx.prefetch_requested)
            snap = ctx.snapshot()
            if (
                not snap.prefetched_rooms <= snap.open_rooms
                or not {k[0] for k in snap.prefetch_requested} <= snap.open_rooms
            ):
                out.violations.append("snapshot: a view names a room that is not open")
            out.observed_snapshots += 1
            time.sleep(0)

    threads = [threading.Thread(target=_catch(scheduler, out), name="scheduler", daemon=True)]
    workers = [
        threading.Thread(target=_catch(worker, out, stop), name=f"worker-{i}", daemon=True)
        for i in range(4)
    ]
    watcher = threading.Thread(target=_catch(observer, out, stop), name="observer", daemon=True)
    for t in [*threads, *workers, watcher]:
        t.start()
    _join(threads)
    # Every room ends with one late item; the sentinels go in once all of them were done.
    deadline = time.monotonic() + JOIN_S
    while time.monotonic() < deadline and not out.errors:
        with book:
            if out.late_done == rooms:
                break
        time.sleep(0.005)
    for _ in workers:
        work.put(None)
    _join(workers)
    stop.set()
    _join([watcher])

    s = ctx.stats()
    normal = rooms - len(failing)
    if (s.open_rooms, s.prefetched_rooms, s.requested_keys) != (0, 0, 0):
        out.violations.append(f"state left after every room was purged: {s}")
    if s.refused_late_writes != LATE_WRITES_PER_ROOM * rooms:
        out.violations.append(
            f"refused late writes {s.refused_late_writes}, expected {LATE_WRITES_PER_ROOM * rooms}"
        )
    if out.rebinds_refused != normal:
        out.violations.append(f"rebinds refused {out.rebinds_refused}, expected {normal}")
    if out.observed_snapshots == 0:
        out.violations.append("the observer never ran")
    return out


def _catch(
    fn: Callable[[], None], out: Outcome, stop: threading.Event | None = None
) -> Callable[[], None]:
    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # reported by the test
            out.errors.append(exc)
            if stop is not None:
                stop.set()

    return run


def _join(threads: list[threading.Thread]) -> None:
    deadline = time.monotonic() + JOIN_S
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    alive = [t.name for t in threads if t.is_alive()]
    assert not alive, f"threads did not finish within {JOIN_S} s: {alive}"


@pytest.mark.usefixtures("fast_switch")
@pytest.mark.parametrize("lock", LOCK_KINDS)
def test_upstream_shaped_scheduler_and_four_workers(lock: str) -> None:
    out = upstream_shaped_run(CompatStagingContext(lock=lock, debug=True), _seed())
    assert not out.errors, out.errors
    assert not out.violations, out.violations


@pytest.fixture
def planted_no_tombstone(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Plant the bug: purge_room purges but does not remember the id."""

    def purge_only(self: _CompatCore, room: int) -> RoomPurge:
        with self._lock.write_untimed():
            return self._purge_locked(room, None)

    monkeypatch.setattr(_CompatCore, "purge_and_tombstone", purge_only)
    yield


@pytest.mark.usefixtures("fast_switch", "planted_no_tombstone")
def test_planted_purge_without_tombstone_is_caught() -> None:
    out = upstream_shaped_run(CompatStagingContext(), _seed(), rooms=60)
    text = " | ".join(out.violations) + " | " + " | ".join(map(repr, out.errors))
    assert "refused late writes 0" in text and "late write to purged room" in text


@pytest.mark.usefixtures("fast_switch")
def test_planted_live_iteration_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plant the bug: iterate the live room dict instead of a snapshot. The observer must
    die with "changed size during iteration" (the upstream symptom)."""

    def live_iter(self: PrefetchRequestedView) -> Iterator[PrefetchKey]:
        for room, state in self._core._rooms.items():
            for chunk, session in state.requests:
                time.sleep(0)  # yield inside the iteration, as a slow consumer would
                yield room, chunk, session

    monkeypatch.setattr(PrefetchRequestedView, "__iter__", live_iter)
    out = upstream_shaped_run(CompatStagingContext(), _seed(), rooms=120)
    assert any(
        isinstance(e, RuntimeError) and "changed size during iteration" in str(e)
        for e in out.errors
    ), out.errors


# ------------------------------------------------------------------ the benchmark


def test_compat_bench_tiny_and_registered() -> None:
    preset = compat_bench.Preset(
        sizes=(20,),
        rounds=1,
        checks=40,
        purges=3,
        upstream_key_budget=100,
        snapshot_checks=1,
        lifecycles=5,
    )
    result = compat_bench.measure(preset)
    assert result.status == "ok"
    assert [(row["operation"], row["live rooms"]) for row in result.rows] == [
        ("key in prefetch_requested (vs is_requested)", 20),
        ("room in prefetched_rooms (vs is_prefetched)", 20),
        ("purge one room (upstream: discard + rebind)", 20),
        ("room lifecycle: 8 adds, mark, 8 `in`, purge", 0),
    ]
    assert all(set(row) == set(result.columns) for row in result.rows)
    assert len(result.samples) == 12 and all(len(v) == 1 for v in result.samples.values())
    assert result.goals and result.render()
    assert callable(BY_NAME["compat"].load())


# ------------------------------------------------------------------ the README quick start


def test_readme_staging_quick_start_runs(caplog: pytest.LogCaptureFixture) -> None:
    readme = Path(__file__).resolve().parents[2] / "README.md"
    text = readme.read_text(encoding="utf-8")
    section = text[text.index("## Quick start: staging only") : text.index("## Usage")]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "no python example under '## Quick start: staging only'"
    assert "torch" not in match.group(1) and "sender" not in match.group(1)
    with caplog.at_level(logging.DEBUG):
        exec(compile(match.group(1), "README.md:quick-start", "exec"), {"__name__": "quick_start"})
    # What it logs is announced before the example (it printed an unannounced WARNING).
    logged = [(r.name, r.levelname) for r in caplog.records if r.levelno >= logging.WARNING]
    assert logged == [("staging.compat", "WARNING")]
    before = section[: match.start()]
    assert "one `WARNING` on purpose (logger `staging.compat`" in " ".join(before.split())


@pytest.mark.usefixtures("fast_switch")
def test_adopting_guide_handle_example_runs() -> None:
    guide = Path(__file__).resolve().parents[2] / "docs" / "ADOPTING.md"
    text = guide.read_text(encoding="utf-8")
    section = text[text.index("## Carrying a RoomHandle") : text.index("## Picking the lock kind")]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "no python example under '## Carrying a RoomHandle through work items'"
    code = compile(match.group(1), "docs/ADOPTING.md:handles", "exec", dont_inherit=True)
    exec(code, {"__name__": "__main__"})
