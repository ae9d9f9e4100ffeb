"""How late this process's threads get to run: the scheduling delay a bound on the sender
must allow for (CPU run queue, GIL, a process-wide stall), measured, not assumed.

Used where a room's bound is derived: ``peer-faults`` (a killed peer's rooms) and
``two-hosts`` (every fault's rooms): bound = fixed part + 2 x the worst lateness seen while
the room waited.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

__all__ = ["LagProbe"]


class LagProbe:
    """How late this process's threads get to run: a thread sleeps :data:`PERIOD_S` again
    and again and records by how much it overslept (CPU run queue, GIL). Thread-safe."""

    PERIOD_S = 0.01

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._samples: deque[tuple[float, float]] = deque(maxlen=100_000)  # guarded by _lock

    def run(self, running: Callable[[], bool]) -> None:
        """The probe thread's body, until ``running()`` is false."""
        while running():
            t0 = time.monotonic()
            time.sleep(self.PERIOD_S)
            woke = time.monotonic()
            with self._lock:
                self._samples.append((woke, max(0.0, woke - t0 - self.PERIOD_S)))

    def worst(self, start: float, end: float) -> float:
        """The worst lateness of a wake-up in ``[start, end + PERIOD_S]`` (0 if none)."""
        with self._lock:
            return max(
                (late for at, late in self._samples if start <= at <= end + self.PERIOD_S),
                default=0.0,
            )
