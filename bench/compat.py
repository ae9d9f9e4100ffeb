"""Benchmark ``compat``: what the upstream-shaped compat views cost next to bare sets.

Compared side by side at each size N (live rooms, 8 prefetch keys each, one session):

* ``key in prefetch_requested`` -- a bare ``set`` of ``(room, chunk_idx, session_id)`` keys;
  :class:`staging.compat.CompatStagingContext`'s live view; and
  :meth:`staging.StagingContext.is_requested` (the lock-free point read the view reuses).
* ``room in prefetched_rooms`` -- a bare ``set``; the compat view;
  :meth:`staging.StagingContext.is_prefetched`.
* ``purge a room`` -- the upstream pattern (``prefetched_rooms.discard(room)`` then
  ``prefetch_requested = {k for k in prefetch_requested if k[0] != room}``, O(all keys));
  ``CompatStagingContext.purge_room`` (with its tombstone); ``StagingContext.purge_room``
  with a handle.

Membership checks run over one list of keys (half present, half absent, random live rooms);
each cell times the loop with the check and the same loop without it (fastest of three
each) and reports the difference per check (ns), so loop overhead is not counted for
anyone. Purges are timed one by one with the timer overhead subtracted; every purged room
is replaced, untimed, by a room with a fresh id, so exactly N rooms are live for every
purge. A fourth row times whole room lifecycles (8 test-and-adds, mark, 8 checks, purge)
with no other room live, each path written as it is meant to be used. Also reported once
per size: ``key in StagingContext.prefetch_requested``, the frozen-snapshot property that
copies every key (what the compat view replaces). Every cell runs on one thread and is
timed in that thread's CPU time (``time.thread_time_ns``), so a busy shared machine shows
less in the numbers.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from bench._harness import (
    BenchResult,
    Cell,
    Goal,
    JSONValue,
    Ratio,
    gc_paused,
    interleave,
    median,
    median_ratio,
)
from bench.purge_scaling import UpstreamSets
from staging import PrefetchKey, RoomHandle, StagingContext
from staging.compat import CompatStagingContext

NAME = "compat"
TITLE = "compat views: `in` and purge vs bare sets and StagingContext"

KEYS_PER_ROOM = 8
SESSION = "peer-0"
KINDS = ("bare", "compat", "context")
OPS = ("key in", "room in", "purge")
NEVER_OPENED = 10**12  # room ids from here on are never opened (the misses)

CLOCK = time.thread_time_ns
"""Every cell here runs on one thread, so it is timed in that thread's CPU time: time the
thread spends descheduled (other processes on a shared machine) is not counted. What load
still does to caches and clock speed is not removed."""


def clock_overhead_ns(samples: int = 2001) -> float:
    """Median cost of one back-to-back :data:`CLOCK` pair, to subtract from single spans."""
    spans = []
    for _ in range(samples):
        t0 = CLOCK()
        t1 = CLOCK()
        spans.append(t1 - t0)
    return median(spans)


@dataclass(frozen=True)
class Preset:
    """Sizes and effort. ``checks``: membership checks per cell; ``purges``: purges of ours
    per cell; the upstream purges per cell are sized from ``upstream_key_budget`` (keys it
    may scan per cell), at least 2; ``snapshot_checks``: checks through the copying
    property, per size; ``lifecycles``: room lifecycles per lifecycle cell."""

    sizes: tuple[int, ...]
    rounds: int
    checks: int
    purges: int
    upstream_key_budget: int
    snapshot_checks: int
    lifecycles: int
    warmup: int = 1


FULL = Preset(
    sizes=(1_000, 10_000),
    rounds=7,
    checks=20_000,
    purges=300,
    upstream_key_budget=800_000,
    snapshot_checks=5,
    lifecycles=2_000,
)
QUICK = Preset(
    sizes=(1_000,),
    rounds=3,
    checks=4_000,
    purges=60,
    upstream_key_budget=160_000,
    snapshot_checks=2,
    lifecycles=300,
)


def _upstream() -> UpstreamSets:
    """The upstream pattern (``bench/purge_scaling.py``'s), one session, this bench's keys."""
    return UpstreamSets(KEYS_PER_ROOM, lambda _room: SESSION)


@dataclass
class _Size:
    """The three structures of one size with the same N live rooms, and the work lists."""

    rooms: int
    upstream: UpstreamSets
    compat: CompatStagingContext
    context: StagingContext
    handles: dict[int, RoomHandle]
    live: list[int]
    next_id: int
    checks: int
    rng: random.Random

    def keys(self) -> list[PrefetchKey]:
        """Keys to check: half present (a live room, a chunk it has), half absent (a live
        room, a chunk it never had). Drawn afresh per cell: purges replace rooms."""
        live, draw = self.live, self.rng.randrange
        return [
            (
                live[draw(len(live))],
                draw(KEYS_PER_ROOM) + (0 if i % 2 == 0 else KEYS_PER_ROOM),
                SESSION,
            )
            for i in range(self.checks)
        ]

    def room_ids(self) -> list[int]:
        """Room ids to check: half live, half never opened."""
        live, draw = self.live, self.rng.randrange
        return [
            live[draw(len(live))] if i % 2 == 0 else NEVER_OPENED + draw(self.rooms)
            for i in range(self.checks)
        ]


def _fill_compat(ctx: CompatStagingContext, room: int) -> None:
    for c in range(KEYS_PER_ROOM):
        ctx.prefetch_requested.add((room, c, SESSION))
    ctx.prefetched_rooms.add(room)


def _fill_context(size: _Size, room: int) -> None:
    handle = size.context.open_room(room)
    size.context.request_prefetches(handle, range(KEYS_PER_ROOM), SESSION)
    size.context.mark_prefetched(handle)
    size.handles[room] = handle


def _build(rooms: int, preset: Preset, rng: random.Random) -> _Size:
    size = _Size(
        rooms=rooms,
        upstream=_upstream(),
        compat=CompatStagingContext(),
        context=StagingContext(debug=False),
        handles={},
        live=list(range(rooms)),
        next_id=rooms,
        checks=preset.checks,
        rng=rng,
    )
    for room in range(rooms):
        size.upstream.fill(room)
        _fill_compat(size.compat, room)
        _fill_context(size, room)
    return size


REPEATS = 3
"""Each membership cell times its loop (and the bare loop) this many times and keeps the
fastest of each, as ``timeit`` advises: on a shared machine the slower repeats measure the
neighbours, not the code."""


def _net_ns(with_check: Callable[[], None], floor: Callable[[], None], n: int) -> float:
    """ns per iteration of ``with_check`` minus the same loop without the check (fastest of
    ``REPEATS`` each)."""
    clock = CLOCK
    floors: list[int] = []
    checks: list[int] = []
    with gc_paused():
        for _ in range(REPEATS):
            t0 = clock()
            floor()
            t1 = clock()
            with_check()
            t2 = clock()
            floors.append(t1 - t0)
            checks.append(t2 - t1)
    return max(min(checks) - min(floors), 0) / n


def _key_cells(size: _Size) -> list[tuple[str, Callable[[], float]]]:
    # upstream.prefetch_requested is rebound by its purges: look it up per cell.
    view = size.compat.prefetch_requested
    is_requested = size.context.is_requested

    def bare_in() -> float:
        keys, bare = size.keys(), size.upstream.prefetch_requested

        def floor() -> None:
            for _key in keys:
                pass

        def check() -> None:
            for key in keys:
                key in bare  # noqa: B015

        return _net_ns(check, floor, len(keys))

    def view_in() -> float:
        keys = size.keys()

        def floor() -> None:
            for _key in keys:
                pass

        def check() -> None:
            for key in keys:
                key in view  # noqa: B015

        return _net_ns(check, floor, len(keys))

    def ctx_in() -> float:
        keys = size.keys()

        def floor() -> None:
            for _room, _chunk, _session in keys:
                pass

        def check() -> None:
            for room, chunk, session in keys:
                is_requested(room, chunk, session)

        return _net_ns(check, floor, len(keys))

    return [
        (_label("key in", "bare", size.rooms), bare_in),
        (_label("key in", "compat", size.rooms), view_in),
        (_label("key in", "context", size.rooms), ctx_in),
    ]


def _room_cells(size: _Size) -> list[tuple[str, Callable[[], float]]]:
    view = size.compat.prefetched_rooms
    is_prefetched = size.context.is_prefetched

    def cell(kind: str) -> Callable[[], float]:
        def run() -> float:
            ids = size.room_ids()
            bare = size.upstream.prefetched_rooms

            def floor() -> None:
                for _room in ids:
                    pass

            def bare_in() -> None:
                for room in ids:
                    room in bare  # noqa: B015

            def view_in() -> None:
                for room in ids:
                    room in view  # noqa: B015

            def ctx_in() -> None:
                for room in ids:
                    is_prefetched(room)

            check = {"bare": bare_in, "compat": view_in, "context": ctx_in}[kind]
            return _net_ns(check, floor, len(ids))

        return run

    return [(_label("room in", kind, size.rooms), cell(kind)) for kind in KINDS]


def _purge_cells(
    size: _Size, preset: Preset, overhead_ns: float, rng: random.Random
) -> list[tuple[str, Callable[[], float]]]:
    n_upstream = max(2, preset.upstream_key_budget // (size.rooms * KEYS_PER_ROOM))

    def timed(kind: str, purges: int) -> float:
        """µs per purge of ``kind``; each purged room is replaced by a fresh id, untimed.
        All three structures replace the same rooms, so they stay equal in size."""
        clock = CLOCK
        total = 0
        with gc_paused():
            for _ in range(purges):
                index = rng.randrange(len(size.live))
                room = size.live[index]
                if kind == "bare":
                    t0 = clock()
                    size.upstream.purge(room)
                    t1 = clock()
                elif kind == "compat":
                    t0 = clock()
                    size.compat.purge_room(room)
                    t1 = clock()
                else:
                    handle = size.handles.pop(room)
                    t0 = clock()
                    size.context.purge_room(handle)
                    t1 = clock()
                total += t1 - t0
                _replace(size, kind, index)
        return max(total / purges - overhead_ns, 0.0) / 1e3

    return [
        (_label("purge", "bare", size.rooms), lambda: timed("bare", n_upstream)),
        (_label("purge", "compat", size.rooms), lambda: timed("compat", preset.purges)),
        (_label("purge", "context", size.rooms), lambda: timed("context", preset.purges)),
    ]


def _replace(size: _Size, purged_kind: str, index: int) -> None:
    """After ``purged_kind`` purged ``live[index]``: purge it from the other two structures
    too (untimed) and fill a fresh room id into all three."""
    room = size.live[index]
    if purged_kind != "bare":
        _upstream_drop(size.upstream, room)
    if purged_kind != "compat":
        size.compat.purge_room(room)
    if purged_kind != "context":
        size.context.purge_room(size.handles.pop(room))
    fresh = size.next_id
    size.next_id += 1
    size.live[index] = fresh
    size.upstream.fill(fresh)
    _fill_compat(size.compat, fresh)
    _fill_context(size, fresh)


def _upstream_drop(upstream: UpstreamSets, room: int) -> None:
    """Remove a room's keys from the bare sets in O(keys of the room) (untimed upkeep)."""
    upstream.prefetched_rooms.discard(room)
    for c in range(KEYS_PER_ROOM):
        upstream.prefetch_requested.discard((room, c, SESSION))


def _label(op: str, kind: str, rooms: int) -> str:
    return f"{op} {kind} @{rooms}"


def _snapshot_in_us(size: _Size, checks: int) -> float:
    """µs per ``key in StagingContext.prefetch_requested`` (the copying property)."""
    clock = CLOCK
    keys = size.keys()[:checks]
    ctx = size.context
    with gc_paused():
        t0 = clock()
        for key in keys:
            key in ctx.prefetch_requested  # noqa: B015
        t1 = clock()
    return (t1 - t0) / len(keys) / 1e3


def _lifecycle_cells(preset: Preset) -> list[tuple[str, Callable[[], float]]]:
    """ns per room lifecycle with no other room live: 8 test-and-adds, mark, 8 membership
    checks, purge -- written as each path is used (fresh room ids: tombstones refuse a
    purged id)."""
    chunks = range(KEYS_PER_ROOM)
    ids = iter(range(1, 2**62))
    upstream = _upstream()
    compat = CompatStagingContext()
    context = StagingContext(debug=False)
    n = preset.lifecycles

    def bare() -> None:
        for _ in range(n):
            room = next(ids)
            for c in chunks:
                key = (room, c, SESSION)
                if key not in upstream.prefetch_requested:
                    upstream.prefetch_requested.add(key)
            upstream.prefetched_rooms.add(room)
            for c in chunks:
                (room, c, SESSION) in upstream.prefetch_requested  # noqa: B015
            upstream.purge(room)

    def ours_compat() -> None:
        keys, rooms = compat.prefetch_requested, compat.prefetched_rooms
        for _ in range(n):
            room = next(ids)
            for c in chunks:
                keys.test_and_add((room, c, SESSION))
            rooms.add(room)
            for c in chunks:
                (room, c, SESSION) in keys  # noqa: B015
            compat.purge_room(room)

    def ours_context() -> None:
        for _ in range(n):
            handle = context.open_room(next(ids))
            for c in chunks:
                context.request_prefetch(handle, c, SESSION)
            context.mark_prefetched(handle)
            for c in chunks:
                context.is_requested(handle, c, SESSION)
            context.purge_room(handle)

    def timed(work: Callable[[], None]) -> Callable[[], float]:
        def cell() -> float:
            clock = CLOCK
            with gc_paused():
                t0 = clock()
                work()
                t1 = clock()
            return (t1 - t0) / n

        return cell

    return [
        (_label("lifecycle", "bare", 0), timed(bare)),
        (_label("lifecycle", "compat", 0), timed(ours_compat)),
        (_label("lifecycle", "context", 0), timed(ours_context)),
    ]


def measure(preset: Preset) -> BenchResult:
    """Run the benchmark with an explicit preset (tests use tiny ones)."""
    rng = random.Random(10)
    overhead_ns = clock_overhead_ns()
    sizes = [_build(rooms, preset, rng) for rooms in preset.sizes]
    cells: list[tuple[str, Callable[[], float]]] = []
    for size in sizes:
        cells += _key_cells(size) + _room_cells(size) + _purge_cells(size, preset, overhead_ns, rng)
    cells += _lifecycle_cells(preset)
    samples = interleave(cells, preset.rounds, warmup=preset.warmup)
    snapshot_us = {size.rooms: _snapshot_in_us(size, preset.snapshot_checks) for size in sizes}
    for size in sizes:
        _check_intact(size)

    columns = [
        "operation",
        "live rooms",
        "unit",
        "bare set / upstream",
        "compat view",
        "StagingContext",
        "compat/bare",
        "compat/StagingContext",
    ]
    what = {
        "key in": ("key in prefetch_requested (vs is_requested)", "ns"),
        "room in": ("room in prefetched_rooms (vs is_prefetched)", "ns"),
        "purge": ("purge one room (upstream: discard + rebind)", "µs"),
        "lifecycle": ("room lifecycle: 8 adds, mark, 8 `in`, purge", "ns"),
    }
    rows: list[dict[str, Cell]] = []
    ratios: list[Ratio] = []
    plan = [(size.rooms, op) for size in sizes for op in OPS] + [(0, "lifecycle")]
    for n, op in plan:
        got = {kind: samples[_label(op, kind, n)] for kind in KINDS}
        c_bare = median_ratio(got["compat"], got["bare"])
        c_ctx = median_ratio(got["compat"], got["context"])
        rows.append(
            {
                "operation": what[op][0],
                "live rooms": n,
                "unit": what[op][1],
                "bare set / upstream": median(got["bare"]),
                "compat view": median(got["compat"]),
                "StagingContext": median(got["context"]),
                "compat/bare": c_bare,
                "compat/StagingContext": c_ctx,
            }
        )
        ratios.append(Ratio(f"{op} compat/bare @{n:,}", c_bare, "> 1: compat is slower"))
        ratios.append(Ratio(f"{op} compat/StagingContext @{n:,}", c_ctx, "> 1: compat is slower"))

    largest = max(preset.sizes)
    key_ctx = median_ratio(
        samples[_label("key in", "compat", largest)], samples[_label("key in", "context", largest)]
    )
    purge_up = median_ratio(
        samples[_label("purge", "bare", largest)], samples[_label("purge", "compat", largest)]
    )
    goals = [
        Goal(
            "`key in` on the compat view costs no more than is_requested",
            None if key_ctx is None else key_ctx <= 1.0,
            f"compat/is_requested {key_ctx:.2f}x at {largest:,} rooms"
            if key_ctx is not None
            else "not measured",
        ),
        Goal(
            "compat purge_room is faster than the upstream discard + rebind",
            None if purge_up is None else purge_up > 1.0,
            f"upstream/compat {purge_up:.0f}x at {largest:,} rooms"
            if purge_up is not None
            else "not measured",
        ),
    ]
    snap_text = ", ".join(
        f"{us:,.0f} µs @{n:,} rooms ({n * KEYS_PER_ROOM:,} keys)" for n, us in snapshot_us.items()
    )
    params: dict[str, JSONValue] = {
        "sizes": list(preset.sizes),
        "rounds": preset.rounds,
        "warmup_rounds": preset.warmup,
        "checks_per_cell": preset.checks,
        "purges_per_cell": preset.purges,
        "upstream_key_budget": preset.upstream_key_budget,
        "keys_per_room": KEYS_PER_ROOM,
        "timer_overhead_ns": overhead_ns,
        "lock": "mutex (the default)",
    }
    return BenchResult(
        name=NAME,
        title=TITLE,
        columns=columns,
        rows=rows,
        ratios=ratios,
        goals=goals,
        notes=[
            "CPU time of the measuring thread (time.thread_time_ns: time descheduled is not "
            f"counted); medians of {preset.rounds} interleaved rounds; membership: net ns "
            "per check "
            f"(fastest of {REPEATS} loops, minus the fastest loop without the check), half "
            "hits, half misses; purges: µs each, "
            f"timer overhead {overhead_ns:.0f} ns subtracted, N rooms live for every purge; "
            "GC paused while timing",
            "key in StagingContext.prefetch_requested (the frozen-snapshot property, copies "
            f"every key per check): {snap_text}",
        ],
        params=params,
        samples=samples,
        extra={"snapshot_in_us": {str(n): us for n, us in snapshot_us.items()}},
        ratios_in_table=True,
    )


def _check_intact(size: _Size) -> None:
    """All three structures still hold exactly the N live rooms (the benchmark's own check).

    Raises:
        RuntimeError: they do not (a benchmark bug).
    """
    want = size.rooms
    keys = want * KEYS_PER_ROOM
    up = size.upstream
    stats = size.compat.stats()
    ctx = size.context.stats()
    got = (
        (len(up.prefetched_rooms), len(up.prefetch_requested)),
        (stats.prefetched_rooms, stats.requested_keys),
        (ctx.prefetched_rooms, ctx.requested_keys),
    )
    if any(g != (want, keys) for g in got) or stats.refused_late_writes:
        raise RuntimeError(f"benchmark bug: expected {want} rooms / {keys} keys, got {got}")


def run(quick: bool) -> BenchResult:
    """The ``--quick`` preset (1k rooms, tiny) or the full one (1k and 10k rooms)."""
    return measure(QUICK if quick else FULL)
