"""Where a ``StagingContext`` lifecycle spends its time (a diagnostic, not a benchmark).

``python -m bench.lifecycle_profile [--quick]`` prints five views:

1. **Ablation** of the whole lifecycle of :mod:`bench.lifecycle`, single-threaded
   (interleaved rounds, medians): the default ``mutex``; ``mutex`` with debug checks on;
   ``rw``; the context with its lock swapped for a no-op (everything but the lock layer);
   that plus the argument validators stubbed out (the hot methods inline their exact-type
   fast paths, so this now strips only what is left outside them); and the
   ``threading.Lock`` reference and the bare floor. Differences between neighbours give
   each layer's cost.
2. **Micro** costs per operation: a bare ``threading.Lock``, our lock's guards and its
   ``acquire_write``/``release_write`` pair, ``RWLockFair`` driven directly, argument checks,
   and each call of the lifecycle on the default context beside the reference's.
3. **cProfile** of the default lifecycle: the top functions by own time (cProfile inflates
   per-call costs of small functions; read it for call counts and ranking).
4. **What-if** lifecycles for ``rw`` with candidate savings applied from outside (a subclass
   of our ``RWLock`` swapped in), to size each suggestion before anyone edits ``staging``.
5. **Threads**: the default lifecycle at 2-8 threads, with contended waiters handing the GIL
   to the holder first (``staging.locks.HANDOFF_YIELDS``, shipped) and blocking at once (as
   before): rounds, the median ratio to the reference, the contended share and voluntary
   context switches. A *convoy* -- every acquisition a hand-off through the kernel, see
   ``staging.locks.StagingLock._wait`` -- shows as a round with hundreds of
   contended acquisitions and context switches.

The ablation patches ``staging.context``'s validators, one context's ``_lock`` and (view 5)
``staging.locks.HANDOFF_YIELDS`` for the duration of a cell only; nothing in ``staging`` is
edited.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import resource
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import PurePath
from types import TracebackType
from typing import Protocol

from readerwriterlock import rwlock

import staging.context as staging_context
import staging.locks as staging_locks
from bench._harness import format_table, gc_paused, interleave, median, timer_overhead_ns
from bench.lifecycle import CHUNKS, SESSION, LockedSets, PlainSets, context_work, timed_threads
from staging import StagingContext
from staging.errors import LockTimeoutError
from staging.locks import LockLevel, LockMode, RWLock, make_lock
from staging.validate import check_chunk_idx, check_room_id, check_session_id

VALIDATORS = ("check_room_id", "check_chunk_idx", "check_session_id")
DEFAULT_LABEL = "mutex (shipped, the default)"


class _NoGuard:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None


_NO_GUARD = _NoGuard()


class _NullLock:
    """Stands in for a context's lock: read()/write() return one shared no-op guard, the
    plain acquire/release methods do nothing."""

    kind = "none"

    def acquire_write(self) -> None:
        return None

    def acquire_write_untimed(self) -> None:
        return None

    def release_write(self) -> None:
        return None

    def read(self) -> _NoGuard:
        return _NO_GUARD

    def write(self) -> _NoGuard:
        return _NO_GUARD

    def write_untimed(self) -> _NoGuard:
        return _NO_GUARD


def _identity(value: object) -> object:
    return value


class _Inner(Protocol):
    def acquire(self, blocking: bool = ..., timeout: float = ...) -> bool: ...


# The what-if locks override RWLock._take and use these private attributes; if staging's
# lock internals change, the what-if view is skipped (and says so) rather than mis-measured.
_WHAT_IF_NEEDS: tuple[str, ...] = ("_take", "_give", "_timeout_arg", "_stats_lock")
_WHAT_IF_NEEDS += ("_owner", "_writes", "_reads", "_timeouts", "_name", "_rw")


class _RWNoProbe(RWLock):
    """What-if: our RWLock (debug off) without the non-blocking probe before the blocking
    acquire. (It loses the ``contended`` count: this only sizes what the probe costs.)"""

    def _take(self, inner: _Inner, mode: LockMode, untimed: bool = False) -> None:
        if not inner.acquire(True, -1.0 if untimed else self._timeout_arg):
            with self._stats_lock:
                self._timeouts += 1
            raise LockTimeoutError(self._name, mode, self._timeout_arg)
        if mode == "write":
            self._owner = threading.get_ident()
            self._writes += 1
        else:
            with self._stats_lock:
                self._reads += 1


class _RWNoProbeNoStatsLock(RWLock):
    """What-if: as :class:`_RWNoProbe`, and the read count not taken under ``_stats_lock``.

    (Unlocked ``+=`` is inexact under threads: this only sizes what the stats lock costs; an
    exact free count needs a lock that counts readers in its own critical section.)
    """

    def _take(self, inner: _Inner, mode: LockMode, untimed: bool = False) -> None:
        if not inner.acquire(True, -1.0 if untimed else self._timeout_arg):
            raise LockTimeoutError(self._name, mode, self._timeout_arg)
        if mode == "write":
            self._owner = threading.get_ident()
            self._writes += 1
        else:
            self._reads += 1


def what_if_available() -> bool:
    """Whether staging's RWLock still has the internals the what-if locks rely on."""
    probe = RWLock("probe", LockLevel.STAGING, debug=False)
    return all(hasattr(probe, name) for name in _WHAT_IF_NEEDS)


