"""Behavioural contract of the lock model, run over both implementations, plus debug mode."""

from __future__ import annotations

import contextlib
import os
import random
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
    StagingContext,
    make_lock,
)
from staging.locks import (
    DEBUG_ENV,
    LOCK_KINDS,
    LockMode,
    MutexLock,
    _FastMutexGuard,
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


def test_contract_suite_runs_on_the_fast_mutex_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests above build locks without ``debug``: a non-debug mutex there uses the inline
    guard (``_FastMutexGuard``), debug mode the full one, so both are under the contract."""
    from staging.locks import _FastMutexGuard, _Guard

    monkeypatch.delenv(DEBUG_ENV, raising=False)
    fast = make_lock("mutex", "t", 1)
    full = make_lock("mutex", "t", 1, debug=True)
    assert all(type(g) is _FastMutexGuard for g in (fast.read(), fast.write()))
    assert all(type(g) is _Guard for g in (full.read(), full.write()))
    # The inline path keeps the same counters and owner as the full one.
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
# MutexLock's inline guard "writes the owner and its counter, as the full path does". So,
# whatever path took the lock (the inline guard, acquire_write/release_write, the contended
# path, a StagingContext writer that takes it inline): while a thread holds it -- also while
# others wait for it -- that thread's assert_held passes, and a thread that does not hold it
# never passes. The check below takes the lock through every path from several threads, the
# holders wait inside until a contender is counted and check ownership before and after; every
# thread checks it is not taken for the owner right after each release.

OWNERSHIP_THREADS = 4
OWNERSHIP_ITERATIONS = 300  # per thread; a run is bounded by JOIN_S anyway
HOLD_YIELDS = 20  # a holder yields the GIL at most this often waiting for a contender
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


def ownership_violations(
    lock: MutexLock, seed: int, ctx: StagingContext | None = None
) -> tuple[list[str], int]:
    """Run the ownership check on ``lock`` (and through ``ctx``'s writers, if given, whose
    lock it must be); return (violations, holds that saw a counted contender)."""
    violations: list[str] = []
    inside = [0]
    waited = [0]
    stop = threading.Event()
    barrier = threading.Barrier(OWNERSHIP_THREADS, timeout=JOIN_S)
    handle = None if ctx is None else ctx.open_room(0)
    paths = HOLDER_PATHS + (CONTEXT_PATHS if ctx is not None else ())

    def bad(what: str) -> None:
        violations.append(f"{threading.current_thread().name}: {what}")
        stop.set()

    def holds(mode: LockMode) -> bool:
        try:
            lock.assert_held(mode)
        except LockNotHeldError:
            return False
        return True

    def hold(path: str) -> None:
        with _hold(lock, path):
            inside[0] += 1
            if inside[0] != 1:
                bad(f"{inside[0]} holders at once ({path})")
            if not holds("write") or not holds("read"):
                bad(f"the holder is not the owner on entry ({path})")
            before = lock.stats().contended
            for _ in range(HOLD_YIELDS):  # let the others run into the lock and wait
                time.sleep(0)
                if not holds("write"):
                    bad(f"the holder lost ownership while another thread waited ({path})")
                    break
                if lock.stats().contended > before:
                    waited[0] += 1
                    break
            inside[0] -= 1

    def through_context(path: str, rng: random.Random) -> None:
        assert ctx is not None and handle is not None
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

    def worker(index: int) -> None:
        rng = random.Random(seed + index)
        barrier.wait()
        for _ in range(OWNERSHIP_ITERATIONS):
            if stop.is_set():
                return
            path = rng.choice(paths)
            if path in HOLDER_PATHS:
                hold(path)
            else:
                through_context(path, rng)
            if holds("write"):
                bad(f"assert_held passes after this thread released ({path})")

    threads = [
        threading.Thread(target=worker, args=(i,), name=f"owner-{i}", daemon=True)
        for i in range(OWNERSHIP_THREADS)
    ]
    for t in threads:
        t.start()
    _join(*threads)
    return violations, waited[0]


@pytest.mark.usefixtures("fast_switch")
@pytest.mark.parametrize("through", ["lock", "context"])
def test_owner_is_the_holder_under_contention(
    through: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ownership check on the non-debug mutex (the library default), alone and as a
    StagingContext's lock with its writers (request_prefetch takes it inline) in the mix."""
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    seed = _ownership_seed()
    ctx = StagingContext(lock="mutex") if through == "context" else None
    lock = ctx.lock if ctx is not None else make_lock("mutex", "t", 1)
    assert isinstance(lock, MutexLock) and lock.inline_mutex is not None  # the inline paths
    violations, waited = ownership_violations(lock, seed, ctx)
    assert violations == []
    assert waited > 0, "no holder ever saw a contender: the check proved nothing"
    assert lock.stats().contended > 0


class _OwnerClearedAfterRelease(_FastMutexGuard):
    """PLANTED BUG: the inline guard lets the lock go before it clears the owner, so it can
    clear the owner that the next holder has just written."""

    __slots__ = ()

    def __exit__(self, *exc: object) -> None:
        self._inner.release()
        self._lock._owner = None


@pytest.mark.usefixtures("fast_switch")
def test_ownership_check_catches_an_owner_cleared_after_release() -> None:
    seed = _ownership_seed()
    violations: list[str] = []
    for attempt in range(8):  # measured: 17 of 20 single attempts catch it
        lock = make_lock("mutex", "t", 1, debug=False)
        assert isinstance(lock, MutexLock)
        for name in ("_read_guard", "_write_guard", "_untimed_guard"):
            guard = getattr(lock, name)
            planted = _OwnerClearedAfterRelease(lock, guard._inner, guard._mode)
            planted._untimed = guard._untimed
            setattr(lock, name, planted)
        violations, _ = ownership_violations(lock, seed + attempt)
        if violations:
            break
    assert violations, "the planted owner race survived: the check is too weak"
    assert any("lost ownership" in v or "not the owner" in v for v in violations), violations
