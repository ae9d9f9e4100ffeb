"""``CompatStagingContext``: an engine's two bare staging sets, made thread-safe.

``ctx.prefetched_rooms`` (room ids) and ``ctx.prefetch_requested`` (``(room, chunk_idx,
session_id)`` keys) are live :class:`collections.abc.MutableSet` views of one
:class:`StagingContext` (``_CompatCore``); its lock guards both views and the tombstones.
``in`` is lock-free; every write is one critical section; whole-set reads use one snapshot.
Elements are normalised to exact ``int``/``str`` before the lock is taken. A purged id is
tombstoned: a later ``add`` is refused (counted, first refusal logged) until
:meth:`CompatStagingContext.reopen_room` or ``lift_tombstone``.

See docs/THREADING.md, '``CompatStagingContext`` and its views', and docs/ADOPTING.md,
'What behaves differently from a bare set'.
"""

from __future__ import annotations

import logging
import operator
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
from staging.validate import check_id, check_room_id, check_session_id

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
R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class CompatStats:
    """Counters of one :class:`CompatStagingContext`, taken under one read lock.

    ``refused_late_writes``: refused ``add`` calls (tombstoned room); ``tombstones``: ids
    remembered now (at most ``tombstone_capacity``); ``reopens``: ``reopen_room`` and
    ``lift_tombstone`` calls that lifted a tombstone or dropped leftover state.
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


# Element checks run before any lock: __index__ / str.__str__ of a subclass may be user code.


def _maybe(check: Callable[[object, bool], T], value: object, sets: bool = True) -> T | None:
    """The member ``value`` would be, or ``None`` if it cannot be one (``sets``: a ``set``
    is looked up as a ``frozenset``, as ``set.discard`` does). Raises: TypeError (unhashable).
    """
    if sets and isinstance(value, set):
        value = frozenset(value)
    hash(value)
    try:
        return check(value, True)
    except (TypeError, ValueError):
        return None


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

    Each method is one critical section of the inherited lock and keeps the base class's
    invariants, so its lock-free point reads stay linearizable. Callers pass checked,
    exact elements.
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
        # Guarded by _lock: the last purged ids, oldest first -> "refusal logged already".
        # Invariant: an id is never open and tombstoned at once.
        self._tombstones: OrderedDict[int, bool] = OrderedDict()
        self._reopens = 0  # guarded by _lock

    # ---------------------------------------------------------------- under the write lock

    def _room_for_write(self, room: int, to_log: list[int]) -> _Room | None:
        """The open room (opened if needed), or ``None`` if tombstoned (refused; its first
        refusal per tombstone goes to ``to_log``, logged after the lock). Write lock held.
        Raises: RoomPurgedError (strict mode)."""
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
            if not logged:
                self._tombstones[room] = True
                to_log.append(room)
            return None
        state = _Room(next_generation())
        self._rooms[room] = state
        self._rooms_opened += 1
        return state

    def _close_if_empty(self, room: int, state: _Room) -> None:
        """Close an empty room (no purge, no tombstone). Write lock held."""
        if not state.requests and not state.prefetched:
            del self._rooms[room]

    def _check_batch_strict(self, rooms: Iterable[int]) -> None:
        """Strict mode: raise before any change if one room of the batch would be refused."""
        for room in rooms:
            if room not in self._rooms and room in self._tombstones:
                self._room_for_write(room, [])  # counts and raises

    # Per-element bodies (write lock held): True if changed (a refused add: False).

    def _add_key_locked(self, key: PrefetchKey, to_log: list[int]) -> bool:
        room, chunk_idx, session_id = key
        state = self._room_for_write(room, to_log)
        pair = (chunk_idx, session_id)
        if state is None or pair in state.requests:
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

    def _add_mark_locked(self, room: int, to_log: list[int]) -> bool:
        state = self._room_for_write(room, to_log)
        if state is None or state.prefetched:
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

    def _ops(
        self, rooms_view: bool
    ) -> tuple[Callable[[Any, list[int]], bool], Callable[[Any], bool]]:
        """One view's per-element add and discard (write lock held when called)."""
        if rooms_view:
            return self._add_mark_locked, self._discard_mark_locked
        return self._add_key_locked, self._discard_key_locked

    def _items_locked(self, rooms_view: bool) -> Iterator[Any]:
        """Every element of one view. Lock held; materialise before mutating."""
        if rooms_view:
            return (room for room, state in self._rooms.items() if state.prefetched)
        return (
            (room, chunk_idx, session)
            for room, state in self._rooms.items()
            for chunk_idx, session in state.requests
        )

    # ---------------------------------------------------------------- writes of one view

    def write_many(
        self,
        rooms_view: bool,
        *,
        adds: Sequence[Any] = (),
        discards: Sequence[Any] = (),
        toggles: Sequence[Any] = (),
        keep: AbstractSet[Any] | None = None,
    ) -> int:
        """One critical section: ``discards``, then drop all not in ``keep``, then ``adds``,
        then flip each of ``toggles``. Returns how many elements it added or removed.

        Raises:
            RoomPurgedError: strict mode, an added element's room is tombstoned (no change).
        """
        add, discard = self._ops(rooms_view)
        changed = 0
        to_log: list[int] = []
        # mutant-site: write-many
        with self._lock.write():
            if self._strict:
                self._check_batch_strict([x if rooms_view else x[0] for x in (*adds, *toggles)])
            for item in discards:
                changed += discard(item)
            if keep is not None:
                for item in list(self._items_locked(rooms_view)):
                    if item not in keep:
                        changed += discard(item)
            for item in adds:
                changed += add(item, to_log)
            for item in toggles:
                changed += discard(item) or add(item, to_log)
        _log_refusals(to_log, self._tombstone_capacity)
        return changed

    def pop_item(self, rooms_view: bool) -> Any:
        """Remove and return some element of one view. Raises: KeyError (empty)."""
        # mutant-site: pop-item-with
        with self._lock.write():
            for item in self._items_locked(rooms_view):
                self._ops(rooms_view)[1](item)
                return item  # before the iteration over _rooms goes on
        name = "prefetched_rooms" if rooms_view else "prefetch_requested"
        raise KeyError(f"pop from an empty {name}")

    def view_snapshot(self, rooms_view: bool) -> frozenset[Any]:
        with self._lock.read():
            return frozenset(self._items_locked(rooms_view))

    def view_len(self, rooms_view: bool) -> int:
        with self._lock.read():
            return self._prefetched_count if rooms_view else self._requested_keys

    # ---------------------------------------------------------------- purge and reopen

    def purge_and_tombstone(self, room: int) -> RoomPurge:
        """Purge the room and tombstone its id in ONE untimed critical section."""
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
        """Lift the tombstone and drop what the id holds in ONE untimed critical section."""
        with self._lock.write_untimed():
            lifted = self._tombstones.pop(room, None) is not None
            result = self._purge_locked(room, None)
            if result.was_open:
                self._purges -= 1  # not a purge of a finished request: counted as a reopen
            if lifted or result.was_open:
                self._reopens += 1
            return result

    def lift(self, room: int) -> bool:
        """Lift the tombstone, dropping nothing (a tombstoned id is never open). Untimed."""
        with self._lock.write_untimed():
            lifted = self._tombstones.pop(room, None) is not None
            if lifted:
                self._reopens += 1
            return lifted

    def compat_stats(self) -> CompatStats:
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
    """``other`` as a frozenset (a view iterates one snapshot), or ``None`` if not
    iterable."""
    if isinstance(other, frozenset):
        return other
    return frozenset(other) if isinstance(other, Iterable) else None


