"""Room notices: the NIXL notification telling a decode session that one opening of a room
will not complete (failed or cleared before ``Success``), sent once nothing of it can land.
Wire format version 1 (docs/PROTOCOL.md, section 3)::

    b"NXSTG-ROOM/1 " + UTF-8 JSON {"room": int, "gen": int, "outcome": str, "code": str}

``outcome`` is one of :data:`OUTCOMES`, ``code`` one of :data:`CODES`; ``gen`` names the
opening. Pure functions; thread-safe.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

PREFIX = b"NXSTG-ROOM/1 "
"""Magic and version of the format (a decoder refuses other versions)."""

MAX_NOTICE_BYTES = 512
"""A notice is small; anything longer is not one of ours."""

OUTCOMES = ("failed", "cleared")
CODES = ("aborted", "transport", "timeout", "peer-failed", "bad-input", "internal", "cleared")
"""Why: the caller aborted; a transport error; a transfer deadline; the decode session was
failed as a whole (or every staging slot it may hold is held by its hung transfers); bad
transfer info; an internal error; cleared without a failure."""


class NoticeError(ValueError):
    """Bytes that are not a valid room notice of this version."""


@dataclass(frozen=True, slots=True)
class RoomNotice:
    """One room notice: that opening of the room will not complete."""

    room: int
    gen: int
    outcome: str
    code: str

    def encode(self) -> bytes:
        """The notification bytes.

        Raises:
            NoticeError: a field out of its domain.
        """
        _check(self.room, self.gen, self.outcome, self.code)
        return PREFIX + json.dumps(asdict(self), separators=(",", ":")).encode()


def is_notice(message: bytes) -> bool:
    """``True`` when ``message`` claims to be a room notice (any version of ours)."""
    return message.startswith(b"NXSTG-ROOM/")


def decode_notice(message: bytes) -> RoomNotice:
    """Parse a room notice.

    Raises:
        NoticeError: not a version-1 room notice, or a malformed one.
    """
    if not isinstance(message, bytes | bytearray):
        raise NoticeError(f"a notice is bytes, got {type(message).__name__}")
    message = bytes(message)
    if len(message) > MAX_NOTICE_BYTES or not message.startswith(PREFIX):
        raise NoticeError("not a version-1 room notice")
    try:
        doc = json.loads(message[len(PREFIX) :].decode())
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise NoticeError("malformed room notice") from None
    if not isinstance(doc, dict):
        raise NoticeError("malformed room notice")
    room, gen, outcome, code = (doc.get(k) for k in ("room", "gen", "outcome", "code"))
    _check(room, gen, outcome, code)
    assert isinstance(room, int) and isinstance(gen, int)  # checked above: for the type checker
    return RoomNotice(room, gen, str(outcome), str(code))


def code_for(reason: str | None, exc: BaseException | None) -> str:
    """Classify a failure reason (as the manager records it) into one of :data:`CODES`."""
    from sender.errors import TransferTimeoutError

    text = reason or ""
    if isinstance(exc, TransferTimeoutError) or "TransferTimeoutError" in text:
        return "timeout"
    if text.startswith("aborted"):
        return "aborted"
    if text.startswith("decode peer"):
        return "peer-failed"
    if "destination pages" in text:
        return "bad-input"
    if text.startswith("internal error"):
        return "internal"
    if text:
        return "transport"
    return "cleared"


def _check(room: object, gen: object, outcome: object, code: object) -> None:
    for name, value in (("room", room), ("gen", gen)):
        if type(value) is not int or value < 0:
            raise NoticeError(f"bad {name} in room notice: {value!r}")
    if outcome not in OUTCOMES:
        raise NoticeError(f"bad outcome in room notice: {outcome!r}")
    if code not in CODES:
        raise NoticeError(f"bad code in room notice: {code!r}")
