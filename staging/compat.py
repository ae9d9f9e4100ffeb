"""``CompatStagingContext``: the two staging sets an engine already has, made thread-safe.

Engines keep their staging prefetch state in two bare sets, ``prefetched_rooms`` (room ids)
and ``prefetch_requested`` (``(room, chunk_idx, session_id)`` keys), written by the
scheduler, bootstrap and transfer-worker threads without a lock. This module keeps that
shape so that adopting the staging layer is a small diff:

* ``ctx.prefetched_rooms`` and ``ctx.prefetch_requested`` are live
  :class:`collections.abc.MutableSet` views. ``x in view`` is O(1) and takes no lock (the
  same linearizable point read as :meth:`StagingContext.is_requested`); ``add``,
  ``discard``, ``remove``, ``pop`` and ``clear`` are each one atomic write; iteration,
  ``len``, comparisons and set algebra work on one consistent snapshot, so "Set changed
  size during iteration" cannot happen.
* Rebinding either attribute (``ctx.prefetch_requested = {k for k in ... if k[0] != room}``,
  the racy upstream purge) raises :class:`TypeError` telling you to call
  :meth:`CompatStagingContext.purge_room`, which removes the room from both views in one
  critical section, in O(keys of that room).
* Rooms open implicitly on their first write; there is no ``open_room`` step.
* **Tombstones.** A purged room id is remembered among the last ``tombstones`` purged ids;
  a later ``add`` for it (a late worker) is *refused*: it returns normally, changes nothing
  and counts in ``stats().refused_late_writes`` (``strict=True`` raises
  :class:`~staging.errors.RoomPurgedError` instead). This is the id-based stand-in for the
  generations of :class:`~staging.context.RoomHandle`. The trade-off: an id that is
  *reused* while it is still among the last ``tombstones`` purges is refused too. Upstream
  room ids are random 63-bit integers, so a legitimate reuse within 65,536 purges has a
  probability of about 65,536 / 2**63 per room (about 7e-15); if your ids are small
  counters that wrap, size the window below the wrap or use ``tombstones=0`` (off: a late
  ``add`` then re-creates the room, as with bare sets).

The full protection (generations instead of an id window, explicit open, batched writes)
is :class:`~staging.context.StagingContext` with :class:`~staging.context.RoomHandle`;
``docs/ADOPTING.md`` shows both migrations. Thread-safety contract: each method's docstring.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, MutableSet
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any, Final, Generic, TypeVar

from staging.context import (
    PrefetchKey,
    RoomPurge,
    StagingContext,
    StagingSnapshot,
    _Room,
    next_generation,
)
from staging.locks import LockStats, MutexLock, RWLock
from staging.validate import check_chunk_idx, check_index, check_room_id, check_session_id

__all__ = [
    "DEFAULT_TOMBSTONES",
    "CompatStagingContext",
    "CompatStats",
    "PrefetchRequestedView",
    "PrefetchedRoomsView",
]

DEFAULT_TOMBSTONES = 65536
"""How many purged room ids a :class:`CompatStagingContext` remembers by default."""

_VIEW_NAMES: Final = frozenset({"prefetched_rooms", "prefetch_requested"})

T = TypeVar("T")
S = TypeVar("S")


@dataclass(frozen=True, slots=True)
class CompatStats:
    """Counters of one :class:`CompatStagingContext`, taken under one read lock.

    ``refused_late_writes`` counts every refused ``add`` (a room among the tombstones);
    ``tombstones`` is how many purged ids are remembered now, at most
    ``tombstone_capacity``.
    """

    open_rooms: int
    prefetched_rooms: int
    requested_keys: int
    rooms_opened: int
    purges: int
    refused_late_writes: int
    tombstones: int
    tombstone_capacity: int
    lock: LockStats


class _CompatCore(StagingContext):
    """A :class:`StagingContext` with the compat layer's combined writes and tombstones.

    Every method here runs one critical section of the inherited lock and keeps the
    invariants of the base class (per-room key sets mutated only by single atomic calls
    while the room is in ``_rooms``, the session reverse index, the counters), so the
    base class's lock-free point reads stay linearizable.
    """

    def __init__(
        self,
        *,
        lock: str,
        lock_timeout: float | None,
        debug: bool | None,
        strict: bool,
        tombstones: int,
    ) -> None:
        super().__init__(lock=lock, lock_timeout=lock_timeout, debug=debug, strict=strict)
        self._tombstone_capacity = tombstones
        # Guarded by _lock: the last purged room ids, oldest first (an ordered set).
        self._tombstones: OrderedDict[int, None] = OrderedDict()

    # ---------------------------------------------------------------- under the write lock

    def _room_for_write(self, room: int) -> _Room | None:
        """The open room, opening it if needed; ``None`` (refused) if it is tombstoned.

        Caller holds the write lock. Raises: RoomPurgedError (strict mode).
        """
        state = self._rooms.get(room)
        if state is not None:
            return state
        if room in self._tombstones:
            self._refuse(
                room,
                None,
                f" (it was purged; its id is among the last {self._tombstone_capacity} "
                "purged ids, so this is a late write)",
            )
            return None
        state = _Room(next_generation())
        self._rooms[room] = state
        self._rooms_opened += 1
        return state

    def _close_if_empty(self, room: int, state: _Room) -> None:
        """A room with no keys and no prefetched mark holds nothing: close it (not a purge,
        no tombstone; as with bare sets, a later add simply brings it back). Caller holds the
        write lock."""
        if not state.requests and not state.prefetched:
            del self._rooms[room]

    # ---------------------------------------------------------------- prefetch_requested

    def add_request(self, room: int, chunk_idx: int, session_id: str) -> bool:
        """Test-and-add one key, opening the room if needed. Write lock; atomic."""
        key = (chunk_idx, session_id)
        with self._lock.write():
            state = self._room_for_write(room)
            if state is None or key in state.requests:
                return False
            state.requests.add(key)
            self._add_session_ref(session_id, room)
            self._requested_keys += 1
            return True

    def discard_request(self, room: int, chunk_idx: int, session_id: str) -> bool:
        """Remove one key if present (never refused, never opens). Write lock; atomic."""
        key = (chunk_idx, session_id)
        with self._lock.write():
            state = self._rooms.get(room)
            if state is None or key not in state.requests:
                return False
            state.requests.remove(key)
            self._drop_session_ref(session_id, room)
            self._requested_keys -= 1
            self._close_if_empty(room, state)
            return True

    def pop_request(self) -> PrefetchKey:
        """Remove and return some key. Write lock; atomic. Raises: KeyError (empty)."""
        with self._lock.write():
            for room, state in self._rooms.items():
                if state.requests:
                    chunk_idx, session_id = state.requests.pop()
                    self._drop_session_ref(session_id, room)
                    self._requested_keys -= 1
                    self._close_if_empty(room, state)
                    return room, chunk_idx, session_id
        raise KeyError("pop from an empty prefetch_requested")

    def clear_requests(self) -> None:
        """Remove every key of every room. Write lock; atomic for locked readers (lock-free
        point reads may see it room by room, as with ``purge_session``)."""
        with self._lock.write():
            emptied = []
            for room, state in self._rooms.items():
                state.requests.clear()
                if not state.prefetched:
                    emptied.append(room)
            for room in emptied:
                del self._rooms[room]
            self._session_rooms.clear()
            self._requested_keys = 0

    def requested_snapshot(self) -> frozenset[PrefetchKey]:
        """Every key, under one read lock."""
        with self._lock.read():
            return self._requested_unlocked()

    def requested_len(self) -> int:
        """Number of keys, under the read lock."""
        with self._lock.read():
            return self._requested_keys

    # ---------------------------------------------------------------- prefetched_rooms

    def add_prefetched(self, room: int) -> bool:
        """Mark the room prefetched, opening it if needed. Write lock; atomic."""
        with self._lock.write():
            state = self._room_for_write(room)
            if state is None or state.prefetched:
                return False
            state.prefetched = True
            self._prefetched_count += 1
            return True

    def discard_prefetched(self, room: int) -> bool:
        """Unmark the room if marked (never refused, never opens). Write lock; atomic."""
        with self._lock.write():
            state = self._rooms.get(room)
            if state is None or not state.prefetched:
                return False
            state.prefetched = False
            self._prefetched_count -= 1
            self._close_if_empty(room, state)
            return True

    def pop_prefetched(self) -> int:
        """Unmark and return some prefetched room. Write lock; atomic.

        Raises:
            KeyError: no room is marked.
        """
        with self._lock.write():
            for room, state in self._rooms.items():
                if state.prefetched:
                    state.prefetched = False
                    self._prefetched_count -= 1
                    self._close_if_empty(room, state)
                    return room
        raise KeyError("pop from an empty prefetched_rooms")

    def clear_prefetched(self) -> None:
        """Unmark every room. Write lock; atomic for locked readers."""
        with self._lock.write():
            emptied = []
            for room, state in self._rooms.items():
                state.prefetched = False
                if not state.requests:
                    emptied.append(room)
            for room in emptied:
                del self._rooms[room]
            self._prefetched_count = 0

    def prefetched_snapshot(self) -> frozenset[int]:
        """Every prefetched room, under one read lock."""
        with self._lock.read():
            return frozenset(room for room, state in self._rooms.items() if state.prefetched)

    def prefetched_len(self) -> int:
        """Number of prefetched rooms, under the read lock."""
        with self._lock.read():
            return self._prefetched_count

    # ---------------------------------------------------------------- purge and stats

    def purge_and_tombstone(self, room: int) -> RoomPurge:
        """Purge the room (both views) and remember its id, in ONE critical section that
        never times out. Write lock; atomic."""
        with self._lock.write_untimed():
            result = self._purge_locked(room, None)
            if self._tombstone_capacity:
                tombstones = self._tombstones
                if room in tombstones:
                    tombstones.move_to_end(room)
                else:
                    tombstones[room] = None
                    if len(tombstones) > self._tombstone_capacity:
                        tombstones.popitem(last=False)
            return result

    def compat_stats(self) -> CompatStats:
        """Counters under one read lock."""
        with self._lock.read():
            return CompatStats(
                open_rooms=len(self._rooms),
                prefetched_rooms=self._prefetched_count,
                requested_keys=self._requested_keys,
                rooms_opened=self._rooms_opened,
                purges=self._purges,
                refused_late_writes=self._refused,
                tombstones=len(self._tombstones),
                tombstone_capacity=self._tombstone_capacity,
                lock=self._lock.stats(),
            )


def _frozen(other: object) -> frozenset[Any] | None:
    """``other`` as a frozenset for set algebra (one snapshot if it is a view), or ``None``
    when it is not iterable."""
    if isinstance(other, frozenset):
        return other
    if isinstance(other, _SetView):
        return other.snapshot()
    if isinstance(other, Iterable):
        return frozenset(other)
    return None


class _SetView(MutableSet[T], Generic[T]):
    """The behaviour both views share: writes go through the context, every whole-set
    operation reads one snapshot. Subclasses provide ``__contains__`` (lock-free) and the
    hooks."""

    __slots__ = ("_core",)

    def __init__(self, core: _CompatCore) -> None:
        self._core = core

    # hooks ---------------------------------------------------------------------------
    def _test_and_add(self, item: T) -> bool:
        raise NotImplementedError

    def _discard(self, item: T) -> bool:
        raise NotImplementedError

    def snapshot(self) -> frozenset[T]:
        """A frozen copy of the whole set, taken under one read lock. Thread-safe; O(n)."""
        raise NotImplementedError

    # writes --------------------------------------------------------------------------
    def add(self, value: T) -> None:
        """Add ``value`` (opening its room if needed). Thread-safe; write lock; atomic.

        A room among the recent purges is refused: nothing changes, ``stats()`` counts it.

        Raises:
            TypeError, ValueError: ``value`` is malformed.
            RoomPurgedError: strict mode, and the room was purged recently.
        """
        self._test_and_add(value)

    def test_and_add(self, value: T) -> bool:
        """Add ``value``; ``True`` only if it was not there and was added (the atomic
        replacement of ``if x not in view: view.add(x)``). Thread-safe; write lock; atomic.

        Raises:
            TypeError, ValueError: ``value`` is malformed.
            RoomPurgedError: strict mode, and the room was purged recently.
        """
        return self._test_and_add(value)

    def discard(self, value: T) -> None:
        """Remove ``value`` if present. Thread-safe; write lock; atomic; never refused.

        Raises:
            TypeError, ValueError: ``value`` is malformed.
        """
        self._discard(value)

    def remove(self, value: T) -> None:
        """Remove ``value``. Thread-safe; write lock; atomic (one check-and-remove).

        Raises:
            KeyError: ``value`` was not there.
            TypeError, ValueError: ``value`` is malformed.
        """
        if not self._discard(value):
            raise KeyError(value)

    # whole-set reads: one snapshot each -----------------------------------------------
    def __iter__(self) -> Iterator[T]:
        """Iterate over one snapshot (later changes are not seen). Thread-safe; read lock."""
        return iter(self.snapshot())

    @classmethod
    def _from_iterable(cls, it: Iterable[S]) -> frozenset[S]:
        return frozenset(it)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, AbstractSet):
            return NotImplemented
        return self.snapshot() == _frozen(other)

    __hash__ = None  # type: ignore[assignment]  # mutable, like set

    def __le__(self, other: AbstractSet[Any]) -> bool:
        theirs = _frozen(other) if isinstance(other, AbstractSet) else None
        return NotImplemented if theirs is None else self.snapshot() <= theirs

    def __lt__(self, other: AbstractSet[Any]) -> bool:
        theirs = _frozen(other) if isinstance(other, AbstractSet) else None
        return NotImplemented if theirs is None else self.snapshot() < theirs

    def __ge__(self, other: AbstractSet[Any]) -> bool:
        theirs = _frozen(other) if isinstance(other, AbstractSet) else None
        return NotImplemented if theirs is None else self.snapshot() >= theirs

    def __gt__(self, other: AbstractSet[Any]) -> bool:
        theirs = _frozen(other) if isinstance(other, AbstractSet) else None
        return NotImplemented if theirs is None else self.snapshot() > theirs

    def __and__(self, other: AbstractSet[Any]) -> frozenset[T]:
        theirs = _frozen(other)
        return NotImplemented if theirs is None else self.snapshot() & theirs

    __rand__ = __and__

    def __or__(self, other: AbstractSet[S]) -> frozenset[T | S]:
        theirs = _frozen(other)
        return NotImplemented if theirs is None else self.snapshot() | theirs

    __ror__ = __or__

    def __sub__(self, other: AbstractSet[Any]) -> frozenset[T]:
        theirs = _frozen(other)
        return NotImplemented if theirs is None else self.snapshot() - theirs

    def __rsub__(self, other: AbstractSet[Any]) -> frozenset[Any]:
        theirs = _frozen(other)
        return NotImplemented if theirs is None else theirs - self.snapshot()

    def __xor__(self, other: AbstractSet[S]) -> frozenset[T | S]:
        theirs = _frozen(other)
        return NotImplemented if theirs is None else self.snapshot() ^ theirs

    __rxor__ = __xor__

    def isdisjoint(self, other: Iterable[Any]) -> bool:
        """``True`` if no element of ``other`` is in one snapshot. Thread-safe; read lock."""
        return self.snapshot().isdisjoint(other)

    def __repr__(self) -> str:
        items = sorted(self.snapshot(), key=repr)
        shown = ", ".join(repr(x) for x in items[:8]) + (", ..." if len(items) > 8 else "")
        return f"<{type(self).__name__} of {len(items)}: {{{shown}}}>"


class PrefetchedRoomsView(_SetView[int]):
    """``ctx.prefetched_rooms``: the ids of rooms marked prefetched, as a live set.

    ``room in view`` takes no lock and is linearizable (one dict lookup and one attribute
    read). ``add(room)`` marks the room (opening it if needed; refused if it was purged
    recently), ``discard(room)`` unmarks it (a room left with no keys closes). Thread-safe.
    """

    __slots__ = ("_get",)

    def __init__(self, core: _CompatCore) -> None:
        super().__init__(core)
        # The context's room dict is never rebound, so its bound .get stays valid.
        self._get: Callable[[Any], _Room | None] = core._rooms.get

    def __contains__(self, room: object) -> bool:
        """O(1), no lock; linearizable (same argument as ``StagingContext.is_prefetched``)."""
        state = self._get(room)
        return state is not None and state.prefetched

    def __len__(self) -> int:
        """Prefetched rooms now. Thread-safe; read lock; O(1)."""
        return self._core.prefetched_len()

    def _test_and_add(self, item: int) -> bool:
        return self._core.add_prefetched(check_room_id(item))

    def _discard(self, item: int) -> bool:
        return self._core.discard_prefetched(check_room_id(item))

    def pop(self) -> int:
        """Unmark and return some prefetched room. Thread-safe; write lock; atomic.

        Raises:
            KeyError: empty.
        """
        return self._core.pop_prefetched()

    def clear(self) -> None:
        """Unmark every room (rooms with keys stay open). Thread-safe; write lock; atomic."""
        self._core.clear_prefetched()

    def snapshot(self) -> frozenset[int]:
        """Frozen copy under one read lock. Thread-safe; O(open rooms)."""
        return self._core.prefetched_snapshot()


def _check_key(key: object) -> PrefetchKey:
    """A ``(room, chunk_idx, session_id)`` key. Raises: TypeError, ValueError."""
    if not isinstance(key, tuple) or len(key) != 3:
        raise TypeError(
            f"prefetch_requested holds (room, chunk_idx, session_id) tuples, got {key!r}"
        )
    room, chunk_idx, session_id = key
    return check_room_id(room), check_chunk_idx(chunk_idx), check_session_id(session_id)


class PrefetchRequestedView(_SetView[PrefetchKey]):
    """``ctx.prefetch_requested``: every ``(room, chunk_idx, session_id)`` key, as a live set.

    ``key in view`` takes no lock and is linearizable (one dict lookup and one set
    membership test, as ``StagingContext.is_requested``). ``add(key)`` records the key
    (opening its room if needed; refused if the room was purged recently), ``discard(key)``
    removes it (a room left with no keys and no prefetched mark closes). Thread-safe.
    """

    __slots__ = ("_get",)

    def __init__(self, core: _CompatCore) -> None:
        super().__init__(core)
        self._get: Callable[[Any], _Room | None] = core._rooms.get

    def __contains__(self, key: object) -> bool:
        """O(1), no lock; linearizable (same argument as ``StagingContext.is_requested``).

        Like a set, a non-key (wrong shape) is simply not a member.
        """
        if type(key) is tuple and len(key) == 3:  # the hot path: one branch
            state = self._get(key[0])
            return state is not None and (key[1], key[2]) in state.requests
        if isinstance(key, tuple) and len(key) == 3:  # a tuple subclass (namedtuple)
            return tuple(key) in self
        return False

    def __len__(self) -> int:
        """Keys now. Thread-safe; read lock; O(1)."""
        return self._core.requested_len()

    def _test_and_add(self, item: PrefetchKey) -> bool:
        return self._core.add_request(*_check_key(item))

    def _discard(self, item: PrefetchKey) -> bool:
        return self._core.discard_request(*_check_key(item))

    def pop(self) -> PrefetchKey:
        """Remove and return some key. Thread-safe; write lock; atomic.

        Raises:
            KeyError: empty.
        """
        return self._core.pop_request()

    def clear(self) -> None:
        """Remove every key (prefetched marks stay). Thread-safe; write lock; atomic for
        locked readers; lock-free ``in`` may see it room by room."""
        self._core.clear_requests()

    def snapshot(self) -> frozenset[PrefetchKey]:
        """Frozen copy under one read lock. Thread-safe; O(keys)."""
        return self._core.requested_snapshot()


class CompatStagingContext:
    """Staging prefetch state shaped like the upstream two sets, safe to share between
    threads. See the module docstring for the semantics and the tombstone trade-off.

    Args:
        lock: ``"mutex"`` (default; the rule under the GIL) or ``"rw"``.
        lock_timeout: seconds to wait for the lock before
            :class:`~staging.errors.LockTimeoutError`; ``None``/``inf`` wait forever;
            purges never time out.
        tombstones: how many purged room ids to remember (late ``add`` refused); ``0``
            turns tombstones off.
        strict: ``True`` raises :class:`~staging.errors.RoomPurgedError` for an ``add`` to a
            recently purged room instead of refusing it silently.
        debug: lock debug mode (``None`` reads env ``NIXL_STAGING_DEBUG_LOCKS``).

    Rebinding ``prefetched_rooms`` or ``prefetch_requested`` raises :class:`TypeError`
    (call :meth:`purge_room`); augmented assignment (``|=``, ``-=``) works in place.

    Raises:
        TypeError, ValueError: bad arguments (as :class:`StagingContext`; ``tombstones``
            must be an ``int`` >= 0).
    """

    __slots__ = ("_core", "prefetch_requested", "prefetched_rooms")

    def __init__(
        self,
        *,
        lock: str = "mutex",
        lock_timeout: float | None = None,
        tombstones: int = DEFAULT_TOMBSTONES,
        strict: bool = False,
        debug: bool | None = None,
    ) -> None:
        check_index(tombstones, "tombstones")
        core = _CompatCore(
            lock=lock, lock_timeout=lock_timeout, debug=debug, strict=strict, tombstones=tombstones
        )
        self._core: Final = core
        # A type checker flags a rebind to a set (wrong type); __setattr__ refuses it at run
        # time. Not Final: `ctx.prefetch_requested |= keys` (in place) must type-check.
        self.prefetched_rooms: PrefetchedRoomsView = PrefetchedRoomsView(core)
        self.prefetch_requested: PrefetchRequestedView = PrefetchRequestedView(core)

    def __setattr__(self, name: str, value: object) -> None:
        if name in _VIEW_NAMES:
            current = getattr(self, name, None)
            if current is None:  # the one assignment, in __init__
                object.__setattr__(self, name, value)
                return
            if value is current:
                return  # `ctx.view |= {...}` mutated the view in place and stores it back
            raise TypeError(
                f"{name} is a live thread-safe view and cannot be rebound: to drop a room "
                "from prefetched_rooms and prefetch_requested, call ctx.purge_room(room) "
                "(atomic, O(keys of the room)) instead of rebuilding the set"
            )
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if name in _VIEW_NAMES:
            raise TypeError(f"{name} cannot be deleted; call ctx.purge_room(room)")
        object.__delattr__(self, name)

    # ------------------------------------------------------------------ operations

    def purge_room(self, room: int) -> RoomPurge:
        """Remove ``room`` from both views at one instant and remember its id (tombstone).

        After it returns, an ``add`` for the room is refused while the id is among the last
        ``tombstones`` purges. Idempotent (a second purge returns ``was_open=False``). Cost
        O(keys of that room). Thread-safe; write lock; atomic; never times out.

        Raises:
            TypeError, ValueError: ``room`` is not an ``int`` >= 0.
        """
        return self._core.purge_and_tombstone(check_room_id(room))

    def purge_session(self, session_id: str) -> frozenset[int]:
        """Drop a dead decode peer's keys from every room; return the rooms that had any
        (they stay open, no tombstone). Thread-safe; write lock; atomic; never times out.

        Raises:
            TypeError, ValueError: ``session_id`` is not a non-empty ``str``.
        """
        return self._core.purge_session(session_id)

    def snapshot(self) -> StagingSnapshot:
        """``prefetched_rooms``, ``prefetch_requested`` and open rooms, mutually consistent
        (one read lock). Thread-safe.

        Raises:
            LockTimeoutError: the lock was not acquired within ``lock_timeout``.
        """
        return self._core.snapshot()

    def stats(self) -> CompatStats:
        """Counters under one read lock. Thread-safe.

        Raises:
            LockTimeoutError: the lock was not acquired within ``lock_timeout``.
        """
        return self._core.compat_stats()

    @property
    def lock_kind(self) -> str:
        """``"mutex"`` or ``"rw"``."""
        return self._core.lock_kind

    @property
    def lock(self) -> RWLock | MutexLock:
        """The context's lock (for ``assert_held`` in tests)."""
        return self._core.lock

    @property
    def strict(self) -> bool:
        """Whether a refused ``add`` raises."""
        return self._core.strict

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"<CompatStagingContext lock={s.lock.kind} open={s.open_rooms} "
            f"prefetched={s.prefetched_rooms} keys={s.requested_keys} "
            f"tombstones={s.tombstones}/{s.tombstone_capacity}>"
        )
