"""Argument checks shared by the staging layer and the sender; no state, no locks.

Each raises before any state changes: ``TypeError`` for a wrong type, ``ValueError`` for a
value out of range. ``bool`` is refused where an ``int`` is expected.
"""

from __future__ import annotations

import math
import operator
import threading


def check_index(value: object, what: str, *, bools: bool = False) -> int:
    """``value`` as an exact ``int`` >= 0: an ``int`` or anything with ``__index__``
    (``numpy.int64``), not a ``bool`` unless ``bools``. Exact, so that no user
    ``__hash__``/``__eq__`` runs later under a lock.

    Raises:
        TypeError: no ``__index__`` (``float``, ``str``), or a ``bool``.
        ValueError: negative.
    """
    if type(value) is int and value >= 0:  # the common case, checked first
        return value
    if isinstance(value, bool) and not bools:
        raise TypeError(f"{what} must be an int >= 0, got bool {value!r}")
    try:
        plain = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"{what} must be an int >= 0 (or an integer such as numpy.int64), "
            f"got {type(value).__name__} {value!r}"
        ) from None
    plain = int.__index__(plain)  # int's own slot: an exact int, no user code
    if plain < 0:
        raise ValueError(f"{what} must be >= 0, got {plain}")
    return plain


def check_indices(values: object, what: str, *, bounded: bool = False) -> tuple[int, ...]:
    """Every element of ``values`` (any iterable; ``tolist()`` used if present) through
    :func:`check_index`, or with ``bounded`` :func:`check_id`.

    Raises:
        TypeError: not iterable (or ``str``/``bytes``), or an element is not an integer.
        ValueError: an element is negative, or (``bounded``) not below :data:`MAX_ID`.
    """
    if isinstance(values, (str, bytes)):
        raise TypeError(f"{what} must be an iterable of ints, got {type(values).__name__}")
    tolist = getattr(values, "tolist", None)
    items = tolist() if callable(tolist) else values
    if not isinstance(items, list):
        try:
            items = list(items)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(
                f"{what} must be an iterable of ints, got {type(values).__name__}"
            ) from None
    check = check_id if bounded else check_index
    out: list[int] = []
    for position, item in enumerate(items):
        try:
            out.append(check(item, what))
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{exc} (at position {position})") from None
    return tuple(out)


def check_seconds(
    value: object, what: str, *, allow_zero: bool = False, allow_inf: bool = False
) -> float:
    """A number of seconds (``int`` or ``float``, not ``bool``), returned as a ``float``.

    Raises:
        TypeError: not an ``int``/``float``, or a ``bool``.
        ValueError: NaN; negative, or zero unless ``allow_zero``; infinite unless
            ``allow_inf``; an ``int`` too large for a float.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{what} must be a number of seconds, got {value!r}")
    try:
        seconds = float(value)
    except OverflowError:
        hint = " (use float('inf'))" if allow_inf else ""
        raise ValueError(f"{what} is too large{hint}") from None
    if math.isnan(seconds) or seconds < 0 or (seconds == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{what} must be a number {bound}, got {value!r}")
    if math.isinf(seconds) and not allow_inf:
        raise ValueError(f"{what} must be finite, got {value!r}")
    return seconds


MAX_ID = 2**63
"""Room ids and chunk indices are below this (a signed 64-bit integer), so every message
built from them fits ``sender.notices.MAX_NOTICE_BYTES``."""


def check_id(value: object, what: str, *, bools: bool = False) -> int:
    """:func:`check_index`, and below :data:`MAX_ID` (``2**63``).

    Raises:
        TypeError: as :func:`check_index`.
        ValueError: negative, or not below ``2**63``.
    """
    plain = check_index(value, what, bools=bools)
    if plain >= MAX_ID:
        # Named by its size past a few hundred bits: str() of a huge int itself raises.
        shown = str(plain) if plain.bit_length() <= 256 else f"an int of {plain.bit_length()} bits"
        raise ValueError(f"{what} must be < 2**63, got {shown}")
    return plain


def check_room_id(room: object) -> int:
    """A room id (:func:`check_id`). Raises: TypeError, ValueError."""
    return check_id(room, "room")


def check_chunk_idx(chunk_idx: object) -> int:
    """A chunk index (:func:`check_id`). Raises: TypeError, ValueError."""
    return check_id(chunk_idx, "chunk_idx")


def check_session_id(session_id: object) -> str:
    """A session id: non-empty ``str``, returned as an exact ``str``.
    Raises: TypeError, ValueError."""
    if type(session_id) is str and session_id:
        return session_id
    if not isinstance(session_id, str):
        raise TypeError(f"session_id must be a str, got {type(session_id).__name__}")
    if not session_id:
        raise ValueError("session_id must be a non-empty str")
    return str.__str__(session_id)


def bounded_wait(seconds: float) -> float:
    """``seconds`` clamped to ``[0, threading.TIMEOUT_MAX]`` (beyond it blocking calls
    raise ``OverflowError``); NaN becomes 0. Raises: nothing."""
    return min(seconds, threading.TIMEOUT_MAX) if seconds > 0 else 0.0
