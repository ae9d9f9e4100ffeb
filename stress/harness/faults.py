"""Fault injection around a *real* transport.

:class:`FaultInjectingTransport` wraps a :class:`sender.transport.NixlTransport` and, at the
points a sender touches it (posting a write, polling a transfer), raises instances of NIXL's
real exception classes — with a probability, or at chosen call numbers — instead of (or
after) calling through. Everything else is delegated to the real transport, so the bytes
that do move are real. Used by tests and the stress suite.

It can also **delay** posted writes (``delay_rate``, ``delay_s``): a slow network. The write
is accepted at once (``write_pages`` returns, ``poll`` says ``"PROC"``) and really posted
``delay_s`` later by the injector's delayer thread. As with NIXL, releasing such a transfer
does not cancel it: a write released before its post is still posted when due (its bytes
land) and its real handle is released once it is done. That is exactly the case a sender must
not reuse the destination pages in (see the drain rule in :mod:`stress.harness.driver`).
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from sender import _nixl
from sender.errors import TransferFailedError, TransferReleasedError, TransferTimeoutError

FaultPoint = Literal["write", "poll"]

DEFAULT_FAULT_CLASSES: tuple[str, ...] = (
    "nixlBackendError",
    "nixlCancelledError",
    "nixlNotFoundError",
)
"""NIXL classes raised by default: per-transfer failures. ``nixlRemoteDisconnectError``
(peer gone: fails the whole session) is opt-in via ``classes``."""


def nixl_error(name: str) -> BaseException:
    """An instance of NIXL's exception class ``name`` (message = its status name), or of our
    :class:`TransferFailedError` if NIXL is not importable.

    Raises:
        ValueError: ``name`` is not a NIXL exception class.
    """
    bindings = _nixl.bindings
    if bindings is None:
        return TransferFailedError(name)
    cls = getattr(bindings, name, None)
    if not (isinstance(cls, type) and issubclass(cls, BaseException)):
        raise ValueError(f"{name!r} is not a NIXL exception class")
    status = {
        "nixlRemoteDisconnectError": "NIXL_ERR_REMOTE_DISCONNECT",
        "nixlBackendError": "NIXL_ERR_BACKEND",
        "nixlCancelledError": "NIXL_ERR_CANCELED",
        "nixlNotFoundError": "NIXL_ERR_NOT_FOUND",
    }.get(name, name)
    return cls(status)


@dataclass(frozen=True, slots=True)
class FaultStats:
    """How many calls went through each point and how many faults were raised.

    ``delayed``: writes held back by the delay mode; ``posted_after_release``: of those, how
    many were released by the sender before they were really posted (their bytes landed
    after the release).
    """

    writes: int
    polls: int
    faults: int
    delayed: int = 0
    posted_after_release: int = 0


class FaultInjectingTransport:
    """A real transport with injected faults.

    Args:
        transport: the real transport to wrap.
        rate: probability in ``[0, 1]`` that a call at an enabled point raises.
        seed: seed of the injector's own ``random.Random`` (replayable).
        points: which calls may fault (``"write"``, ``"poll"``).
        classes: NIXL exception class names to raise (chosen at random).
        fail_writes: write call numbers (1-based) that always fault, whatever ``rate``.
        delay_rate: probability in ``[0, 1]`` that a write (that did not fault) is held back
            ``delay_s`` seconds before it is really posted (see the module docstring).
        delay_s: how long a delayed write is held back.

    Thread-safe: the random stream and counters are guarded by ``_lock`` (a plain mutex,
    never held while calling the real transport). With delays, call :meth:`close` when done
    (it stops the delayer thread).

    Raises:
        ValueError: ``rate``/``delay_rate`` outside ``[0, 1]``, negative ``delay_s``,
            unknown point or class.
    """

    def __init__(
        self,
        transport: Any,
        *,
        rate: float = 0.0,
        seed: int = 0,
        points: Sequence[FaultPoint] = ("write", "poll"),
        classes: Sequence[str] = DEFAULT_FAULT_CLASSES,
        fail_writes: Sequence[int] = (),
        delay_rate: float = 0.0,
        delay_s: float = 0.0,
    ) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate must be in [0, 1], got {rate}")
        if not 0.0 <= delay_rate <= 1.0:
            raise ValueError(f"delay_rate must be in [0, 1], got {delay_rate}")
        if not delay_s >= 0.0:
            raise ValueError(f"delay_s must be >= 0, got {delay_s}")
        bad = set(points) - {"write", "poll"}
        if bad:
            raise ValueError(f"unknown fault points {sorted(bad)}")
        for name in classes:
            nixl_error(name)
        self._inner = transport
        self._rate = rate
        self._points = frozenset(points)
        self._classes = tuple(classes)
        self._fail_writes = frozenset(fail_writes)
        self._lock = threading.Lock()
        # Guarded by _lock.
        self._rng = random.Random(seed)
        self._writes = 0
        self._polls = 0
        self._faults = 0
        self._delay_rate = delay_rate
        self._delay_s = delay_s
        self._delay_select: Callable[[bytes | None], bool] | None = None
        self._delayed = 0
        self._posted_after_release = 0
        # The delay mode. _cond (its own mutex) guards _pending (a heap of (due, seq,
        # transfer) not yet posted), _posting, _orphans (posted after their release: polled
        # by the delayer until done, then released), _closing and _delayer.
        self._cond = threading.Condition(threading.Lock())
        self._pending: list[tuple[float, int, _DelayedTransfer]] = []
        self._orphans: list[Any] = []
        self._seq = itertools.count()
        self._closing = False
        self._posting = 0  # due writes taken off _pending, being posted by the delayer now
        self._delayer: threading.Thread | None = None

    @property
    def inner(self) -> Any:
        """The wrapped real transport."""
        return self._inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def stats(self) -> FaultStats:
        """Counters so far. Thread-safe."""
        with self._lock:
            return FaultStats(
                self._writes,
                self._polls,
                self._faults,
                self._delayed,
                self._posted_after_release,
            )

    def set_delay(
        self, rate: float, delay_s: float, select: Callable[[bytes | None], bool] | None = None
    ) -> None:
        """Change the delay mode (``rate`` 0 turns it off for later writes). ``select``, if
        given, limits it to the writes whose notification it accepts (e.g. the writes of the
        rooms a test is about to fail); it is called without a lock held. Thread-safe.

        Raises:
            ValueError: ``rate`` outside ``[0, 1]`` or negative ``delay_s``.
        """
        if not 0.0 <= rate <= 1.0 or not delay_s >= 0.0:
            raise ValueError(f"bad delay: rate={rate}, delay_s={delay_s}")
        with self._lock:
            self._delay_rate = rate
            self._delay_s = delay_s
            self._delay_select = select

    def quiesce(self, timeout_s: float) -> bool:
        """Wait until every delayed write was posted and every one released before its post
        is done and released; ``True`` if so within ``timeout_s``. Thread-safe."""
        end = time.monotonic() + timeout_s
        with self._cond:
            while self._pending or self._orphans or self._posting:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.01))
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Post what is still held back now, wait (bounded) for writes released before their
        post, release them, and stop the delayer thread. Idempotent; thread-safe. The wrapped
        transport is not closed.

        Raises:
            RuntimeError: the delayer thread did not stop within ``timeout_s``.
        """
        with self._cond:
            self._closing = True
            thread = self._delayer
            self._cond.notify_all()
        if thread is not None:
            thread.join(timeout_s)
            if thread.is_alive():
                raise RuntimeError("fault injector's delayer thread did not stop")

    def _draw(self, point: FaultPoint) -> BaseException | None:
        with self._lock:
            if point == "write":
                self._writes += 1
                forced = self._writes in self._fail_writes
            else:
                self._polls += 1
                forced = False
            enabled = point in self._points and self._rate > 0.0
            if not forced and not (enabled and self._rng.random() < self._rate):
                return None
            self._faults += 1
            name = self._rng.choice(self._classes)
        return nixl_error(name)

    def write_pages(self, session_id: str, src_pages: Any, dst_pages: Any, *args: Any,
                    **kwargs: Any) -> _FaultyTransfer | _DelayedTransfer:
        """Like the real ``write_pages``; may raise an injected NIXL error instead, or (delay
        mode) return a transfer that is really posted ``delay_s`` later.

        Raises:
            Whatever the real ``write_pages`` raises, or an injected NIXL error.
        """
        fault = self._draw("write")
        if fault is not None:
            raise fault
        with self._lock:
            select = self._delay_select
        chosen = True
        if select is not None:
            notif = args[0] if args else kwargs.get("notif")
            chosen = bool(select(notif))
        with self._lock:
            delay = chosen and self._delay_rate > 0.0 and self._rng.random() < self._delay_rate
            if delay:
                self._delayed += 1
            delay_s = self._delay_s
        if delay:
            return self._hold((session_id, src_pages, dst_pages, *args), kwargs, delay_s)
        return _FaultyTransfer(
            self._inner.write_pages(session_id, src_pages, dst_pages, *args, **kwargs), self
        )

    # ------------------------------------------------------------------ delay mode

    def _hold(self, args: tuple[Any, ...], kwargs: dict[str, Any], delay_s: float
              ) -> _DelayedTransfer:
        timeout = kwargs.get("timeout_s")
        if timeout is None:
            timeout = float(getattr(self._inner, "default_timeout_s", 30.0))
        xfer = _DelayedTransfer(self, str(args[0]), args, kwargs, float(timeout))
        with self._cond:
            if self._closing:
                raise RuntimeError("fault injector is closed")
            heapq.heappush(self._pending, (time.monotonic() + delay_s, next(self._seq), xfer))
            if self._delayer is None:
                self._delayer = threading.Thread(
                    target=self._delayer_main, name="fault-delayer", daemon=True
                )
                self._delayer.start()
            self._cond.notify_all()
        return xfer

    def _delayer_main(self) -> None:
        while True:
            due: list[_DelayedTransfer] = []
            with self._cond:
                now = time.monotonic()
                while self._pending and (self._closing or self._pending[0][0] <= now):
                    due.append(heapq.heappop(self._pending)[2])
                self._posting += len(due)
                orphans = list(self._orphans)
                if not due and not orphans:
                    if self._closing:
                        return
                    wait = self._pending[0][0] - now if self._pending else None
                    self._cond.wait(wait)
                    continue
            for xfer in due:
                orphan = xfer._post()
                if orphan is not None:
                    with self._lock:
                        self._posted_after_release += 1
                with self._cond:
                    if orphan is not None:
                        self._orphans.append(orphan)
                    self._posting -= 1
            finished = [o for o in orphans if self._orphan_done(o)]
            with self._cond:
                for o in finished:
                    self._orphans.remove(o)
                self._cond.notify_all()
            if orphans and not finished:
                time.sleep(0.0005)

    def _orphan_done(self, real: Any) -> bool:
        """Poll a write released before its post; release it once it is over."""
        with self._cond:
            closing = self._closing
        try:
            done = real.poll() == "DONE"
        except Exception:  # failed, timed out or released by the transport: over
            done = True
        if done or closing:
            real.release()
            return True
        return False


