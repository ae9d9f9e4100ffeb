"""Fault injection around a *real* transport.

:class:`FaultInjectingTransport` wraps a :class:`sender.transport.NixlTransport` and, at the
points a sender touches it (posting a write, polling a transfer), raises instances of NIXL's
real exception classes — with a probability, or at chosen call numbers — instead of (or
after) calling through. Everything else is delegated to the real transport, so the bytes
that do move are real. Used by tests and the stress suite.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from sender import _nixl
from sender.errors import TransferFailedError

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
    """How many calls went through each point and how many faults were raised."""

    writes: int
    polls: int
    faults: int


class FaultInjectingTransport:
    """A real transport with injected faults.

    Args:
        transport: the real transport to wrap.
        rate: probability in ``[0, 1]`` that a call at an enabled point raises.
        seed: seed of the injector's own ``random.Random`` (replayable).
        points: which calls may fault (``"write"``, ``"poll"``).
        classes: NIXL exception class names to raise (chosen at random).
        fail_writes: write call numbers (1-based) that always fault, whatever ``rate``.

    Thread-safe: the random stream and counters are guarded by ``_lock`` (a plain mutex,
    never held while calling the real transport).

    Raises:
        ValueError: ``rate`` outside ``[0, 1]``, unknown point or class.
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
    ) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate must be in [0, 1], got {rate}")
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

    @property
    def inner(self) -> Any:
        """The wrapped real transport."""
        return self._inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def stats(self) -> FaultStats:
        """Counters so far. Thread-safe."""
        with self._lock:
            return FaultStats(self._writes, self._polls, self._faults)

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
                    **kwargs: Any) -> _FaultyTransfer:
        """Like the real ``write_pages``; may raise an injected NIXL error instead."""
        fault = self._draw("write")
        if fault is not None:
            raise fault
        return _FaultyTransfer(
            self._inner.write_pages(session_id, src_pages, dst_pages, *args, **kwargs), self
        )


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
