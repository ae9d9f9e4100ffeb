"""The decode page audit: which room's bytes must each decode page hold at the end of a run?

Every concluded room (a :class:`~stress.harness.driver.RoomOutcome`) is recorded with the decode
pages it was given, the prefill pages it sends there and whether its bytes were verified at the
peer. The driver hands a page to a new room only when the previous one is finished with it (its
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

Who wrote what a violating page holds: a digest names the *bytes*, and rooms that send the
same prefill page send the same bytes, so without stamps it names a prefill page, not a room.
The finding then lists every recorded room that sent those bytes anywhere (``ambiguous``
when more than one did) instead of naming the last one in the page's history (which named a
failed room as the writer of bytes that a later room, given another page, had sent just as
well). With stamped sources (:mod:`stress.harness.stamps`: each room's bytes carry its opening,
chunk and intended decode page; ``RoomOutcome.sent_digests``) the digest names one write,
and the audit also reads the page's stamp (``read``): a *misdirected* write (bytes meant for
another decode page) is told apart from a *stale* one (a room given this page before V).

Thread-safety: :meth:`PageAudit.record` and :meth:`PageAudit.peer_reset` may be called from
any thread; :meth:`PageAudit.check` from one thread at a time, when nothing is in flight.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from sender.poll import KVPoll
from stress.harness.driver import DigestFn, RoomOutcome
from stress.harness.landings import Landing
from stress.harness.stamps import read_stamp

ReadFn = Callable[[str, Sequence[int]], bytes]
"""``read(session_id, pages) -> the pages' bytes``, concatenated (the peer's ``read_pages``)."""


@dataclass(frozen=True, slots=True)
class _Use:
    """One room's use of one decode page."""

    room: int
    started_at: float
    digest: str  # digest of the bytes this room sends to the decode page
    verified: bool  # a Success whose bytes were read back and matched
    status: KVPoll | None
    generation: int = -1
    chunk: int = -1
    session_id: str = ""
    page: int = -1  # the decode page it was sent to
    stamped: bool = False

    def who(self) -> str:
        ended = self.status.name if self.status is not None else "?"
        gen = f" gen {self.generation}" if self.generation >= 0 else ""
        return f"room {self.room}{gen} ({ended})"


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
    # Every recorded use, by the digest of the bytes it sent (attribution of a finding).
    _senders: dict[str, list[_Use]] = field(default_factory=dict, repr=False)
    rooms_recorded: int = 0
    read: ReadFn | None = None
    """Optional: read a violating page's bytes to name the write by its stamp."""
    explain: Callable[[str, int], str] | None = None
    """Optional: more about a violating page ``(session, page)`` for the finding's text (e.g.
    the peer's log of the writes that landed there, :mod:`stress.harness.landings`)."""

    def record(self, outcome: RoomOutcome) -> None:
        """Add a concluded room's pages to their histories. Thread-safe."""
        if not outcome.dst_pages:
            return
        verified = outcome.status is KVPoll.Success and outcome.verified is True
        stamped = len(outcome.sent_digests) == len(outcome.dst_pages)
        with self._lock:
            self.rooms_recorded += 1
            for i, (dst, src) in enumerate(zip(outcome.dst_pages, outcome.src_pages, strict=True)):
                use = _Use(
                    outcome.room,
                    outcome.started_at,
                    outcome.sent_digests[i] if stamped else self.src_digests[src],
                    verified,
                    outcome.status,
                    outcome.generation,
                    i,
                    outcome.session_id,
                    dst,
                    stamped,
                )
                self._uses.setdefault((outcome.session_id, dst), []).append(use)
                self._senders.setdefault(use.digest, []).append(use)

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

    def late_landings(self, sid: str, landings: Sequence[Landing]) -> list[str]:
        """Judge the order of the writes that landed on the session's pages (the peer's log,
        :mod:`stress.harness.landings`, of its current process): on each page, a stamped write of an
        opening given the page *before* another opening whose write already landed there is
        a late landing -- the page was handed on while the old write could still land. It
        is found whether or not a later write covered it again (the final bytes, which
        :meth:`check` judges, may then look right). Landings of openings not in the page's
        history (misdirected) and unstamped ones are not judged here. Returns new findings
        (each reported once per run). One thread at a time, when nothing is in flight (every
        room of the log concluded and recorded)."""
        pages = {r.page for r in landings}
        with self._lock:
            history = {
                p: sorted(self._uses.get((sid, p), ()), key=lambda u: u.started_at) for p in pages
            }
        # Per page, each opening's place in its history (looked up once per landing).
        place = {
            p: {(u.room, u.generation): i for i, u in enumerate(hist)}
            for p, hist in history.items()
        }
        found: list[str] = []
        latest: dict[int, int] = {}  # page -> history index of the newest opening landed
        for r in sorted(landings, key=lambda r: r.seq):
            if r.room < 0:
                continue
            hist = history[r.page]
            idx = place[r.page].get((r.room, r.generation))
            if idx is None:
                continue
            newest = latest.get(r.page)
            if newest is None or idx > newest:
                latest[r.page] = idx
                continue
            if idx == newest:
                continue
            key = (sid, r.page, f"late {r.room}/{r.generation}", hist[newest].room)
            with self._lock:
                new = key not in self._reported
                self._reported.add(key)
            if new:
                later = hist[newest]
                found.append(
                    f"late landing: decode page {r.page} of {sid!r}: the write of "
                    f"{hist[idx].who()} (chunk {r.chunk}) landed at {r.at:.3f}, after the write "
                    f"of {later.who()}, which was given the page after it (admitted "
                    f"{hist[idx].started_at:.3f} and {later.started_at:.3f})"
                )
        return found

    def _judge(
        self, sid: str, page: int, actual: str, history: list[_Use], reset_at: float | None
    ) -> tuple[tuple[str, int, str, int], str] | None:
        """``None``: not judged; else ``(key, "")`` when it holds, ``(key, why)`` when not."""
        last = max((i for i, u in enumerate(history) if u.verified), default=None)
        if last is None:
            return None
        verified = history[last]
        if reset_at is not None and reset_at >= verified.started_at:
            return None
        # mutant-site: judge
        allowed = {u.digest for u in history[last:]}
        key = (sid, page, actual, verified.room)
        if actual in allowed:
            return key, ""
        return key, self._attribute(sid, page, actual, history, last)

    def _attribute(self, sid: str, page: int, actual: str, history: list[_Use], last: int) -> str:
        """Why the page's bytes are wrong, naming who sent them as far as the bytes tell."""
        verified = history[last]
        later_rooms = [u.room for u in history[last + 1 :]]
        later = f" (later rooms: {later_rooms})" if later_rooms else ""
        with self._lock:
            senders = list(self._senders.get(actual, ()))
        rooms = sorted({(u.room, u.generation) for u in senders})
        here = f"decode page {page} of {sid!r}"
        if len(senders) == 1 and senders[0].stamped:
            w = senders[0]
            if (w.session_id, w.page) == (sid, page):
                why = (
                    f"cross-room overwrite: {here} holds the bytes {w.who()} sent it (chunk "
                    f"{w.chunk}), but room {verified.room} was given the page after it and "
                    f"verified{later}"
                )
            else:
                why = (
                    f"misdirected write: {here} holds the bytes {w.who()} sent to decode page "
                    f"{w.page} of {w.session_id!r} (chunk {w.chunk}); room {verified.room} was "
                    f"verified on this page{later}"
                )
        elif len(rooms) == 1 and any(u.digest == actual for u in history[:last]):
            # Unstamped, but no other room ever sent these bytes: the page's earlier user.
            culprit = next(u for u in reversed(history[:last]) if u.digest == actual)
            why = (
                f"cross-room overwrite: {here} holds the bytes of {culprit.who()}, but room "
                f"{verified.room} was given the page after it and verified{later}"
            )
        elif senders:
            earlier = [u.room for u in history[:last] if u.digest == actual]
            shown = ", ".join(f"{u.who()} -> page {u.page}" for u in senders[-6:])
            why = (
                f"{here} holds bytes not sent to it since room {verified.room} was verified on "
                f"it{later}; who wrote them is ambiguous: {len(rooms)} rooms sent the same "
                f"bytes (the same prefill page), last: {shown}"
                + (f"; of them given this page before: {earlier}" if earlier else "")
            )
        else:
            why = (
                f"{here} holds bytes of no room given it since room {verified.room} was "
                f"verified on it{later}"
            )
        times = f"; room {verified.room} admitted at {verified.started_at:.3f}"
        if later_rooms:
            times += ", later rooms at " + ", ".join(
                f"{u.started_at:.3f}" for u in history[last + 1 :]
            )
        return why + self._stamp_of(sid, page) + times + self._explained(sid, page)

    def _explained(self, sid: str, page: int) -> str:
        if self.explain is None:
            return ""
        try:
            more = self.explain(sid, page)
        except Exception as exc:  # a diagnostic only: the finding stands without it
            return f"; (explain failed: {exc!r})"
        return f"; {more}" if more else ""

    def _stamp_of(self, sid: str, page: int) -> str:
        """What the page's own stamp says (when a reader was given); "" otherwise."""
        if self.read is None:
            return ""
        try:
            data = self.read(sid, [page])
        except Exception:  # the peer went away meanwhile: the digest finding stands
            return ""
        stamp = read_stamp(data)
        return f"; its stamp names {stamp}" if stamp is not None else "; it carries no stamp"
