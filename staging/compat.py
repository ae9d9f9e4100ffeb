"""``CompatStagingContext``: the two staging sets an engine already has, made thread-safe.

Engines keep their staging prefetch state in two bare sets, ``prefetched_rooms`` (room ids)
and ``prefetch_requested`` (``(room, chunk_idx, session_id)`` keys), written by the
scheduler, bootstrap and transfer-worker threads without a lock. This module keeps that
shape so that adopting the staging layer is a small diff:

* ``ctx.prefetched_rooms`` and ``ctx.prefetch_requested`` are live
  :class:`collections.abc.MutableSet` views. ``x in view`` is O(1) and takes no lock (the
  same linearizable point read as :meth:`StagingContext.is_requested`); ``add``,
  ``discard``, ``remove``, ``pop`` and ``clear`` are each one atomic write; the ``set``
  methods that take many elements (``update``, ``difference_update``,
  ``intersection_update``, ``symmetric_difference_update`` and the in-place operators)
  take the lock once for the whole update; iteration, ``len``, comparisons, ``copy`` and
  set algebra work on one consistent snapshot, so "Set changed size during iteration"
  cannot happen (a view with itself -- ``view == view``, ``view - view``, ``view &= view``
  -- is one snapshot, or one critical section, on both sides).
* **As lenient as a set where that is safe.** Integer-like room ids and chunk indices
  (anything with ``__index__``: ``numpy.int64``, ``numpy.int32``) and ``str`` subclasses
  are normalised to exact ``int``/``str`` before the lock is taken. ``discard`` of
  something that cannot be a member (wrong shape or type, a negative id, an id of
  ``2**63`` or more) does nothing, as ``set.discard`` does, and ``in`` answers ``False``;
  an unhashable value raises ``TypeError``, as with a set. Still refused, with a clear
  error: ``add`` of a non-key (a set would store anything hashable; the views store only
  ``int`` rooms and ``(int, int, str)`` keys), ``bool`` ids (``True`` as a room id is a
  caller bug), an id not below ``2**63`` (the bound ``StagingContext`` and the sender keep,
  with the same ``ValueError``), and an empty session id (it names no decode peer, and
  ``purge_session`` could never reach its keys).
* Rebinding either attribute (``ctx.prefetch_requested = {k for k in ... if k[0] != room}``,
  the racy upstream purge) raises :class:`TypeError` telling you to call
  :meth:`CompatStagingContext.purge_room`, which removes the room from both views in one
  critical section, in O(keys of that room).
* Rooms open implicitly on their first write; there is no ``open_room`` step.
* **Tombstones and reused ids.** A purged room id is remembered among the last
  ``tombstones`` purged ids; a later ``add`` for it (a late writer) is *refused*: it
  returns normally, changes nothing and counts in ``stats().refused_late_writes``
  (``strict=True`` raises :class:`~staging.errors.RoomPurgedError` instead). The first
  refusal of each remembered id is also logged (logger ``staging.compat``, WARNING, after
  the lock is released), because an id cannot tell a late writer from a *new* request
  that reuses it. The decision: **a new request that may reuse an id says so** --
  :meth:`CompatStagingContext.reopen_room` (call it where the request is admitted, before
  anything writes for it) lifts the tombstone and drops whatever the id still holds, in
  one critical section. Without that call the reused id is refused like a late writer.
  ``tombstones=0`` turns the window off (a late ``add`` then re-creates the room, as with
  bare sets). Generations (:class:`~staging.context.RoomHandle`) tell openings apart with
  no window and no call; that is step 2 in ``docs/ADOPTING.md``.

Thread-safety contract: each method's docstring.
"""

from __future__ import annotations

import enum
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, MutableSet, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any, ClassVar, Final, Generic, TypeVar

from staging._views import FixedViews
from staging.context import (
    PrefetchKey,
    RoomPurge,
    StagingContext,
    StagingSnapshot,
    _Room,
    next_generation,
)
from staging.locks import LockStats, MutexLock, RWLock
from staging.validate import MAX_ID, check_id, check_session_id

__all__ = [
    "DEFAULT_TOMBSTONES",
    "CompatStagingContext",
    "CompatStats",
    "PrefetchRequestedView",
    "PrefetchedRoomsView",
]

DEFAULT_TOMBSTONES = 65536
"""How many purged room ids a :class:`CompatStagingContext` remembers by default."""

LOG: Final = logging.getLogger("staging.compat")
"""Where the first refused write of each remembered id is logged (WARNING)."""


