"""Exceptions of the KV sender and the classification of NIXL's exceptions.

* Transport errors ("this peer or transfer is gone": fail the room, carry on):
  :data:`TRANSPORT_ERRORS` (NIXL's classes and ours), :func:`classify`.
* Programming errors (bad indices, NIXL's ``nixlInvalidParamError`` and friends):
  :class:`TransportParamError`, a ``ValueError``; never in :data:`TRANSPORT_ERRORS`.

NIXL's exceptions subclass ``Exception`` directly; their message is the status name
(e.g. ``"NIXL_ERR_REMOTE_DISCONNECT"``).
"""

from __future__ import annotations

from functools import partial
from typing import Any

from sender import _nixl

__all__ = [
    "AgentSetupError", "ConcurrentSenderUseError", "KVTransferError", "PARAM_ERRORS",
    "PeerNotFoundError", "RegionRetiredError", "RoomNotFailedError", "TRANSPORT_ERRORS",
    "TransferFailedError", "TransferReleasedError", "TransferTimeoutError", "TransportClosedError",
    "TransportError", "TransportParamError", "as_param_error", "classify", "status_name",
]


class TransportError(Exception):
    """Base class of the transport's own errors (see the subclasses)."""


class TransferTimeoutError(TransportError):
    """A transfer was still in progress when its deadline passed (NIXL never detects a hung
    peer). The handle is still live: data may land until the peer is removed.

    Attributes:
        session_id: The session the transfer was addressed to.
        timeout_s: The deadline the transfer was given, in seconds from its start.
    """

    def __init__(self, session_id: str, timeout_s: float) -> None:
        super().__init__(f"transfer to session {session_id!r} not done within {timeout_s:g} s")
        self.session_id = session_id
        self.timeout_s = timeout_s


class TransferFailedError(TransportError):
    """NIXL reported a failed transfer as a status (``"ERR"``) instead of an exception."""


class TransportClosedError(TransportError):
    """The transport was closed; nothing can be started on it any more. In
    :data:`TRANSPORT_ERRORS`: a worker racing with shutdown sees its transfer gone."""


# mutant-site: module
class PeerNotFoundError(TransportError):
    """No peer with this session id is known to the transport (never added, or removed after
    a failure): a transport error, as NIXL's ``nixlNotFoundError``, not a ``KeyError``.

    Attributes:
        session_id: The unknown session id.
    """

    def __init__(self, session_id: str) -> None:
        super().__init__(f"unknown session {session_id!r} (never added, or removed)")
        self.session_id = session_id


class RegionRetiredError(TransportError):
    """The transfer's source region was deregistered while NIXL still had the write in
    progress; NIXL may read it until it settles, so the write is kept, not released.

    Attributes:
        region: The region's name.
    """

    def __init__(self, region: str) -> None:
        super().__init__(f"source region {region!r} was deregistered during the write")
        self.region = region


class TransferReleasedError(TransportError):
    """``poll()``/``wait()`` on a released transfer (NIXL would answer a bogus ``"DONE"``).
    A caller bug: *not* in :data:`TRANSPORT_ERRORS`."""


class AgentSetupError(TransportError, RuntimeError):
    """NIXL could not create a :class:`~sender.transport.NixlTransport`'s agent or UCX
    backend. The message names each attempt's status, interface changes and the UCX
    environment. Not in :data:`TRANSPORT_ERRORS`: no peer is involved.

    Attributes:
        attempts: One line per failed attempt, in order.
        interfaces_changed: True when some attempt saw a network interface appear or vanish.
    """

    def __init__(
        self, message: str, attempts: tuple[str, ...] = (), interfaces_changed: bool = False
    ) -> None:
        super().__init__(message)
        self.attempts = attempts
        self.interfaces_changed = interfaces_changed


class TransportParamError(ValueError):
    """A programming error: bad page indices, mismatched lengths, bad metadata, or a NIXL
    parameter error (``nixlInvalidParamError`` and the other non-transport statuses).

    Attributes:
        status: NIXL status name (e.g. ``"NIXL_ERR_INVALID_PARAM"``) or ``None``.
    """

    def __init__(self, message: str, status: str | None = None) -> None:
        super().__init__(f"{message} [{status}]" if status else message)
        self.status = status


