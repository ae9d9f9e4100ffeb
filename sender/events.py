"""What a :class:`~sender.manager.KVManager` tells listeners as rooms and chunks conclude.

:class:`ManagerEvents` is the listener protocol, called outside the manager's locks by the
thread that made the change or the first reader that saw it, never the notifier thread
(docs/THREADING.md, "Listeners"). :class:`FanOut` passes each event to several listeners and
never raises (a listener's error is counted and swallowed). The values of ``outcome`` and
``code``: :data:`ROOM_OUTCOMES`, :data:`ROOM_CODES`, :data:`CHUNK_OUTCOMES`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from sender.notices import CODES

__all__ = [
    "CHUNK_OUTCOMES", "ROOM_CODES", "ROOM_OUTCOMES", "FanOut", "FanOutStats", "ManagerEvents",
]

logger = logging.getLogger(__name__)

ROOM_OUTCOMES = ("success", "failed", "cleared")
"""``outcome`` of :meth:`ManagerEvents.room_concluded`."""

ROOM_CODES = ("ok", *CODES)
"""``code`` of :meth:`ManagerEvents.room_concluded`: ``"ok"`` or a room-notice code."""

CHUNK_OUTCOMES = ("done", "failed", "skipped", "drained")
"""``outcome`` of :meth:`ManagerEvents.chunk_ended`."""


@runtime_checkable
class ManagerEvents(Protocol):
    """A listener of a manager's room and chunk conclusions: called from any of its threads,
    possibly several at once, so it must be thread-safe and return quickly."""

    def room_concluded(
        self, room: int, generation: int, outcome: str, code: str, seconds: float
    ) -> None:
        """Opening ``generation`` of ``room`` concluded ``outcome`` (``code`` says why),
        ``seconds`` after it was opened."""
        ...

    def chunk_ended(self, session_id: str, outcome: str, seconds: float, nbytes: int) -> None:
        """A chunk of ``nbytes`` to ``session_id`` ended ``outcome``, ``seconds`` after its
        start."""
        ...


@dataclass(frozen=True)
class FanOutStats:
    """Counters of one :class:`FanOut`: events passed on (once each), listener calls that
    raised, and the ``repr`` of the latest such error (or ``None``)."""

    events: int
    errors: int
    last_error: str | None


class FanOut:
    """Passes every event to each listener in order; never raises. A listener's error is
    counted, logged once per listener (WARNING, ``sender.events``), and the next listener
    still gets the event.

    Thread-safety: safe from any threads; ``_lock`` guards the counters only and is never
    held across a listener call.

    Args:
        *listeners: Objects with callable ``room_concluded`` and ``chunk_ended``.

    Raises:
        TypeError: A listener lacks one of the two methods.
    """

    def __init__(self, *listeners: ManagerEvents) -> None:
        for i, listener in enumerate(listeners):
            names = ("room_concluded", "chunk_ended")
            missing = [n for n in names if not callable(getattr(listener, n, None))]
            if missing:
                raise TypeError(
                    f"listener {i} ({type(listener).__name__}) has no callable "
                    f"{' or '.join(missing)}: not a ManagerEvents"
                )
        self._listeners: tuple[ManagerEvents, ...] = tuple(listeners)
        self._lock = threading.Lock()  # guards the four fields below
        self._events = 0
        self._errors = 0
        self._last_error: str | None = None
        self._logged: set[int] = set()  # indices of listeners whose first error was logged

    @property
    def listeners(self) -> tuple[ManagerEvents, ...]:
        """The listeners, in calling order. Thread-safe (immutable); raises nothing."""
        return self._listeners

    def stats(self) -> FanOutStats:
        """Frozen counters. Thread-safe; raises nothing."""
        with self._lock:
            return FanOutStats(self._events, self._errors, self._last_error)

    def room_concluded(
        self, room: int, generation: int, outcome: str, code: str, seconds: float
    ) -> None:
        """Pass a room conclusion to every listener. Thread-safe. Raises: nothing."""
        self._pass("room_concluded", room, generation, outcome, code, seconds)

    def chunk_ended(self, session_id: str, outcome: str, seconds: float, nbytes: int) -> None:
        """Pass a chunk end to every listener. Thread-safe. Raises: nothing."""
        self._pass("chunk_ended", session_id, outcome, seconds, nbytes)

    def _pass(self, method: str, *args: object) -> None:
        # mutant-site: pass-count
        with self._lock:
            self._events += 1
        for i, listener in enumerate(self._listeners):
            try:
                getattr(listener, method)(*args)
            except Exception as exc:
                self._failed(i, listener, exc)

    def _failed(self, index: int, listener: object, exc: Exception) -> None:
        try:
            text = repr(exc)
        except Exception:  # a broken __repr__ must not escape either
            text = f"<{type(exc).__name__}>"
        with self._lock:
            self._errors += 1
            # mutant-site: failed
            self._last_error = text
            first = index not in self._logged
            self._logged.add(index)
        if first:  # logged outside the lock: a handler may be slow or re-enter
            with contextlib.suppress(Exception):  # nor may a broken handler reach the manager
                logger.warning(
                    "metrics listener %d (%s) raised %s; its errors are counted and "
                    "swallowed from now on", index, type(listener).__name__, text, exc_info=exc,
                )
