"""``DecodeCompatContext``: the decode side's two per-room dicts, under one lock.

SGLang's decode staging state is two plain dicts keyed by bootstrap room id,
``room_bootstrap`` (room -> the prefill peers' bootstrap infos) and ``room_receivers``
(room -> the request's receiver). The decode scheduler writes both (one ``d[room] = v``
each) and pops both (one ``d.pop(room, None)`` each); the decode thread that receives the
prefill side's staging requests reads them (``d.get(room)``). This module keeps that shape:

* ``ctx.room_bootstrap`` and ``ctx.room_receivers`` are live
  :class:`collections.abc.MutableMapping` views on **one** lock. Every single operation
  (``get``, ``pop``, ``setdefault``, ``d[k] = v``, ``del d[k]``, ``in``, ``len``, ``update``,
  ``clear``, ``popitem``) is one critical section; iteration, ``keys()``, ``values()``,
  ``items()``, ``copy()`` and ``==`` work on one snapshot taken under the lock, so
  "dictionary changed size during iteration" cannot happen.
* The compound operations a per-room pair needs, each one critical section over *both*
  dicts: :meth:`DecodeCompatContext.register_room` (both entries at one instant),
  :meth:`DecodeCompatContext.room_entry` (both values at one instant) and
  :meth:`DecodeCompatContext.purge_room` (both entries removed at one instant: a reader
  sees both or neither).
* Rebinding or deleting either attribute raises :class:`TypeError` (the view is the state;
  a rebound dict would split it).
* Keys are whatever the engine uses (SGLang: ``int`` room ids); an unhashable key raises
  ``TypeError`` as with a dict, *before* the lock is taken. Hashing of the key runs under
  the lock: keys must be plain values (``int``, ``str``, tuples of them) whose ``__hash__``
  and ``__eq__`` do not call back into the context.
* Nothing is called out while the lock is held: a value a write replaces or removes is
  released after the lock is (so that a finaliser that touches the context cannot
  deadlock).

Only the standard library is used (no torch, numpy or nixl). Thread-safety contract: each
method's docstring.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterator, Mapping, MutableMapping
from typing import Any, ClassVar, Final

from staging._views import FixedViews

__all__ = ["DecodeCompatContext", "LockedDictView", "RoomEntry"]

_MISSING: Final = object()

RoomEntry = tuple[Any, Any]
"""``(bootstrap_infos, receiver)`` of one room; ``None`` for an absent entry."""


def _hashable(key: object) -> Hashable:
    """``key`` if it can be a dict key. Runs before the lock is taken.

    Raises:
        TypeError: ``key`` is unhashable.
    """
    hash(key)
    return key


class LockedDictView(MutableMapping[Any, Any]):
    """One of the context's dicts, every operation under the context's lock.

    Thread-safety: every method is thread-safe; each is one critical section (the ones
    that return many entries return a snapshot). Not reentrant: nothing is called out
    under the lock.
    """

    __slots__ = ("_data", "_lock", "_name")

    def __init__(self, name: str, lock: threading.Lock, data: dict[Any, Any]) -> None:
        self._name: Final = name
        self._lock: Final = lock
        self._data: Final = data  # guarded by `_lock`

    # ------------------------------------------------------------------ single operations

    def __getitem__(self, key: object) -> Any:
        """Raises: KeyError: absent; TypeError: unhashable key."""
        k = _hashable(key)
        with self._lock:
            value = self._data.get(k, _MISSING)
        if value is _MISSING:
            raise KeyError(key)
        return value

    def get(self, key: object, default: Any = None) -> Any:
        """The value, or ``default``. Raises: TypeError: unhashable key."""
        k = _hashable(key)
        with self._lock:
            return self._data.get(k, default)

    def __contains__(self, key: object) -> bool:
        """Raises: TypeError: unhashable key."""
        k = _hashable(key)
        with self._lock:
            return k in self._data

    def __setitem__(self, key: object, value: Any) -> None:
        """Raises: TypeError: unhashable key."""
        k = _hashable(key)
        with self._lock:
            old = self._data.get(k)
            self._data[k] = value
        del old  # released after the lock

    def __delitem__(self, key: object) -> None:
        """Raises: KeyError: absent; TypeError: unhashable key."""
        k = _hashable(key)
        with self._lock:
            old = self._data.pop(k, _MISSING)
        if old is _MISSING:
            raise KeyError(key)

    def pop(self, key: object, default: Any = _MISSING) -> Any:
        """Remove and return the value; ``default`` if absent and given.

        Raises:
            KeyError: absent and no ``default``.
            TypeError: unhashable key.
        """
        k = _hashable(key)
        with self._lock:
            value = self._data.pop(k, _MISSING)
        if value is _MISSING:
            if default is _MISSING:
                raise KeyError(key)
            return default
        return value

    def setdefault(self, key: object, default: Any = None) -> Any:
        """The value, inserting ``default`` first if absent (one critical section).

        Raises: TypeError: unhashable key.
        """
        k = _hashable(key)
        with self._lock:
            return self._data.setdefault(k, default)

    def popitem(self) -> tuple[Any, Any]:
        """Remove and return the last inserted entry. Raises: KeyError: empty."""
        with self._lock:
            if not self._data:
                raise KeyError(f"{self._name} is empty")
            return self._data.popitem()

    def clear(self) -> None:
        """Remove every entry (one critical section; values released after it)."""
        with self._lock:
            old = dict(self._data)
            self._data.clear()
        del old

    def update(self, other: Any = (), /, **kwargs: Any) -> None:
        """Insert many entries in one critical section (the input is read first).

        Raises: TypeError: an unhashable key, or ``other`` is not a mapping or pairs.
        """
        items = list(other.items() if isinstance(other, Mapping) else other)
        items.extend(kwargs.items())
        pairs = [(_hashable(k), v) for k, v in items]
        with self._lock:
            old = [self._data.get(k) for k, _ in pairs]
            self._data.update(pairs)
        del old

    def __len__(self) -> int:
        with self._lock:
            return len(self._data)

    # ------------------------------------------------------------------ snapshots

    def snapshot(self) -> dict[Any, Any]:
        """A copy of the dict, taken in one critical section."""
        with self._lock:
            return dict(self._data)

    def copy(self) -> dict[Any, Any]:
        """As :meth:`snapshot` (a plain ``dict``)."""
        return self.snapshot()

    def __iter__(self) -> Iterator[Any]:
        """Over a snapshot of the keys: never "changed size during iteration"."""
        with self._lock:
            keys = list(self._data)
        return iter(keys)

    def keys(self) -> list[Any]:  # type: ignore[override]
        """A snapshot of the keys."""
        with self._lock:
            return list(self._data)

    def values(self) -> list[Any]:  # type: ignore[override]
        """A snapshot of the values."""
        with self._lock:
            return list(self._data.values())

    def items(self) -> list[tuple[Any, Any]]:  # type: ignore[override]
        """A snapshot of the entries (consistent: one critical section)."""
        with self._lock:
            return list(self._data.items())

    def __eq__(self, other: object) -> bool:
        mine = self.snapshot()
        if isinstance(other, LockedDictView):
            return other is self or mine == other.snapshot()
        if isinstance(other, Mapping):
            return mine == dict(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"<{self._name} (locked view) {self.snapshot()!r}>"


class DecodeCompatContext(FixedViews):
    """The decode staging context: ``room_bootstrap`` and ``room_receivers`` as live views
    on one lock, plus the per-room compound operations (module docstring).

    A subclass may be a dataclass (an engine's own decode staging dataclass with the two
    dict fields dropped): its ``__post_init__`` must call
    ``DecodeCompatContext.__init__(self)``; until then the views do not exist. Other
    attributes (SGLang's ``allocator``) are plain attributes.

    Rebinding or deleting ``room_bootstrap``/``room_receivers`` raises :class:`TypeError`.

    Thread-safety: every method is thread-safe; the lock is a plain ``threading.Lock``
    (made when the context is, so a deterministic scheduler that patches the lock factory
    sees it). Not reentrant.

    Raises:
        nothing (no arguments).
    """

    VIEW_NAMES: ClassVar[frozenset[str]] = frozenset({"room_bootstrap", "room_receivers"})
    REBIND_HINT: ClassVar[str] = (
        "drop a room from both dicts with ctx.purge_room(room), add one with "
        "ctx.register_room(room, bootstrap_infos, receiver)"
    )


    def __init__(self) -> None:
        lock = threading.Lock()
        self._lock: Final = lock
        # Both dicts are guarded by `_lock` (one lock: the pair changes at one instant).
        self._bootstrap: Final[dict[Any, Any]] = {}
        self._receivers: Final[dict[Any, Any]] = {}
        self.room_bootstrap: LockedDictView = LockedDictView(
            "room_bootstrap", lock, self._bootstrap
        )
        self.room_receivers: LockedDictView = LockedDictView(
            "room_receivers", lock, self._receivers
        )


    # ------------------------------------------------------------------ per-room pairs

    def register_room(self, room: object, bootstrap_infos: Any, receiver: Any) -> None:
        """Set both entries of ``room`` at one instant (replacing any). Thread-safe; one
        critical section.

        Raises:
            TypeError: ``room`` is unhashable.
        """
        k = _hashable(room)
        with self._lock:
            old = (self._bootstrap.get(k), self._receivers.get(k))
            self._bootstrap[k] = bootstrap_infos
            self._receivers[k] = receiver
        del old

    def room_entry(self, room: object) -> RoomEntry:
        """``(bootstrap_infos, receiver)`` of ``room`` read at one instant (``None`` for an
        absent entry). Thread-safe; one critical section.

        Raises:
            TypeError: ``room`` is unhashable.
        """
        k = _hashable(room)
        # mutant-site: room-entry
        with self._lock:
            return self._bootstrap.get(k), self._receivers.get(k)

    def purge_room(self, room: object) -> RoomEntry:
        """Remove ``room`` from both dicts at one instant and return what it held
        (``(None, None)`` if nothing; idempotent). A concurrent :meth:`room_entry` sees both
        entries or neither. Thread-safe; one critical section; O(1).

        Raises:
            TypeError: ``room`` is unhashable.
        """
        k = _hashable(room)
        # mutant-site: purge-room
        with self._lock:
            bootstrap = self._bootstrap.pop(k, None)
            receiver = self._receivers.pop(k, None)
        return bootstrap, receiver

    def rooms(self) -> tuple[frozenset[Any], frozenset[Any]]:
        """The rooms of ``room_bootstrap`` and of ``room_receivers``, one snapshot of both.
        Thread-safe."""
        with self._lock:
            return frozenset(self._bootstrap), frozenset(self._receivers)

    @property
    def lock(self) -> threading.Lock:
        """The context's lock (for tests: ``ctx.lock.locked()``)."""
        return self._lock

    def __repr__(self) -> str:
        boot, recv = self.rooms()
        return f"<DecodeCompatContext bootstrap={len(boot)} receivers={len(recv)}>"
