"""Behavioural contract of the lock model, run over both implementations, plus debug mode."""

from __future__ import annotations

import contextlib
import os
import random
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from staging import (
    LockLevel,
    LockNotHeldError,
    LockOrderError,
    LockReentryError,
    LockTimeoutError,
    RoomAlreadyOpenError,
    RoomHandle,
    StagingContext,
    make_lock,
)
from staging.locks import (
    DEBUG_ENV,
    HANDOFF_YIELDS,
    LOCK_KINDS,
    LockMode,
    MutexLock,
    _Guard,
    held_locks,
)

pytestmark = pytest.mark.timeout(30)

JOIN_S = 5.0


@pytest.fixture(params=LOCK_KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _join(*threads: threading.Thread) -> None:
    for t in threads:
        t.join(JOIN_S)
        assert not t.is_alive(), f"{t.name} did not finish"


def test_write_excludes_writers_and_readers(kind: str) -> None:
    lock = make_lock(kind, "t", 1)
    inside = threading.Event()
    entered: list[str] = []

    def other(mode: str) -> None:
        with lock.write() if mode == "write" else lock.read():
            entered.append(mode)

    with lock.write():
        threads = [
            threading.Thread(target=other, args=(m,), daemon=True) for m in ("read", "write")
        ]
        for t in threads:
            t.start()
        inside.wait(0.2)
        assert entered == []
    _join(*threads)
    assert sorted(entered) == ["read", "write"]


def test_rw_admits_concurrent_readers() -> None:
    lock = make_lock("rw", "t", 1)
    barrier = threading.Barrier(3, timeout=JOIN_S)

    def reader() -> None:
        with lock.read():
            barrier.wait()  # all three inside at once, or BrokenBarrierError

    threads = [threading.Thread(target=reader, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    reader()
    _join(*threads)


def test_mutex_read_is_exclusive() -> None:
    lock = make_lock("mutex", "t", 1)
    got = threading.Event()

    def reader() -> None:
        with lock.read():
            got.set()

    with lock.read():
        t = threading.Thread(target=reader, daemon=True)
        t.start()
        assert not got.wait(0.1)
    _join(t)
    assert got.is_set()


def test_timeout_raises(kind: str) -> None:
    lock = make_lock(kind, "slow", 1, timeout=0.05)
    errors: list[BaseException] = []

    def waiter() -> None:
        try:
            with lock.write():
                pass
        except LockTimeoutError as exc:
            errors.append(exc)

    with lock.write():
        t = threading.Thread(target=waiter, daemon=True)
        t.start()
        _join(t)
    assert len(errors) == 1
    assert "slow" in str(errors[0])
    assert lock.stats().timeouts == 1
    with lock.write():  # the lock is still usable
        pass


@pytest.mark.parametrize("debug", [False, True])
def test_stats_count_acquisitions_and_contention(kind: str, debug: bool) -> None:
    lock = make_lock(kind, "t", 1, debug=debug)
    with lock.read():
        pass
    with lock.write():
        pass
    s = lock.stats()
    assert (s.read_acquisitions, s.write_acquisitions, s.contended) == (1, 1, 0)
    release = threading.Event()

    def holder() -> None:
        with lock.write():
            release.wait(JOIN_S)

    t = threading.Thread(target=holder, daemon=True)
    t.start()
    deadline = time.monotonic() + JOIN_S
    while lock.stats().write_acquisitions < 2 and time.monotonic() < deadline:
        time.sleep(0.001)
    threading.Timer(0.05, release.set).start()
    with lock.write():
        pass
    _join(t)
    if kind == "rw" and not debug:
        assert lock.stats().contended == 0  # not measured: the try-acquire costs too much
    else:
        assert lock.stats().contended >= 1


def test_assert_held(kind: str) -> None:
    lock = make_lock(kind, "t", 1)
    with pytest.raises(LockNotHeldError):
        lock.assert_held("write")
    with lock.write():
        lock.assert_held("write")
        lock.assert_held("read")
    with lock.read():
        lock.assert_held("read")


@pytest.mark.parametrize("outer", ["read", "write"])
@pytest.mark.parametrize("inner", ["read", "write"])
def test_debug_reentry_raises_instead_of_deadlocking(kind: str, outer: str, inner: str) -> None:
    lock = make_lock(kind, "staging", 1, debug=True)
    outer_guard = lock.read() if outer == "read" else lock.write()
    inner_guard = lock.read() if inner == "read" else lock.write()
    with outer_guard, pytest.raises(LockReentryError, match="staging"), inner_guard:
        pass  # pragma: no cover
    with lock.write():  # nothing leaked by the refused acquisition
        assert held_locks() == (("staging", "write"),)
    assert held_locks() == ()


def test_debug_order_inversion_raises_first_time(kind: str) -> None:
    outer = make_lock(kind, "room", LockLevel.ROOM, debug=True)
    inner = make_lock(kind, "staging", LockLevel.STAGING, debug=True)
    with outer.write(), inner.write():  # the right order is fine
        pass
    with inner.read(), pytest.raises(LockOrderError) as info, outer.write():
        pass  # pragma: no cover
    err = info.value
    assert (err.held, err.wanted) == ("staging", "room")
    assert "room" in str(err) and "staging" in str(err)
    peer = make_lock(kind, "staging2", LockLevel.STAGING, debug=True)
    with inner.write(), pytest.raises(LockOrderError), peer.write():
        pass  # pragma: no cover


def test_debug_held_past_timeout_raises(kind: str) -> None:
    ctx = StagingContext(lock=kind, lock_timeout=0.05, debug=True)
    hold = threading.Event()
    held = threading.Event()

    def holder() -> None:
        with ctx.lock.write():
            held.set()
            hold.wait(JOIN_S)

    t = threading.Thread(target=holder, daemon=True)
    t.start()
    assert held.wait(JOIN_S)
    try:
        with pytest.raises(LockTimeoutError):
            ctx.open_room(1)
    finally:
        hold.set()
        _join(t)
    assert ctx.open_rooms == frozenset()
    ctx.open_room(1)


def test_debug_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DEBUG_ENV, "1")
    assert make_lock("rw", "t", 1).debug is True
    assert StagingContext().lock.debug is True
    monkeypatch.setenv(DEBUG_ENV, "0")
    assert make_lock("rw", "t", 1).debug is False
    assert make_lock("rw", "t", 1, debug=True).debug is True


def test_make_lock_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        make_lock("spin", "t", 1)
    with pytest.raises(ValueError):
        make_lock("rw", "", 1)
    with pytest.raises(TypeError):
        make_lock("rw", "t", True)
    with pytest.raises(ValueError):
        make_lock("rw", "t", 1, timeout=0)


def test_non_debug_mutex_keeps_owner_and_counters(monkeypatch: pytest.MonkeyPatch) -> None:
    """The library default (a mutex, debug off) records its holder and counts as debug does."""
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    fast = make_lock("mutex", "t", 1)
    with fast.write():
        fast.assert_held("write")
    with fast.read():
        fast.assert_held("read")
    st = fast.stats()
    assert (st.write_acquisitions, st.read_acquisitions, st.contended) == (1, 1, 0)
    with pytest.raises(LockNotHeldError):
        fast.assert_held("write")


@pytest.mark.parametrize("debug", [False, True])
def test_acquire_write_pair_behaves_like_the_write_guard(kind: str, debug: bool) -> None:
    lock = make_lock(kind, "t", 1, debug=debug)
    for acquire in (lock.acquire_write, lock.acquire_write_untimed):
        acquire()
        try:
            lock.assert_held("write")
            if debug:
                with pytest.raises(LockReentryError):
                    lock.acquire_write()
        finally:
            lock.release_write()
        with pytest.raises(LockNotHeldError):
            lock.assert_held("write")
    assert lock.stats().write_acquisitions == 2
    if kind == "rw" or debug:  # the checked paths refuse a release that holds nothing
        with pytest.raises((LockNotHeldError, RuntimeError)):
            lock.release_write()
    with lock.write():  # still usable
        pass


@pytest.mark.parametrize("debug", [False, True])
def test_release_write_by_a_thread_that_does_not_hold_it(kind: str, debug: bool) -> None:
    """``release_write()``: "only the thread that acquired" (docs/THREADING.md, the lock
    model): another thread's release raises ``LockNotHeldError`` and leaves the lock held, on
    ``RWLock`` always and on ``MutexLock`` in debug mode (outside it that is not checked)."""
    lock = make_lock(kind, "t", 1, debug=debug)
    lock.acquire_write()
    raised: list[BaseException] = []

    def other() -> None:
        try:
            lock.release_write()
        except BaseException as exc:  # reported to the test thread
            raised.append(exc)

    t = threading.Thread(target=other)
    t.start()
    _join(t)
    if kind == "mutex" and not debug:
        assert not raised  # not checked: documented
        return
    assert [type(e) for e in raised] == [LockNotHeldError]
    lock.assert_held("write")  # still ours
    lock.release_write()
    with lock.write():  # and usable
        pass


def test_acquire_write_times_out_like_the_guard(kind: str) -> None:
    lock = make_lock(kind, "slow", 1, timeout=0.05)
    errors: list[BaseException] = []

    def waiter() -> None:
        try:
            lock.acquire_write()
        except LockTimeoutError as exc:
            errors.append(exc)
        else:  # pragma: no cover - the holder never lets go in time
            lock.release_write()

    with lock.write():
        t = threading.Thread(target=waiter, daemon=True)
        t.start()
        _join(t)
    assert len(errors) == 1 and lock.stats().timeouts == 1


# ---------------------------------------------------------------- ownership under contention
#
# The contract (docs/THREADING.md, "The lock model"): ``assert_held(mode)`` raises
# LockNotHeldError "unless the calling thread holds this lock in mode"; outside debug mode a
# MutexLock's holder "writes the owner and its counter" on every path. So, whatever path
# took the lock (a guard, acquire_write/release_write, the contended path, a StagingContext
# writer): while a thread holds it -- also while
# others wait for it -- that thread's assert_held passes, and a thread that does not hold it
# never passes. Two checks:
# - ownership_violations: several threads take the lock through every path; a holder stays
#   inside until a contender is counted (or no other thread is left to contend: a bound by
#   progress, not by the clock) and checks ownership meanwhile; every thread checks it is not
#   taken for the owner right after each release. Random, seeded.
# - handover_violations: the hand-over at every step. A releasing thread is stopped at each
#   scheduling point of its take-and-release (tests.interleave's points) in turn; wherever the
#   mutex is free there, a second thread takes the lock and holds it while the first one
#   finishes. The second must be the owner all along. Deterministic: it does not wait for the
#   scheduler to switch threads inside a two-line window, which a busy machine may never do.

OWNERSHIP_THREADS = 4
OWNERSHIP_ITERATIONS = 300  # per thread
OWNERSHIP_JOIN_S = 60.0
"""Join bound of one ownership run. A run is bounded by its work (every hold ends once a
contender is counted or no other thread runs); about 1 s on a quiet 2-core machine and under
10 s at load 12, so running past this is a hang, not a slow machine. Within the tests' own
timeout (OWNERSHIP_TIMEOUT_S)."""
OWNERSHIP_TIMEOUT_S = 4 * OWNERSHIP_JOIN_S
HOLDER_PATHS = ("write", "read", "write_untimed", "acquire_write", "acquire_write_untimed")
CONTEXT_PATHS = ("request_prefetch", "cancel_prefetch", "mark_prefetched", "open_purge")


def _ownership_seed() -> int:
    seed = int(os.environ.get("LOCK_OWNERSHIP_SEED", random.randrange(2**32)))
    print(f"LOCK_OWNERSHIP_SEED={seed}")
    return seed


@contextlib.contextmanager
def _hold(lock: MutexLock, path: str) -> Iterator[None]:
    """Hold ``lock`` through one of its acquisition paths."""
    if path == "acquire_write":
        lock.acquire_write()
    elif path == "acquire_write_untimed":
        lock.acquire_write_untimed()
    else:
        guard = {"write": lock.write, "read": lock.read, "write_untimed": lock.write_untimed}
        with guard[path]():
            yield
        return
    try:
        yield
    finally:
        lock.release_write()


def _take_through_context(
    ctx: StagingContext, handle: RoomHandle, path: str, rng: random.Random
) -> None:
    """One StagingContext writer (each takes the context's lock)."""
    chunk = rng.randrange(4)
    if path == "request_prefetch":
        ctx.request_prefetch(handle, chunk, "d0")
    elif path == "cancel_prefetch":
        ctx.cancel_prefetch(handle, chunk, "d0")
    elif path == "mark_prefetched":
        ctx.mark_prefetched(handle)
    else:
        room = 1 + rng.randrange(3)
        with contextlib.suppress(RoomAlreadyOpenError):
            ctx.open_room(room)
        ctx.purge_room(room)


def _holds(lock: MutexLock, mode: LockMode) -> bool:
    try:
        lock.assert_held(mode)
    except LockNotHeldError:
        return False
    return True


def ownership_violations(
    lock: MutexLock, seed: int, ctx: StagingContext | None = None
) -> tuple[list[str], int]:
    """Run the random ownership check on ``lock`` (and through ``ctx``'s writers, if given,
    whose lock it must be); return (violations, holds during which another thread wanted
    the lock)."""
    violations: list[str] = []
    inside = [0]
    waited = [0]
    # Guarded by count_lock: workers not yet finished; workers on their way into the lock.
    running = [OWNERSHIP_THREADS]
    wanting = [0]
    count_lock = threading.Lock()
    stop = threading.Event()
    barrier = threading.Barrier(OWNERSHIP_THREADS, timeout=OWNERSHIP_JOIN_S)
    handle = None if ctx is None else ctx.open_room(0)
    paths = HOLDER_PATHS + (CONTEXT_PATHS if ctx is not None else ())

    def bad(what: str) -> None:
        violations.append(f"{threading.current_thread().name}: {what}")
        stop.set()

    def want(delta: int) -> None:
        with count_lock:
            wanting[0] += delta

    def hold(path: str) -> None:
        want(1)
        with _hold(lock, path):
            want(-1)
            inside[0] += 1
            if inside[0] != 1:
                bad(f"{inside[0]} holders at once ({path})")
            if not _holds(lock, "write") or not _holds(lock, "read"):
                bad(f"the holder is not the owner on entry ({path})")
            # Stay inside until another thread wants the lock. Every other running worker
            # takes it on each iteration, so this ends by progress: one wants it, or every
            # other worker has finished (or stopped on a violation).
            while wanting[0] == 0 and running[0] > 1 and not stop.is_set():
                time.sleep(0)  # hands the GIL over: the others run into the lock
                if not _holds(lock, "write"):
                    break
            if wanting[0] > 0:
                waited[0] += 1
                for _ in range(HANDOFF_YIELDS + 2):  # the contender goes on into the lock
                    time.sleep(0)
                    if not _holds(lock, "write"):
                        break
            if not _holds(lock, "write"):
                bad(f"the holder lost ownership while another thread waited ({path})")
            inside[0] -= 1

    def worker(index: int) -> None:
        rng = random.Random(seed + index)
        try:
            barrier.wait()
            for _ in range(OWNERSHIP_ITERATIONS):
                if stop.is_set():
                    return
                path = rng.choice(paths)
                if path in HOLDER_PATHS:
                    hold(path)
                else:
                    assert ctx is not None and handle is not None
                    want(1)
                    try:
                        _take_through_context(ctx, handle, path, rng)
                    finally:
                        want(-1)
                if _holds(lock, "write"):
                    bad(f"assert_held passes after this thread released ({path})")
        finally:
            with count_lock:
                running[0] -= 1

    threads = [
        threading.Thread(target=worker, args=(i,), name=f"owner-{i}", daemon=True)
        for i in range(OWNERSHIP_THREADS)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(OWNERSHIP_JOIN_S)
        assert not t.is_alive(), f"{t.name} did not finish within {OWNERSHIP_JOIN_S:g} s"
    return violations, waited[0]


def handover_violations(through: str) -> tuple[list[str], int]:
    """The deterministic hand-over check (section comment): for every path the first thread
    takes and releases the lock by (HOLDER_PATHS, and CONTEXT_PATHS when ``through`` is
    ``"context"``), every scheduling point ``k`` of it, and every path the second takes it by.
    Returns (violations, schedules in which the second thread held the lock while the first
    went on).

    Raises:
        AssertionError: a thread did not finish within OWNERSHIP_JOIN_S (a deadlock).
    """
    from tests.interleave import TRACED_DIRS, _Stopper

    violations: list[str] = []
    handovers = 0
    traced = (*TRACED_DIRS, __file__)  # the library, and this file's guards and paths
    first_paths = HOLDER_PATHS + (CONTEXT_PATHS if through == "context" else ())

    def fresh() -> tuple[MutexLock, StagingContext | None, RoomHandle | None]:
        if through == "context":
            ctx = StagingContext(lock="mutex")
            assert isinstance(ctx.lock, MutexLock)
            return ctx.lock, ctx, ctx.open_room(0)
        lock = make_lock("mutex", "t", 1, debug=False)
        assert isinstance(lock, MutexLock)
        return lock, None, None

    def run_first(
        lock: MutexLock, ctx: StagingContext | None, handle: RoomHandle | None, path: str,
        stopper: _Stopper, after: list[bool],
    ) -> None:  # fmt: skip
        sys.settrace(stopper.tracer())
        try:
            if path in HOLDER_PATHS:
                with _hold(lock, path):
                    pass
            else:
                assert ctx is not None and handle is not None
                _take_through_context(ctx, handle, path, random.Random(0))
        finally:
            sys.settrace(None)
        after.append(_holds(lock, "write"))

    def join(t: threading.Thread, what: str) -> None:
        t.join(OWNERSHIP_JOIN_S)
        assert not t.is_alive(), f"{what} did not finish within {OWNERSHIP_JOIN_S:g} s"

    for first_path in first_paths:
        for second_path in HOLDER_PATHS:
            k = 0
            while True:
                k += 1
                lock, ctx, handle = fresh()
                stopper = _Stopper(k, OWNERSHIP_JOIN_S, traced)
                after: list[bool] = []
                a = threading.Thread(
                    target=run_first, args=(lock, ctx, handle, first_path, stopper, after),
                    daemon=True,
                )  # fmt: skip
                a.start()
                while not stopper.stopped.wait(0.001) and a.is_alive():
                    pass
                if not stopper.stopped.is_set():  # past its last point: every k was tried
                    join(a, "the first thread")
                    break
                where = f"{first_path} stopped at point {k}, then {second_path}"
                b: threading.Thread | None = None
                if not lock._mutex.locked():  # the second takes it here and holds it
                    entered = threading.Event()
                    b = threading.Thread(
                        target=second_holds, args=(lock, second_path, entered, a, where,
                                                   violations),
                        daemon=True,
                    )  # fmt: skip
                    b.start()
                    assert entered.wait(OWNERSHIP_JOIN_S), f"{where}: the second never took it"
                    handovers += 1
                stopper.resume()
                join(a, "the first thread")
                if b is not None:
                    join(b, "the second thread")
                if after != [False]:
                    violations.append(f"{where}: the first passes assert_held after its release")
    return violations, handovers


def second_holds(
    lock: MutexLock, path: str, entered: threading.Event, first: threading.Thread, where: str,
    violations: list[str],
) -> None:  # fmt: skip
    """Take ``lock`` by ``path``; hold it until ``first`` ends or runs into the lock (it was
    stopped before its own acquisition); the holder must be the owner throughout."""
    with _hold(lock, path):
        entered.set()
        contended = lock.stats().contended
        while first.is_alive() and lock.stats().contended == contended:
            time.sleep(0.0005)  # the first runs on: a bound by progress (it ends, or contends)
        if not _holds(lock, "write") or not _holds(lock, "read"):
            violations.append(f"{where}: the second, holding the lock, is not its owner")


@pytest.mark.timeout(OWNERSHIP_TIMEOUT_S)
@pytest.mark.usefixtures("fast_switch")
@pytest.mark.parametrize("through", ["lock", "context"])
def test_owner_is_the_holder_under_contention(
    through: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The random ownership check on the non-debug mutex (the library default), alone and as
    a StagingContext's lock with its writers in the mix."""
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    seed = _ownership_seed()
    ctx = StagingContext(lock="mutex") if through == "context" else None
    lock = ctx.lock if ctx is not None else make_lock("mutex", "t", 1)
    assert isinstance(lock, MutexLock) and not lock.debug
    violations, waited = ownership_violations(lock, seed, ctx)
    assert violations == []
    assert waited > 0, "no holder ever saw a contender: the check proved nothing"
    assert lock.stats().contended > 0


@pytest.mark.timeout(OWNERSHIP_TIMEOUT_S)
@pytest.mark.parametrize("through", ["lock", "context"])
def test_owner_is_the_holder_at_every_step_of_a_handover(
    through: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    violations, handovers = handover_violations(through)
    assert violations == []
    assert handovers > 0, "the second thread never took the lock mid-way: proved nothing"


class _OwnerClearedAfterRelease(_Guard):
    """PLANTED BUG: the guard lets the lock go before it clears the owner, so it can clear
    the owner that the next holder has just written."""

    __slots__ = ()

    def __exit__(self, *exc: object) -> None:
        self._inner.release()
        self._lock._owner = None


class _OwnerWrittenBeforeAcquire(_Guard):
    """PLANTED BUG: the guard writes the owner before it has the lock, so a contender
    overwrites the owner of the thread that holds it."""

    __slots__ = ()

    def __enter__(self) -> None:
        self._lock._owner = threading.get_ident()
        super().__enter__()


def _plant(lock: MutexLock, guard_class: type[_Guard]) -> None:
    for name in ("_read_guard", "_write_guard", "_untimed_guard"):
        guard = getattr(lock, name)
        planted = guard_class(lock, guard._inner, guard._mode)
        planted._untimed = guard._untimed
        setattr(lock, name, planted)


@pytest.mark.timeout(OWNERSHIP_TIMEOUT_S)
def test_handover_check_catches_an_owner_cleared_after_release(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The two-line window of this planted race is found at once, on any machine: the check
    stops the releasing thread between the two lines instead of waiting for the scheduler to."""
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    real = make_lock

    def planted_lock(*args: object, **kwargs: object) -> MutexLock:
        lock = real(*args, **kwargs)  # type: ignore[arg-type]
        assert isinstance(lock, MutexLock)
        _plant(lock, _OwnerClearedAfterRelease)
        return lock

    monkeypatch.setattr(sys.modules[__name__], "make_lock", planted_lock)
    violations, _ = handover_violations("lock")
    assert any("the second, holding the lock, is not its owner" in v for v in violations), (
        "the planted owner race survived the hand-over check"
    )


@pytest.mark.timeout(OWNERSHIP_TIMEOUT_S)
@pytest.mark.usefixtures("fast_switch")
def test_ownership_check_catches_an_owner_written_before_the_lock_is_taken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The random check's own power: every hold waits for a contender, so a contender that
    writes the owner before it has the lock is seen by the holder, whatever the load."""
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    seed = _ownership_seed()
    lock = make_lock("mutex", "t", 1, debug=False)
    assert isinstance(lock, MutexLock)
    _plant(lock, _OwnerWrittenBeforeAcquire)
    violations, _ = ownership_violations(lock, seed)
    assert any("lost ownership" in v or "not the owner" in v for v in violations), violations
