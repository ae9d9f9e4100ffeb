"""The lock model shared by the staging layer and the sender: every lock has a *name*, a
*level* in the hierarchy (:class:`LockLevel`) and the context managers ``read()``/``write()``.

* :class:`RWLock` -- ``readerwriterlock.RWLockFair`` (neither side starves). A fresh
  ``gen_rlock()``/``gen_wlock()`` object per use: one shared by two threads corrupts the
  reader count. Its internal locks come from a late-binding factory, so tools that patch
  ``threading.Lock`` (deterministic schedulers) see them.
* :class:`MutexLock` -- one ``threading.Lock`` for both modes.

Neither is reentrant. The rules for holders, and debug mode (``LockReentryError``,
``LockOrderError`` raised before blocking), are in docs/THREADING.md.
"""

from __future__ import annotations

import math
import numbers
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Literal, NoReturn, Protocol

from readerwriterlock import rwlock

from staging.errors import LockNotHeldError, LockOrderError, LockReentryError, LockTimeoutError

LockMode = Literal["read", "write"]
LockKind = Literal["rw", "mutex"]

DEBUG_ENV = "NIXL_STAGING_DEBUG_LOCKS"


class LockLevel(IntEnum):
    """The lock hierarchy, outermost first: a thread takes locks in increasing level.
    ``TRANSFER`` is reserved (no lock uses it). Who holds which: docs/THREADING.md."""

    ROOM_GATE = 5
    ROOM = 10
    STAGING = 20
    POOL = 30
    FAILURE = 40
    TRANSFER = 50


