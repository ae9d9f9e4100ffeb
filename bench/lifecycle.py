"""Benchmark ``lifecycle``: the bookkeeping cost of one room's life, 1 to 8 threads.

One lifecycle = ``open_room`` + 8 ``request_prefetch`` + ``mark_prefetched`` + 8
``is_requested`` + ``purge_room`` (the batch variants replace the 8 ``request_prefetch`` by
one ``request_prefetches(room, range(8), session)``). Writers use the :class:`RoomHandle`
that ``open_room`` returned, as the sender does. Each thread runs lifecycles on its own,
disjoint range of room ids against ONE shared object.

Variants, all measured side by side (interleaved round by round):

* ``rw``, ``mutex`` (and ``rw-batch``, ``mutex-batch``) -- :class:`staging.StagingContext`
  with that lock kind, debug checks off.
* ``lock-ref`` -- the reference: the same operations on a minimal class of plain dicts/sets
  guarded by one bare ``threading.Lock`` (no validation, generations, counters or handles).
* ``plain`` -- the same minimal class with no lock at all: the floor.

Reported: ns per lifecycle = wall time / all threads' lifecycles, where wall time runs from
the first worker's start to the last worker's end (each worker stamps both itself, after a
common barrier). Ratios are to ``lock-ref``.

Judged: the library's *default* lock kind (whatever ``StagingContext()`` builds: ``mutex``)
against the goals, <= 2x the reference at 1 thread and <= 3x at 2-8 threads. The other
variants are reported beside it.
"""

from __future__ import annotations

import threading
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
)
from staging import StagingContext

NAME = "lifecycle"
TITLE = (
    "room lifecycle bookkeeping: StagingContext (default mutex; rw) vs a threading.Lock reference"
)

CHUNKS = 8
SESSION = "peer-0"
ROOM_STRIDE = 1_000_000
GOAL_LIMIT = 2.0
"""The goal at 1 thread: the default lifecycle at most this many times the reference."""
GOAL_LIMIT_THREADS = 3.0
"""The goal at 2-8 threads."""
REFERENCE = "lock-ref"
VARIANTS = ("rw", "mutex", "rw-batch", "mutex-batch", REFERENCE, "plain")
JOIN_S = 120.0


@dataclass(frozen=True)
class Preset:
    """Thread counts and effort. ``lifecycles``: per cell, split evenly over the threads."""

    threads: tuple[int, ...]
    lifecycles: int
    rounds: int
    warmup: int = 1


FULL = Preset(threads=(1, 2, 4, 8), lifecycles=2400, rounds=9)
QUICK = Preset(threads=(1, 4), lifecycles=1200, rounds=5)


class LockedSets:
    """The reference: room bookkeeping in plain dicts and sets behind one ``threading.Lock``."""

    __slots__ = ("_lock", "_prefetched", "_rooms")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rooms: dict[int, set[tuple[int, str]]] = {}
        self._prefetched: set[int] = set()

    def open_room(self, room: int) -> int:
        with self._lock:
            if room in self._rooms:
                raise KeyError(room)
            self._rooms[room] = set()
        return room

    def request_prefetch(self, room: int, chunk_idx: int, session_id: str) -> bool:
        key = (chunk_idx, session_id)
        with self._lock:
            keys = self._rooms.get(room)
            if keys is None or key in keys:
                return False
            keys.add(key)
            return True

    def mark_prefetched(self, room: int) -> bool:
        with self._lock:
            if room not in self._rooms or room in self._prefetched:
                return False
            self._prefetched.add(room)
            return True

    def is_requested(self, room: int, chunk_idx: int, session_id: str) -> bool:
        with self._lock:
            keys = self._rooms.get(room)
            return keys is not None and (chunk_idx, session_id) in keys

    def purge_room(self, room: int) -> set[tuple[int, str]] | None:
        with self._lock:
            self._prefetched.discard(room)
            return self._rooms.pop(room, None)


class PlainSets:
    """The floor: :class:`LockedSets` without the lock (safe here only because each thread
    owns its rooms and single dict/set operations are atomic under the GIL)."""

    __slots__ = ("_prefetched", "_rooms")

    def __init__(self) -> None:
        self._rooms: dict[int, set[tuple[int, str]]] = {}
        self._prefetched: set[int] = set()

    def open_room(self, room: int) -> int:
        if room in self._rooms:
            raise KeyError(room)
        self._rooms[room] = set()
        return room

    def request_prefetch(self, room: int, chunk_idx: int, session_id: str) -> bool:
        key = (chunk_idx, session_id)
        keys = self._rooms.get(room)
        if keys is None or key in keys:
            return False
        keys.add(key)
        return True

    def mark_prefetched(self, room: int) -> bool:
        if room not in self._rooms or room in self._prefetched:
            return False
        self._prefetched.add(room)
        return True

    def is_requested(self, room: int, chunk_idx: int, session_id: str) -> bool:
        keys = self._rooms.get(room)
        return keys is not None and (chunk_idx, session_id) in keys

    def purge_room(self, room: int) -> set[tuple[int, str]] | None:
        self._prefetched.discard(room)
        return self._rooms.pop(room, None)


