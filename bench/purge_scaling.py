"""Benchmark ``purge-scaling``: cost of purging one room as the number of live rooms grows.

Compared side by side at each size N (live rooms, 4 prefetch keys each):

* ``rw`` / ``mutex`` -- :meth:`staging.StagingContext.purge_room` (per-room index: the cost
  is O(keys of that room)).
* ``upstream`` -- the pattern engines use today, written fresh here: two bare sets,
  ``prefetched_rooms`` and ``prefetch_requested``; a purge discards the room from the first
  and rebuilds the second without the room's keys (O(all keys)).

Every timed purge runs with exactly N rooms live: each purged room is re-populated right
after its purge, outside the timed span. The per-purge timer overhead (a back-to-back
``perf_counter_ns`` pair) is measured once and subtracted. The upstream purge at 400k keys
takes a large fraction of a second here, so its number of purges per round is sized from a
budget of keys scanned per round.
"""

from __future__ import annotations

import gc
import random
import time
from collections.abc import Callable, Sequence
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
    timer_overhead_ns,
)
from staging import PrefetchKey, StagingContext

NAME = "purge-scaling"
TITLE = "purge_room cost vs live rooms: StagingContext (rw, mutex) vs upstream bare sets"

KEYS_PER_ROOM = 4
SESSIONS = ("peer-0", "peer-1", "peer-2", "peer-3")
GOAL_SIZE = 100_000
GOAL_SPEEDUP = 100.0
FLAT_LIMIT = 2.0
VARIANTS = ("rw", "mutex", "upstream")


@dataclass(frozen=True)
class Preset:
    """Sizes and effort of one run.

    ``ours_purges``: purges timed per round for each of our variants. ``upstream_key_budget``:
    keys the upstream purges may scan per round; its purges per round are
    ``budget // keys``, clamped to ``[2, max_upstream_purges]``.
    """

    sizes: tuple[int, ...]
    rounds: int
    ours_purges: int
    upstream_key_budget: int
    max_upstream_purges: int
    warmup: int = 1


FULL = Preset(
    sizes=(100, 1_000, 10_000, 100_000),
    rounds=9,
    ours_purges=300,
    upstream_key_budget=1_200_000,
    max_upstream_purges=200,
)
QUICK = Preset(
    sizes=(100, 10_000),
    rounds=7,
    ours_purges=150,
    upstream_key_budget=400_000,
    max_upstream_purges=100,
)


class UpstreamSets:
    """The upstream bookkeeping: two bare sets, no lock, no per-room index; purge by discard
    + rebuild. ``fill(room)`` records ``keys_per_room`` chunks of ``session_of(room)``.
    Shared with ``bench/compat.py``."""

    __slots__ = ("keys_per_room", "prefetch_requested", "prefetched_rooms", "session_of")

    def __init__(
        self, keys_per_room: int = KEYS_PER_ROOM, session_of: Callable[[int], str] | None = None
    ) -> None:
        self.keys_per_room = keys_per_room
        self.session_of = _session if session_of is None else session_of
        self.prefetched_rooms: set[int] = set()
        self.prefetch_requested: set[PrefetchKey] = set()

    def fill(self, room: int) -> None:
        session = self.session_of(room)
        self.prefetch_requested.update(
            (room, chunk, session) for chunk in range(self.keys_per_room)
        )
        self.prefetched_rooms.add(room)

    def purge(self, room: int) -> None:
        self.prefetched_rooms.discard(room)
        self.prefetch_requested = {k for k in self.prefetch_requested if k[0] != room}


def _session(room: int) -> str:
    return SESSIONS[room % len(SESSIONS)]


def _fill_ours(ctx: StagingContext, room: int) -> None:
    handle = ctx.open_room(room)
    ctx.request_prefetches(handle, range(KEYS_PER_ROOM), _session(room))
    ctx.mark_prefetched(handle)


def upstream_purges_per_round(preset: Preset, rooms: int) -> int:
    """How many upstream purges one round times at ``rooms`` live rooms."""
    by_budget = preset.upstream_key_budget // (rooms * KEYS_PER_ROOM)
    return max(2, min(preset.max_upstream_purges, by_budget))


