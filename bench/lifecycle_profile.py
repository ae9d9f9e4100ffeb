"""Where a ``StagingContext(lock="rw")`` lifecycle spends its time (a diagnostic, not a benchmark).

``python -m bench.lifecycle_profile [--quick]`` prints three views, single-threaded:

1. **Ablation** of the whole lifecycle of :mod:`bench.lifecycle` (interleaved rounds,
   medians): shipped ``rw``; ``rw`` with debug checks on; ``mutex``; the context with its
   lock swapped for a no-op (everything but the lock layer); that plus argument validation
   stubbed out (bodies, dispatch and result objects only); and the ``threading.Lock``
   reference and the bare floor. Differences between neighbours give each layer's cost.
2. **Micro** costs per acquire+release: a bare ``threading.Lock``, ``RWLockFair`` driven
   directly (blocking ``acquire()`` and the non-blocking ``acquire(False)`` probe our wrapper
   makes first), our ``RWLock``/``MutexLock`` guards, guard construction alone, and the
   argument checks of one call. Composed with the read and write acquisitions one lifecycle
   makes (counted by the lock's own stats) they split the lock layer into library internals
   and our wrapper.
3. **cProfile** of the shipped ``rw`` lifecycle: the top functions by own time (cProfile
   inflates per-call costs of small functions; read it for call counts and ranking).
4. **What-if** lifecycles with candidate savings applied to a context from outside (a
   subclass of our ``RWLock`` swapped in; validators wrapped in an exact-``int`` fast path)
   to size each suggestion before anyone edits ``staging``.

The ablation patches ``staging.context``'s validators and one context's ``_lock`` for the
duration of a cell only; nothing in ``staging`` is edited.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import PurePath
from types import TracebackType
from typing import Protocol

from readerwriterlock import rwlock

import staging.context as staging_context
from bench._harness import format_table, gc_paused, interleave, median, timer_overhead_ns
from bench.lifecycle import SESSION, LockedSets, PlainSets, context_work
from staging import StagingContext
from staging.errors import LockTimeoutError
from staging.locks import LockLevel, LockMode, RWLock, make_lock
from staging.validate import check_chunk_idx, check_room_id, check_session_id

VALIDATORS = ("check_room_id", "check_chunk_idx", "check_session_id")


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
    """Stands in for a context's lock: read()/write() return one shared no-op guard."""

    kind = "none"

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


# The what-if locks override RWLock._acquire and use these private attributes; if staging's
# lock internals change, the what-if view is skipped (and says so) rather than mis-measured.
_WHAT_IF_NEEDS: tuple[str, ...] = ("_acquire", "_release", "_timeout_arg", "_stats_lock")
_WHAT_IF_NEEDS += ("_owner", "_writes", "_reads", "_timeouts", "_name", "_rw")