def _fast_index(check: Callable[[object], int]) -> Callable[[object], object]:
    """Exact-``int`` fast path in front of a validator; anything else takes the full check."""

    def fast(value: object) -> object:
        if type(value) is int and value >= 0:
            return value
        return check(value)

    return fast


def _fast_session(value: object) -> object:
    if type(value) is str and value:
        return value
    return check_session_id(value)


@contextmanager
def _validation_fast() -> Iterator[None]:
    saved = {name: getattr(staging_context, name) for name in VALIDATORS}
    fast = {
        "check_room_id": _fast_index(check_room_id),
        "check_chunk_idx": _fast_index(check_chunk_idx),
        "check_session_id": _fast_session,
    }
    for name, fn in fast.items():
        setattr(staging_context, name, fn)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(staging_context, name, fn)


def _ctx_with(lock: RWLock) -> StagingContext:
    ctx = StagingContext(lock="rw", debug=False)
    ctx.__dict__["_lock"] = lock
    return ctx


def what_if(n: int, rounds: int) -> dict[str, float]:
    """Median ns per lifecycle with candidate savings applied (see the module docstring).

    Empty when :func:`what_if_available` is false.
    """
    if not what_if_available():
        return {}
    level = LockLevel.STAGING

    def lean(cls: type[RWLock]) -> Callable[[], Callable[[range], None]]:
        return lambda: context_work(_ctx_with(cls("staging", level, debug=False)))

    cells: list[tuple[str, Callable[[], float]]] = [
        (
            "rw (shipped)",
            _lifecycle_cell(lambda: context_work(StagingContext(lock="rw", debug=False)), n),
        ),
        ("rw, no probe", _lifecycle_cell(lean(_RWNoProbe), n)),
        ("rw, no probe, no stats lock", _lifecycle_cell(lean(_RWNoProbeNoStatsLock), n)),
        (
            "rw, no probe, no stats lock, fast validation",
            _lifecycle_cell(lean(_RWNoProbeNoStatsLock), n, validation=_validation_fast),
        ),
        (
            "mutex (shipped)",
            _lifecycle_cell(lambda: context_work(StagingContext(lock="mutex", debug=False)), n),
        ),
        (
            "mutex, fast validation",
            _lifecycle_cell(
                lambda: context_work(StagingContext(lock="mutex", debug=False)),
                n,
                validation=_validation_fast,
            ),
        ),
        ("lock-ref", _lifecycle_cell(lambda: context_work(LockedSets()), n)),
    ]
    samples = interleave(cells, rounds)
    return {label: median(values) for label, values in samples.items()}