def _timed_purges(
    purge: Callable[[int], object],
    refill: Callable[[int], object],
    rooms: Sequence[int],
    overhead_ns: float,
) -> float:
    """Mean ns per purge over ``rooms``; each room is re-filled, untimed, right after."""
    clock = time.perf_counter_ns
    total = 0
    with gc_paused():
        for room in rooms:
            t0 = clock()
            purge(room)
            t1 = clock()
            total += t1 - t0
            refill(room)
    return max(total / len(rooms) - overhead_ns, 0.0)


def _check_intact(ctx: StagingContext, upstream: UpstreamSets, rooms: int) -> None:
    stats = ctx.stats()
    if stats.open_rooms != rooms or stats.requested_keys != rooms * KEYS_PER_ROOM:
        raise RuntimeError(f"benchmark bug: {ctx!r} should hold {rooms} rooms")
    keys = len(upstream.prefetch_requested)
    if len(upstream.prefetched_rooms) != rooms or keys != rooms * KEYS_PER_ROOM:
        raise RuntimeError(f"benchmark bug: upstream holds {keys} keys for {rooms} rooms")


@dataclass
class _Size:
    """The three structures of one size, filled with `rooms` live rooms."""

    rooms: int
    contexts: dict[str, StagingContext]
    upstream: UpstreamSets
    fill_us: float


def _build(rooms: int) -> _Size:
    contexts = {kind: StagingContext(lock=kind, debug=False) for kind in ("rw", "mutex")}
    upstream = UpstreamSets()
    started = time.perf_counter_ns()
    for room in range(rooms):
        _fill_ours(contexts["rw"], room)
    fill_us = (time.perf_counter_ns() - started) / rooms / 1e3
    for room in range(rooms):
        _fill_ours(contexts["mutex"], room)
        upstream.fill(room)
    return _Size(rooms, contexts, upstream, fill_us)


def _cells(
    size: _Size, preset: Preset, overhead_ns: float, rng: random.Random
) -> list[tuple[str, Callable[[], float]]]:
    """One cell per variant: µs per purge over a fresh random sample of rooms."""
    rooms = size.rooms
    n_up = upstream_purges_per_round(preset, rooms)

    def ours(ctx: StagingContext) -> Callable[[], float]:
        def refill(room: int) -> None:
            _fill_ours(ctx, room)

        def cell() -> float:
            sample = [rng.randrange(rooms) for _ in range(preset.ours_purges)]
            return _timed_purges(ctx.purge_room, refill, sample, overhead_ns) / 1e3

        return cell

    def upstream_cell() -> float:
        sample = [rng.randrange(rooms) for _ in range(n_up)]
        return _timed_purges(size.upstream.purge, size.upstream.fill, sample, overhead_ns) / 1e3

    return [
        (_label("rw", rooms), ours(size.contexts["rw"])),
        (_label("mutex", rooms), ours(size.contexts["mutex"])),
        (_label("upstream", rooms), upstream_cell),
    ]


def _label(variant: str, rooms: int) -> str:
    return f"{variant} us/purge @{rooms}"


