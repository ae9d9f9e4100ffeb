"""When the *sender* concluded each room, as opposed to when the harness's scheduler noticed.

A :class:`~stress.harness.driver.RoomOutcome`'s ``concluded_at`` is taken by the driver on the
scheduler thread, after its own work for the room (a bytes check over the peer's control
channel). A bound on the sender is judged by the sender's own time: :class:`ConclusionClock`
is a manager listener (:class:`~sender.events.ManagerEvents`) that notes ``time.monotonic()``
when the manager tells of each opening's conclusion -- after the room's status changed, so
never early -- and of each chunk that ended ``failed``: the sender's own progress, in which
``two-hosts`` bounds a fault's rooms (so many failed chunks, not so many seconds).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["ConclusionClock"]


class ConclusionClock:
    """``(room, generation) -> time.monotonic()`` of the manager's ``room_concluded`` event.

    Thread-safety: the manager calls it from any of its threads, possibly several at once;
    ``_lock`` guards ``_at`` (mutate and read only under it). Never calls out while holding
    it. Raises nothing.
    """

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self._now = now  # the clock read (tests pass their own)
        self._lock = threading.Lock()
        self._at: dict[tuple[int, int], float] = {}  # guarded by _lock
        self._failed_chunks: list[float] = []  # guarded by _lock; when each was told

    def room_concluded(
        self, room: int, generation: int, outcome: str, code: str, seconds: float
    ) -> None:
        """Note when opening ``generation`` of ``room`` concluded (its first event only)."""
        now = self._now()
        with self._lock:
            self._at.setdefault((room, generation), now)

    def chunk_ended(self, session_id: str, outcome: str, seconds: float, nbytes: int) -> None:
        """Note when a chunk ended ``failed`` (other outcomes are not needed here)."""
        if outcome != "failed":
            return
        now = self._now()
        with self._lock:
            self._failed_chunks.append(now)

    def failed_chunks(self, start: float, end: float) -> int:
        """How many chunks the manager told as ``failed`` in ``(start, end)``."""
        with self._lock:
            return sum(start < at < end for at in self._failed_chunks)

    def at(self, room: int, generation: int) -> float | None:
        """When the manager concluded that opening (``None``: not told, e.g. a room the
        harness refused before the manager opened it)."""
        with self._lock:
            return self._at.get((room, generation))
