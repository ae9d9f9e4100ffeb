"""Exceptions raised by the staging layer: every deliberate error is a
:class:`StagingError`; bad arguments raise ``TypeError``/``ValueError`` before any change.
"""

from __future__ import annotations


class StagingError(Exception):
    """Base class of every deliberate staging-layer error."""


class RoomAlreadyOpenError(StagingError):
    """``open_room`` was called for a room id that is open (not yet purged)."""

    def __init__(self, room: int) -> None:
        super().__init__(f"room {room} is already open; purge it before reopening")
        self.room = room


class LockError(StagingError):
    """Base class of the lock-model errors."""


class LockTimeoutError(LockError):
    """A lock was not acquired within its ``timeout``."""

    def __init__(self, lock_name: str, mode: str, timeout: float) -> None:
        super().__init__(
            f"could not acquire {lock_name!r} for {mode} within {timeout:g} s "
            "(held too long elsewhere, or a deadlock)"
        )
        self.lock_name = lock_name
        self.mode = mode
        self.timeout = timeout


class LockReentryError(LockError):
    """Debug mode: a thread tried to acquire a non-reentrant lock it already holds."""

    def __init__(self, lock_name: str, held_mode: str, mode: str) -> None:
        super().__init__(
            f"thread already holds {lock_name!r} for {held_mode} and asked for {mode}: "
            "the lock is not reentrant, this would deadlock"
        )
        self.lock_name = lock_name
        self.held_mode = held_mode
        self.mode = mode


class LockOrderError(LockError):
    """Debug mode: a lock was acquired against the lock hierarchy (even without deadlock)."""

    def __init__(self, held: str, held_level: int, wanted: str, wanted_level: int) -> None:
        super().__init__(
            f"lock order inverted: holding {held!r} (level {held_level}) while acquiring "
            f"{wanted!r} (level {wanted_level}); locks must be taken in increasing level"
        )
        self.held = held
        self.held_level = held_level
        self.wanted = wanted
        self.wanted_level = wanted_level


class LockNotHeldError(LockError):
    """``assert_held`` found that the calling thread does not hold the lock as required."""


class RoomNotOpenError(StagingError):
    """Strict mode: a write named a room that is not open (otherwise it is refused and
    counted in ``stats().refused_late_writes``)."""

    def __init__(self, room: int, generation: int | None = None, detail: str = "") -> None:
        what = f"room {room}" if generation is None else f"room {room} (generation {generation})"
        super().__init__(
            f"{what} is not open{detail or ' (never opened, or already purged)'}: "
            "the write was refused (strict mode)"
        )
        self.room = room
        self.generation = generation


class RoomPurgedError(RoomNotOpenError):
    """Strict mode: a late write to a room known to be purged (stale handle or tombstone)."""
