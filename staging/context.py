"""``StagingContext``: the staging prefetch state of a prefill sender, behind one lock.

It holds, per *room* (one request), the set of ``(chunk_idx, session_id)`` prefetch keys that
were requested and whether the room's prefetch is complete. The two collections engines know
as ``prefetch_requested`` (keys ``(room, chunk_idx, session_id)``) and ``prefetched_rooms``
(room ids) are *derived* from that per-room index and handed out only as frozen snapshots.

Rooms have a lifecycle: ``open_room`` -> writes -> ``purge_room`` (closed). Each opening gets
a new *generation*, unique in the process (one counter shared by every context, so a handle
of one context can never match a room of another); a writer holding a :class:`RoomHandle`
of an older generation, or writing to a room that is not open, is refused (``False`` and a
counter), never raised at unless the context is ``strict``, and never allowed to re-create
the room. That is what keeps a late transfer worker from resurrecting a purged room.

The default lock is ``"mutex"``: point reads take no lock, so ``"rw"`` would let only the
snapshots run side by side, at about ten times the cost of an acquisition (docs/PERFORMANCE.md).
The thread-safety contract of every method is in ``docs/THREADING.md``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from staging.errors import RoomAlreadyOpenError, RoomNotOpenError, RoomPurgedError
from staging.locks import LockLevel, LockStats, MutexLock, RWLock, make_lock
from staging.validate import (
    MAX_ID,
    check_chunk_idx,
    check_index,
    check_indices,
    check_room_id,
    check_session_id,
)

PrefetchKey = tuple[int, int, str]
"""``(room, chunk_idx, session_id)``: the key engines store in ``prefetch_requested``."""

RoomKey = tuple[int, str]
"""``(chunk_idx, session_id)``: a prefetch key within one room."""


# Generations of every context in the process. next() on an itertools.count is one C call:
# atomic under the GIL, and made thread-safe for free-threaded CPython (gh-117657, 3.13).
_GENERATIONS = itertools.count(1)


def next_generation() -> int:
    """A generation number never handed out before in this process. Thread-safe; no lock."""
    return next(_GENERATIONS)


class _RoomHandleFields(NamedTuple):
    room: int
    generation: int


class RoomHandle(_RoomHandleFields):
    """One opening of a room: ``(room, generation)``, an immutable named tuple. Generations
    are unique in the process, so a handle never matches a room of another context or a later
    opening of the same id.

    Raises:
        TypeError, ValueError: ``room`` or ``generation`` is not an ``int`` >= 0.
    """

    __slots__ = ()

    def __new__(cls, room: int, generation: int) -> RoomHandle:
        # Normalised to exact ints: a handle is hashed and compared under locks.
        return super().__new__(cls, check_room_id(room), check_index(generation, "generation"))


class RoomPurge(NamedTuple):
    """What one ``purge_room`` removed, taken in the same critical section that removed it."""

    room: int
    was_open: bool
    was_prefetched: bool
    requests: frozenset[RoomKey]
    generation: int | None = None


@dataclass(frozen=True, slots=True)
class StagingSnapshot:
    """The three views, taken together under one read lock."""

    prefetched_rooms: frozenset[int]
    prefetch_requested: frozenset[PrefetchKey]
    open_rooms: frozenset[int]


@dataclass(frozen=True, slots=True)
class StagingStats:
    """Counters of one context, taken under one read lock."""

    open_rooms: int
    prefetched_rooms: int
    requested_keys: int
    rooms_opened: int
    purges: int
    session_purges: int
    refused_late_writes: int
    lock: LockStats


class _Room:
    """Mutable state of one open room. Guarded by the owning context's lock.

    ``sessions``: the sessions whose entry of ``_session_rooms`` holds this room (see
    ``StagingContext.__init__``); writers skip the index when the session is already here.
    """

    __slots__ = ("generation", "prefetched", "requests", "sessions")

    def __init__(self, generation: int = 0) -> None:
        self.generation = generation  # open_room sets it under the lock, at publication
        self.prefetched = False
        self.requests: set[RoomKey] = set()
        self.sessions: set[str] = set()


RoomRef = int | RoomHandle


class StagingContext:
    """Staging prefetch state of one sender, safe to share between threads.

    Args:
        lock: ``"mutex"`` (default; ``threading.Lock`` for both modes) or ``"rw"``
            (``readerwriterlock.RWLockFair``; readers share). Under the GIL take the mutex:
            the hot reads are lock-free anyway (``python -m bench lifecycle``).
        lock_timeout: seconds to wait for the lock before raising
            :class:`~staging.errors.LockTimeoutError`; ``None`` or ``float("inf")`` waits
            forever. Purges ignore it (they never time out).
        debug: lock debug mode (re-entry and order checks); ``None`` reads env
            ``NIXL_STAGING_DEBUG_LOCKS``. Only ``True``, ``False`` or ``None``.
        strict: ``True`` makes a refused write raise instead of returning ``False``:
            :class:`~staging.errors.RoomNotOpenError` for a room id that is not open,
            :class:`~staging.errors.RoomPurgedError` for a stale handle. Duplicates still
            return ``False``.

    Raises:
        ValueError: unknown ``lock`` kind; ``lock_timeout`` NaN, <= 0, or finite above
            ``threading.TIMEOUT_MAX``.
        TypeError: ``lock_timeout`` not ``None`` or a real number (``bool``, ``str``);
            ``debug`` not ``None`` or a ``bool``; ``strict`` not a ``bool``.
    """

    # The hot methods inline what a helper call (~0.1 us) would cost more than: the exact-type
    # fast path of each argument check (else staging.validate, which raises), the unpacking
    # of a RoomHandle, and the lookup of the open room (_live_quiet's body).

    def __init__(
        self,
        *,
        lock: str = "mutex",
        lock_timeout: float | None = None,
        debug: bool | None = None,
        strict: bool = False,
    ) -> None:
        """Make a :class:`StagingContext`: every argument and what it raises are in the
        class docstring (``help(StagingContext)``)."""
        if debug is not None and not isinstance(debug, bool):
            raise TypeError(f"debug must be True, False or None, got {debug!r}")
        if not isinstance(strict, bool):
            raise TypeError(f"strict must be True or False, got {strict!r}")
        self._lock = make_lock(
            lock, "staging", LockLevel.STAGING, timeout=lock_timeout, debug=debug
        )
        self._strict = strict
        # --- Everything below is guarded by _lock: read under read(), mutate under write(). ---
        # A room id is in _rooms iff it is open; its _Room.requests holds its prefetch keys.
        # _session_rooms, the reverse index that lets purge_session skip rooms without a key
        # of that session, is kept per (room, session), not per key (a request pays one
        # `session in state.sessions` test):
        #   complete: every open room with a key of session s is in _session_rooms[s], and
        #             s is in its _Room.sessions;
        #   sound:    a room in _session_rooms[s] is open, has s in its _Room.sessions, and
        #             has at least one key (of some session); no empty set is stored.
        # It may hold a room whose keys of s are gone (cancel_prefetch, or the compat
        # layer's discard, leave it while other keys remain): purge_session(s) skips those.
        # A room leaves every entry when it is purged or its last key goes (_unindex).
        self._rooms: dict[int, _Room] = {}
        self._session_rooms: dict[str, set[int]] = {}
        self._requested_keys = 0
        self._prefetched_count = 0
        self._rooms_opened = 0
        self._purges = 0
        self._session_purges = 0
        self._refused = 0

    @property
    def lock_kind(self) -> str:
        """``"rw"`` or ``"mutex"``."""
        return self._lock.kind

    @property
    def strict(self) -> bool:
        """Whether refused writes raise (see the class docstring). Thread-safe."""
        return self._strict

    @property
    def lock(self) -> RWLock | MutexLock:
        """The context's lock (level ``LockLevel.STAGING``), for ``assert_held`` in tests."""
        return self._lock

    def open_room(self, room: int) -> RoomHandle:
        """Open ``room`` with a new generation. Thread-safe; write lock; atomic.

        Raises:
            RoomAlreadyOpenError: ``room`` is open (purge it first).
            TypeError, ValueError: ``room`` is not an ``int`` with ``0 <= room < 2**63``
                (``bool`` is refused).
        """
        if type(room) is not int or not 0 <= room < MAX_ID:
            room = check_room_id(room)
        state = _Room()  # built before the lock; published in _rooms under it
        lock = self._lock
        lock.acquire_write()
        try:
            if room in self._rooms:
                raise RoomAlreadyOpenError(room)
            state.generation = generation = next(_GENERATIONS)
            self._rooms[room] = state
            self._rooms_opened += 1
        finally:
            lock.release_write()
        return RoomHandle._make((room, generation))  # checked above: skips __new__'s checks

    def purge_room(self, room: RoomRef) -> RoomPurge:
        """Remove ``room`` from both collections and close it, in ONE critical section.

        Idempotent: purging a closed room (or with a stale handle, which never touches a newer
        generation) returns ``was_open=False`` and changes nothing. Everything recorded for
        the purged generation before this returns is in the result; nothing is recorded for
        it afterwards. O(keys of that room). Thread-safe; write lock; atomic. Never times out
        (ignores ``lock_timeout``): callers such as ``KVManager.purge_room`` rely on it being
        all-or-nothing.

        Raises:
            TypeError, ValueError: bad ``room``.
        """
        room_id, generation = self._ref(room)
        # mutant-site: purge-room
        with self._lock.write_untimed():
            state = self._close_locked(room_id, generation)
        return _purge_record(room_id, state)  # after the release: a purged _Room never changes

    def purge_session(self, session_id: str) -> frozenset[int]:
        """A decode peer died: drop its keys from every room; return the rooms that had any.

        The rooms stay open (the sender fails them). The reverse index finds the rooms that
        got a key of that session (since opened or its last ``purge_session``); each of
        their keys is looked at once: close to O(keys of that session). Thread-safe; write
        lock; atomic; like :meth:`purge_room` it never times out (ignores ``lock_timeout``).

        Raises:
            TypeError, ValueError: ``session_id`` is not a non-empty ``str``.
        """
        session_id = check_session_id(session_id)
        touched: list[int] = []
        # mutant-site: purge-session-with
        with self._lock.write_untimed():
            by_room = self._session_rooms.pop(session_id, None)
            if not by_room:
                return frozenset()
            for room_id in by_room:
                state = self._rooms[room_id]
                state.sessions.discard(session_id)
                doomed = [key for key in state.requests if key[1] == session_id]
                if doomed:
                    # mutant-site: purge-session-call-difference-update
                    state.requests.difference_update(doomed)
                    self._requested_keys -= len(doomed)
                    touched.append(room_id)
                    if not state.requests:
                        self._unindex(state, room_id)
            if touched:
                self._session_purges += 1
        return frozenset(touched)

    def request_prefetch(self, room: RoomRef, chunk_idx: int, session_id: str) -> bool:
        """Atomically test-and-add the key ``(room, chunk_idx, session_id)``.

        ``True`` only if newly recorded for the room's open generation; ``False`` for a
        duplicate, or (counted as a refused late write; raised only if ``strict``) when the
        room is not open or the handle is stale. Thread-safe; write lock; atomic.

        Raises:
            TypeError, ValueError: bad ``room``, ``chunk_idx`` or ``session_id``.
            RoomNotOpenError, RoomPurgedError: ``strict`` only, for a refused write.
        """
        room_id, generation = room if type(room) is RoomHandle else self._ref(room)
        if type(chunk_idx) is not int or not 0 <= chunk_idx < MAX_ID:
            chunk_idx = check_chunk_idx(chunk_idx)
        if type(session_id) is not str or not session_id:
            session_id = check_session_id(session_id)
        key = (chunk_idx, session_id)
        lock = self._lock
        lock.acquire_write()
        try:
            state = self._rooms.get(room_id)
            # mutant-site: request-prefetch-if
            if state is None or (generation is not None and state.generation != generation):
                self._refuse(room_id, generation)
                return False
            # mutant-site: request-prefetch-set-requests
            requests = state.requests
            if key in requests:
                return False
            requests.add(key)
            self._requested_keys += 1
            if session_id not in state.sessions:
                self._index_session(state, session_id, room_id)
            return True
        finally:
            lock.release_write()

    def request_prefetches(
        self, room: RoomRef, chunk_idxs: Iterable[int], session_id: str
    ) -> frozenset[int]:
        """Batch :meth:`request_prefetch` for many chunks of one session, one acquisition.

        Returns the chunk indices newly recorded (empty if the room is closed or the handle
        stale; that counts one refused late write). Thread-safe; write lock; atomic as a whole.

        Raises:
            TypeError, ValueError: bad ``room``, any bad chunk index or bad ``session_id``
                (checked before any state changes).
            RoomNotOpenError, RoomPurgedError: ``strict`` only, for a refused write.
        """
        room_id, generation = room if type(room) is RoomHandle else self._ref(room)
        chunks: Iterable[int]
        if (
            type(chunk_idxs) is range
            and chunk_idxs.start >= 0
            and chunk_idxs.step > 0
            and chunk_idxs.stop <= MAX_ID
        ):
            chunks = chunk_idxs  # every member an exact int >= 0 (the common call)
        else:
            chunks = check_indices(chunk_idxs, "chunk_idx", bounded=True)  # as check_chunk_idx
        if type(session_id) is not str or not session_id:
            session_id = check_session_id(session_id)
        lock = self._lock
        lock.acquire_write()
        try:
            state = self._live(room_id, generation)
            if state is None:
                return frozenset()
            requests = state.requests
            fresh = {(c, session_id) for c in chunks} - requests
            if not fresh:
                return frozenset()
            requests.update(fresh)  # one atomic call: lock-free readers see all or none
            self._requested_keys += len(fresh)
            if session_id not in state.sessions:
                self._index_session(state, session_id, room_id)
        finally:
            lock.release_write()
        return frozenset(c for c, _ in fresh)

    def cancel_prefetch(self, room: RoomRef, chunk_idx: int, session_id: str) -> bool:
        """Remove one key (e.g. the request could not be sent). ``True`` if it was there.

        A closed room or stale handle returns ``False`` and counts a refused late write.
        Thread-safe; write lock; atomic.

        Raises:
            TypeError, ValueError: bad ``room``, ``chunk_idx`` or ``session_id``.
            RoomNotOpenError, RoomPurgedError: ``strict`` only, for a refused write.
        """
        room_id, generation = self._ref(room)
        chunk_idx = check_chunk_idx(chunk_idx)
        session_id = check_session_id(session_id)
        key = (chunk_idx, session_id)
        with self._lock.write():
            state = self._live(room_id, generation)
            if state is None or key not in state.requests:
                return False
            state.requests.remove(key)
            self._requested_keys -= 1
            if not state.requests:  # else the session index may keep the room (__init__)
                self._unindex(state, room_id)
            return True

    def mark_prefetched(self, room: RoomRef) -> bool:
        """Mark the room's prefetch complete. ``True`` only if newly marked.

        A closed room or stale handle returns ``False`` and counts a refused late write.
        Thread-safe; write lock; atomic.

        Raises:
            TypeError, ValueError: bad ``room``.
            RoomNotOpenError, RoomPurgedError: ``strict`` only, for a refused write.
        """
        room_id, generation = room if type(room) is RoomHandle else self._ref(room)
        lock = self._lock
        # mutant-site: mark-prefetched-call-acquire-write
        lock.acquire_write()
        try:
            state = self._rooms.get(room_id)
            if state is None or (generation is not None and state.generation != generation):
                self._refuse(room_id, generation)
                # mutant-site: mark-prefetched-return
                return False
            if state.prefetched:
                return False
            state.prefetched = True
            self._prefetched_count += 1
            return True
        finally:
            lock.release_write()

    # Point reads take no lock and are still linearizable: each is one dict lookup, then one
    # field read or set-membership test, each atomic (GIL, or free-threaded per-object locks).
    # A _Room is mutated only while in _rooms, under the write lock, one atomic call per
    # mutation, and never once purged: a read that found it answers as of a moment it was
    # live, or as of its purge, which lies inside the read's own interval.

    def is_open(self, room: RoomRef) -> bool:
        """``True`` if the room (that generation, for a handle) is open. Thread-safe; no lock.

        Raises:
            TypeError, ValueError: bad ``room``.
        """
        return self._live_quiet(*self._ref(room)) is not None

    def is_prefetched(self, room: RoomRef) -> bool:
        """``True`` if the room is open and marked prefetched. Thread-safe; no lock.

        Raises:
            TypeError, ValueError: bad ``room``.
        """
        state = self._live_quiet(*self._ref(room))
        return state is not None and state.prefetched

    def is_requested(self, room: RoomRef, chunk_idx: int, session_id: str) -> bool:
        """``True`` if the key is recorded for the open room. Thread-safe; no lock.

        Raises:
            TypeError, ValueError: bad ``room``, ``chunk_idx`` or ``session_id``.
        """
        room_id, generation = room if type(room) is RoomHandle else self._ref(room)
        if type(chunk_idx) is not int or not 0 <= chunk_idx < MAX_ID:
            chunk_idx = check_chunk_idx(chunk_idx)
        if type(session_id) is not str or not session_id:
            session_id = check_session_id(session_id)
        # mutant-site: is-requested-set-state
        state = self._rooms.get(room_id)
        # mutant-site: is-requested-return
        return (
            state is not None
            and (generation is None or state.generation == generation)
            and (chunk_idx, session_id) in state.requests
        )

    def handle(self, room: RoomRef) -> RoomHandle | None:
        """The handle of the open ``room`` (for a handle: it, if that generation is open), or
        ``None``. Thread-safe; read lock.

        Raises:
            TypeError, ValueError: bad ``room``.
        """
        room_id, generation = self._ref(room)
        with self._lock.read():
            state = self._live_quiet(room_id, generation)
            return None if state is None else RoomHandle._make((room_id, state.generation))

    def room_requests(self, room: RoomRef) -> frozenset[RoomKey]:
        """The ``(chunk_idx, session_id)`` keys of the open room (empty if closed).
        Thread-safe; read lock.

        Raises:
            TypeError, ValueError: bad ``room``.
        """
        room_id, generation = self._ref(room)
        with self._lock.read():
            state = self._live_quiet(room_id, generation)
            return frozenset() if state is None else frozenset(state.requests)

    @property
    def prefetched_rooms(self) -> frozenset[int]:
        """Snapshot of the ids of open rooms marked prefetched. Thread-safe; read lock."""
        with self._lock.read():
            return frozenset(room for room, state in self._rooms.items() if state.prefetched)

    @property
    def prefetch_requested(self) -> frozenset[PrefetchKey]:
        """Snapshot of every ``(room, chunk_idx, session_id)`` key. Thread-safe; read lock."""
        # mutant-site: prefetch-requested
        with self._lock.read():
            return self._requested_unlocked()

    @property
    def open_rooms(self) -> frozenset[int]:
        """Snapshot of the open room ids. Thread-safe; read lock."""
        with self._lock.read():
            return frozenset(self._rooms)

    def snapshot(self) -> StagingSnapshot:
        """All three views taken under ONE read lock (mutually consistent). Thread-safe.

        Raises:
            LockTimeoutError: the lock was not acquired within ``lock_timeout``.
        """
        with self._lock.read():
            return StagingSnapshot(
                prefetched_rooms=frozenset(r for r, s in self._rooms.items() if s.prefetched),
                prefetch_requested=self._requested_unlocked(),
                open_rooms=frozenset(self._rooms),
            )

    def stats(self) -> StagingStats:
        """Frozen counters taken under one read lock. Thread-safe.

        Raises:
            LockTimeoutError: the lock was not acquired within ``lock_timeout``.
        """
        with self._lock.read():
            return StagingStats(
                open_rooms=len(self._rooms),
                prefetched_rooms=self._prefetched_count,
                requested_keys=self._requested_keys,
                rooms_opened=self._rooms_opened,
                purges=self._purges,
                session_purges=self._session_purges,
                refused_late_writes=self._refused,
                lock=self._lock.stats(),
            )

    def __len__(self) -> int:
        """Number of open rooms. Thread-safe; read lock."""
        with self._lock.read():
            return len(self._rooms)

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"<StagingContext lock={self._lock.kind} open={s.open_rooms} "
            f"prefetched={s.prefetched_rooms} keys={s.requested_keys}>"
        )

    @staticmethod
    def _ref(room: RoomRef) -> tuple[int, int | None]:
        """Validate a room reference; ``(room_id, generation or None)``. No lock."""
        if type(room) is int and 0 <= room < MAX_ID:
            return room, None
        if isinstance(room, RoomHandle):  # validated when it was made
            return room.room, room.generation
        return check_room_id(room), None

    def _live_quiet(self, room_id: int, generation: int | None) -> _Room | None:
        """The open room matching the reference, or ``None``. Under the lock, or a point read."""
        state = self._rooms.get(room_id)
        if state is None or (generation is not None and state.generation != generation):
            return None
        return state

    def _live(self, room_id: int, generation: int | None) -> _Room | None:
        """:meth:`_live_quiet`, counting (strict: raising) a refused write. Under the lock."""
        state = self._live_quiet(room_id, generation)
        if state is None:
            self._refuse(room_id, generation)
        return state

    def _refuse(self, room_id: int, generation: int | None, detail: str = "") -> None:
        """Count a refused write; strict: raise RoomNotOpenError for a room id,
        RoomPurgedError for a stale handle or a ``detail``. Caller holds the write lock."""
        self._refused += 1
        if not self._strict:
            return
        if generation is None and not detail:
            raise RoomNotOpenError(room_id)
        raise RoomPurgedError(
            room_id,
            generation,
            detail or " (that opening was purged, or the handle is of another context)",
        )

    def _close_locked(self, room_id: int, generation: int | None) -> _Room | None:
        """Close that opening (``generation`` None: whichever is open) and return its state,
        frozen from now on, or ``None`` if not open. Caller holds the write lock."""
        state = self._rooms.get(room_id)
        if state is None or (generation is not None and state.generation != generation):
            return None
        if state.sessions:
            self._unindex(state, room_id)  # while it is open: a purged _Room never changes
        del self._rooms[room_id]
        self._requested_keys -= len(state.requests)
        if state.prefetched:
            self._prefetched_count -= 1
        self._purges += 1
        return state

    def _purge_locked(self, room_id: int, generation: int | None) -> RoomPurge:
        """:meth:`_close_locked` as a :class:`RoomPurge`, for subclasses. Under the write lock."""
        return _purge_record(room_id, self._close_locked(room_id, generation))

    def _index_session(self, state: _Room, session_id: str, room_id: int) -> None:
        """Enter the open room in the session index (idempotent). Under the write lock."""
        state.sessions.add(session_id)
        self._session_rooms.setdefault(session_id, set()).add(room_id)

    def _unindex(self, state: _Room, room_id: int) -> None:
        """Take the room out of the session index (closing, or its last key went). Under the
        write lock."""
        index = self._session_rooms
        for session in state.sessions:
            rooms = index.get(session)  # absent only after a subclass cleared the index
            if rooms is not None:
                rooms.discard(room_id)
                if not rooms:
                    del index[session]
        state.sessions = set()

    # For subclasses (staging.compat) that add or remove one key of state.requests
    # themselves, under the write lock: the session index follows.

    def _add_session_ref(self, session_id: str, room_id: int) -> None:
        self._index_session(self._rooms[room_id], session_id, room_id)

    def _drop_session_ref(self, session_id: str, room_id: int) -> None:
        """If that was the room's last key, the room leaves the index."""
        state = self._rooms[room_id]
        if not state.requests:
            self._unindex(state, room_id)

    def _requested_unlocked(self) -> frozenset[PrefetchKey]:
        return frozenset(
            (room, chunk_idx, session)
            for room, state in self._rooms.items()
            for chunk_idx, session in state.requests
        )


def _purge_record(room_id: int, state: _Room | None) -> RoomPurge:
    """The :class:`RoomPurge` of what ``_close_locked`` returned (``None``: nothing open)."""
    if state is None:
        return RoomPurge(room_id, False, False, frozenset())
    return RoomPurge(room_id, True, state.prefetched, frozenset(state.requests), state.generation)