@contextmanager
def _validation_off() -> Iterator[None]:
    saved = {name: getattr(staging_context, name) for name in VALIDATORS}
    for name in VALIDATORS:
        setattr(staging_context, name, _identity)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(staging_context, name, fn)


def _ctx_without_lock() -> StagingContext:
    ctx = StagingContext(lock="mutex", debug=False)
    ctx.__dict__["_lock"] = _NullLock()
    return ctx


def _lifecycle_cell(
    make: Callable[[], Callable[[range], None]],
    n: int,
    *,
    validation: Callable[[], AbstractContextManager[None]] | None = None,
) -> Callable[[], float]:
    def cell() -> float:
        work = make()
        with gc_paused(), validation() if validation is not None else nullcontext():
            t0 = time.perf_counter_ns()
            work(range(n))
            t1 = time.perf_counter_ns()
        return (t1 - t0) / n

    return cell


def ablation(n: int, rounds: int) -> dict[str, float]:
    """Median ns per lifecycle of each layer-stripped variant."""

    def shipped(kind: str, debug: bool = False) -> Callable[[], Callable[[range], None]]:
        return lambda: context_work(StagingContext(lock=kind, debug=debug))

    cells: list[tuple[str, Callable[[], float]]] = [
        (DEFAULT_LABEL, _lifecycle_cell(shipped("mutex"), n)),
        ("mutex, debug=True", _lifecycle_cell(shipped("mutex", True), n)),
        ("rw (shipped)", _lifecycle_cell(shipped("rw"), n)),
        ("no lock", _lifecycle_cell(lambda: context_work(_ctx_without_lock()), n)),
        (
            "no lock, no validation",
            _lifecycle_cell(
                lambda: context_work(_ctx_without_lock()), n, validation=_validation_off
            ),
        ),
        ("lock-ref", _lifecycle_cell(lambda: context_work(LockedSets()), n)),
        ("plain", _lifecycle_cell(lambda: context_work(PlainSets()), n)),
    ]
    samples = interleave(cells, rounds)
    return {label: median(values) for label, values in samples.items()}


def _loop_cell(op: Callable[[], object], n: int, overhead: float) -> Callable[[], float]:
    def cell() -> float:
        with gc_paused():
            t0 = time.perf_counter_ns()
            for _ in range(n):
                op()
            t1 = time.perf_counter_ns()
        return (t1 - t0) / n - overhead

    return cell