class KVTransferError(RuntimeError):
    """A KV transfer of one room failed (raised by the sender to its caller).

    Attributes:
        room: The room (request) id.
        reason: Human-readable cause.
        is_from_another_rank: True when the failure was reported by another rank of the same
            request rather than observed locally.
        generation: The opening (``RoomHandle.generation``), when known.
        session_id: The decode session the failure concerns, when one does.
        chunk_idx: The chunk the failure concerns, when one does.
    """

    def __init__(
        self, room: int, reason: str, is_from_another_rank: bool = False, *,
        generation: int | None = None, session_id: str | None = None, chunk_idx: int | None = None,
    ) -> None:
        where = [] if generation is None else [f"generation {generation}"]
        where += [] if session_id is None else [f"session {session_id!r}"]
        where += [] if chunk_idx is None else [f"chunk {chunk_idx}"]
        context = f" ({', '.join(where)})" if where else ""
        super().__init__(f"{self._headline} for room {room}{context}: {reason}")
        self.room = room
        self.reason = reason
        self.is_from_another_rank = is_from_another_rank
        self.generation = generation
        self.session_id = session_id
        self.chunk_idx = chunk_idx

    _headline = "KV transfer failed"
    _pickled: tuple[tuple[str, ...], tuple[str, ...]] = (
        ("room", "reason", "is_from_another_rank"),
        ("generation", "session_id", "chunk_idx"),
    )
    """The attributes pickling passes back to the constructor: (positional, keyword)."""

    def __reduce__(self) -> tuple[Any, ...]:
        args, kwargs = self._pickled
        rebuild = partial(type(self), **{k: getattr(self, k) for k in kwargs})
        return rebuild, tuple(getattr(self, a) for a in args)


class RoomNotFailedError(KVTransferError):
    """``failure_exception()`` on a room that did not fail (it succeeded, or was cleared
    first). A :class:`KVTransferError` whose message does not say a transfer failed."""

    _headline = "no KV transfer failure to report"


class ConcurrentSenderUseError(KVTransferError):
    """Two threads were inside one ``NixlKVSender``'s scheduler-thread methods at once; seen
    in debug mode only (docs/THREADING.md, "Two threads on one sender"). A caller bug, and a
    :class:`KVTransferError` so that ``failure_exception()``'s handlers handle it too.

    Attributes:
        method: The method the second thread called (it noticed the overlap).
        thread: That thread's name and id.
        other_method: The method the first thread was inside.
        other_thread: The first thread's name and id.
    """

    _headline = "NixlKVSender used from two threads at once"
    _pickled = ("room", "method", "thread", "other_method", "other_thread"), ("generation",)

    def __init__(
        self, room: int, method: str, thread: str, other_method: str, other_thread: str, *,
        generation: int | None = None,
    ) -> None:
        super().__init__(
            room,
            f"thread {thread} called {method}() while thread {other_thread} was inside "
            f"{other_method}(); a sender's init/send/poll/failure_exception/abort must be "
            "called by one thread at a time (docs/THREADING.md, 'Two threads on one sender')",
            generation=generation,
        )
        self.method = method
        self.thread = thread
        self.other_method = other_method
        self.other_thread = other_thread


def _nixl_classes(*names: str) -> tuple[type[BaseException], ...]:
    found = (getattr(_nixl.bindings, n, None) for n in names)  # no bindings: none found
    return tuple(c for c in found if isinstance(c, type) and issubclass(c, BaseException))


TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (
    *_nixl_classes(
        "nixlRemoteDisconnectError", "nixlBackendError", "nixlCancelledError", "nixlNotFoundError"
    ),
    # Without NIXL, RuntimeError stands in for its classes (which do NOT subclass it).
    *(() if _nixl.AVAILABLE else (RuntimeError,)),
    TransferTimeoutError, TransferFailedError, TransportClosedError, PeerNotFoundError,
    RegionRetiredError,
)

# NIXL statuses that mean "the caller passed something wrong" (never a dead peer).
PARAM_ERRORS: tuple[type[BaseException], ...] = _nixl_classes(
    "nixlInvalidParamError", "nixlMismatchError", "nixlNotAllowedError", "nixlNotPostedError",
    "nixlNotSupportedError", "nixlRepostActiveError",
)


def classify(exc: BaseException) -> bool:
    """True if ``exc`` means "this peer or transfer is gone" (a transport error). Pure."""
    return isinstance(exc, TRANSPORT_ERRORS)


def status_name(exc: BaseException) -> str:
    """The NIXL status name carried by a NIXL exception (its message), else the class name."""
    text = str(exc)
    return text if text.startswith("NIXL_") else type(exc).__name__


def as_param_error(exc: BaseException, context: str) -> TransportParamError | None:
    """``exc`` as a :class:`TransportParamError` (to ``raise ... from exc``), or ``None``
    when it is not one of :data:`PARAM_ERRORS`. Pure."""
    if PARAM_ERRORS and isinstance(exc, PARAM_ERRORS):
        return TransportParamError(context, status=status_name(exc))
    return None