_BUILTIN_SCALARS: Final = frozenset({int, float, complex, bool, str, bytes, type(None)})


def _builtin(value: object) -> bool:
    """``value`` compares and hashes with built-in code only (no user ``__eq__``)."""
    kind = type(value)
    if kind is tuple:
        return all(_builtin(x) for x in value)  # type: ignore[attr-defined]
    return kind in _BUILTIN_SCALARS


def _members(check: Callable[[object, bool], T], values: Iterable[Any]) -> frozenset[Any]:
    """The members ``values`` name, as exact elements; run before the lock (user code).
    A non-element built of built-in types is kept as is (``1.0`` matches room ``1``).

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


def _on_pair(
    op: Callable[[frozenset[Any], frozenset[Any]], R], sets_only: bool = False
) -> Callable[..., R]:
    """A view's binary operator or (``sets_only``) comparison: ``op`` on one snapshot and
    ``other`` frozen; a non-iterable (a comparison: a non-set) gives ``NotImplemented``."""

    def method(self: _SetView[Any], other: object) -> Any:  # R or NotImplemented
        if sets_only and not isinstance(other, AbstractSet):
            return NotImplemented
        mine, theirs = self._pair(other)
        return NotImplemented if theirs is None else op(mine, theirs)

    return method


def _on_snapshot(op: Callable[..., R]) -> Callable[..., R]:
    """A view's named set method: ``op(snapshot, *others)``, the view itself among
    ``others`` read as that snapshot."""

    def method(self: _SetView[Any], *others: Iterable[Any]) -> R:
        mine = self.snapshot()
        return op(mine, *[mine if other is self else other for other in others])

    method.__doc__ = f"``frozenset.{op.__name__}`` on one snapshot. Thread-safe."
    return method


def _in_place(update: Callable[[Any, Any], None]) -> Callable[..., Any]:
    """A view's in-place operator: ``update(view, other)``, then the view itself."""

    def method(self: _SetView[Any], other: AbstractSet[Any]) -> _SetView[Any]:
        update(self, other)
        return self

    method.__doc__ = f":meth:`{update.__name__}`, then the view itself. Raises: as it."
    return method