def debug_from_env() -> bool:
    """``True`` when env ``NIXL_STAGING_DEBUG_LOCKS`` is ``1``/``true``/``yes``."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def check_lock_timeout(timeout: object, what: str = "lock timeout") -> float | None:
    """Validate a lock timeout in seconds; return it as a ``float``, or ``None`` (no limit).

    ``inf`` is returned as ``None``. A finite timeout must be > 0 and at most
    ``threading.TIMEOUT_MAX``: ``Lock.acquire`` raises ``OverflowError`` above it.

    Raises:
        TypeError: not ``None`` and not a real number, or a ``bool``.
        ValueError: NaN, <= 0, or finite and above ``threading.TIMEOUT_MAX``.
    """
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(
            f"{what} must be None or a number of seconds, got {type(timeout).__name__} {timeout!r}"
        )
    too_large = ValueError(
        f"{what} must be at most threading.TIMEOUT_MAX ({threading.TIMEOUT_MAX:g} s), or "
        f"None/inf for no limit, got {timeout!r}"
    )
    try:
        seconds = float(timeout)
    except OverflowError:  # an int (or Fraction) beyond any float
        raise too_large from None
    if math.isnan(seconds) or seconds <= 0:
        raise ValueError(f"{what} must be None or > 0 seconds, got {timeout!r}")
    if seconds == math.inf:
        return None
    if seconds > threading.TIMEOUT_MAX:
        raise too_large
    return seconds


_get_ident = threading.get_ident

HANDOFF_YIELDS: int = 3 if getattr(sys, "_is_gil_enabled", lambda: True)() else 0
"""How many times a contended acquisition hands the GIL over (``time.sleep(0)``) and tries
again before it blocks on the lock (see ``StagingLock._wait``). Without a GIL
(free-threaded CPython) the holder runs on its own core: then 0, block at once."""


def _new_thread_lock() -> threading.Lock:
    # Looked up at call time, not bound at import: patched ``threading.Lock`` is honoured.
    return threading.Lock()


@dataclass(frozen=True)
class LockStats:
    """A snapshot of one lock's counters. ``contended`` (acquisitions that found the lock
    busy) is measured for a :class:`MutexLock` and a debug-mode :class:`RWLock`, else 0."""

    name: str
    kind: LockKind
    level: int
    read_acquisitions: int
    write_acquisitions: int
    contended: int
    timeouts: int


class _Acquirable(Protocol):
    def acquire(self, blocking: bool = ..., timeout: float = ...) -> bool: ...

    def release(self) -> None: ...


class _Held(threading.local):
    def __init__(self) -> None:
        self.locks: list[tuple[StagingLock, LockMode]] = []


# Per thread: (lock, mode) of each lock it holds; maintained only by locks in debug mode.
_held = _Held()


def held_locks() -> tuple[tuple[str, LockMode], ...]:
    """Debug mode: the (name, mode) of every debug lock the calling thread holds, in order."""
    return tuple((lock.name, mode) for lock, mode in _held.locks)


class _Guard:
    """The lock's own ``_acquire``/``_release`` in one mode, as a context manager.
    Stateless: an RWLock makes one per use, a MutexLock reuses one per mode."""

    __slots__ = ("_inner", "_lock", "_mode", "_untimed")

    def __init__(
        self, lock: StagingLock, inner: _Acquirable, mode: LockMode, *, untimed: bool = False
    ) -> None:
        self._lock = lock
        self._inner = inner
        self._mode: LockMode = mode
        self._untimed = untimed

    def __enter__(self) -> None:
        self._lock._acquire(self._inner, self._mode, self._untimed)

    def __exit__(self, *exc_info: object) -> None:
        self._lock._release(self._inner, self._mode)


class StagingLock:
    """The interface of every lock of the model (:class:`RWLock`, :class:`MutexLock`) and
    their shared logic: timeouts, counters, debug tracking."""

    kind: LockKind
    _exclusive_only: bool

    def __init__(
        self, name: str, level: int, *, timeout: float | None = None, debug: bool | None = None
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError("lock name must be a non-empty str")
        if isinstance(level, bool) or not isinstance(level, int):
            raise TypeError(f"lock level must be an int, got {type(level).__name__}")
        timeout = check_lock_timeout(timeout)
        self._name = name
        self._level = int(level)
        self._timeout = timeout
        self._timeout_arg: float = -1 if timeout is None else float(timeout)
        self._debug = debug_from_env() if debug is None else bool(debug)
        self._count_contention = self._debug or self._exclusive_only
        # The acquisition and release paths, chosen once: debug mode wraps the plain ones in
        # its checks and tracking.
        self._acquire: Callable[[_Acquirable, LockMode, bool], None] = (
            self._take_checked if self._debug else self._take
        )
        self._release: Callable[[_Acquirable, LockMode], None] = (
            self._give_checked if self._debug else self._give
        )
        # Thread ident of the exclusive holder (write mode, or any mode of a mutex), or None.
        # Written only by the holder, after acquiring and before releasing (_acquire,
        # _release): guarded by the lock itself.
        self._owner: int | None = None
        # The inner lock of the acquisition made by acquire_write* (not MutexLock's, which
        # overrides the pair): guarded by the write side itself (only its holder stores or
        # reads it).
        self._writer: _Acquirable | None = None
        # Counters. _writes, and _reads of an exclusive-only lock, are guarded by the lock
        # itself (only the exclusive holder increments them); _reads of a shared-mode lock,
        # _contended and _timeouts are guarded by _stats_lock.
        self._stats_lock = threading.Lock()
        self._reads = 0
        self._writes = 0
        self._contended = 0
        self._timeouts = 0

    @property
    def name(self) -> str:
        return self._name

    @property
    def level(self) -> int:
        return self._level

    @property
    def debug(self) -> bool:
        return self._debug

    @property
    def timeout(self) -> float | None:
        return self._timeout

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._name!r} level={self._level} debug={self._debug}>"

    # -- acquisition -------------------------------------------------------------------

    def _take(self, inner: _Acquirable, mode: LockMode, untimed: bool = False) -> None:
        """The one acquisition path: acquire (:meth:`_wait` when contended), then the
        holder's bookkeeping (owner, counters)."""
        # Contention is counted where a try-acquire is cheap: readerwriterlock's costs more
        # than its blocking acquire, so a non-debug RWLock goes straight to that.
        if self._count_contention:
            # mutant-site: take-try-acquire
            if not inner.acquire(False):
                self._wait(inner, mode, untimed)
        elif not inner.acquire(True, -1.0 if untimed else self._timeout_arg):
            self._timed_out(mode)
        if mode == "write":
            self._owner = _get_ident()
            self._writes += 1
        elif self._exclusive_only:
            self._owner = _get_ident()
            self._reads += 1
        else:
            with self._stats_lock:
                self._reads += 1

    def _take_checked(self, inner: _Acquirable, mode: LockMode, untimed: bool = False) -> None:
        """Debug mode's acquisition: order and reentry checks, :meth:`_take`, the record."""
        for lock, held_mode in _held.locks:
            if lock is self:
                raise LockReentryError(self._name, held_mode, mode)
            if lock._level >= self._level:
                raise LockOrderError(lock._name, lock._level, self._name, self._level)
        self._take(inner, mode, untimed)
        _held.locks.append((self, mode))

    def _wait(self, inner: _Acquirable, mode: LockMode, untimed: bool) -> None:
        """Take ``inner`` after its try-acquire failed: count it, hand the GIL to the holder
        and retry (:data:`HANDOFF_YIELDS` times), then block up to the timeout (unless
        ``untimed``). Why: docs/PERFORMANCE.md, "The GIL hand-off before blocking"."""
        # mutant-site: acquire-contended
        with self._stats_lock:
            self._contended += 1
        timeout = -1.0 if untimed else self._timeout_arg
        if HANDOFF_YIELDS:
            started = time.monotonic()
            for _ in range(HANDOFF_YIELDS):
                time.sleep(0)  # releases the GIL: the holder runs
                if inner.acquire(False):
                    return
            if timeout >= 0:
                timeout = max(0.0, timeout - (time.monotonic() - started))
        if not inner.acquire(True, timeout):
            self._timed_out(mode)

    def _timed_out(self, mode: LockMode) -> NoReturn:
        with self._stats_lock:
            self._timeouts += 1
        raise LockTimeoutError(self._name, mode, self._timeout_arg)

    def _give(self, inner: _Acquirable, mode: LockMode) -> None:
        """The one release path: clear the owner, then release."""
        # mutant-site: give
        if mode == "write" or self._exclusive_only:
            self._owner = None
        inner.release()

    def _give_checked(self, inner: _Acquirable, mode: LockMode) -> None:
        """Debug mode's release: forget the calling thread's record, then :meth:`_give`.
        Raises :class:`LockNotHeldError` (nothing released) if this thread holds no record."""
        held = _held.locks
        for i in range(len(held) - 1, -1, -1):
            if held[i][0] is self:
                del held[i]
                break
        else:
            raise LockNotHeldError(f"{self._name!r} is not held for {mode} by this thread")
        self._give(inner, mode)

    # -- the guards and the acquire_write/release_write pair (MutexLock overrides them with
    # one reused guard per mode and inlined steps: its writers are StagingContext's hot path)

    def _inner(self, mode: LockMode) -> _Acquirable:
        """The inner lock that one acquisition in ``mode`` takes."""
        raise NotImplementedError

    def read(self) -> _Guard:
        """Hold in shared mode. Raises: LockTimeoutError, LockReentryError, LockOrderError."""
        return _Guard(self, self._inner("read"), "read")

    def write(self) -> _Guard:
        """Hold exclusively. Raises: LockTimeoutError, LockReentryError, LockOrderError."""
        # mutant-site: write
        return _Guard(self, self._inner("write"), "write")

    def write_untimed(self) -> _Guard:
        """Hold exclusively, ignoring ``timeout`` (waits as long as it takes).
        Raises: LockReentryError, LockOrderError (debug mode)."""
        return _Guard(self, self._inner("write"), "write", untimed=True)

    def acquire_write(self) -> None:
        """As ``write().__enter__()``; release with :meth:`release_write`.
        Raises: LockTimeoutError, LockReentryError, LockOrderError."""
        self._acquire_writer(False)

    def acquire_write_untimed(self) -> None:
        """As ``write_untimed().__enter__()``; release with :meth:`release_write`.
        Raises: LockReentryError, LockOrderError (debug mode)."""
        self._acquire_writer(True)

    def _acquire_writer(self, untimed: bool) -> None:
        writer = self._inner("write")
        self._acquire(writer, "write", untimed)
        self._writer = writer

    def release_write(self) -> None:
        """Release the write side taken by :meth:`acquire_write`/:meth:`acquire_write_untimed`.
        Raises: LockNotHeldError: the calling thread does not hold it that way."""
        writer = self._writer
        if writer is None or self._owner != _get_ident():
            raise LockNotHeldError(f"{self._name!r} is not held for write by this thread")
        self._writer = None
        self._release(writer, "write")

    # -- inspection --------------------------------------------------------------------

    def assert_held(self, mode: LockMode) -> None:
        """Raise :class:`LockNotHeldError` unless the calling thread holds this lock in ``mode``
        (write satisfies ``"read"``). Exact in debug mode; outside it, shared holders of an
        :class:`RWLock` are not tracked, so ``"read"`` means "not free". Thread-safe."""
        if self._debug:
            held = any(lock is self and m in (mode, "write") for lock, m in _held.locks)
        else:
            held = self._owner == threading.get_ident() or (
                mode == "read" and not self._exclusive_only and self._held_by_anyone()
            )
        if not held:
            raise LockNotHeldError(f"{self._name!r} is not held for {mode} by this thread")

    def _held_by_anyone(self) -> bool:
        raise NotImplementedError

    def stats(self) -> LockStats:
        """A frozen snapshot of the counters. Thread-safe; never blocks on the lock itself."""
        with self._stats_lock:
            return LockStats(
                name=self._name,
                kind=self.kind,
                level=self._level,
                read_acquisitions=self._reads,
                write_acquisitions=self._writes,
                contended=self._contended,
                timeouts=self._timeouts,
            )


