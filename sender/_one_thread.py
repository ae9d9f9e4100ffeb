"""Debug mode's check that one sender's scheduler-thread methods are used by one thread at a
time (docs/THREADING.md, "Two threads on one sender"). An overlap is a second thread
entering while another is inside; a hand-over between calls or a re-entry is not.
"""

from __future__ import annotations

import threading

from sender.errors import ConcurrentSenderUseError

__all__ = ["OneThreadCheck", "thread_label"]


def thread_label(thread: threading.Thread) -> str:
    """``'name' (id N)``: a thread's name and id, as the error message names them."""
    return f"{thread.name!r} (id {thread.ident})"


class OneThreadCheck:
    """Who is inside one sender's scheduler-thread methods, and since which method.

    Args:
        room: the sender's room id (for the error message).
        generation: the sender's opening (for the error message).

    Thread-safety: every method is safe from any thread; ``_lock`` guards the owner, method
    and depth, never held while calling out.
    """

    __slots__ = ("_depth", "_generation", "_lock", "_method", "_owner", "_room")

    def __init__(self, room: int, generation: int) -> None:
        self._lock = threading.Lock()
        self._owner: threading.Thread | None = None
        self._method = ""
        self._depth = 0
        self._room = room
        self._generation = generation

    def enter(self, method: str) -> OneThreadCheck:
        """The calling thread enters ``method``; pair it with :meth:`leave`, or use the
        returned check as a context manager that leaves on exit.

        Raises:
            ConcurrentSenderUseError: another thread is inside (names both threads and both
                methods). Nothing is recorded then: do not call :meth:`leave`.
        """
        me = threading.current_thread()
        # mutant-site: enter-with
        with self._lock:
            owner = self._owner
            if owner is None:
                self._owner = me
                self._method = method
                self._depth = 1
                return self
            if owner is me:
                self._depth += 1
                return self
            inside = self._method
        raise ConcurrentSenderUseError(
            self._room, method, thread_label(me), inside, thread_label(owner),
            generation=self._generation,
        )

    def leave(self) -> None:
        """The calling thread leaves the method it entered last. Never raises."""
        with self._lock:
            self._depth -= 1
            if self._depth <= 0:
                self._depth = 0
                self._owner = None
                self._method = ""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        self.leave()
