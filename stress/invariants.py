"""The invariant vocabulary shared by every stress scenario.

A scenario declares which of these names it checks; the report lists each declared name with
its violation count (0 means it held). Use these constants rather than string literals so
that the staging scenario and the sender scenarios report under the same names.
"""

from __future__ import annotations

NO_ESCAPED_EXCEPTION = "no-escaped-exception"
"""No exception escaped a worker (``threading.excepthook`` capture + worker-loop catch)."""

NO_RESURRECTION = "no-resurrection"
"""No write with a stale handle, or to a closed room, was accepted; a purge returned only the
keys of the generation it closed."""

NO_LEAK = "no-leak"
"""After the final purge of every room nothing is left: no open room, key, prefetched room,
staging slot or transfer handle."""

COUNTERS_CONSISTENT = "counters-consistent"
"""Counters agree with the collections they count, taken at a quiescent point."""

NO_DEADLOCK = "no-deadlock"
"""Progress never stalled for the watchdog period (stacks are dumped to stderr if it did)."""

NO_THREAD_LEFT = "no-thread-left"
"""Every thread a scenario started was joined within a bound and is dead at exit."""

LOCK_ORDER = "lock-order"
"""No ``LockOrderError`` / ``LockReentryError`` was raised (debug locks are on)."""

LINEARIZABLE = "linearizable"
"""Recorded per-room histories are linearizable against the sequential model."""

DECODE_PAGE_AUDIT = "decode-page-audit"
"""At the end (after every transfer drained), every decode page holds the bytes of the last
room verified on it, or of a room given that page after it (which may have failed part-way);
the bytes of an earlier room landing on a page a later room was verified on (a cross-room
overwrite) are a violation. Pages never verified are not judged."""

FAILURE_CONTRACT = "failure-contract"
"""``failure_exception()`` raised the room's stored exception object, a ``KVTransferError`` or
a transport error, nothing else; a room refused for too few destination pages failed cleanly
(never succeeded, never got as far as a transfer)."""

DECODE_TOLD = "decode-told"
"""Every room that failed or was cleared before ``Success`` on the prefill side is known as
failed (with the same outcome) at each of its decode peers by the end of the phase, through a
room notice (``sender.notices``), unless that peer had a fault (killed, stopped, restarted,
removed from the transport, cut off) while the room lived or shortly after its purge; and no
room that succeeded is told failed. Latencies (purge -> learnt) are reported."""

DESCRIPTIONS: dict[str, str] = {
    NO_ESCAPED_EXCEPTION: "no exception escaped a worker thread",
    NO_RESURRECTION: "no stale/closed-room write accepted; purges return one generation",
    NO_LEAK: "nothing left after the final purge of every room",
    COUNTERS_CONSISTENT: "counters match the collections at quiescent points",
    NO_DEADLOCK: "progress never stalled for the watchdog period",
    NO_THREAD_LEFT: "all worker threads joined and dead at exit",
    LOCK_ORDER: "no LockOrderError / LockReentryError",
    LINEARIZABLE: "recorded histories are linearizable",
    DECODE_PAGE_AUDIT: "every decode page holds the last verified room's bytes (or a later room's)",
    FAILURE_CONTRACT: "failure_exception raised only the stored error, a KVTransferError or a "
    "transport error",
    DECODE_TOLD: "every room failed/cleared before Success is known as failed at its live decode "
    "peer; no Success room told failed",
}
"""One-line description per invariant name, used by the report."""

LOCK_ERROR_NAMES = frozenset({"LockOrderError", "LockReentryError"})
"""Exception class names counted under :data:`LOCK_ORDER` (besides no-escaped-exception)."""

DEADLOCK_ERROR_NAMES = frozenset({"LockTimeoutError"})
"""Exception class names that also count as a stall under :data:`NO_DEADLOCK`."""


def describe(name: str, text: str) -> str:
    """Give a scenario-specific invariant name its one-line report description; returns
    ``name`` (``ROOMS_CONCLUDED = describe("rooms-concluded", "every room concluded")``)."""
    DESCRIPTIONS[name] = text
    return name