def micro(n: int, rounds: int) -> dict[str, float]:
    """Median ns per operation (loop overhead subtracted) of the lock and validation pieces."""
    bare = threading.Lock()
    raw = rwlock.RWLockFair(lock_factory=lambda: threading.Lock())
    ours_rw = make_lock("rw", "p", LockLevel.STAGING, debug=False)
    ours_rw_debug = make_lock("rw", "p", LockLevel.STAGING, debug=True)
    ours_mutex = make_lock("mutex", "p", LockLevel.STAGING, debug=False)
    ref = staging_context.StagingContext._ref
    check_chunk = check_chunk_idx
    check_session = check_session_id
    ctx = StagingContext(lock="rw", debug=False)
    handle = ctx.open_room(1)

    def bare_lock() -> None:
        with bare:
            pass

    def raw_write() -> None:
        w = raw.gen_wlock()
        w.acquire()
        w.release()

    def raw_write_probe() -> None:
        w = raw.gen_wlock()
        w.acquire(False)
        w.release()

    def raw_read() -> None:
        r = raw.gen_rlock()
        r.acquire()
        r.release()

    def raw_read_probe() -> None:
        r = raw.gen_rlock()
        r.acquire(False)
        r.release()

    def guard(lock_mode: Callable[[], AbstractContextManager[None]]) -> Callable[[], None]:
        def op() -> None:
            with lock_mode():
                pass

        return op

    def validate_request() -> None:
        ref(handle)
        check_chunk(3)
        check_session(SESSION)

    def empty() -> None:
        pass

    overhead_cell = _loop_cell(empty, n, 0.0)
    loop_overhead = median([overhead_cell() for _ in range(5)])
    ops: list[tuple[str, Callable[[], object]]] = [
        ("threading.Lock with", bare_lock),
        ("RWLockFair write: gen+acquire()+release", raw_write),
        ("RWLockFair write: gen+acquire(False)+release", raw_write_probe),
        ("RWLockFair read: gen+acquire()+release", raw_read),
        ("RWLockFair read: gen+acquire(False)+release", raw_read_probe),
        ("our RWLock.write() guard", guard(ours_rw.write)),
        ("our RWLock.read() guard", guard(ours_rw.read)),
        ("our RWLock.write() guard, debug", guard(ours_rw_debug.write)),
        ("our RWLock.read() guard, debug", guard(ours_rw_debug.read)),
        ("our MutexLock.write() guard", guard(ours_mutex.write)),
        ("our MutexLock.read() guard", guard(ours_mutex.read)),
        ("RWLock.write() call only (gen_wlock+_Guard)", ours_rw.write),
        ("RWLock.read() call only (gen_rlock+_Guard)", ours_rw.read),
        ("validate one request (_ref+chunk+session)", validate_request),
        ("ctx.is_requested (rw, whole call)", lambda: ctx.is_requested(handle, 3, SESSION)),
        (
            "ctx.request_prefetch dup (rw, whole call)",
            lambda: ctx.request_prefetch(handle, 3, SESSION),
        ),
    ]
    ctx.request_prefetch(handle, 3, SESSION)

    def acquire_release() -> None:
        ours_mutex.acquire_write()
        ours_mutex.release_write()

    default = StagingContext(debug=False)
    mine = default.open_room(1)
    default.request_prefetch(mine, 3, SESSION)
    default.mark_prefetched(mine)
    reference = LockedSets()
    reference.open_room(1)
    reference.request_prefetch(1, 3, SESSION)
    reference.mark_prefetched(1)
    rooms = iter(range(2, 10**9))

    def open_purge(book: StagingContext | LockedSets) -> Callable[[], None]:
        def op() -> None:
            room = next(rooms)
            book.purge_room(book.open_room(room))  # type: ignore[arg-type]

        return op

    ops += [
        ("our MutexLock acquire_write+release_write", acquire_release),
        (
            "default ctx: request_prefetch (duplicate)",
            lambda: default.request_prefetch(mine, 3, SESSION),
        ),
        ("ref: request_prefetch (duplicate)", lambda: reference.request_prefetch(1, 3, SESSION)),
        ("default ctx: is_requested", lambda: default.is_requested(mine, 3, SESSION)),
        ("ref: is_requested", lambda: reference.is_requested(1, 3, SESSION)),
        ("default ctx: mark_prefetched (again)", lambda: default.mark_prefetched(mine)),
        ("ref: mark_prefetched (again)", lambda: reference.mark_prefetched(1)),
        ("default ctx: open_room + purge_room (empty)", open_purge(default)),
        ("ref: open_room + purge_room (empty)", open_purge(reference)),
    ]
    samples = interleave([(label, _loop_cell(op, n, loop_overhead)) for label, op in ops], rounds)
    result = {label: median(values) for label, values in samples.items()}
    result["(loop overhead subtracted)"] = loop_overhead
    result["(perf_counter_ns pair)"] = timer_overhead_ns()
    return result


def acquisitions_per_lifecycle(n: int = 50, kind: str = "rw") -> tuple[float, float]:
    """(write, read) lock acquisitions one shipped lifecycle of ``kind`` makes, counted by the
    lock."""
    ctx = StagingContext(lock=kind, debug=False)
    context_work(ctx)(range(n))
    stats = ctx.lock.stats()
    return stats.write_acquisitions / n, stats.read_acquisitions / n