class _SetView(MutableSet[T], Generic[T]):
    """Shared view behaviour: writes go through the core, whole-set operations read one
    snapshot. Subclasses provide ``__contains__`` (lock-free) and ``_check``."""

    __slots__ = ("_core", "_get")
    _ROOMS: bool = False  # which view of the core

    def __init__(self, core: _CompatCore) -> None:
        self._core = core
        # The context's room dict is never rebound, so its bound .get stays valid.
        self._get: Callable[[Any], _Room | None] = core._rooms.get

    def _check(self, value: object, bools: bool = False) -> T:
        """``value`` as an exact element (``bools``: lookups read bools as 0/1)."""
        raise NotImplementedError

    def _test_and_add(self, item: T) -> bool:
        return self._core.write_many(self._ROOMS, adds=(item,)) > 0

    def _discard(self, item: T) -> bool:
        return self._core.write_many(self._ROOMS, discards=(item,)) > 0

    def __len__(self) -> int:
        """Thread-safe; read lock; O(1)."""
        return self._core.view_len(self._ROOMS)

    def snapshot(self) -> frozenset[T]:
        """Frozen copy under one read lock. Thread-safe; O(n)."""
        return self._core.view_snapshot(self._ROOMS)

    # writes --------------------------------------------------------------------------
    def add(self, value: T) -> None:
        """Add ``value``; a tombstoned room is refused (counted). Thread-safe; atomic.

        Raises: TypeError, ValueError (malformed); RoomPurgedError (strict, tombstoned).
        """
        self._test_and_add(self._check(value))

    def test_and_add(self, value: T) -> bool:
        """Add ``value``; ``True`` only if this call added it. Thread-safe; atomic.

        Raises: as :meth:`add`.
        """
        # mutant-site: test-and-add
        return self._test_and_add(self._check(value))

    def discard(self, value: object) -> None:
        """Remove ``value`` if present (a non-member does nothing). Thread-safe; atomic.

        Raises: TypeError (unhashable, as with a set).
        """
        item = _maybe(self._check, value)
        if item is not None:
            self._discard(item)

    def remove(self, value: object) -> None:
        """Remove ``value``. Thread-safe; atomic (one check-and-remove).

        Raises: KeyError (not there, or cannot be a member); TypeError (unhashable).
        """
        item = _maybe(self._check, value)
        # mutant-site: remove
        if item is None or not self._discard(item):
            raise KeyError(value)

    def pop(self) -> T:
        """Remove (unmark) and return some element. Thread-safe; atomic.

        Raises: KeyError (empty).
        """
        item: T = self._core.pop_item(self._ROOMS)
        return item

    def clear(self) -> None:
        """Remove every element; the other view keeps its own (keys, marks). Thread-safe;
        one critical section; lock-free ``in`` may see it room by room."""
        self._core.write_many(self._ROOMS, keep=frozenset())

    def update(self, *others: Iterable[T]) -> None:
        """Add every element of ``others`` under ONE write lock; tombstoned rooms' elements
        are refused. Thread-safe.

        Raises: as :meth:`add`, before any change.
        """
        # view |= view is a no-op, not a re-add of an older snapshot.
        items = [self._check(x) for other in others if other is not self for x in other]
        # mutant-site: update
        if items:
            self._core.write_many(self._ROOMS, adds=items)

    def difference_update(self, *others: Iterable[Any]) -> None:
        """Remove every element of ``others`` under ONE write lock. Thread-safe.

        Raises: TypeError (an element is unhashable).
        """
        if any(other is self for other in others):  # view -= view: empty, at one instant
            self._core.write_many(self._ROOMS, keep=frozenset())
            return
        maybe = (_maybe(self._check, x, sets=False) for other in others for x in other)
        items = [item for item in maybe if item is not None]
        if items:
            self._core.write_many(self._ROOMS, discards=items)

    def intersection_update(self, *others: Iterable[Any]) -> None:
        """Keep only elements in every one of ``others``, decided under ONE write lock
        (``others`` normalised before it; the view itself constrains nothing). Thread-safe.

        Raises: TypeError (an element is unhashable, or an argument is not iterable).
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
        """Flip each element of ``other`` under ONE write lock. Thread-safe.

        Raises: as :meth:`add`, before any change.
        """
        if other is self:  # view ^= view: empty, at one instant
            self._core.write_many(self._ROOMS, keep=frozenset())
            return
        items = list(dict.fromkeys(self._check(x) for x in other))
        if items:
            self._core.write_many(self._ROOMS, toggles=items)

    __ior__ = _in_place(update)
    __isub__ = _in_place(difference_update)
    __iand__ = _in_place(intersection_update)
    __ixor__ = _in_place(symmetric_difference_update)

    # whole-set reads: one snapshot each -----------------------------------------------
    def __iter__(self) -> Iterator[T]:
        """Over one snapshot. Thread-safe."""
        return iter(self.snapshot())

    def copy(self) -> set[T]:
        """A plain ``set`` of one snapshot. Thread-safe."""
        return set(self.snapshot())

    @classmethod
    def _from_iterable(cls, it: Iterable[S]) -> frozenset[S]:
        return frozenset(it)

    def _pair(self, other: object) -> tuple[frozenset[T], frozenset[Any] | None]:
        """One snapshot and ``other`` frozen (``None``: not iterable); self: one snapshot."""
        # mutant-site: pair
        if other is self:
            mine = self.snapshot()
            return mine, mine
        theirs = _frozen(other)
        return (frozenset() if theirs is None else self.snapshot()), theirs

    __hash__ = None  # type: ignore[assignment]  # mutable, like set
    __eq__ = _on_pair(operator.eq, sets_only=True)
    __le__ = _on_pair(operator.le, sets_only=True)
    __lt__ = _on_pair(operator.lt, sets_only=True)
    __ge__ = _on_pair(operator.ge, sets_only=True)
    __gt__ = _on_pair(operator.gt, sets_only=True)
    __and__ = __rand__ = _on_pair(operator.and_)
    __or__ = __ror__ = _on_pair(operator.or_)
    __sub__ = _on_pair(operator.sub)
    __rsub__ = _on_pair(lambda mine, theirs: theirs - mine)
    __xor__ = __rxor__ = _on_pair(operator.xor)
    isdisjoint = _on_snapshot(frozenset.isdisjoint)
    issubset = _on_snapshot(frozenset.issubset)
    issuperset = _on_snapshot(frozenset.issuperset)
    union = _on_snapshot(frozenset.union)
    intersection = _on_snapshot(frozenset.intersection)
    difference = _on_snapshot(frozenset.difference)
    symmetric_difference = _on_snapshot(frozenset.symmetric_difference)

    def __repr__(self) -> str:
        items = sorted(self.snapshot(), key=repr)
        shown = ", ".join(repr(x) for x in items[:8]) + (", ..." if len(items) > 8 else "")
        return f"<{type(self).__name__} of {len(items)}: {{{shown}}}>"


class PrefetchedRoomsView(_SetView[int]):
    """``ctx.prefetched_rooms``: the rooms marked prefetched, as a live set. Thread-safe;
    ``room in view`` is lock-free and linearizable."""

    __slots__ = ()
    _ROOMS = True

    def __contains__(self, room: object) -> bool:
        """O(1), no lock; linearizable (as ``StagingContext.is_prefetched``)."""
        state = self._get(room)
        return state is not None and state.prefetched

    def _check(self, value: object, bools: bool = False) -> int:
        """A room id (lenient). Raises: TypeError, ValueError."""
        return check_id(value, "room", bools=bools)


class PrefetchRequestedView(_SetView[PrefetchKey]):
    """``ctx.prefetch_requested``: every ``(room, chunk_idx, session_id)`` key, as a live
    set. Thread-safe; ``key in view`` is lock-free and linearizable."""

    __slots__ = ()

    def __contains__(self, key: object) -> bool:
        """O(1), no lock; linearizable (as ``StagingContext.is_requested``). A non-key is
        not a member."""
        if not isinstance(key, tuple) or len(key) != 3:
            return False
        room, chunk_idx, session_id = tuple(key)
        state = self._get(room)
        return state is not None and (chunk_idx, session_id) in state.requests

    def _check(self, value: object, bools: bool = False) -> PrefetchKey:
        """A ``(room, chunk_idx, session_id)`` key (lenient). Raises: TypeError, ValueError."""
        if not isinstance(value, tuple) or len(value) != 3:
            raise TypeError(
                f"prefetch_requested holds (room, chunk_idx, session_id) tuples, got {value!r}"
            )
        room, chunk_idx, session_id = tuple(value)
        return (
            check_id(room, "room", bools=bools),
            check_id(chunk_idx, "chunk_idx", bools=bools),
            check_session_id(session_id),
        )


class CompatStagingContext(FixedViews):
    """Staging prefetch state shaped like the upstream two sets, safe to share between
    threads; the views are guarded by the core's lock (module docstring).

    Args:
        lock: ``"mutex"`` (default; the rule under the GIL) or ``"rw"``.
        lock_timeout: seconds before :class:`~staging.errors.LockTimeoutError`;
            ``None``/``inf`` wait forever; purges never time out.
        tombstones: how many purged room ids to remember; ``0`` turns tombstones off.
        strict: an ``add`` to a tombstoned room raises
            :class:`~staging.errors.RoomPurgedError` instead of being refused silently.
        debug: lock debug mode (``None`` reads env ``NIXL_STAGING_DEBUG_LOCKS``).

    Rebinding either view raises :class:`TypeError` (call :meth:`purge_room`); ``|=`` etc.
    work in place. A dataclass subclass calls ``CompatStagingContext.__init__(self, ...)``
    from its ``__post_init__`` (docs/ADOPTING.md).

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
        tombstones = check_id(tombstones, "tombstones")
        core = _CompatCore(
            lock=lock, lock_timeout=lock_timeout, debug=debug, strict=strict, tombstones=tombstones
        )
        self._core: Final = core
        # Not Final: `ctx.prefetch_requested |= keys` must type-check.
        self.prefetched_rooms: PrefetchedRoomsView = PrefetchedRoomsView(core)
        self.prefetch_requested: PrefetchRequestedView = PrefetchRequestedView(core)

    # ------------------------------------------------------------------ operations

    def purge_room(self, room: int) -> RoomPurge:
        """Remove ``room`` from both views at one instant and tombstone its id; idempotent.
        Thread-safe; atomic; never times out; O(keys of the room).

        Raises: TypeError, ValueError (``room`` not an integer in ``[0, 2**63)``).
        """
        return self._core.purge_and_tombstone(check_room_id(room))

    def reopen_room(self, room: int) -> RoomPurge:
        """A new request reuses ``room``: lift its tombstone and drop what the id holds, at
        one instant; returns what was dropped. Call it where the request is admitted.
        Thread-safe; atomic; never times out.

        Raises: as :meth:`purge_room`.
        """
        # mutant-site: reopen-room
        return self._core.reopen(check_room_id(room))

    def lift_tombstone(self, room: int) -> bool:
        """Lift ``room``'s tombstone, if any, dropping nothing (for engines that cannot tell
        a reused id from a live duplicate); returns whether one was lifted. Thread-safe;
        atomic; never times out.

        Raises: as :meth:`purge_room`.
        """
        return self._core.lift(check_room_id(room))

    def purge_session(self, session_id: str) -> frozenset[int]:
        """Drop a dead decode peer's keys from every room; return the rooms that had any
        (no tombstone). Thread-safe; atomic; never times out.

        Raises: TypeError, ValueError (``session_id`` not a non-empty ``str``).
        """
        return self._core.purge_session(session_id)

    def snapshot(self) -> StagingSnapshot:
        """Both views and the open rooms under one read lock. Thread-safe.

        Raises: LockTimeoutError (not acquired within ``lock_timeout``).
        """
        return self._core.snapshot()

    def stats(self) -> CompatStats:
        """Counters under one read lock. Thread-safe.

        Raises: LockTimeoutError (not acquired within ``lock_timeout``).
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