T = TypeVar("T")
S = TypeVar("S")


@dataclass(frozen=True, slots=True)
class CompatStats:
    """Counters of one :class:`CompatStagingContext`, taken under one read lock.

    ``refused_late_writes`` counts every refused ``add`` (a room among the tombstones);
    ``tombstones`` is how many purged ids are remembered now, at most
    ``tombstone_capacity``; ``reopens`` counts :meth:`CompatStagingContext.reopen_room`
    and :meth:`CompatStagingContext.lift_tombstone`
    calls that lifted a tombstone or dropped leftover state.
    """

    open_rooms: int
    prefetched_rooms: int
    requested_keys: int
    rooms_opened: int
    purges: int
    refused_late_writes: int
    tombstones: int
    tombstone_capacity: int
    reopens: int
    lock: LockStats


# ---------------------------------------------------------------------- element checks
# All of them run before any lock is taken: __index__ and str.__str__ of a subclass may be
# user code, which must never run under the context's lock.


def _plain_index(value: object, what: str, bools: bool = False) -> int:
    """An id or index as an exact ``int`` with ``0 <= value < 2**63``: ``int``, or anything
    with ``__index__`` (``numpy.int64``); ``bool`` only if ``bools`` (then as 0/1). The
    validator ``StagingContext`` uses (:func:`staging.validate.check_id`), so the bound and
    its error are the same. Raises: TypeError, ValueError."""
    if type(value) is int and 0 <= value < MAX_ID:  # the hot path, without a call
        return value
    return check_id(value, what, bools=bools)


def _room_id(value: object, bools: bool = False) -> int:
    """A room id (lenient). Raises: TypeError, ValueError."""
    return _plain_index(value, "room", bools)


def _key(value: object, bools: bool = False) -> PrefetchKey:
    """A ``(room, chunk_idx, session_id)`` key (lenient). Raises: TypeError, ValueError."""
    if type(value) is tuple and len(value) == 3:
        room, chunk_idx, session_id = value
        if (  # the hot path
            type(room) is int
            and type(chunk_idx) is int
            and type(session_id) is str
            and 0 <= room < MAX_ID
            and 0 <= chunk_idx < MAX_ID
            and session_id
        ):
            return value
    elif not isinstance(value, tuple) or len(value) != 3:
        raise TypeError(
            f"prefetch_requested holds (room, chunk_idx, session_id) tuples, got {value!r}"
        )
    room, chunk_idx, session_id = tuple(value)
    return (
        _plain_index(room, "room", bools),
        _plain_index(chunk_idx, "chunk_idx", bools),
        check_session_id(session_id),
    )


def _maybe(check: Callable[[object, bool], T], value: object, sets: bool = True) -> T | None:
    """The member ``value`` would be, for ``discard``/``remove``: ``None`` when it cannot be
    one (what ``discard`` of a non-member does with a set: nothing). As with a set, an
    unhashable value raises (``set.discard`` and ``set.remove``, but not
    ``set.difference_update``, look a ``set`` up as a ``frozenset``: ``sets``), and ``True`` finds
    what ``1`` finds (``True == 1``; only ``add`` refuses bools).

    Raises:
        TypeError: ``value`` is unhashable.
    """
    if sets and isinstance(value, set):
        value = frozenset(value)
    hash(value)
    try:
        return check(value, True)
    except (TypeError, ValueError):
        return None


class _Refusal(enum.Enum):
    """Why :meth:`_CompatCore._room_for_write` gave no room."""

    QUIET = 0  # refused, already logged for this tombstone
    LOG = 1  # refused, the first time for this tombstone: log it (after the lock)


def _log_refusals(rooms: Iterable[int], window: int) -> None:
    """Log the first refusal of each id. Called with no lock held."""
    for room in rooms:
        LOG.warning(
            "refused a write for room %d: it was purged and its id is among the last %d "
            "purged ids, so this is taken for a late writer. If a new request reuses this "
            "id, call reopen_room(%d) where it is admitted. Later refusals for this id are "
            "only counted (stats().refused_late_writes).",
            room,
            window,
            room,
        )


