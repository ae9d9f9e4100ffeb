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

The default lock is ``"mutex"``, the same as ``KVManager``'s: the rule is "under the GIL,
take the mutex". Point reads take no lock at all, so what ``"rw"`` would let run side by
side is only the snapshots, and its pure-Python acquisition costs about ten times a
``threading.Lock``'s (``python -m bench lifecycle``: a room's lifecycle was 1.6-1.9x slower
with ``"rw"``, at 1 to 8 threads). ``"rw"`` stays available for workloads that hold read
snapshots of many rooms while other threads write.

The thread-safety contract of every method is in ``docs/THREADING.md``; each docstring
repeats it in one line.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, cast

from staging.errors import RoomAlreadyOpenError, RoomNotOpenError, RoomPurgedError
from staging.locks import LockLevel, LockStats, MutexLock, RWLock, make_lock
from staging.validate import check_chunk_idx, check_index, check_room_id, check_session_id

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


@dataclass(frozen=True, slots=True)
class RoomHandle:
    """One opening of a room: ``(room, generation)``. Generations are unique in the process,
    so a handle never matches a room of another context or a later opening of the same id.

    Raises:
        TypeError, ValueError: ``room`` or ``generation`` is not an ``int`` >= 0.
    """

    room: int
    generation: int

    def __post_init__(self) -> None:
        # Normalised to exact ints: a handle is hashed and compared under locks.
        object.__setattr__(self, "room", check_room_id(self.room))
        object.__setattr__(self, "generation", check_index(self.generation, "generation"))


def _checked_handle(
    room: int, generation: int, _new: Any = object.__new__, _set: Any = object.__setattr__
) -> RoomHandle:
    """A :class:`RoomHandle` of values the caller already checked (exact ints >= 0): skips
    ``__post_init__``'s checks (1.9 vs 0.6 us; ``open_room`` makes one per room)."""
    handle = _new(RoomHandle)
    _set(handle, "room", room)
    _set(handle, "generation", generation)
    return cast(RoomHandle, handle)


@dataclass(frozen=True, slots=True)
class RoomPurge:
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


@dataclass(slots=True)
class _Room:
    """Mutable state of one open room. Guarded by the owning context's lock."""

    generation: int
    prefetched: bool = False
    requests: set[RoomKey] = field(default_factory=set)


RoomRef = int | RoomHandle


