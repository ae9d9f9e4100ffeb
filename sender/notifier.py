"""Room notices to the decode side: held until their opening drained, then sent by one
thread, best effort.

A notice (:mod:`sender.notices`) of an opening with chunks in flight is *held* until its last
posted chunk ends (:meth:`Notifier.drained`), so no byte of the room lands after it;
``close()`` *withholds* those of abandoned writes. The notifier thread sends each queued
notice to every session of its room, never under a lock of the model; failures are counted,
never raised or retried; sessions whose peer reported a disconnect are skipped (counted).
See docs/THREADING.md, "Room notices to the decode side".
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sender.notices import RoomNotice
from staging.context import RoomHandle
from staging.validate import bounded_wait

__all__ = ["NoticeCounts", "Notifier"]

logger = logging.getLogger(__name__)

_Item = tuple[RoomNotice, tuple[str, ...]]


@dataclass(frozen=True, slots=True)
class NoticeCounts:
    """Counters of one notifier (a consistent snapshot). ``queued`` counts session messages,
    each ending as ``sent``, ``failed`` or ``skipped_dead``; ``withheld``: never queued
    (abandoned at ``close()``); ``held``: waiting for their opening to drain."""

    queued: int
    sent: int
    failed: int
    skipped_dead: int
    withheld: int
    held: int

    @property
    def pending(self) -> int:
        """Session messages queued but not yet sent, failed or skipped."""
        return self.queued - self.sent - self.failed - self.skipped_dead


class Notifier:
    """Holds, queues and sends room notices for one manager.

    Args:
        send_notif: ``transport.send_notif`` (``None``: notices are off; nothing is held,
            queued or sent, and no thread is started).
        peer_disconnected: ``transport.peer_disconnected`` or ``None``.

    Thread-safety: every method is safe from any thread, also under a lock of the model:
    ``_lock`` (outside the model, innermost) guards the held notices and counters, and is
    never held while sending or waiting.
    """

    def __init__(
        self,
        send_notif: Callable[[str, bytes], Any] | None,
        peer_disconnected: Callable[[str], bool] | None = None,
    ) -> None:
        self._send = send_notif
        self._dead = peer_disconnected
        self._lock = threading.Lock()
        # Guarded by _lock (down to _stopped). _held: notices of openings still draining.
        # mutant-site: init
        self._held: dict[RoomHandle, _Item] = {}
        self._queued = self._sent = self._failed = self._skipped_dead = self._withheld = 0
        self._withheld_handles: set[RoomHandle] = set()
        self._stopped = False
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        if send_notif is not None:
            self._thread = threading.Thread(target=self._main, name="kv-notifier", daemon=True)
            self._thread.start()

    @property
    def enabled(self) -> bool:
        """``True`` when notices are sent at all."""
        return self._send is not None

    @property
    def thread(self) -> threading.Thread | None:
        """The notifier thread (``None`` when notices are off)."""
        return self._thread

    def enqueue(self, notice: RoomNotice, sessions: tuple[str, ...]) -> None:
        """Queue ``notice`` for every session in ``sessions`` now. Never blocks or raises."""
        if self._send is None:
            return
        # mutant-site: enqueue
        with self._lock:
            if self._stopped:  # close() stopped the thread: nobody would send it
                self._withheld += 1
                return
            self._queued += len(sessions)
            self._queue.put((notice, sessions))

    def hold(self, handle: RoomHandle, notice: RoomNotice, sessions: tuple[str, ...]) -> None:
        """Keep ``notice`` until ``handle``'s opening drained (:meth:`drained`)."""
        if self._send is None:
            return
        with self._lock:
            self._held[handle] = (notice, sessions)

    def drained(self, handle: RoomHandle) -> bool:
        """The opening's last posted chunk ended: queue its held notice (``True`` if one was
        held)."""
        with self._lock:
            item = self._held.pop(handle, None)
        if item is None:
            return False
        self.enqueue(*item)
        return True

    def withhold(self, handle: RoomHandle) -> bool:
        """Drop the opening's held notice, counted as withheld (its writes were abandoned:
        bytes may still land). ``True`` if one was held."""
        with self._lock:
            if self._held.pop(handle, None) is None:
                return False
            self._withheld += 1
            self._withheld_handles.add(handle)
            return True

    def withhold_all(self) -> int:
        """Drop every held notice (counted as withheld); how many."""
        with self._lock:
            n = len(self._held)
            self._withheld_handles.update(self._held)
            self._held.clear()
            self._withheld += n
            return n

    def withheld_handles(self) -> frozenset[RoomHandle]:
        """The openings whose notices were withheld so far (a snapshot)."""
        with self._lock:
            return frozenset(self._withheld_handles)

    def stop(self, timeout_s: float) -> bool:
        """Stop the thread once it sent what is queued; wait up to ``timeout_s``. ``True`` if
        it ended (or there is none). Later :meth:`enqueue` calls count as withheld.
        Idempotent."""
        with self._lock:
            first = not self._stopped
            self._stopped = True
        if self._thread is None:
            return True
        if first:
            self._queue.put(None)
        self._thread.join(bounded_wait(timeout_s))
        return not self._thread.is_alive()

    def counts(self) -> NoticeCounts:
        """A consistent snapshot of the counters."""
        with self._lock:
            return NoticeCounts(
                self._queued, self._sent, self._failed, self._skipped_dead, self._withheld,
                len(self._held),
            )

    def _count(self, name: str) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + 1)

    def _main(self) -> None:
        send = self._send
        assert send is not None
        while True:
            item = self._queue.get()
            if item is None:
                return
            notice, sessions = item
            try:
                payload = notice.encode()
            except BaseException:
                logger.exception("room notice of room %d could not be encoded", notice.room)
                for _ in sessions:
                    self._count("_failed")
                continue
            for session_id in sessions:
                try:
                    if self._dead is not None and self._dead(session_id):
                        self._count("_skipped_dead")
                        continue
                    send(session_id, payload)
                except BaseException as exc:  # a dead or removed peer: best effort, counted
                    self._count("_failed")
                    logger.debug(
                        "room notice of room %d gen %d to %r failed: %r",
                        notice.room, notice.gen, session_id, exc,
                    )
                else:
                    self._count("_sent")