Work = Callable[[range], None]


def context_work(book: StagingContext | LockedSets | PlainSets) -> Work:
    """Lifecycles with 8 single ``request_prefetch`` calls, on a context, the reference or
    the floor (the same calls; the sets take room ids where a context returns handles)."""
    open_room = book.open_room
    request = book.request_prefetch
    mark = book.mark_prefetched
    is_requested = book.is_requested
    purge = book.purge_room
    chunks = range(CHUNKS)
    session = SESSION

    def work(rooms: range) -> None:
        for room in rooms:
            handle = open_room(room)
            for chunk in chunks:
                request(handle, chunk, session)  # type: ignore[arg-type]
            mark(handle)  # type: ignore[arg-type]
            for chunk in chunks:
                is_requested(handle, chunk, session)  # type: ignore[arg-type]
            purge(handle)  # type: ignore[arg-type]

    return work


def context_batch_work(ctx: StagingContext) -> Work:
    """Lifecycles on ``ctx`` with one ``request_prefetches(handle, range(8), session)``."""
    open_room = ctx.open_room
    requests = ctx.request_prefetches
    mark = ctx.mark_prefetched
    is_requested = ctx.is_requested
    purge = ctx.purge_room
    chunks = range(CHUNKS)
    session = SESSION

    def work(rooms: range) -> None:
        for room in rooms:
            handle = open_room(room)
            requests(handle, chunks, session)
            mark(handle)
            for chunk in chunks:
                is_requested(handle, chunk, session)
            purge(handle)

    return work


def default_variant() -> str:
    """The variant of the library's default lock kind (what ``StagingContext()`` builds)."""
    return StagingContext().lock_kind


def make_context(variant: str) -> StagingContext | None:
    """A fresh context for a ``StagingContext`` variant; ``None`` for the reference/floor."""
    if variant in ("rw", "mutex", "rw-batch", "mutex-batch"):
        return StagingContext(lock=variant.removesuffix("-batch"), debug=False)
    if variant in (REFERENCE, "plain"):
        return None
    raise ValueError(f"unknown variant {variant!r}")


def make_work(variant: str, ctx: StagingContext | None = None) -> Work:
    """The lifecycle loop of ``variant`` over ``ctx`` (or over a fresh object of it)."""
    if ctx is None:
        ctx = make_context(variant)
    if ctx is not None:
        batch = variant.endswith("-batch")
        return context_batch_work(ctx) if batch else context_work(ctx)
    return context_work(LockedSets() if variant == REFERENCE else PlainSets())


def timed_threads(work: Work, threads: int, per_thread: int) -> float:
    """Run ``work`` on ``threads`` threads (disjoint room ranges); ns per lifecycle.

    Raises:
        RuntimeError: a worker raised or did not finish within ``JOIN_S``.
    """
    barrier = threading.Barrier(threads)
    starts = [0] * threads
    ends = [0] * threads
    errors: list[BaseException] = []
    clock = time.perf_counter_ns

    def body(index: int) -> None:
        rooms = range(index * ROOM_STRIDE, index * ROOM_STRIDE + per_thread)
        try:
            barrier.wait(JOIN_S)
            starts[index] = clock()
            work(rooms)
            ends[index] = clock()
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    workers = [
        threading.Thread(target=body, args=(i,), name=f"bench-lifecycle-{i}", daemon=True)
        for i in range(threads)
    ]
    with gc_paused():
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(JOIN_S)
    if any(worker.is_alive() for worker in workers):
        raise RuntimeError("lifecycle worker did not finish")
    if errors:
        raise RuntimeError("lifecycle worker failed") from errors[0]
    return (max(ends) - min(starts)) / (threads * per_thread)


def _cell(
    variant: str, threads: int, per_thread: int, contended: list[float]
) -> Callable[[], float]:
    """Time one cell; for a context variant, also append its contended-acquisition share."""

    def cell() -> float:
        ctx = make_context(variant)
        ns = timed_threads(make_work(variant, ctx), threads, per_thread)
        if ctx is not None:
            stats = ctx.lock.stats()
            total = stats.read_acquisitions + stats.write_acquisitions
            contended.append(stats.contended / total if total else 0.0)
        return ns

    return cell


