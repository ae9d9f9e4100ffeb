"""The decode page audit: which room's bytes must each decode page hold at the end of a run?

Every concluded room (a :class:`~sender.driver.RoomOutcome`) is recorded with the decode pages
it was given, the prefill pages it sends there and whether its bytes were verified at the peer.
The driver hands a page to a new room only when the previous one is finished with it (its
purge returned and nothing of it still drains), so the uses of one page are ordered by when
their rooms were admitted. After the run, once every transfer drained, the page's digest at
the peer is read and judged against its history:

* let V be the last room *verified* on the page (its bytes were read back and matched). The
  page may hold V's bytes, or the bytes of any room given the page after V (such a room may
  have failed part-way, or succeeded unverified);
* anything else is a violation: the bytes of a room given the page *before* V mean that room's
  write landed after V was verified — a cross-room overwrite — and bytes of no room at all
  mean a torn or foreign write;
* pages never verified are not judged, nor pages whose peer lost its memory (a restarted
  process) after V was admitted.

Thread-safety: :meth:`PageAudit.record` and :meth:`PageAudit.peer_reset` may be called from
any thread; :meth:`PageAudit.check` from one thread at a time, when nothing is in flight.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from sender.driver import DigestFn, RoomOutcome
from sender.poll import KVPoll


@dataclass(frozen=True, slots=True)
class _Use:
    """One room's use of one decode page."""

    room: int
    started_at: float
    digest: str  # digest of the prefill page this room sends to the decode page
    verified: bool  # a Success whose bytes were read back and matched
    status: KVPoll | None


@dataclass(frozen=True, slots=True)
class AuditReport:
    """What one :meth:`PageAudit.check` found.

    ``violations``: new findings (each reported once per run). ``judged``: pages checked
    against a verified room; ``unjudged``: pages with a history but nothing to judge them by;
    ``sessions_unread``: sessions whose digests could not be read (peer down).
    """

    violations: tuple[str, ...]
    judged: int
    unjudged: int
    sessions_unread: tuple[str, ...] = ()


@dataclass
class PageAudit:
    """Per decode page, the rooms that used it; judged by :meth:`check`.

    Args:
        src_digests: the digest of every prefill KV page, by page index (the bytes a room
            sends), in the format of the peer's ``page_digest``.
    """

    src_digests: Sequence[str]
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # Guarded by _lock.
    _uses: dict[tuple[str, int], list[_Use]] = field(default_factory=dict, repr=False)
    _resets: dict[str, float] = field(default_factory=dict, repr=False)
    _reported: set[tuple[str, int, str, int]] = field(default_factory=set, repr=False)
    rooms_recorded: int = 0

    def record(self, outcome: RoomOutcome) -> None:
        """Add a concluded room's pages to their histories. Thread-safe."""
        if not outcome.dst_pages:
            return
        verified = outcome.status is KVPoll.Success and outcome.verified is True
        with self._lock:
            self.rooms_recorded += 1
            for dst, src in zip(outcome.dst_pages, outcome.src_pages, strict=True):
                use = _Use(
                    outcome.room,
                    outcome.started_at,
                    self.src_digests[src],
                    verified,
                    outcome.status,
                )
                self._uses.setdefault((outcome.session_id, dst), []).append(use)

    def peer_reset(self, session_id: str, at: float) -> None:
        """The session's peer lost its pages at ``at`` (``time.monotonic()``; e.g. it was
        killed and restarted): rooms verified before are no longer judged. Thread-safe."""
        with self._lock:
            self._resets[session_id] = max(at, self._resets.get(session_id, at))

    def sessions(self) -> list[str]:
        """Sessions with at least one recorded page. Thread-safe."""
        with self._lock:
            return sorted({s for s, _ in self._uses})

    def check_pages(self, digest: DigestFn, session_id: str, pages: Sequence[int]) -> list[str]:
        """Judge ``pages`` of one session now: pages about to be handed to a new room (every
        earlier user of them concluded and drained). Returns new findings. A session whose
        digests cannot be read is skipped. Scheduler thread (any one thread at a time).
        """
        with self._lock:
            uses = {
                p: sorted(self._uses.get((session_id, p), ()), key=lambda u: u.started_at)
                for p in pages
            }
            reset_at = self._resets.get(session_id)
        judged = [p for p in pages if any(u.verified for u in uses[p])]
        if not judged:
            return []
        try:
            got = digest(session_id, judged)
        except Exception:  # the peer is down: nothing to read now
            return []
        found: list[str] = []
        for page, actual in zip(judged, got, strict=True):
            verdict = self._judge(session_id, page, actual, uses[page], reset_at)
            if verdict is None:
                continue
            key, text = verdict
            with self._lock:
                new = bool(text) and key not in self._reported
                if new:
                    self._reported.add(key)
            if new:
                found.append(text + " (seen before the page was reused)")
        return found

    def check(self, digest: DigestFn, sessions: Iterable[str] | None = None) -> AuditReport:
        """Read every recorded page's digest at its peer and judge it (see the module
        docstring). A finding already reported by an earlier check is not repeated.
        Call it when no transfer is in flight (after the manager drained). One thread.
        """
        with self._lock:
            uses = {k: sorted(v, key=lambda u: u.started_at) for k, v in self._uses.items()}
            resets = dict(self._resets)
        by_session: dict[str, list[int]] = {}
        for sid, page in uses:
            by_session.setdefault(sid, []).append(page)
        wanted = set(by_session) if sessions is None else set(sessions) & set(by_session)
        violations: list[str] = []
        unread: list[str] = []
        judged = unjudged = 0
        for sid in sorted(wanted):
            pages = sorted(by_session[sid])
            try:
                got = digest(sid, pages)
            except Exception:  # the peer is down (e.g. a failed restart): nothing to read
                unread.append(sid)
                continue
            for page, actual in zip(pages, got, strict=True):
                verdict = self._judge(sid, page, actual, uses[(sid, page)], resets.get(sid))
                if verdict is None:
                    unjudged += 1
                    continue
                judged += 1
                key, text = verdict
                with self._lock:
                    new = bool(text) and key not in self._reported
                    if new:
                        self._reported.add(key)
                if new:
                    violations.append(text)
        return AuditReport(tuple(violations), judged, unjudged, tuple(unread))

    @staticmethod
    def _judge(
        sid: str, page: int, actual: str, history: list[_Use], reset_at: float | None
    ) -> tuple[tuple[str, int, str, int], str] | None:
        """``None``: not judged; else ``(key, "")`` when it holds, ``(key, why)`` when not."""
        last = max((i for i, u in enumerate(history) if u.verified), default=None)
        if last is None:
            return None
        verified = history[last]
        if reset_at is not None and reset_at >= verified.started_at:
            return None
        allowed = {u.digest for u in history[last:]}
        key = (sid, page, actual, verified.room)
        if actual in allowed:
            return key, ""
        later_rooms = [u.room for u in history[last + 1 :]]
        later = f" (later rooms: {later_rooms})" if later_rooms else ""
        culprit = next((u for u in reversed(history[:last]) if u.digest == actual), None)
        if culprit is not None:
            ended = culprit.status.name if culprit.status is not None else "?"
            why = (
                f"cross-room overwrite: decode page {page} of {sid!r} holds the bytes of room "
                f"{culprit.room} ({ended}), but room {verified.room} was given the page after "
                f"it and verified{later}"
            )
        else:
            why = (
                f"decode page {page} of {sid!r} holds bytes of no room given it since room "
                f"{verified.room} was verified on it{later}"
            )
        return key, why