def _where(key: tuple[str, int, str]) -> str:
    filename, line, func = key
    if filename == "~":
        return func
    parts = PurePath(filename).parts[-2:]
    return f"{'/'.join(parts)}:{line}({func})"


def profile(n: int, top: int = 18, kind: str = "mutex") -> list[tuple[str, int, float, float]]:
    """cProfile of ``n`` shipped lifecycles of ``kind`` (the default: mutex): (where, calls,
    own µs/lifecycle, share %)."""
    work = context_work(StagingContext(lock=kind, debug=False))
    profiler = cProfile.Profile()
    with gc_paused():
        profiler.enable()
        work(range(n))
        profiler.disable()
    stats = pstats.Stats(profiler)
    table: dict[tuple[str, int, str], tuple[int, int, float, float, object]]
    table = stats.stats  # type: ignore[attr-defined]
    total = sum(entry[2] for entry in table.values())
    rows = sorted(
        ((key, entry[1], entry[2]) for key, entry in table.items()),
        key=lambda item: item[2],
        reverse=True,
    )
    return [
        (_where(key), calls, own / n * 1e6, 100.0 * own / total) for key, calls, own in rows[:top]
    ]


CONVOY_CONTENDED = 100
"""A round with more contended acquisitions than this (of ~26,000) is counted as a convoy."""


@dataclass(frozen=True)
class ThreadsRow:
    """View 5, one cell: the default lifecycle at ``threads`` threads with contended waiters
    handing the GIL over first (``yields`` > 0, shipped) or blocking at once (0)."""

    threads: int
    yields: int
    ratio: float | None  # median per-round ratio to the reference
    contended_median: float
    contended_max: int
    convoy_rounds: int
    rounds: int
    switches_median: float  # voluntary context switches of the process per round
    reference_switches_median: float


@contextmanager
def _handoff_yields(count: int) -> Iterator[None]:
    saved = staging_locks.HANDOFF_YIELDS
    staging_locks.HANDOFF_YIELDS = count
    try:
        yield
    finally:
        staging_locks.HANDOFF_YIELDS = saved