def _label(variant: str, threads: int) -> str:
    return f"{variant} t={threads}"


def _contention_text(
    contention: dict[str, list[float]], variants: Sequence[str], threads: Sequence[int]
) -> str:
    parts = []
    for v in variants:
        shares = {t: contention[_label(v, t)] for t in threads if t > 1}
        if not all(shares.values()) or not shares:
            continue
        cells = ", ".join(
            f"t={t} {100 * median(got):.1f}%/{100 * max(got):.1f}%" for t, got in shares.items()
        )
        parts.append(f"{v}: {cells}")
    return "; ".join(parts) or "-"


def measure(preset: Preset, variants: Sequence[str] = VARIANTS) -> BenchResult:
    """Run the benchmark with an explicit preset (tests use tiny ones).

    ``variants`` must include ``lock-ref`` (the ratios' denominator).

    Raises:
        ValueError: ``lock-ref`` missing or an unknown variant.
    """
    if REFERENCE not in variants:
        raise ValueError(f"variants must include {REFERENCE!r}")
    for variant in variants:
        make_work(variant)
    contention: dict[str, list[float]] = {
        _label(v, t): [] for t in preset.threads for v in variants
    }
    cells = [
        (_label(v, t), _cell(v, t, max(1, preset.lifecycles // t), contention[_label(v, t)]))
        for t in preset.threads
        for v in variants
    ]
    samples = interleave(cells, preset.rounds, warmup=preset.warmup)
    contention = {k: v[preset.warmup :] for k, v in contention.items()}  # as interleave does

    columns = [
        "variant",
        *(f"ns t={t}" for t in preset.threads),
        *(f"/ref t={t}" for t in preset.threads),
    ]
    rows: list[dict[str, Cell]] = []
    for v in variants:
        row: dict[str, Cell] = {"variant": v}
        for t in preset.threads:
            row[f"ns t={t}"] = median(samples[_label(v, t)])
            row[f"/ref t={t}"] = median_ratio(samples[_label(v, t)], samples[_label(REFERENCE, t)])
        rows.append(row)
    ratios: list[Ratio] = []
    judged = default_variant()
    judged_vs_ref: dict[int, float | None] = {}
    for t in preset.threads:
        ref = samples[_label(REFERENCE, t)]
        for v in variants:
            if v == REFERENCE:
                continue
            ratio = median_ratio(samples[_label(v, t)], ref)
            if v == judged:
                judged_vs_ref[t] = ratio
            ratios.append(Ratio(f"{v}/{REFERENCE} t={t}", ratio, "> 1: slower than reference"))

    goals: list[Goal] = []
    if judged in variants:
        for text, limit, counts in (
            ("1 thread", GOAL_LIMIT, [t for t in preset.threads if t == 1]),
            ("2-8 threads", GOAL_LIMIT_THREADS, [t for t in preset.threads if 2 <= t <= 8]),
        ):
            known = {t: r for t in counts if (r := judged_vs_ref.get(t)) is not None}
            detail = ", ".join(f"t={t}: {r:.2f}x" for t, r in known.items())
            goals.append(
                Goal(
                    f"default lock ({judged}) <= {limit:g}x the threading.Lock reference at {text}",
                    all(r <= limit for r in known.values()) if known else None,
                    detail or "not measured",
                )
            )
    contended_text = _contention_text(contention, variants, preset.threads)
    params: dict[str, JSONValue] = {
        "threads": list(preset.threads),
        "lifecycles_per_cell": preset.lifecycles,
        "rounds": preset.rounds,
        "warmup_rounds": preset.warmup,
        "chunks": CHUNKS,
        "variants": list(variants),
    }
    return BenchResult(
        name=NAME,
        title=TITLE,
        columns=columns,
        rows=rows,
        ratios=ratios,
        goals=goals,
        notes=[
            f"ns per lifecycle (open + {CHUNKS} request + mark + {CHUNKS} is_requested + "
            f"purge), medians of {preset.rounds} interleaved rounds of {preset.lifecycles} "
            "lifecycles split over the threads; GC paused while timing",
            "lock-ref and plain do no argument validation and keep no generations, "
            "counters or reverse index; ratios to lock-ref include all of that",
            "contended acquisitions (lock stats), median/max over rounds: " + contended_text,
        ],
        params=params,
        samples=samples,
        extra={"contended_share": {k: list(v) for k, v in contention.items() if v}},
        ratios_in_table=True,
    )


def run(quick: bool) -> BenchResult:
    """The ``--quick`` preset (1 and 4 threads) or the full one (1, 2, 4, 8 threads)."""
    return measure(QUICK if quick else FULL)