class RWLock(StagingLock):
    """Readers-writer lock over ``readerwriterlock.RWLockFair``.

    Thread-safety: all methods are thread-safe. ``read()`` admits many concurrent holders,
    ``write()`` one holder and no reader. Not reentrant.
    """

    kind: LockKind = "rw"
    _exclusive_only = False

    def __init__(
        self, name: str, level: int, *, timeout: float | None = None, debug: bool | None = None
    ) -> None:
        super().__init__(name, level, timeout=timeout, debug=debug)
        self._rw = rwlock.RWLockFair(lock_factory=_new_thread_lock)

    def _inner(self, mode: LockMode) -> _Acquirable:
        return self._rw.gen_rlock() if mode == "read" else self._rw.gen_wlock()

    def _held_by_anyone(self) -> bool:
        probe = self._rw.gen_wlock()
        if probe.acquire(blocking=False):
            probe.release()
            return False
        return True


class MutexLock(StagingLock):
    """One ``threading.Lock`` serving both modes (readers exclude each other).

    Thread-safety: all methods are thread-safe. Not reentrant.
    """

    kind: LockKind = "mutex"
    _exclusive_only = True

    def __init__(
        self, name: str, level: int, *, timeout: float | None = None, debug: bool | None = None
    ) -> None:
        super().__init__(name, level, timeout=timeout, debug=debug)
        self._mutex = _new_thread_lock()
        # A mutex guard carries no per-use state, so one instance per mode serves every use
        # and every thread (unlike readerwriterlock's generated lock objects).
        self._read_guard = _Guard(self, self._mutex, "read")
        self._write_guard = _Guard(self, self._mutex, "write")
        self._untimed_guard = _Guard(self, self._mutex, "write", untimed=True)

    def _held_by_anyone(self) -> bool:
        return self._mutex.locked()

    # acquire_write/release_write repeat the steps of _take/_give as plain methods, one
    # Python frame each: StagingContext's writers make ~10 a room (a partial around _take
    # costs ~850 instructions more a pair). Debug mode takes the checked forms instead.

    def acquire_write(self) -> None:
        """As ``write().__enter__()``; release with :meth:`release_write`.
        Raises: LockTimeoutError, LockReentryError, LockOrderError."""
        mutex = self._mutex
        if self._debug:
            self._take_checked(mutex, "write", False)
            return
        # mutant-site: acquire-write-try
        if not mutex.acquire(False):
            self._wait(mutex, "write", False)
        self._owner = _get_ident()
        self._writes += 1

    def acquire_write_untimed(self) -> None:
        """As ``write_untimed().__enter__()``; release with :meth:`release_write`.
        Raises: LockReentryError, LockOrderError (debug mode)."""
        self._acquire(self._mutex, "write", True)

    def release_write(self) -> None:
        """Release what :meth:`acquire_write`/:meth:`acquire_write_untimed` took. The caller
        must hold it (as with ``__exit__``, this is not checked outside debug mode).

        Raises:
            LockNotHeldError: debug mode, and the calling thread does not hold it.
            RuntimeError: outside debug mode, the lock is not held by any thread.
        """
        if self._debug:
            self._give_checked(self._mutex, "write")
            return
        # mutant-site: release-write
        self._owner = None
        self._mutex.release()

    def read(self) -> _Guard:
        """Hold (exclusively). Raises: LockTimeoutError, LockReentryError, LockOrderError."""
        return self._read_guard

    def write(self) -> _Guard:
        return self._write_guard

    def write_untimed(self) -> _Guard:
        return self._untimed_guard


LOCK_KINDS: tuple[LockKind, ...] = ("rw", "mutex")


def make_lock(
    kind: str, name: str, level: int, *, timeout: float | None = None, debug: bool | None = None
) -> RWLock | MutexLock:
    """Build a lock of ``kind`` (``"rw"`` or ``"mutex"``).

    ``timeout``: see :func:`check_lock_timeout` (``None`` or ``inf``: no limit).

    Raises:
        ValueError: unknown ``kind``, empty ``name``, or a ``timeout`` that is NaN, <= 0 or
            finite above ``threading.TIMEOUT_MAX``.
        TypeError: ``level`` is not an int, or ``timeout`` is not ``None`` or a real number
            (``bool`` and ``str`` are refused).
    """
    if kind not in LOCK_KINDS:
        raise ValueError(f"lock kind must be one of {LOCK_KINDS}, got {kind!r}")
    return (RWLock if kind == "rw" else MutexLock)(name, level, timeout=timeout, debug=debug)