class _CompatCore(StagingContext):
    """A :class:`StagingContext` with the compat layer's combined writes and tombstones.

    Every method here runs one critical section of the inherited lock and keeps the
    invariants of the base class (per-room key sets mutated only by single atomic calls
    while the room is in ``_rooms``, the session reverse index, the counters), so the
    base class's lock-free point reads stay linearizable. Callers pass checked, exact
    elements (the views check them before calling).
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
        # Guarded by _lock: the last purged room ids, oldest first (an ordered set); the
        # value says whether a refused write for that id was logged already. Invariant: a
        # room id is never open and tombstoned at once (purge closes and tombstones in one
        # critical section; reopen_room lifts the tombstone; a tombstoned id never opens).
        self._tombstones: OrderedDict[int, bool] = OrderedDict()
        self._reopens = 0  # guarded by _lock

    # ---------------------------------------------------------------- under the write lock

    def _room_for_write(self, room: int) -> _Room | _Refusal:
        """The open room, opening it if needed; a :class:`_Refusal` if it is tombstoned.

        Caller holds the write lock. Raises: RoomPurgedError (strict mode).
        """
        state = self._rooms.get(room)
        if state is not None:
            return state
        logged = self._tombstones.get(room)
        if logged is not None:
            self._refuse(
                room,
                None,
                f" (it was purged; its id is among the last {self._tombstone_capacity} "
                "purged ids, so this is a late write; a new request that reuses the id "
                "calls reopen_room first)",
            )
            if logged:
                return _Refusal.QUIET
            self._tombstones[room] = True
            return _Refusal.LOG
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

    def _check_batch_strict(self, rooms: Iterable[int]) -> None:
        """Strict mode: refuse a whole batch (before any change) if one of its rooms would
        be refused. Caller holds the write lock. Raises: RoomPurgedError."""
        if not self._strict:
            return
        for room in rooms:
            if room not in self._rooms and room in self._tombstones:
                self._room_for_write(room)  # counts and raises

    # The per-element bodies, shared by the single and the batched writes. Each returns
    # True if it changed something, False if not, or the refusal. Caller holds the lock.

    def _add_key_locked(self, key: PrefetchKey) -> bool | _Refusal:
        room, chunk_idx, session_id = key
        state = self._room_for_write(room)
        if isinstance(state, _Refusal):
            return state
        pair = (chunk_idx, session_id)
        if pair in state.requests:
            return False
        state.requests.add(pair)
        self._add_session_ref(session_id, room)
        self._requested_keys += 1
        return True

    def _discard_key_locked(self, key: PrefetchKey) -> bool:
        room, chunk_idx, session_id = key
        state = self._rooms.get(room)
        pair = (chunk_idx, session_id)
        if state is None or pair not in state.requests:
            return False
        state.requests.remove(pair)
        self._drop_session_ref(session_id, room)
        self._requested_keys -= 1
        self._close_if_empty(room, state)
        return True

    def _has_key(self, key: PrefetchKey) -> bool:
        state = self._rooms.get(key[0])
        return state is not None and (key[1], key[2]) in state.requests

    def _add_mark_locked(self, room: int) -> bool | _Refusal:
        state = self._room_for_write(room)
        if isinstance(state, _Refusal):
            return state
        if state.prefetched:
            return False
        state.prefetched = True
        self._prefetched_count += 1
        return True

    def _discard_mark_locked(self, room: int) -> bool:
        state = self._rooms.get(room)
        if state is None or not state.prefetched:
            return False
        state.prefetched = False
        self._prefetched_count -= 1
        self._close_if_empty(room, state)
        return True

    def _has_mark(self, room: int) -> bool:
        state = self._rooms.get(room)
        return state is not None and state.prefetched

    # ---------------------------------------------------------------- single writes

    def add_request(self, room: int, chunk_idx: int, session_id: str) -> bool:
        """Test-and-add one key, opening the room if needed. Write lock; atomic.

        Raises: RoomPurgedError (strict mode, tombstoned room)."""
        with self._lock.write():
            done = self._add_key_locked((room, chunk_idx, session_id))
        if done is _Refusal.LOG:
            _log_refusals((room,), self._tombstone_capacity)
        return done is True

    def discard_request(self, room: int, chunk_idx: int, session_id: str) -> bool:
        """Remove one key if present (never refused, never opens). Write lock; atomic."""
        with self._lock.write():
            return self._discard_key_locked((room, chunk_idx, session_id))

    def add_prefetched(self, room: int) -> bool:
        """Mark the room prefetched, opening it if needed. Write lock; atomic.

        Raises: RoomPurgedError (strict mode, tombstoned room)."""
        with self._lock.write():
            done = self._add_mark_locked(room)
        if done is _Refusal.LOG:
            _log_refusals((room,), self._tombstone_capacity)
        return done is True

    def discard_prefetched(self, room: int) -> bool:
        """Unmark the room if marked (never refused, never opens). Write lock; atomic."""
        with self._lock.write():
            return self._discard_mark_locked(room)

    # ---------------------------------------------------------------- batched writes

    def write_many(
        self,
        rooms_view: bool,
        *,
        adds: Sequence[Any] = (),
        discards: Sequence[Any] = (),
        toggles: Sequence[Any] = (),
        keep: AbstractSet[Any] | None = None,
    ) -> int:
        """One critical section for a whole set update of one view: first ``discards``,
        then (``keep``) every element not in ``keep`` is discarded, then ``adds``, then
        each of ``toggles`` is discarded if present, else added. Elements are checked,
        exact keys (or room ids when ``rooms_view``). Returns how many were added.
        Write lock; atomic as a whole.

        Raises:
            RoomPurgedError: strict mode and an added element's room is tombstoned
                (nothing changed).
        """
        add: Callable[[Any], bool | _Refusal]
        discard: Callable[[Any], bool]
        has: Callable[[Any], bool]
        if rooms_view:
            add, discard, has = self._add_mark_locked, self._discard_mark_locked, self._has_mark
        else:
            add, discard, has = self._add_key_locked, self._discard_key_locked, self._has_key
        added = 0
        to_log: list[int] = []
        # mutant-site: write-many
        with self._lock.write():
            if self._strict:
                self._check_batch_strict([x if rooms_view else x[0] for x in (*adds, *toggles)])
            for item in discards:
                discard(item)
            if keep is not None:
                for item in list(self._items_locked(rooms_view)):
                    if item not in keep:
                        discard(item)
            for item in adds:
                done = add(item)
                if done is True:
                    added += 1
                elif done is _Refusal.LOG:
                    to_log.append(item if rooms_view else item[0])
            for item in toggles:
                if has(item):
                    discard(item)
                    continue
                done = add(item)
                if done is True:
                    added += 1
                elif done is _Refusal.LOG:
                    to_log.append(item if rooms_view else item[0])
        _log_refusals(to_log, self._tombstone_capacity)
        return added

    def _items_locked(self, rooms_view: bool) -> Iterator[Any]:
        """Every element of one view. Caller holds the lock (and materialises it before
        mutating)."""
        if rooms_view:
            return (room for room, state in self._rooms.items() if state.prefetched)
        return (
            (room, chunk_idx, session)
            for room, state in self._rooms.items()
            for chunk_idx, session in state.requests
        )

    # ---------------------------------------------------------------- pop, clear, reads

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

    # ---------------------------------------------------------------- purge and reopen

    def purge_and_tombstone(self, room: int) -> RoomPurge:
        """Purge the room (both views) and remember its id, in ONE critical section that
        never times out. Write lock; atomic."""
        # mutant-site: purge-and-tombstone-with
        with self._lock.write_untimed():
            result = self._purge_locked(room, None)
            if self._tombstone_capacity:
                tombstones = self._tombstones
                # mutant-site: purge-and-tombstone-if
                if room in tombstones:
                    tombstones.move_to_end(room)
                    tombstones[room] = False  # a new purge: its first refusal logs again
                else:
                    tombstones[room] = False
                    if len(tombstones) > self._tombstone_capacity:
                        tombstones.popitem(last=False)
            return result

    def reopen(self, room: int) -> RoomPurge:
        """Lift the room's tombstone and drop what the id holds, in ONE critical section
        that never times out. Write lock; atomic."""
        with self._lock.write_untimed():
            lifted = self._tombstones.pop(room, None) is not None
            result = self._purge_locked(room, None)
            if result.was_open:
                self._purges -= 1  # not a purge of a finished request: counted as a reopen
            if lifted or result.was_open:
                self._reopens += 1
            return result

    def lift(self, room: int) -> bool:
        """Lift the room's tombstone, dropping nothing (a tombstoned id is never open, so a
        live room is never touched). Write lock; atomic; never times out."""
        with self._lock.write_untimed():
            lifted = self._tombstones.pop(room, None) is not None
            if lifted:
                self._reopens += 1
            return lifted

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
                reopens=self._reopens,
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


def _all(others: tuple[Iterable[Any], ...]) -> list[Any]:
    """The elements of several iterables, one snapshot each for a view."""
    out: list[Any] = []
    for other in others:
        out.extend(other.snapshot() if isinstance(other, _SetView) else other)
    return out


_BUILTIN_SCALARS: Final = frozenset({int, float, complex, bool, str, bytes, type(None)})


def _builtin(value: object) -> bool:
    """``value`` compares and hashes with built-in code only (no user ``__eq__``)."""
    kind = type(value)
    if kind is tuple:
        return all(_builtin(x) for x in value)  # type: ignore[attr-defined]
    return kind in _BUILTIN_SCALARS


def _members(check: Callable[[object, bool], T], values: Iterable[Any]) -> frozenset[Any]:
    """The members ``values`` name, as exact elements (what :meth:`_SetView.discard` would
    look for). Runs before any lock is taken: the caller's ``__hash__``/``__eq__``/
    ``__index__`` (user code) run here, never under the context's lock. A value that is not
    an element's exact form is kept as it is only when it is built of built-in types (``1.0``
    still matches room ``1``, as in a set); any other names no member.

    Raises:
        TypeError: an element is unhashable.
    """
    out: list[Any] = []
    for value in values:
        item = _maybe(check, value, sets=False)
        if item is not None:
            out.append(item)
        elif _builtin(value):
            out.append(value)
    return frozenset(out)


class _SetView(MutableSet[T], Generic[T]):
    """The behaviour both views share: writes go through the context, every whole-set
    operation reads one snapshot. Subclasses provide ``__contains__`` (lock-free), the
    element check and the hooks."""

    __slots__ = ("_core",)
    _ROOMS: bool = False  # which view of the core (the batched writes need to know)

    def __init__(self, core: _CompatCore) -> None:
        self._core = core

    # hooks ---------------------------------------------------------------------------
    def _check(self, value: object, bools: bool = False) -> T:
        """``value`` as an exact element (``bools``: ``True``/``False`` read as 1/0, for
        lookups). Raises: TypeError, ValueError."""
        raise NotImplementedError

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

        A room among the recent purges is refused: nothing changes, ``stats()`` counts it
        (and the first refusal of each such id is logged).

        Raises:
            TypeError, ValueError: ``value`` is malformed, or an id is not below ``2**63``
                (numpy integers and ``str`` subclasses are accepted and normalised).
            RoomPurgedError: strict mode, and the room was purged recently.
        """
        self._test_and_add(self._check(value))

    def test_and_add(self, value: T) -> bool:
        """Add ``value``; ``True`` only if it was not there and was added (the atomic
        replacement of ``if x not in view: view.add(x)``). Thread-safe; write lock; atomic.

        Raises:
            TypeError, ValueError: ``value`` is malformed, or an id is not below ``2**63``.
            RoomPurgedError: strict mode, and the room was purged recently.
        """
        # mutant-site: test-and-add
        return self._test_and_add(self._check(value))

    def discard(self, value: object) -> None:
        """Remove ``value`` if present. Thread-safe; write lock; atomic; never refused.

        Like ``set.discard``, a value that cannot be a member (wrong type or shape, a
        negative id) is simply not there: nothing happens.

        Raises:
            TypeError: ``value`` is unhashable (as with a set).
        """
        item = _maybe(self._check, value)
        if item is not None:
            self._discard(item)

    def remove(self, value: object) -> None:
        """Remove ``value``. Thread-safe; write lock; atomic (one check-and-remove).

        Raises:
            KeyError: ``value`` was not there (also for a value that cannot be a member).
            TypeError: ``value`` is unhashable.
        """
        item = _maybe(self._check, value)
        # mutant-site: remove
        if item is None or not self._discard(item):
            raise KeyError(value)

    def update(self, *others: Iterable[T]) -> None:
        """Add every element of ``others``, taking the write lock ONCE for the whole update
        (atomic: lock-free readers see each element appear, locked readers all or none).
        Elements of a recently purged room are refused (counted), the rest are added.

        Raises:
            TypeError, ValueError: an element is malformed (checked before any change).
            RoomPurgedError: strict mode, and an element's room was purged recently
                (nothing is added).
        """
        # The view itself adds nothing (``view |= view`` is a no-op, not a re-add of an
        # earlier snapshot over what other threads removed meanwhile).
        items = [self._check(x) for x in _all(tuple(o for o in others if o is not self))]
        # mutant-site: update
        if items:
            self._core.write_many(self._ROOMS, adds=items)

    def difference_update(self, *others: Iterable[Any]) -> None:
        """Remove every element of ``others`` (non-members are ignored, as with a set);
        write lock taken ONCE; atomic. Thread-safe.

        Raises:
            TypeError: an element is unhashable.
        """
        if any(other is self for other in others):  # view -= view: empty, at one instant
            self._core.write_many(self._ROOMS, keep=frozenset())
            return
        maybe = (_maybe(self._check, x, sets=False) for x in _all(others))
        items = [item for item in maybe if item is not None]
        if items:
            self._core.write_many(self._ROOMS, discards=items)

    def intersection_update(self, *others: Iterable[Any]) -> None:
        """Keep only the elements that are in every one of ``others``; write lock taken
        ONCE; atomic (decided against the set as it is inside that critical section).
        Thread-safe.

        The elements of ``others`` are normalised first, outside the lock, as
        :meth:`discard` normalises its argument (``numpy.int64(5)`` keeps ``5``; a ``str``
        subclass's key keeps the plain key), so that no ``__eq__``/``__hash__`` of the
        caller runs under the lock. The view itself among ``others`` keeps everything
        (``view &= view`` changes nothing, whatever other threads write meanwhile).

        Raises:
            TypeError: an element is unhashable, or an argument is not iterable.
        """
        keep: frozenset[Any] | None = None
        for other in others:
            if other is self:  # s & s is s, in the critical section too: no constraint
                continue
            these = _frozen(other)
            if these is None:
                raise TypeError(f"intersection_update needs iterables, got {other!r}")
            # mutant-site: intersection-update-set-plain
            plain = _members(self._check, these)
            keep = plain if keep is None else keep & plain
        # mutant-site: intersection-update-if
        if keep is not None:
            self._core.write_many(self._ROOMS, keep=keep)

    def symmetric_difference_update(self, other: Iterable[T]) -> None:
        """Remove the elements of ``other`` that are present and add those that are not;
        write lock taken ONCE; atomic. Adds to a recently purged room are refused.
        Thread-safe.

        Raises:
            TypeError, ValueError: an element is malformed (checked before any change).
            RoomPurgedError: strict mode, and an element to add is of a recently purged
                room (nothing changes).
        """
        if other is self:  # view ^= view: empty, at one instant
            self._core.write_many(self._ROOMS, keep=frozenset())
            return
        items = list(dict.fromkeys(self._check(x) for x in _all((other,))))
        if items:
            self._core.write_many(self._ROOMS, toggles=items)

    def __ior__(self, other: AbstractSet[Any]) -> _SetView[T]:  # type: ignore[misc]
        """``view |= other``: :meth:`update` (one lock acquisition). Thread-safe.

        Raises: as :meth:`update`."""
        self.update(other)
        return self

    def __isub__(self, other: AbstractSet[Any]) -> _SetView[T]:
        """``view -= other``: :meth:`difference_update` (one lock acquisition).

        Raises: as :meth:`difference_update`."""
        self.difference_update(other)
        return self

    def __iand__(self, other: AbstractSet[Any]) -> _SetView[T]:
        """``view &= other``: :meth:`intersection_update` (one lock acquisition).

        Raises: as :meth:`intersection_update`."""
        self.intersection_update(other)
        return self

    def __ixor__(self, other: AbstractSet[Any]) -> _SetView[T]:  # type: ignore[misc]
        """``view ^= other``: :meth:`symmetric_difference_update` (one lock acquisition).

        Raises: as :meth:`symmetric_difference_update`."""
        self.symmetric_difference_update(other)
        return self

    # whole-set reads: one snapshot each -----------------------------------------------
    def __iter__(self) -> Iterator[T]:
        """Iterate over one snapshot (later changes are not seen). Thread-safe; read lock."""
        return iter(self.snapshot())

    def copy(self) -> set[T]:
        """A plain, detached ``set`` of one snapshot (as ``set.copy``). Thread-safe; read
        lock; O(n)."""
        return set(self.snapshot())

    @classmethod
    def _from_iterable(cls, it: Iterable[S]) -> frozenset[S]:
        return frozenset(it)

    def _pair(self, other: object) -> tuple[frozenset[T], frozenset[Any] | None]:
        """One snapshot of this view and ``other`` as a frozenset (``None``: not iterable).
        The view compared with itself is ONE snapshot on both sides, so ``view == view``,
        ``view - view`` and the rest answer as for one set, whatever other threads write."""
        # mutant-site: pair
        if other is self:
            mine = self.snapshot()
            return mine, mine
        theirs = _frozen(other)
        return (frozenset() if theirs is None else self.snapshot()), theirs

    def _sub_self(self, others: tuple[Iterable[Any], ...], mine: frozenset[T]) -> list[Any]:
        """``others`` with the view itself replaced by the snapshot ``mine``."""
        return [mine if other is self else other for other in others]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, AbstractSet):
            return NotImplemented
        mine, theirs = self._pair(other)
        return mine == theirs

    __hash__ = None  # type: ignore[assignment]  # mutable, like set

    def __le__(self, other: AbstractSet[Any]) -> bool:
        if not isinstance(other, AbstractSet):
            return NotImplemented
        mine, theirs = self._pair(other)
        return NotImplemented if theirs is None else mine <= theirs

    def __lt__(self, other: AbstractSet[Any]) -> bool:
        if not isinstance(other, AbstractSet):
            return NotImplemented
        mine, theirs = self._pair(other)
        return NotImplemented if theirs is None else mine < theirs

    def __ge__(self, other: AbstractSet[Any]) -> bool:
        if not isinstance(other, AbstractSet):
            return NotImplemented
        mine, theirs = self._pair(other)
        return NotImplemented if theirs is None else mine >= theirs

    def __gt__(self, other: AbstractSet[Any]) -> bool:
        if not isinstance(other, AbstractSet):
            return NotImplemented
        mine, theirs = self._pair(other)
        return NotImplemented if theirs is None else mine > theirs

    def __and__(self, other: AbstractSet[Any]) -> frozenset[T]:
        mine, theirs = self._pair(other)
        return NotImplemented if theirs is None else mine & theirs

    __rand__ = __and__

    def __or__(self, other: AbstractSet[S]) -> frozenset[T | S]:
        mine, theirs = self._pair(other)
        return NotImplemented if theirs is None else mine | theirs

    __ror__ = __or__

    def __sub__(self, other: AbstractSet[Any]) -> frozenset[T]:
        mine, theirs = self._pair(other)
        return NotImplemented if theirs is None else mine - theirs

    def __rsub__(self, other: AbstractSet[Any]) -> frozenset[Any]:
        mine, theirs = self._pair(other)
        return NotImplemented if theirs is None else theirs - mine

    def __xor__(self, other: AbstractSet[S]) -> frozenset[T | S]:
        mine, theirs = self._pair(other)
        return NotImplemented if theirs is None else mine ^ theirs

    __rxor__ = __xor__

    # The named set methods take any iterables, like set's (the operators need sets).
    def isdisjoint(self, other: Iterable[Any]) -> bool:
        """``True`` if no element of ``other`` is in one snapshot. Thread-safe; read lock."""
        mine = self.snapshot()
        return mine.isdisjoint(mine if other is self else other)

    def issubset(self, other: Iterable[Any]) -> bool:
        """One snapshot ``<=`` ``other``. Thread-safe; read lock."""
        mine = self.snapshot()
        return mine.issubset(mine if other is self else other)

    def issuperset(self, other: Iterable[Any]) -> bool:
        """One snapshot ``>=`` ``other``. Thread-safe; read lock."""
        mine = self.snapshot()
        return mine.issuperset(mine if other is self else other)

    def union(self, *others: Iterable[S]) -> frozenset[T | S]:
        """One snapshot ``|`` every one of ``others``, as a frozenset. Thread-safe."""
        mine = self.snapshot()
        return mine.union(*self._sub_self(others, mine))

    def intersection(self, *others: Iterable[Any]) -> frozenset[T]:
        """One snapshot ``&`` every one of ``others``, as a frozenset. Thread-safe."""
        mine = self.snapshot()
        return mine.intersection(*self._sub_self(others, mine))

    def difference(self, *others: Iterable[Any]) -> frozenset[T]:
        """One snapshot minus every one of ``others``, as a frozenset. Thread-safe."""
        mine = self.snapshot()
        return mine.difference(*self._sub_self(others, mine))

    def symmetric_difference(self, other: Iterable[S]) -> frozenset[T | S]:
        """One snapshot ``^`` ``other``, as a frozenset. Thread-safe."""
        mine = self.snapshot()
        return mine.symmetric_difference(mine if other is self else other)

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
    _ROOMS = True

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

    def _check(self, value: object, bools: bool = False) -> int:
        return _room_id(value, bools)

    def _test_and_add(self, item: int) -> bool:
        return self._core.add_prefetched(item)

    def _discard(self, item: int) -> bool:
        return self._core.discard_prefetched(item)

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

        Like a set, a non-key (wrong shape) is simply not a member; elements that compare
        and hash equal (``numpy.int64(5)`` and ``5``) match.
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

    def _check(self, value: object, bools: bool = False) -> PrefetchKey:
        return _key(value, bools)

    def _test_and_add(self, item: PrefetchKey) -> bool:
        return self._core.add_request(*item)

    def _discard(self, item: PrefetchKey) -> bool:
        return self._core.discard_request(*item)

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


