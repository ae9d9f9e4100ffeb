"""Sender listeners (``sender.events``) that the tests read back."""

from __future__ import annotations

import threading
from collections import Counter


class Recorder:
    """A listener that counts chunk ends and room conclusions by outcome (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.chunks: Counter[str] = Counter()
        self.nbytes: Counter[str] = Counter()
        self.rooms: Counter[str] = Counter()

    def room_concluded(self, room: int, gen: int, outcome: str, code: str, s: float) -> None:
        with self._lock:
            self.rooms[outcome] += 1

    def chunk_ended(self, session_id: str, outcome: str, seconds: float, nbytes: int) -> None:
        with self._lock:
            self.chunks[outcome] += 1
            self.nbytes[outcome] += nbytes