class StagingContext:
    """Staging prefetch state of one sender, safe to share between threads.

    Args:
        lock: ``"mutex"`` (default; ``threading.Lock`` for both modes) or ``"rw"``
            (``readerwriterlock.RWLockFair``; readers share). Rule: under the GIL take the
            mutex, as ``KVManager`` does; it was 1.6-1.9x faster for a room's lifecycle
            (``python -m bench lifecycle``) because the hot reads are lock-free anyway.
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

    def __init__(
        self,
        *,
        lock: str = "mutex",
        lock_timeout: float | None = None,
        debug: bool | None = None,
        strict: bool = False,
    ) -> None:
        if debug is not None and not isinstance(debug, bool):
            raise TypeError(f"debug must be True, False or None, got {debug!r}")
        if not isinstance(strict, bool):
            raise TypeError(f"strict must be True or False, got {strict!r}")
        self._lock = make_lock(
            lock, "staging", LockLevel.STAGING, timeout=lock_timeout, debug=debug
        )
        self._strict = strict
        # --- Everything below is guarded by _lock: read under read(), mutate under write(). ---
        # Open rooms by id. A room id is in _rooms iff it is open; its _Room.requests holds
        # its prefetch keys. Invariant: _session_rooms[s][room] == number of keys of `room`
        # whose session is `s`, and no zero counts are stored (the reverse index that makes
        # purge_session O(keys of that session)).
        self._rooms: dict[int, _Room] = {}
        self._session_rooms: dict[str, dict[int, int]] = {}
        self._requested_keys = 0
        self._prefetched_count = 0
        self._rooms_opened = 0
        self._purges = 0
        self._session_purges = 0
        self._refused = 0

    # ------------------------------------------------------------------ properties

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

    # ------------------------------------------------------------------ lifecycle

    def open_room(self, room: int) -> RoomHandle:
        """Open ``room`` with a new generation. Thread-safe; write lock; atomic.

        Raises:
            RoomAlreadyOpenError: ``room`` is open (purge it first).
            TypeError, ValueError: ``room`` is not an ``int`` >= 0 (``bool`` is refused).
        """
        room = check_room_id(room)
        with self._lock.write():
            if room in self._rooms:
                raise RoomAlreadyOpenError(room)
            generation = next_generation()
            self._rooms[room] = _Room(generation)
            self._rooms_opened += 1
        return _checked_handle(room, generation)  # both checked: room above, gen by counter

    def purge_room(self, room: RoomRef) -> RoomPurge:
        """Remove ``room`` from both collections and close it, in ONE critical section.

        Idempotent: purging a closed room (or with a stale handle, which never touches a newer
        generation) returns ``was_open=False`` and changes nothing. Everything recorded for
        the purged generation before this returns is in the result; nothing is recorded for
        it afterwards. Cost is O(keys of that room). Thread-safe; write lock; atomic.

        A purge never times out: it waits for the lock as long as it takes, whatever
        ``lock_timeout`` is (a purge that could fail half-way would leak the room; callers
        such as ``KVManager.purge_room`` rely on it being all-or-nothing).

        Raises:
            TypeError, ValueError: bad ``room``.
        """
        room_id, generation = self._ref(room)
        with self._lock.write_untimed():
            return self._purge_locked(room_id, generation)

    def purge_session(self, session_id: str) -> frozenset[int]:
        """A decode peer died: drop its keys from every room; return the rooms that had any.

        The rooms stay open (the sender fails them). Cost is O(keys of the rooms that have
        keys of that session): the reverse index finds those rooms, and each of their keys is
        looked at once (a room has as many sessions as decode TP ranks, so this is close to
        O(keys of that session)). Thread-safe; write lock; atomic; like
        :meth:`purge_room` it never times out (ignores ``lock_timeout``).

        Raises:
            TypeError, ValueError: ``session_id`` is not a non-empty ``str``.
        """
        session_id = check_session_id(session_id)
        with self._lock.write_untimed():
            by_room = self._session_rooms.pop(session_id, None)
            if not by_room:
                return frozenset()
            for room_id in by_room:
                state = self._rooms[room_id]
                doomed = [key for key in state.requests if key[1] == session_id]
                state.requests.difference_update(doomed)
                self._requested_keys -= len(doomed)
            self._session_purges += 1
            return frozenset(by_room)

    # ------------------------------------------------------------------ writers

    def request_prefetch(self, room: RoomRef, chunk_idx: int, session_id: str) -> bool:
        """Atomically test-and-add the key ``(room, chunk_idx, session_id)``.

        ``True`` only if the key was newly recorded for the room's open generation.
        ``False`` for a duplicate; ``False`` and a refused-late-write count if the room is not
        open or ``room`` is a stale handle (late writers are normal: never raises for them,
        unless the context is ``strict``). Thread-safe; write lock; atomic.

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
            if state is None or key in state.requests:
                return False
            state.requests.add(key)
            self._add_session_ref(session_id, room_id)
            self._requested_keys += 1
            return True

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
        room_id, generation = self._ref(room)
        chunks = tuple(check_chunk_idx(chunk_idx) for chunk_idx in chunk_idxs)
        session_id = check_session_id(session_id)
        added: list[int] = []
        with self._lock.write():
            state = self._live(room_id, generation)
            if state is None:
                return frozenset()
            requests = state.requests
            fresh = {(c, session_id) for c in chunks} - requests
            if fresh:
                requests.update(fresh)  # one atomic call: lock-free readers see all or none
                added.extend(c for c, _ in fresh)
                self._add_session_ref(session_id, room_id, len(added))
                self._requested_keys += len(added)
        return frozenset(added)

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
            self._drop_session_ref(session_id, room_id)
            self._requested_keys -= 1
            return True

    def mark_prefetched(self, room: RoomRef) -> bool:
        """Mark the room's prefetch complete. ``True`` only if newly marked.

        A closed room or stale handle returns ``False`` and counts a refused late write.
        Thread-safe; write lock; atomic.

        Raises:
            TypeError, ValueError: bad ``room``.
            RoomNotOpenError, RoomPurgedError: ``strict`` only, for a refused write.
        """
        room_id, generation = self._ref(room)
        with self._lock.write():
            state = self._live(room_id, generation)
            if state is None or state.prefetched:
                return False
            state.prefetched = True
            self._prefetched_count += 1
            return True

    # ------------------------------------------------------------------ readers

    # Point reads take no lock. They are still linearizable: each reads the room's _Room
    # with one dict lookup and then one field or one set-membership test, each a single
    # atomic operation (under the GIL, and under free-threaded CPython's per-object locks).
    # A _Room is mutated only while it is in _rooms and only under the write lock, with every
    # mutation one atomic call (set.add/remove/update/difference_update, one attribute store);
    # once purged it is never mutated again. So a read that found the room answers either as
    # of a moment the room was live (the membership test) or as of its purge, which lies
    # inside the read's own interval. This is what makes reads cheap (no lock round trip).

    def is_open(self, room: RoomRef) -> bool:
        """``True`` if the room (that generation, for a handle) is open. Thread-safe; no lock
        (a linearizable point read).

        Raises:
            TypeError, ValueError: bad ``room``.
        """
        room_id, generation = self._ref(room)
        state = self._rooms.get(room_id)
        return state is not None and (generation is None or state.generation == generation)

    def is_prefetched(self, room: RoomRef) -> bool:
        """``True`` if the room is open and marked prefetched. Thread-safe; no lock
        (a linearizable point read).

        Raises:
            TypeError, ValueError: bad ``room``.
        """
        room_id, generation = self._ref(room)
        state = self._rooms.get(room_id)
        return (
            state is not None
            and (generation is None or state.generation == generation)
            and state.prefetched
        )

    def is_requested(self, room: RoomRef, chunk_idx: int, session_id: str) -> bool:
        """``True`` if the key is recorded for the open room. Thread-safe; no lock
        (a linearizable point read).

        Raises:
            TypeError, ValueError: bad ``room``, ``chunk_idx`` or ``session_id``.
        """
        room_id, generation = self._ref(room)
        chunk_idx = check_chunk_idx(chunk_idx)
        session_id = check_session_id(session_id)
        state = self._rooms.get(room_id)
        return (
            state is not None
            and (generation is None or state.generation == generation)
            and (chunk_idx, session_id) in state.requests
        )

    def handle(self, room: RoomRef) -> RoomHandle | None:
        """The handle of the open ``room``, or ``None``. Thread-safe; read lock.

        Like every other method it takes a room id or a :class:`RoomHandle`; for a handle it
        answers that handle if its generation is the one open now, else ``None``.

        Raises:
            TypeError, ValueError: bad ``room``.
        """
        room_id, generation = self._ref(room)
        with self._lock.read():
            state = self._live_quiet(room_id, generation)
            return None if state is None else RoomHandle(room_id, state.generation)

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
        with self._lock.read():
            return self._requested_unlocked()

    @property
    def open_rooms(self) -> frozenset[int]:
        """Snapshot of the open room ids. Thread-safe; read lock."""
        with self._lock.read():
            return frozenset(self._rooms)

    def snapshot(self) -> StagingSnapshot:
        """All three views taken under ONE read lock (mutually consistent). Thread-safe."""
        with self._lock.read():
            return StagingSnapshot(
                prefetched_rooms=frozenset(r for r, s in self._rooms.items() if s.prefetched),
                prefetch_requested=self._requested_unlocked(),
                open_rooms=frozenset(self._rooms),
            )

    def stats(self) -> StagingStats:
        """Frozen counters taken under one read lock. Thread-safe."""
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

    # ------------------------------------------------------------------ internals

    @staticmethod
    def _ref(room: RoomRef) -> tuple[int, int | None]:
        """Validate a room reference; ``(room_id, generation or None)``. No lock."""
        if type(room) is int and room >= 0:
            return room, None
        if isinstance(room, RoomHandle):  # validated when it was made
            return room.room, room.generation
        return check_room_id(room), None

    def _live_quiet(self, room_id: int, generation: int | None) -> _Room | None:
        """The open room matching the reference, or ``None``. Caller holds the lock."""
        state = self._rooms.get(room_id)
        if state is None or (generation is not None and state.generation != generation):
            return None
        return state

    def _live(self, room_id: int, generation: int | None) -> _Room | None:
        """Like :meth:`_live_quiet`, counting a refused late write (and raising it in strict
        mode). Caller holds the write lock."""
        state = self._live_quiet(room_id, generation)
        if state is None:
            self._refuse(room_id, generation)
        return state

    def _refuse(self, room_id: int, generation: int | None, detail: str = "") -> None:
        """Count a refused write; in strict mode raise it. Caller holds the write lock.

        Raises:
            RoomNotOpenError: strict, and a room id (no handle) that is not open.
            RoomPurgedError: strict, and a stale handle (or ``detail`` says why it is known
                to be purged).
        """
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

    def _purge_locked(self, room_id: int, generation: int | None) -> RoomPurge:
        """The body of :meth:`purge_room`. Caller holds the write lock."""
        state = self._rooms.get(room_id)
        if state is None or (generation is not None and state.generation != generation):
            return RoomPurge(room_id, False, False, frozenset())
        del self._rooms[room_id]
        for _, session in state.requests:
            self._drop_session_ref(session, room_id)
        self._requested_keys -= len(state.requests)
        if state.prefetched:
            self._prefetched_count -= 1
        self._purges += 1
        return RoomPurge(
            room_id, True, state.prefetched, frozenset(state.requests), state.generation
        )

    def _add_session_ref(self, session_id: str, room_id: int, keys: int = 1) -> None:
        by_room = self._session_rooms.setdefault(session_id, {})
        by_room[room_id] = by_room.get(room_id, 0) + keys

    def _drop_session_ref(self, session_id: str, room_id: int) -> None:
        by_room = self._session_rooms[session_id]
        left = by_room[room_id] - 1
        if left:
            by_room[room_id] = left
        else:
            del by_room[room_id]
            if not by_room:
                del self._session_rooms[session_id]

    def _requested_unlocked(self) -> frozenset[PrefetchKey]:
        return frozenset(
            (room, chunk_idx, session)
            for room, state in self._rooms.items()
            for chunk_idx, session in state.requests
        )
