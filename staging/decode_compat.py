"""``DecodeCompatContext``: SGLang's decode-side ``room_bootstrap`` and ``room_receivers``
dicts as live :class:`collections.abc.MutableMapping` views on ONE plain lock.

Each view operation is one critical section; iteration, ``keys()``, ``items()`` and ``==``
use one snapshot. ``register_room``, ``room_entry`` and ``purge_room`` cover both dicts at
one instant. Keys are hashed under the lock, so they must be plain values; nothing is
called out under it (a replaced value is released after it). Standard library only.
See docs/THREADING.md, '``DecodeCompatContext``'.
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
    """``key``, checked hashable before the lock. Raises: TypeError."""
    hash(key)
    return key


class LockedDictView(MutableMapping[Any, Any]):
    """One of the context's dicts; ``_data`` is guarded by the shared ``_lock``.

    Thread-safe: each method is one critical section (many-entry reads return a snapshot).
    """

    __slots__ = ("_data", "_lock", "_name")

    def __init__(self, name: str, lock: threading.Lock, data: dict[Any, Any]) -> None:
        self._name: Final = name
        self._lock: Final = lock
        self._data: Final = data  # guarded by `_lock`

    def __getitem__(self, key: object) -> Any:
        """One critical section, as the ``Mapping`` mixins ``get`` and ``in`` built on it.

        Raises: KeyError: absent; TypeError: unhashable key.
        """
        k = _hashable(key)
        with self._lock:
            return self._data[k]

    def __setitem__(self, key: object, value: Any) -> None:
        """Raises: TypeError: unhashable key."""
        k = _hashable(key)
        with self._lock:
            old = self._data.get(k)
            self._data[k] = value
        del old  # released after the lock

    def __delitem__(self, key: object) -> None:
        """Raises: KeyError: absent; TypeError: unhashable key."""
        self.pop(key)  # the value is released after the lock

    def pop(self, key: object, default: Any = _MISSING) -> Any:
        """Remove and return the value; ``default`` if absent and given.

        Raises: KeyError: absent and no ``default``; TypeError: unhashable key.
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
        """The value, inserting ``default`` first if absent. Raises: TypeError: unhashable key."""
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
        """Remove every entry (values released after the lock). Never raises."""
        with self._lock:
            old = dict(self._data)
            self._data.clear()
        del old

    def update(self, other: Any = (), /, **kwargs: Any) -> None:
        """Insert many entries in one critical section (input read first).

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

    def snapshot(self) -> dict[Any, Any]:
        """A copy of the dict, taken in one critical section. Never raises."""
        with self._lock:
            return dict(self._data)

    copy = snapshot  # a plain ``dict``, as dict.copy

    def __iter__(self) -> Iterator[Any]:
        """Over a snapshot of the keys."""
        return iter(self.keys())

    def keys(self) -> list[Any]:  # type: ignore[override]
        """A snapshot of the keys. Never raises."""
        with self._lock:
            return list(self._data)

    def values(self) -> list[Any]:  # type: ignore[override]
        """A snapshot of the values. Never raises."""
        with self._lock:
            return list(self._data.values())

    def items(self) -> list[tuple[Any, Any]]:  # type: ignore[override]
        """A snapshot of the entries. Never raises."""
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
    """``room_bootstrap`` and ``room_receivers`` as live views on one lock (``_lock``
    guards both dicts), plus the per-room compound operations. Rebinding or deleting a view
    raises :class:`TypeError`. A dataclass subclass calls
    ``DecodeCompatContext.__init__(self)`` from its ``__post_init__``.

    Thread-safety: every method is thread-safe; the lock is a plain, non-reentrant
    ``threading.Lock`` made in ``__init__`` (so a patched lock factory sees it).

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
        """Set both entries of ``room`` at one instant (replacing any). Thread-safe.

        Raises: TypeError: ``room`` is unhashable.
        """
        k = _hashable(room)
        with self._lock:
            old = (self._bootstrap.get(k), self._receivers.get(k))
            self._bootstrap[k] = bootstrap_infos
            self._receivers[k] = receiver
        del old

    def room_entry(self, room: object) -> RoomEntry:
        """``(bootstrap_infos, receiver)`` of ``room`` at one instant (``None``: absent).
        Thread-safe.

        Raises: TypeError: ``room`` is unhashable.
        """
        k = _hashable(room)
        # mutant-site: room-entry
        with self._lock:
            return self._bootstrap.get(k), self._receivers.get(k)

    def purge_room(self, room: object) -> RoomEntry:
        """Remove ``room`` from both dicts at one instant; return what it held (``(None,
        None)`` if nothing). Thread-safe; O(1).

        Raises: TypeError: ``room`` is unhashable.
        """
        k = _hashable(room)
        # mutant-site: purge-room
        with self._lock:
            bootstrap = self._bootstrap.pop(k, None)
            receiver = self._receivers.pop(k, None)
        return bootstrap, receiver

    def rooms(self) -> tuple[frozenset[Any], frozenset[Any]]:
        """The rooms of both dicts, one snapshot. Thread-safe; never raises."""
        with self._lock:
            return frozenset(self._bootstrap), frozenset(self._receivers)

    @property
    def lock(self) -> threading.Lock:
        """The context's lock (for tests: ``ctx.lock.locked()``)."""
        return self._lock

    def __repr__(self) -> str:
        boot, recv = self.rooms()
        return f"<DecodeCompatContext bootstrap={len(boot)} receivers={len(recv)}>"