class _RWNoProbe(RWLock):
    """What-if: our RWLock (debug off) without the non-blocking probe before the blocking
    acquire. (It loses the ``contended`` count: this only sizes what the probe costs.)"""

    def _acquire(self, inner: _Inner, mode: LockMode, *, untimed: bool = False) -> None:
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

    def _acquire(self, inner: _Inner, mode: LockMode, *, untimed: bool = False) -> None:
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
    cells: list[tuple[str, Callable[[], float]]] = [
        (
            "rw (shipped)",
            _lifecycle_cell(lambda: context_work(StagingContext(lock="rw", debug=False)), n),
        ),
        (
            "rw, debug=True",
            _lifecycle_cell(lambda: context_work(StagingContext(lock="rw", debug=True)), n),
        ),
        (
            "mutex",
            _lifecycle_cell(lambda: context_work(StagingContext(lock="mutex", debug=False)), n),
        ),
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
    samples = interleave([(label, _loop_cell(op, n, loop_overhead)) for label, op in ops], rounds)
    result = {label: median(values) for label, values in samples.items()}
    result["(loop overhead subtracted)"] = loop_overhead
    result["(perf_counter_ns pair)"] = timer_overhead_ns()
    return result


def acquisitions_per_lifecycle(n: int = 50) -> tuple[float, float]:
    """(write, read) lock acquisitions one shipped-rw lifecycle makes, counted by the lock."""
    ctx = StagingContext(lock="rw", debug=False)
    context_work(ctx)(range(n))
    stats = ctx.lock.stats()
    return stats.write_acquisitions / n, stats.read_acquisitions / n


def _where(key: tuple[str, int, str]) -> str:
    filename, line, func = key
    if filename == "~":
        return func
    parts = PurePath(filename).parts[-2:]
    return f"{'/'.join(parts)}:{line}({func})"


def profile(n: int, top: int = 18) -> list[tuple[str, int, float, float]]:
    """cProfile of ``n`` shipped-rw lifecycles: (where, calls, own µs/lifecycle, share %)."""
    work = context_work(StagingContext(lock="rw", debug=False))
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


def report(quick: bool) -> str:
    """Run all four views and return the text report."""
    n = 400 if quick else 2000
    rounds = 3 if quick else 7
    out: list[str] = []

    abl = ablation(n, rounds)
    shipped = abl["rw (shipped)"]
    out.append(f"1. ablation, ns per lifecycle (single thread, {n} lifecycles x {rounds} rounds)")
    out.append(
        format_table(
            ["variant", "ns/lifecycle", "share of rw"],
            [{"variant": k, "ns/lifecycle": v, "share of rw": v / shipped} for k, v in abl.items()],
        )
    )
    layers = {
        "lock layer (rw - no lock)": shipped - abl["no lock"],
        "validation (no lock - no lock,no validation)": abl["no lock"]
        - abl["no lock, no validation"],
        "bodies+dispatch+results (no lock,no validation)": abl["no lock, no validation"],
        "debug checks (rw debug - rw), when on": abl["rw, debug=True"] - shipped,
        "mutex instead of rw saves": shipped - abl["mutex"],
    }
    out.append(
        format_table(
            ["layer (difference of ablation rows)", "ns/lifecycle", "% of rw"],
            [
                {
                    "layer (difference of ablation rows)": k,
                    "ns/lifecycle": v,
                    "% of rw": 100 * v / shipped,
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
    w_raw = mic["RWLockFair write: gen+acquire(False)+release"]
    r_raw = mic["RWLockFair read: gen+acquire(False)+release"]
    w_ours = mic["our RWLock.write() guard"]
    r_ours = mic["our RWLock.read() guard"]
    writes, reads = acquisitions_per_lifecycle()
    lib = writes * w_raw + reads * r_raw
    wrap = writes * (w_ours - w_raw) + reads * (r_ours - r_raw)
    out.append(
        f"composed per lifecycle ({writes:g} writes + {reads:g} reads, counted by the lock): "
        f"readerwriterlock internals ~{lib:,.0f} ns, our wrapper (_Guard, _acquire/_release, "
        f"counters) ~{wrap:,.0f} ns, sum ~{lib + wrap:,.0f} ns vs ablation lock layer "
        f"{layers['lock layer (rw - no lock)']:,.0f} ns"
    )

    out.append("")
    out.append(f"3. cProfile, shipped rw, {n} lifecycles (own time; cProfile inflates small calls)")
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
    out.append(f"4. what-if, ns per lifecycle (single thread, {n} lifecycles x {rounds} rounds)")
    wif = what_if(n, rounds)
    if not wif:
        out.append(
            "skipped: staging.locks.RWLock internals changed; update bench.lifecycle_profile"
        )
        return "\n".join(out)
    base = wif["rw (shipped)"]
    ref = wif["lock-ref"]
    out.append(
        format_table(
            ["variant", "ns/lifecycle", "vs rw shipped", "vs lock-ref"],
            [
                {"variant": k, "ns/lifecycle": v, "vs rw shipped": v / base, "vs lock-ref": v / ref}
                for k, v in wif.items()
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
