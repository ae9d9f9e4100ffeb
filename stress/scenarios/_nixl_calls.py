"""Slow NIXL calls of the stress rig's transport: a diagnostic for its findings.

Once, on a loaded machine, rooms opened just after their decode peer was killed failed 2.4 s
later, with the child's scheduling delay at 5 ms (so the process did run): none of their
chunks reached the transfer deadline, as if every worker waited. One reading is a NIXL call
that blocks with the GIL released (a post to the dead peer), while the other workers wait for
NIXL's agent lock. :class:`SlowCalls` wraps the transport's transfer operations (the binding
agent the transport posts, polls and releases with) and notes each call that took longer
than :data:`SLOW_S`, so that a finding can name what NIXL was doing meanwhile.

Harness only: it reaches into ``NixlTransport._xfer_agent`` (no public seam exists for it,
and the library should not grow one for a diagnostic). Cost: one Python frame per call.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

__all__ = ["SLOW_S", "SlowCalls"]

SLOW_S = 0.05
"""A NIXL call longer than this is noted."""


class SlowCalls:
    """Wraps an object of NIXL operations; notes ``(start, end, name, thread)`` of each call
    longer than :data:`SLOW_S`.

    Thread-safety: the wrapped calls run on any thread at once; ``_lock`` guards ``_slow``
    (append and read only under it). Raises whatever the wrapped call raises, unchanged.
    """

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._lock = threading.Lock()
        self._slow: deque[tuple[float, float, str, str]] = deque(maxlen=1000)  # _lock

    def __getattr__(self, name: str) -> Any:
        call = getattr(self._inner, name)
        if not callable(call):
            return call

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.monotonic()
            try:
                return call(*args, **kwargs)
            finally:
                end = time.monotonic()
                if end - start > SLOW_S:
                    with self._lock:
                        self._slow.append((start, end, name, threading.current_thread().name))

        return timed

    def during(self, start: float, end: float) -> list[tuple[float, float, str, str]]:
        """The slow calls that overlapped ``[start, end]``."""
        with self._lock:
            return [c for c in self._slow if c[1] >= start and c[0] <= end]

    def describe(self, start: float, end: float) -> str:
        """The slow calls of ``[start, end]`` as text, for a finding."""
        calls = self.during(start, end)
        if not calls:
            return "no NIXL call took over 50 ms meanwhile"
        parts = [
            f"{name} {(e - s) * 1e3:.0f} ms on {thread} (from +{(s - start) * 1e3:.0f} ms)"
            for s, e, name, thread in calls[:4]
        ]
        more = f" and {len(calls) - 4} more" if len(calls) > 4 else ""
        return "NIXL calls over 50 ms meanwhile: " + "; ".join(parts) + more
