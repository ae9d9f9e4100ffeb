"""nixl-staging's staging layer: prefetch state behind one explicit lock.

See ``docs/THREADING.md`` for the thread-safety contract.
"""

from staging.context import (
    PrefetchKey,
    RoomHandle,
    RoomKey,
    RoomPurge,
    StagingContext,
    StagingSnapshot,
    StagingStats,
)
from staging.errors import (
    LockError,
    LockNotHeldError,
    LockOrderError,
    LockReentryError,
    LockTimeoutError,
    RoomAlreadyOpenError,
    StagingError,
)
from staging.locks import LockLevel, LockStats, MutexLock, RWLock, StagingLock, make_lock

__all__ = [
    "LockError",
    "LockLevel",
    "LockNotHeldError",
    "LockOrderError",
    "LockReentryError",
    "LockStats",
    "LockTimeoutError",
    "MutexLock",
    "PrefetchKey",
    "RWLock",
    "RoomAlreadyOpenError",
    "RoomHandle",
    "RoomKey",
    "RoomPurge",
    "StagingContext",
    "StagingError",
    "StagingLock",
    "StagingSnapshot",
    "StagingStats",
    "make_lock",
]
