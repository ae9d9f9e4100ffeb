"""The reference room: the sender's steps on a bare ``threading.Lock`` and dicts.

:class:`BareRooms` does what a room costs at the least in Python, with none of the sender's
guarantees: open a room (a dict entry under one lock), ``init`` it, send each chunk (a job per
session, the same notification bytes, one transport call, the transfer kept under the lock),
poll (each transfer polled, released and counted; ``Success`` once the last chunk is in and
every transfer is done) and clear it (the entry popped). No argument checks, no room
generations, no post fence, no staging context, no failure paths. ``instructions`` counts
it next to the sender for the same room, as ``lifecycle``'s ``threading.Lock`` + sets
reference does for the staging lifecycle. Single scheduler thread; not a library class.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

PageArray = npt.NDArray[np.int64]


@dataclass
class _Room:
    """One open room: its destination pages by session, counters and live transfers."""

    dst: dict[str, PageArray]
    num_pages: int = 0
    jobs: int = 0
    done: int = 0
    last_seen: bool = False
    success: bool = False
    inflight: dict[int, Any] = field(default_factory=dict)


class BareRooms:
    """The reference (see the module docstring); ``transport`` has ``write_pages``."""

    def __init__(self, transport: Any) -> None:
        self._transport = transport
        self._lock = threading.Lock()
        self._rooms: dict[int, _Room] = {}  # guarded by _lock
        self._next_job = 0  # guarded by _lock

    def open(self, room: int, dst: dict[str, PageArray]) -> None:
        """Open ``room`` with its destination pages per session."""
        with self._lock:
            self._rooms[room] = _Room(dst)

    def init(self, room: int, num_pages: int) -> None:
        """Declare the room's page count."""
        with self._lock:
            self._rooms[room].num_pages = num_pages

    def send(self, room: int, chunk: int, start: int, src: PageArray, is_last: bool) -> None:
        """Post chunk ``chunk`` (room pages ``[start, start + len(src))``) to every session."""
        end = start + int(src.size)
        with self._lock:
            entry = self._rooms[room]
            jobs = []
            for session, pages in entry.dst.items():
                jobs.append((self._next_job, session, pages[start:end]))
                self._next_job += 1
            entry.jobs += len(jobs)
            entry.last_seen = entry.last_seen or is_last
        notif = f"room={room};chunk={chunk};last={int(is_last)}".encode()
        for job_id, session, dst in jobs:
            transfer = self._transport.write_pages(session, src, dst, notif)
            with self._lock:
                entry.inflight[job_id] = transfer

    def poll(self, room: int) -> bool:
        """Poll the room's transfers once; ``True`` once the room succeeded."""
        with self._lock:
            entry = self._rooms[room]
            pending = list(entry.inflight.items())
        for job_id, transfer in pending:
            if transfer.poll() == "DONE":
                transfer.release()
                with self._lock:
                    del entry.inflight[job_id]
                    entry.done += 1
        with self._lock:
            if entry.last_seen and entry.done == entry.jobs:
                entry.success = True
            return entry.success

    def clear(self, room: int) -> None:
        """Forget the room."""
        with self._lock:
            self._rooms.pop(room, None)
