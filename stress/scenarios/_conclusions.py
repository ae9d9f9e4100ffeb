"""When the *sender* concluded each room, as opposed to when the harness's scheduler noticed.

A :class:`~stress.harness.driver.RoomOutcome`'s ``concluded_at`` is taken by the driver on the
scheduler thread, after its own work for the room (a bytes check over the peer's control
channel). A bound on the sender is judged by the sender's own time: :class:`ConclusionClock`
is a manager listener (:class:`~sender.events.ManagerEvents`) that notes ``time.monotonic()``
when the manager tells of each opening's conclusion -- after the room's status changed, so
never early -- and the room-notice ``code`` it gave (``peer-failed``: the room failed with its
decode session as a whole, ``fail_session``).
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
        self._code: dict[tuple[int, int], str] = {}  # guarded by _lock

    def room_concluded(
        self, room: int, generation: int, outcome: str, code: str, seconds: float
    ) -> None:
        """Note when opening ``generation`` of ``room`` concluded (its first event only)."""
        now = self._now()
        with self._lock:
            self._at.setdefault((room, generation), now)
            self._code.setdefault((room, generation), code)

    def chunk_ended(self, session_id: str, outcome: str, seconds: float, nbytes: int) -> None:
        """Not needed here."""

    def code(self, room: int, generation: int) -> str | None:
        """The code the manager concluded that opening with (``None``: not told)."""
        with self._lock:
            return self._code.get((room, generation))

    def at(self, room: int, generation: int) -> float | None:
        """When the manager concluded that opening (``None``: not told, e.g. a room the
        harness refused before the manager opened it)."""
        with self._lock:
            return self._at.get((room, generation))
