"""nixl-staging's staging layer: prefetch state behind one explicit lock.

See ``docs/THREADING.md`` for the thread-safety contract and ``docs/ADOPTING.md`` for
moving an engine's two bare sets onto it (:class:`CompatStagingContext` first, then
:class:`StagingContext` with handles).
"""

from staging._version import __version__
from staging.compat import CompatStagingContext, CompatStats
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
    RoomNotOpenError,
    RoomPurgedError,
    StagingError,
)
from staging.locks import LockLevel, LockStats, MutexLock, RWLock, StagingLock, make_lock

__all__ = [
    "__version__", "CompatStagingContext", "CompatStats", "LockError", "LockLevel",
    "LockNotHeldError", "LockOrderError", "LockReentryError", "LockStats", "LockTimeoutError",
    "MutexLock", "PrefetchKey", "RWLock", "RoomAlreadyOpenError", "RoomHandle", "RoomKey",
    "RoomNotOpenError", "RoomPurge", "RoomPurgedError", "StagingContext", "StagingError",
    "StagingLock", "StagingSnapshot", "StagingStats", "make_lock"
]
