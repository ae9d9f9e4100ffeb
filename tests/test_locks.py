"""Behavioural contract of the lock model, run over both implementations, plus debug mode."""

from __future__ import annotations

import threading
import time

import pytest

from staging import (
    LockLevel,
    LockNotHeldError,
    LockOrderError,
    LockReentryError,
    LockTimeoutError,
    StagingContext,
    make_lock,
)
from staging.locks import DEBUG_ENV, LOCK_KINDS, held_locks

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