def measure(preset: Preset) -> BenchResult:
    """Run the benchmark with an explicit preset (tests use tiny ones).

    Every size is built first and all (size, variant) cells are interleaved in the same
    rounds, so the cross-size flatness ratio is side by side too.
    """
    overhead_ns = timer_overhead_ns()
    sizes = [_build(rooms) for rooms in preset.sizes]
    rng = random.Random(6)
    cells = [cell for size in sizes for cell in _cells(size, preset, overhead_ns, rng)]
    samples = interleave(cells, preset.rounds, warmup=preset.warmup)
    for size in sizes:
        for ctx in size.contexts.values():
            _check_intact(ctx, size.upstream, size.rooms)
    fill_us = {size.rooms: size.fill_us for size in sizes}
    by_size = {size.rooms: {v: samples[_label(v, size.rooms)] for v in VARIANTS} for size in sizes}
    del sizes
    gc.collect()

    columns = [
        "live rooms",
        "keys",
        "rw µs/purge",
        "mutex µs/purge",
        "upstream µs/purge",
        "upstream/rw",
        "upstream/mutex",
        "purges/round ours,up",
    ]
    rows: list[dict[str, Cell]] = []
    ratios: list[Ratio] = []
    for rooms, got in by_size.items():
        up_rw = median_ratio(got["upstream"], got["rw"])
        up_mutex = median_ratio(got["upstream"], got["mutex"])
        n_up = upstream_purges_per_round(preset, rooms)
        rows.append(
            {
                "live rooms": rooms,
                "keys": rooms * KEYS_PER_ROOM,
                "rw µs/purge": median(got["rw"]),
                "mutex µs/purge": median(got["mutex"]),
                "upstream µs/purge": median(got["upstream"]),
                "upstream/rw": up_rw,
                "upstream/mutex": up_mutex,
                "purges/round ours,up": f"{preset.ours_purges},{n_up}",
            }
        )
        ratios.append(Ratio(f"upstream/rw @{rooms:,}", up_rw, "> 1: ours (rw) is faster"))
        ratios.append(Ratio(f"upstream/mutex @{rooms:,}", up_mutex, "> 1: ours (mutex) is faster"))

    smallest, largest = min(by_size), max(by_size)
    flat: dict[str, float] = {}
    for kind in ("rw", "mutex"):
        flat[kind] = median_ratio(by_size[largest][kind], by_size[smallest][kind]) or 0.0
        ratios.append(
            Ratio(f"{kind} @{largest:,} / @{smallest:,}", flat[kind], "~1: flat in live rooms")
        )

    goals = [
        Goal(
            f"ours stays flat as live rooms grow (µs/purge at the largest N <= "
            f"{FLAT_LIMIT:g}x the smallest)",
            all(v <= FLAT_LIMIT for v in flat.values()) if largest > smallest else None,
            f"rw {flat['rw']:.2f}x, mutex {flat['mutex']:.2f}x from {smallest:,} to "
            f"{largest:,} rooms",
        ),
        _speedup_goal(by_size),
    ]
    params: dict[str, JSONValue] = {
        "sizes": list(preset.sizes),
        "rounds": preset.rounds,
        "warmup_rounds": preset.warmup,
        "ours_purges_per_round": preset.ours_purges,
        "upstream_key_budget_per_round": preset.upstream_key_budget,
        "max_upstream_purges_per_round": preset.max_upstream_purges,
        "keys_per_room": KEYS_PER_ROOM,
        "timer_overhead_ns": overhead_ns,
    }
    fill_text = ", ".join(f"{fill_us[n]:.1f} @{n:,}" for n in fill_us)
    return BenchResult(
        name=NAME,
        title=TITLE,
        columns=columns,
        rows=rows,
        ratios=ratios,
        goals=goals,
        notes=[
            f"medians of {preset.rounds} rounds interleaving all sizes and variants; every "
            f"purge timed with exactly N rooms live; timer overhead {overhead_ns:.0f} ns/purge "
            "subtracted; GC paused while timing",
            f"filling one room of ours (open + request_prefetches(4) + mark_prefetched, rw), "
            f"untimed setup, µs: {fill_text}",
        ],
        params=params,
        samples=samples,
    )


def _speedup_goal(by_size: dict[int, dict[str, list[float]]]) -> Goal:
    text = f">= {GOAL_SPEEDUP:g}x faster than upstream at {GOAL_SIZE:,} live rooms"
    if GOAL_SIZE not in by_size:
        largest = max(by_size)
        got = by_size[largest]
        up_rw = median_ratio(got["upstream"], got["rw"]) or 0.0
        return Goal(
            text,
            None,
            f"{GOAL_SIZE:,} not measured in this run; at {largest:,}: upstream/rw {up_rw:.0f}x",
        )
    got = by_size[GOAL_SIZE]
    up_rw = median_ratio(got["upstream"], got["rw"]) or 0.0
    up_mutex = median_ratio(got["upstream"], got["mutex"]) or 0.0
    return Goal(
        text,
        min(up_rw, up_mutex) >= GOAL_SPEEDUP,
        f"upstream/rw {up_rw:.0f}x, upstream/mutex {up_mutex:.0f}x",
    )


def run(quick: bool) -> BenchResult:
    """The ``--quick`` preset (100 and 10k rooms) or the full one (100 to 100k rooms)."""
    return measure(QUICK if quick else FULL)