class _FaultyTransfer:
    """A real transfer whose ``poll`` may raise an injected NIXL error (the handle stays
    live; the caller releases it, exactly as after a real error)."""

    __slots__ = ("_injector", "_inner")

    def __init__(self, inner: Any, injector: FaultInjectingTransport) -> None:
        self._inner = inner
        self._injector = injector

    def poll(self) -> str:
        fault = self._injector._draw("poll")
        if fault is not None:
            raise fault
        state: str = self._inner.poll()
        return state

    def release(self) -> Any:
        return self._inner.release()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _DelayedTransfer:
    """A write accepted now and really posted later by the injector's delayer thread.

    Until then ``poll`` says ``"PROC"`` (or raises :class:`TransferTimeoutError` once its
    deadline passed, as the real transfer would); afterwards it is the real transfer's. A
    release before the post does not cancel it (see the module docstring). Thread-safe:
    ``_lock`` guards the fields below it.
    """

    def __init__(
        self,
        injector: FaultInjectingTransport,
        session_id: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout_s: float,
    ) -> None:
        self._injector = injector
        self._session_id = session_id
        self._args = args
        self._kwargs = kwargs
        self._timeout_s = timeout_s
        self._deadline = time.monotonic() + timeout_s
        self._lock = threading.Lock()
        self._real: Any = None
        self._error: BaseException | None = None
        self._posted = False
        self._released = False

    def _post(self) -> Any:
        """Delayer thread: post the write now. Returns the real transfer when it was
        released before this post (the delayer then owns it), else ``None``."""
        kwargs = dict(self._kwargs)
        kwargs["timeout_s"] = max(0.001, self._deadline - time.monotonic())
        real: Any = None
        error: BaseException | None = None
        try:
            real = self._injector.inner.write_pages(*self._args, **kwargs)
        except Exception as exc:  # the post failed: later polls raise it
            error = exc
        with self._lock:
            self._posted = True
            if self._released:
                return real
            self._real, self._error = real, error
        return None

    def poll(self) -> str:
        """``"PROC"`` until posted (no fault is drawn then: nothing was asked of NIXL), or
        :class:`TransferTimeoutError` once the deadline passed unposted (the write is still
        posted when due: NIXL cannot cancel it); afterwards as the real transfer, with
        injected faults."""
        with self._lock:
            if self._released:
                raise TransferReleasedError(f"poll() on a released transfer: {self!r}")
            if self._error is not None:
                raise self._error
            real = self._real
            if not self._posted:
                if time.monotonic() >= self._deadline:
                    self._error = TransferTimeoutError(self._session_id, self._timeout_s)
                    raise self._error
                return "PROC"
        fault = self._injector._draw("poll")
        if fault is not None:
            raise fault
        state: str = real.poll()
        return state

    def release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
            real = self._real
        if real is not None:
            real.release()

    def settled(self) -> bool:
        """As :meth:`sender.transport.Transfer.settled`: never before the delayed post
        (the write is still to come, even past its deadline or after a release); afterwards
        the real transfer's answer (a failed post is settled). Never raises."""
        with self._lock:
            posted, released, real = self._posted, self._released, self._real
        if not posted:
            return False
        if released or real is None:
            return True
        # Its deadline failed it here, not in the real transfer (never polled since the
        # late post, so not failed by its own deadline either): ask NIXL through a poll, as
        # the real transfer's settled() does for a write failed by our doing.
        with contextlib.suppress(Exception):
            real.poll()
        settled = getattr(real, "settled", None)
        return True if settled is None else bool(settled())

    def __repr__(self) -> str:
        return f"<delayed write to {self._session_id!r} posted={self._posted}>"