def threads_view(
    threads: Sequence[int], lifecycles: int, rounds: int, yields: Sequence[int] | None = None
) -> list[ThreadsRow]:
    """View 5: per thread count and hand-off setting, ``rounds`` rounds of the default
    lifecycle and the reference, side by side (see the module docstring)."""
    settings = (staging_locks.HANDOFF_YIELDS, 0) if yields is None else tuple(yields)
    rows: list[ThreadsRow] = []
    for t in threads:
        per_thread = max(1, lifecycles // t)
        for count in settings:
            ratios: list[float] = []
            contended: list[int] = []
            switches: list[int] = []
            ref_switches: list[int] = []
            for _ in range(rounds):
                ctx = StagingContext(debug=False)
                before = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
                with _handoff_yields(count):
                    ns = timed_threads(context_work(ctx), t, per_thread)
                middle = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
                ref_ns = timed_threads(context_work(LockedSets()), t, per_thread)
                after = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
                ratios.append(ns / ref_ns)
                contended.append(ctx.lock.stats().contended)
                switches.append(middle - before)
                ref_switches.append(after - middle)
            rows.append(
                ThreadsRow(
                    threads=t,
                    yields=count,
                    ratio=median(ratios),
                    contended_median=median([float(c) for c in contended]),
                    contended_max=max(contended),
                    convoy_rounds=sum(c > CONVOY_CONTENDED for c in contended),
                    rounds=rounds,
                    switches_median=median([float(x) for x in switches]),
                    reference_switches_median=median([float(x) for x in ref_switches]),
                )
            )
    return rows


def report(quick: bool) -> str:
    """Run all five views and return the text report."""
    n = 400 if quick else 2000
    rounds = 3 if quick else 7
    out: list[str] = []

    abl = ablation(n, rounds)
    shipped = abl[DEFAULT_LABEL]
    out.append(f"1. ablation, ns per lifecycle (single thread, {n} lifecycles x {rounds} rounds)")
    out.append(
        format_table(
            ["variant", "ns/lifecycle", "vs default", "vs lock-ref"],
            [
                {
                    "variant": k,
                    "ns/lifecycle": v,
                    "vs default": v / shipped,
                    "vs lock-ref": v / abl["lock-ref"],
                }
                for k, v in abl.items()
            ],
        )
    )
    layers = {
        "lock layer (default - no lock)": shipped - abl["no lock"],
        "validation left outside the inlined checks": abl["no lock"]
        - abl["no lock, no validation"],
        "bodies+dispatch+results (no lock,no validation)": abl["no lock, no validation"],
        "debug checks (mutex debug - default), when on": abl["mutex, debug=True"] - shipped,
        "rw instead of mutex costs": abl["rw (shipped)"] - shipped,
    }
    out.append(
        format_table(
            ["layer (difference of ablation rows)", "ns/lifecycle", "% of default"],
            [
                {
                    "layer (difference of ablation rows)": k,
                    "ns/lifecycle": v,
                    "% of default": 100 * v / shipped,
                }
                for k, v in layers.items()
            ],
        )
    )

    mic = micro(20_000 if quick else 100_000, rounds)
    out.append("")
    out.append("2. micro costs, ns per operation (medians)")
    out.append(
        format_table(["operation", "ns"], [{"operation": k, "ns": v} for k, v in mic.items()])
    )
    writes, reads = acquisitions_per_lifecycle(kind="mutex")
    out.append(
        f"the default lifecycle takes its lock {writes:g} times for write and {reads:g} for "
        f"read (counted by the lock); the reference takes its lock {3 + 2 * CHUNKS} times"
    )

    out.append("")
    out.append(
        f"3. cProfile, the default (mutex), {n} lifecycles (own time; cProfile inflates "
        "small calls)"
    )
    prof = profile(n)
    out.append(
        format_table(
            ["function", "calls", "own µs/lifecycle", "% own"],
            [
                {"function": w, "calls": c, "own µs/lifecycle": us, "% own": pct}
                for w, c, us, pct in prof
            ],
        )
    )
    out.append("")
    out.append(f"4. what-if for rw, ns per lifecycle (single thread, {n} x {rounds} rounds)")
    wif = what_if(n, rounds)
    if not wif:
        out.append(
            "skipped: staging.locks.RWLock internals changed; update bench.lifecycle_profile"
        )
    else:
        base = wif["rw (shipped)"]
        ref = wif["lock-ref"]
        out.append(
            format_table(
                ["variant", "ns/lifecycle", "vs rw shipped", "vs lock-ref"],
                [
                    {
                        "variant": k,
                        "ns/lifecycle": v,
                        "vs rw shipped": v / base,
                        "vs lock-ref": v / ref,
                    }
                    for k, v in wif.items()
                ],
            )
        )
    out.append("")
    t_rounds = 6 if quick else 20
    out.append(
        f"5. threads: the default lifecycle, 2400 lifecycles per round, {t_rounds} rounds, "
        "contended waiters handing the GIL over first (yields > 0, shipped) or blocking at "
        f"once (yields 0); a convoy round has > {CONVOY_CONTENDED} contended acquisitions"
    )
    rows = threads_view((2, 4) if quick else (2, 4, 8), 2400, t_rounds)
    out.append(
        format_table(
            [
                "threads",
                "yields",
                "/ref (median)",
                "contended median",
                "contended max",
                "convoy rounds",
                "vol. switches median",
                "ref switches median",
            ],
            [
                {
                    "threads": r.threads,
                    "yields": r.yields,
                    "/ref (median)": r.ratio,
                    "contended median": r.contended_median,
                    "contended max": r.contended_max,
                    "convoy rounds": f"{r.convoy_rounds}/{r.rounds}",
                    "vol. switches median": r.switches_median,
                    "ref switches median": r.reference_switches_median,
                }
                for r in rows
            ],
        )
    )
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lifecycle_profile")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    print(report(bool(args.quick)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