class CompatStagingContext(FixedViews):
    """Staging prefetch state shaped like the upstream two sets, safe to share between
    threads. See the module docstring for the semantics, the tombstones and reused ids.

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
    (call :meth:`purge_room`); augmented assignment (``|=``, ``-=``, ``&=``, ``^=``) works in
    place, one lock acquisition each.

    A subclass may be a dataclass (an engine's own staging dataclass with the two set
    fields dropped): its generated ``__init__`` runs first, then its ``__post_init__`` must
    call ``CompatStagingContext.__init__(self, ...)``; until then the views do not exist.
    ``docs/ADOPTING.md`` shows it and its side effects on ``repr`` and ``==``.

    Raises:
        TypeError, ValueError: bad arguments (as :class:`StagingContext`; ``tombstones``
            must be an ``int`` with ``0 <= tombstones < 2**63``).
    """

    VIEW_NAMES: ClassVar[frozenset[str]] = frozenset({"prefetched_rooms", "prefetch_requested"})
    REBIND_HINT: ClassVar[str] = (
        "to drop a room from prefetched_rooms and prefetch_requested, call "
        "ctx.purge_room(room) (atomic, O(keys of the room)) instead of rebuilding the set"
    )

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
        """Make a :class:`CompatStagingContext`: every argument and what it raises are in the
        class docstring (``help(CompatStagingContext)``)."""
        # Bounded as an id is: the window is formatted into repr() and the refusal WARNING.
        tombstones = check_id(tombstones, "tombstones")
        core = _CompatCore(
            lock=lock, lock_timeout=lock_timeout, debug=debug, strict=strict, tombstones=tombstones
        )
        self._core: Final = core
        # A type checker flags a rebind to a set (wrong type); __setattr__ refuses it at run
        # time. Not Final: `ctx.prefetch_requested |= keys` (in place) must type-check.
        self.prefetched_rooms: PrefetchedRoomsView = PrefetchedRoomsView(core)
        self.prefetch_requested: PrefetchRequestedView = PrefetchRequestedView(core)


    # ------------------------------------------------------------------ operations

    def purge_room(self, room: int) -> RoomPurge:
        """Remove ``room`` from both views at one instant and remember its id (tombstone).

        After it returns, an ``add`` for the room is refused while the id is among the last
        ``tombstones`` purges (until :meth:`reopen_room`). Idempotent (a second purge
        returns ``was_open=False``). Cost O(keys of that room). Thread-safe; write lock;
        atomic; never times out.

        Raises:
            TypeError, ValueError: ``room`` is not an integer in ``[0, 2**63)`` (numpy
                integers are accepted).
        """
        return self._core.purge_and_tombstone(_room_id(room))

    def reopen_room(self, room: int) -> RoomPurge:
        """A *new* request starts with the id ``room``: lift its tombstone and drop what the
        id still holds, at one instant. Returns what was dropped (``was_open=False`` when the
        id held nothing, the usual case).

        Call it where the new request is admitted, before anything writes for it. After it,
        writes for the id are accepted again -- a late writer of the earlier request too,
        which an id cannot tell apart (a :class:`~staging.context.RoomHandle` can).
        Thread-safe; write lock; atomic; never times out.

        Raises:
            TypeError, ValueError: ``room`` is not an integer in ``[0, 2**63)``.
        """
        # mutant-site: reopen-room
        return self._core.reopen(_room_id(room))

    def lift_tombstone(self, room: int) -> bool:
        """A new request starts with the id ``room`` and a request with that id may still be
        live: lift the id's tombstone, if it has one, and drop nothing. Returns whether a
        tombstone was lifted.

        Unlike :meth:`reopen_room` it never drops keys: an id that is open (a live request
        holds keys or the prefetched mark) has no tombstone, so a duplicate id arriving while
        the first request is live leaves every key of the first as it is. Use it where an
        engine cannot tell a reused id from a live duplicate (the SGLang plugin calls it when
        a sender is made; ``docs/ADOPTING.md``). Thread-safe; write lock; atomic; never times
        out.

        Raises:
            TypeError, ValueError: ``room`` is not an integer in ``[0, 2**63)``.
        """
        return self._core.lift(_room_id(room))

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
