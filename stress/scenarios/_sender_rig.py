"""What the sender scenarios share: a real decode peer process (or several), a real NIXL
transport wrapped by the fault injector, a KVManager with debug locks (a new one per phase
where a scenario needs it), a reaper thread that purges random rooms from outside the
scheduler, the end-of-run drain and leak checks, the decode page audit, and the
``decode-told`` check (:class:`NoticeTracker`): every room the prefill side failed or cleared
before ``Success`` is known as failed at its decode peer (room notices), with the latency.

Test-only ``--plant-bug no-notices`` (every sender scenario): the managers are made with
``notify_decode=False``; ``decode-told`` must then report the rooms nobody was told about.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import random
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from sender.events import FanOut, ManagerEvents
from sender.manager import KVManager, ManagerPurge
from sender.notices import NoticeError, decode_notice
from sender.poll import KVPoll
from sender.transport import NixlTransport
from staging.buffers import StagingBufferPool
from staging.context import RoomHandle, StagingContext
from stress import metrics_sink
from stress.framework import JSONValue, Monitor, StressConfig, WorkerCounters, percentile
from stress.harness.driver import (
    CONTRACT_PREFIX,
    BootstrapFn,
    DriverConfig,
    DriverResult,
    RoomOutcome,
    SchedulerDriver,
    page_digests,
)
from stress.harness.faults import FaultInjectingTransport
from stress.harness.peer import LearntRoom, PeerError, PeerProcess
from stress.invariants import (
    DECODE_PAGE_AUDIT,
    DECODE_TOLD,
    FAILURE_CONTRACT,
    LOCK_ORDER,
    NO_DEADLOCK,
    NO_ESCAPED_EXCEPTION,
    NO_LEAK,
    NO_RESURRECTION,
    NO_THREAD_LEFT,
    describe,
)
from stress.scenarios._conclusions import ConclusionClock
from stress.scenarios._nixl_calls import SlowCalls
from stress.scenarios._page_audit import PageAudit

ROOMS_CONCLUDED = describe(
    "rooms-concluded",
    "every room concluded Success or Failed (a killed peer's before the kill's phase ended: "
    "the next fault, or the end of admission; judged by order, not by the clock)",
)
BYTES_VERIFIED = describe("bytes-verified", "every verifiable Success room's bytes match")
CHUNKS_ONCE = describe(
    "chunks-once",
    "every chunk ended once (done+failed+skipped+drained = submitted; each transfer released "
    "by the manager exactly once)",
)
DRAIN_HONEST = describe(
    "drain-honest",
    "draining(handle)/wait_drained(handle) answer 0/True only once nothing of the purged "
    "opening is held: no unreleased transfer, no leased staging slot",
)

SENDER_INVARIANTS = (
    NO_ESCAPED_EXCEPTION,
    FAILURE_CONTRACT,
    ROOMS_CONCLUDED,
    BYTES_VERIFIED,
    DECODE_PAGE_AUDIT,
    DECODE_TOLD,
    CHUNKS_ONCE,
    DRAIN_HONEST,
    NO_LEAK,
    NO_RESURRECTION,
    LOCK_ORDER,
    NO_DEADLOCK,
    NO_THREAD_LEFT,
)
"""What every sender scenario checks."""

PAGE_BYTES = 4096
KV_PAGES = 1024
STAGING_SLOTS = 16
TRANSFER_TIMEOUT_S = 0.5
REAP_EVERY_S = 0.05
REAP_PROBABILITY = 0.2
DRAIN_TIMEOUT_S = 5.0
PEER_START_TIMEOUT_S = 60.0
"""A decode peer process's start bound (``PeerProcess(start_timeout_s=...)``): past it the
start fails by itself (``PeerStartError``). The watchdog's allowance for a start is this
plus its period (:func:`peer_start_bound`)."""
LEGACY_DRAIN_S = 0.3
"""A manager without ``wait_drained`` released in-flight transfers at purge; their bytes may
still land for a while: wait this long before reading pages for the audit."""
PLANT_NO_NOTICES = "no-notices"
"""Test-only planted bug: managers made with ``notify_decode=False`` (``decode-told`` fires)."""
PLANT_NO_FAIL_SESSION = "no-fail-session"
"""Test-only planted bug: managers made with ``fail_session_on_disconnect=False``."""
TOLD_WAIT_S = 2.0
"""``decode-told``: the fixed wait this check used before its bounds were derived (2 s after
the manager closed and drained). Kept as the yardstick of ``late``: a notice learnt later
than this after the check began would have been reported missing by the old check."""
TOLD_STALL_S = 5.0
"""``decode-told``: while the manager's notifier still has notices to send
(``stats().notices_pending``), the judged notices are late, not lost, as long as that backlog
shrinks; if it does not shrink for this long the notifier is stuck (the rooms still missing
then are violations). On a loaded machine one ``send_notif`` takes milliseconds; 5 s without
a single send is a stall, not load."""
TOLD_QUIET_S = 2.0
"""``decode-told``: once the notifier's backlog is empty (every notice sent or failed), a
judged notice the peer has not learnt is waited for as long as the peers keep learning
notices; it is *lost* once no judged peer learnt a new one for this long (a delivery takes
about a millisecond, ``delivery_ms``; 2 s of silence after the last send is not delivery)."""
TOLD_GRACE_S = 1.5
"""``decode-told``: a room is not judged at a decode peer that had a fault between the room's
opening and this long after its purge (the notice waits for the room's posted chunks to
drain: up to a transfer deadline, or a delayed write, after the purge)."""
TOLD_GOAL_S = 0.1
"""Goal: a room with nothing in flight at its purge is known as failed at the decode side
within 100 ms of the purge (reported as ``goal_met``, not a violation)."""


@dataclass
class RigStats:
    """What the scenario reports besides the monitor's counters."""

    succeeded: int = 0
    failed: int = 0
    verified: int = 0
    unverified: int = 0
    reaped: int = 0
    refused_opens: int = 0
    pages_judged: int = 0
    pages_unjudged: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    told: dict[str, JSONValue] = field(default_factory=dict)

    def to_json(self) -> dict[str, JSONValue]:
        return {
            "succeeded": self.succeeded,
            "failed": self.failed,
            "verified": self.verified,
            "unverified_peer_gone": self.unverified,
            "reaped_by_other_thread": self.reaped,
            "refused_opens": self.refused_opens,
            "pages_audited": self.pages_judged,
            "pages_not_judged": self.pages_unjudged,
            "errors": dict(sorted(self.errors.items())),
            "decode_told": self.told,
        }


# --------------------------------------------------------------------------- decode-told


@dataclass(frozen=True, slots=True)
class _Purged:
    room: int
    gen: int | None
    status: KVPoll | None
    at: float
    draining: int
    reason: str | None


class NoticeTracker:
    """What the ``decode-told`` check needs: every opening (sessions, when), every purge (its
    status, when, what still drained), when the manager sent each room notice, the faults of
    each session (time intervals), and what each decode peer learnt (harvested from the peer
    process, also right before a peer is killed or replaced: a new process knows nothing).

    :meth:`check` (at the end of a manager's life, after it closed and drained) judges every
    room failed or cleared before ``Success`` (one failed after it concluded ``Success``, an
    ``abort()`` after the last chunk's end, is never notified: docs/PROTOCOL.md; the tracker
    is a listener of the manager's events to know) at each of its sessions that had no fault in
    ``[opening, purge + TOLD_GRACE_S]``: the peer must know it (same outcome) once the
    notifier's backlog has been sent (waited for while it shrinks, :data:`TOLD_STALL_S`) and
    the peers went quiet (:data:`TOLD_QUIET_S`); and no opening purged at ``Success`` may be
    known as failed. A notice learnt later than :data:`TOLD_WAIT_S` after the check began is
    counted ``late``; one never learnt is ``missing`` (a violation, with its purge, send and
    error times in the example).

    Thread-safe: ``opened``/``purged``/``sent`` come from the manager's callers and threads,
    ``fault``/``harvest`` from scenario threads; everything is guarded by one lock (held only
    for dict updates, never across an RPC).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Guarded by _lock.
        self._opened: dict[tuple[int, int], tuple[tuple[str, ...], float]] = {}
        self._purged: list[_Purged] = []
        self._sent: dict[tuple[int, int, str], float] = {}
        self._send_errors: dict[tuple[int, int, str], tuple[float, str]] = {}
        # Openings the manager concluded Success (its room_concluded event): one failed
        # afterwards (abort() after Success) is never notified (docs/PROTOCOL.md).
        self._succeeded: set[tuple[int, int]] = set()
        # session -> (times the transport answered "disconnected" to the notifier, last time)
        self._dead_answers: dict[str, tuple[int, float]] = {}
        self._faults: dict[str, list[list[float]]] = {}
        self._learnt: dict[str, dict[tuple[int, int], LearntRoom]] = {}
        self._cursor: dict[str, tuple[int, int]] = {}  # session -> (peer pid, since)
        self.latency_s: list[float] = []
        self.latency_idle_s: list[float] = []  # rooms with nothing in flight at the purge
        self.delivery_s: list[float] = []  # send_notif call -> learnt
        self.counts: dict[str, int] = dict.fromkeys(
            (
                "judged",
                "learnt",
                "late",
                "withheld",
                "missing",
                "notifier_stuck",
                "excluded_fault",
                "unreachable",
                "outcome_mismatch",
                "success_told",
                "notices_sent",
                "notices_failed",
            ),
            0,
        )

    # ------------------------------------------------------------------ recording

    def opened(self, handle: RoomHandle, sessions: Sequence[str], at: float) -> None:
        """An opening and its sessions (any thread). Raises: nothing."""
        with self._lock:
            self._opened[(handle.room, handle.generation)] = (tuple(sessions), at)

    def purged(self, purge: ManagerPurge, at: float) -> None:
        """A purge's result (any thread; ignored when nothing was open). Raises: nothing."""
        if not purge.was_open:
            return
        gen = purge.staging.generation if purge.staging is not None else None
        with self._lock:
            self._purged.append(
                _Purged(purge.room, gen, purge.status, at, purge.draining, purge.failure_record)
            )

    def sent(self, session_id: str, message: bytes, at: float) -> None:
        """The notifier called ``send_notif`` with ``message`` at ``at`` (notifier thread).
        Raises: nothing."""
        try:
            notice = decode_notice(message)
        except NoticeError:
            return
        with self._lock:
            self._sent[(notice.room, notice.gen, session_id)] = at

    def send_failed(self, session_id: str, message: bytes, at: float, exc: BaseException) -> None:
        """The notifier's ``send_notif`` call at ``at`` raised ``exc`` (notifier thread).
        Raises: nothing."""
        try:
            notice = decode_notice(message)
        except NoticeError:
            return
        with self._lock:
            self._send_errors[(notice.room, notice.gen, session_id)] = (at, repr(exc))

    def room_concluded(
        self, room: int, generation: int, outcome: str, code: str, seconds: float
    ) -> None:
        """The manager's event (a :class:`~sender.events.ManagerEvents` listener, any thread):
        an opening that concluded ``"success"`` is judged as a Success room even when it was
        failed afterwards. Raises: nothing."""
        if outcome == "success":
            with self._lock:
                self._succeeded.add((room, generation))

    def chunk_ended(self, session_id: str, outcome: str, seconds: float, nbytes: int) -> None:
        """The manager's event: not used here. Raises: nothing."""

    def dead_answer(self, session_id: str, at: float) -> None:
        """The transport told the notifier that ``session_id``'s peer is disconnected (its
        notice is skipped). Any thread. Raises: nothing."""
        with self._lock:
            count, _ = self._dead_answers.get(session_id, (0, at))
            self._dead_answers[session_id] = (count + 1, at)

    def fault(self, session_id: str, start: float, end: float | None = None) -> list[float]:
        """A fault of ``session_id`` from ``start`` to ``end`` (``None``: still on; set
        ``interval[1]`` on the returned list, or call :meth:`fault_end`, once repaired).
        Any thread. Raises: nothing."""
        interval = [start, float("inf") if end is None else end]
        with self._lock:
            self._faults.setdefault(session_id, []).append(interval)
        return interval

    def fault_end(self, interval: list[float], end: float) -> None:
        """The fault ``interval`` (from :meth:`fault`) ended at ``end``. Raises: nothing."""
        with self._lock:
            interval[1] = end

    def overlaps_fault(self, session_id: str, start: float, end: float) -> bool:
        """Whether a fault of ``session_id`` (:meth:`fault`) overlapped ``[start, end]``
        (``time.monotonic()`` seconds). Any thread. Raises: nothing."""
        with self._lock:
            spans = [tuple(span) for span in self._faults.get(session_id, ())]
        return any(begin <= end and start <= until for begin, until in spans)

    def harvest(self, session_id: str, peer: PeerProcess) -> bool:
        """Fetch what ``peer`` learnt since the last harvest. ``False`` when it did not
        answer (or is gone). Never raises."""
        if not peer.alive:
            return False
        with self._lock:
            pid, since = self._cursor.get(session_id, (0, 0))
        if pid != peer.pid:
            since = 0
        try:
            got: dict[tuple[int, int], LearntRoom] = {}
            for _ in range(256):
                page = peer.room_notices(since)
                for rec in page.records:
                    got[(rec.room, rec.gen)] = rec.learnt
                since = page.next
                if not page.more:
                    break
        except PeerError:
            return False
        with self._lock:
            self._cursor[session_id] = (peer.pid, since)
            learnt = self._learnt.setdefault(session_id, {})
            for key, value in got.items():
                learnt.setdefault(key, value)
        return True

    # ------------------------------------------------------------------ the check

    def _excluded(self, session_id: str, opened_at: float, purged_at: float) -> bool:
        """Caller holds ``_lock``."""
        return any(
            start <= purged_at + TOLD_GRACE_S and end >= opened_at
            for start, end in self._faults.get(session_id, ())
        )

    def check(
        self,
        monitor: Monitor,
        peers: Mapping[str, PeerProcess],
        mgr: KVManager,
    ) -> dict[str, int]:
        """Judge the rooms purged since the last check (call after ``mgr`` closed and
        drained); returns this check's counts. How long it waits is derived from the
        notifier's backlog and the peers' progress (:data:`TOLD_STALL_S`,
        :data:`TOLD_QUIET_S`), not fixed. Never raises."""
        st = mgr.stats()
        notifier = getattr(mgr, "notifier", None)
        withheld = (
            {(h.room, h.generation) for h in notifier.withheld_handles()}
            if notifier is not None and hasattr(notifier, "withheld_handles")
            else set()
        )
        with self._lock:
            purged, self._purged = self._purged, []
            opened, self._opened = self._opened, {}
            by_room: dict[int, int] = {}
            for room, gen in opened:
                by_room[room] = max(gen, by_room.get(room, -1))
            pending: dict[tuple[int, int, str], _Purged] = {}
            success: list[tuple[int, int, str]] = []
            counts = dict.fromkeys(self.counts, 0)
            counts["notices_sent"] = int(getattr(st, "notices_sent", 0))
            counts["notices_failed"] = int(getattr(st, "notices_failed", 0))
            for p in purged:
                gen_or_none = p.gen if p.gen is not None else by_room.get(p.room)
                if gen_or_none is None or (p.room, gen_or_none) not in opened:
                    continue  # opened by another manager, or nothing known of it
                gen = gen_or_none
                sessions, opened_at = opened[(p.room, gen)]
                if (p.room, gen) in withheld:  # close() abandoned its writes: no notice
                    counts["withheld"] += len(sessions)
                    continue
                succeeded = (p.room, gen) in self._succeeded
                self._succeeded.discard((p.room, gen))
                for sid in sessions:
                    if p.status is KVPoll.Success or succeeded:
                        success.append((p.room, gen, sid))
                    elif sid not in peers or self._excluded(sid, opened_at, p.at):
                        counts["excluded_fault"] += 1
                    else:
                        pending[(p.room, gen, sid)] = p
        counts["judged"] = len(pending)
        began = time.monotonic()
        reached: set[str] = set()
        sessions_left = {sid for _, _, sid in pending}

        def harvest_left() -> int:
            """Harvest the sessions still owed a notice; how many judged notices are left."""
            nonlocal sessions_left
            for sid in sorted(sessions_left):
                peer = peers.get(sid)
                if peer is not None and self.harvest(sid, peer):
                    reached.add(sid)
            with self._lock:
                left = [k for k in pending if (k[0], k[1]) not in self._learnt.get(k[2], {})]
            sessions_left = {sid for _, _, sid in left}
            return len(left)

        # 1. The notifier's backlog: late, not lost, while it shrinks.
        backlog = _pending_notices(mgr)
        last_move = time.monotonic()
        while backlog and pending and harvest_left():
            time.sleep(0.02)
            now_backlog = _pending_notices(mgr)
            if now_backlog < backlog:
                last_move = time.monotonic()
            backlog = now_backlog
            if time.monotonic() - last_move >= TOLD_STALL_S:
                counts["notifier_stuck"] += 1
                break
        # 2. Delivery: wait while the peers keep learning notices.
        left = harvest_left() if pending else 0
        last_new = time.monotonic()
        while left:
            time.sleep(0.02)
            now_left = harvest_left()
            if now_left < left:
                last_new = time.monotonic()
            left = now_left
            if time.monotonic() - last_new >= TOLD_QUIET_S:
                break
        wait_s = time.monotonic() - began
        for sid in {sid for _, _, sid in success} - reached:  # judge these too
            peer = peers.get(sid)
            if peer is not None:
                self.harvest(sid, peer)
        with self._lock:
            for key, p in pending.items():
                room, gen, sid = key
                learnt = self._learnt.get(sid, {}).get((room, gen))
                want = "failed" if p.status is KVPoll.Failed else "cleared"
                if learnt is None:
                    if sid not in reached:
                        counts["unreachable"] += 1
                        continue
                    counts["missing"] += 1
                    sent_at = self._sent.get(key)
                    error = self._send_errors.get(key)
                    sent = (
                        f"sent {sent_at - began:+.3f} s" if sent_at is not None
                        else f"send raised {error[1]} at {error[0] - began:+.3f} s"
                        if error is not None else "never sent"
                    )
                    dead = self._dead_answers.get(sid)
                    if dead is not None:
                        sent += (
                            f"; the transport answered 'disconnected' for {sid!r} {dead[0]} "
                            f"times, last at {dead[1] - began:+.3f} s"
                        )
                    if p.reason:
                        sent += f"; failed because: {p.reason[:200]}"
                    if notifier is not None and hasattr(notifier, "counts"):
                        sent += f"; notifier {notifier.counts()}"
                    monitor.violation(
                        DECODE_TOLD,
                        f"room {room} gen {gen} ({want} on the prefill side, {p.draining} chunks "
                        f"draining at its purge) is not known as failed at {sid!r} after "
                        f"{wait_s:.1f} s of waiting (purged {p.at - began:+.3f} s, {sent}, "
                        f"times from the check's start; notifier backlog {backlog})",
                    )
                    continue
                counts["learnt"] += 1
                if learnt.learnt_at - began > TOLD_WAIT_S:
                    counts["late"] += 1
                if learnt.outcome != want:
                    counts["outcome_mismatch"] += 1
                    monitor.violation(
                        DECODE_TOLD,
                        f"room {room} gen {gen}: the decode side learnt {learnt.outcome!r}, the "
                        f"prefill side purged it {want!r}",
                    )
                lat = learnt.learnt_at - p.at
                self.latency_s.append(lat)
                if p.draining == 0:
                    self.latency_idle_s.append(lat)
                sent_at = self._sent.get(key)
                if sent_at is not None:
                    self.delivery_s.append(learnt.learnt_at - sent_at)
            for room, gen, sid in success:
                if (room, gen) in self._learnt.get(sid, {}):
                    counts["success_told"] += 1
                    monitor.violation(
                        DECODE_TOLD,
                        f"room {room} gen {gen} succeeded, yet {sid!r} was told it failed",
                    )
            self._sent.clear()
            self._send_errors.clear()
            self._succeeded.clear()
            for learnt_map in self._learnt.values():
                learnt_map.clear()
            for name in self.counts:
                self.counts[name] += counts[name]
        return counts

    def mark(self) -> tuple[int, int, int]:
        """Where the latency lists stand now (for :meth:`summary` of a part of the run)."""
        with self._lock:
            return len(self.latency_s), len(self.latency_idle_s), len(self.delivery_s)

    def summary(self, since: tuple[int, int, int] = (0, 0, 0)) -> dict[str, JSONValue]:
        """Counts so far and latencies in ms (p50/p99/max) of the rooms judged since the
        :meth:`mark` ``since``: ``latency_ms`` purge -> learnt for every judged room (it
        includes the wait for the room's posted chunks to drain and for the notifier's queue);
        ``idle_latency_ms`` for rooms with nothing in flight at their purge (the goal: p99
        <= 100 ms); ``delivery_ms`` from the notifier's ``send_notif`` call to learnt."""

        def q(values: list[float]) -> dict[str, JSONValue]:
            if not values:
                return {"n": 0, "p50": None, "p99": None, "max": None}
            return {
                "n": len(values),
                "p50": round(statistics.median(values) * 1e3, 2),
                "p99": round((percentile(values, 99) or 0.0) * 1e3, 2),
                "max": round(max(values) * 1e3, 2),
            }

        with self._lock:
            idle = self.latency_idle_s[since[1] :]
            p99 = percentile(idle, 99)
            return {
                **self.counts,
                "latency_ms": q(self.latency_s[since[0] :]),
                "idle_latency_ms": q(idle),
                "delivery_ms": q(self.delivery_s[since[2] :]),
                "goal_ms": TOLD_GOAL_S * 1e3,
                "goal_met": None if p99 is None else p99 <= TOLD_GOAL_S,
            }


def _pending_notices(mgr: KVManager) -> int:
    """The manager's notifier backlog (0 for a manager that does not report it)."""
    try:
        return int(getattr(mgr.stats(), "notices_pending", 0))
    except Exception:
        return 0


class TransferLedger:
    """Ground truth of the writes a manager made, kept beside it (not asked of it): per room,
    the transfers it posted and has not released yet; per transfer, how many times it was
    released. The ``drain-honest`` and ``chunks-once`` checks compare the manager's answers
    with it.

    Thread-safety: every method may be called from any thread (one plain lock, held only for
    dict updates).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[int, int] = {}  # guarded by _lock; room -> unreleased transfers
        self.double_released: list[str] = []  # guarded by _lock
        self.posted = 0  # guarded by _lock

    def track(self, room: int, transfer: Any) -> _LedgerTransfer:
        with self._lock:
            self._live[room] = self._live.get(room, 0) + 1
            self.posted += 1
        return _LedgerTransfer(transfer, room, self)

    def released(self, room: int, count: int, what: str) -> None:
        with self._lock:
            if count == 1:
                left = self._live.get(room, 1) - 1
                if left > 0:
                    self._live[room] = left
                else:
                    self._live.pop(room, None)
            elif len(self.double_released) < 64:
                self.double_released.append(f"{what} released {count} times")

    def live_of(self, room: int) -> int:
        with self._lock:
            return self._live.get(room, 0)


class _LedgerTransfer:
    """A transfer as the manager sees it: the fault injector's, with ``release()`` counted."""

    __slots__ = ("_count", "_inner", "_ledger", "_room")

    def __init__(self, inner: Any, room: int, ledger: TransferLedger) -> None:
        self._inner = inner
        self._room = room
        self._ledger = ledger
        self._count = 0

    def poll(self) -> str:
        return str(self._inner.poll())

    def settled(self) -> bool:
        settled = getattr(self._inner, "settled", None)
        return True if settled is None else bool(settled())

    def release(self) -> None:
        self._count += 1  # only the chunk's one ender calls this (a claim guards it)
        self._ledger.released(self._room, self._count, repr(self._inner))
        self._inner.release()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _room_of(notif: bytes | None) -> int | None:
    """The room id of a chunk's notification ``room=R;chunk=C;last=L``."""
    if not notif or not notif.startswith(b"room="):
        return None
    try:
        return int(notif[5 : notif.index(b";")])
    except ValueError:
        return None


class _NoticeClock:
    """The transport a rig's manager sees: the fault injector, with each ``send_notif`` call
    timed for :class:`NoticeTracker` and each write kept in the rig's :class:`TransferLedger`
    (everything else is forwarded as is)."""

    def __init__(
        self,
        inner: FaultInjectingTransport,
        tracker: NoticeTracker,
        ledger: TransferLedger | None = None,
    ) -> None:
        self._inner = inner
        self._tracker = tracker
        self._ledger = ledger

    def write_pages(self, *args: Any, **kwargs: Any) -> Any:
        transfer = self._inner.write_pages(*args, **kwargs)
        notif = args[3] if len(args) > 3 else kwargs.get("notif")
        room = _room_of(notif)
        if self._ledger is None or room is None:
            return transfer
        return self._ledger.track(room, transfer)

    def send_notif(self, session_id: str, message: bytes) -> None:
        at = time.monotonic()
        try:
            self._inner.send_notif(session_id, message)
        except BaseException as exc:
            self._tracker.send_failed(session_id, message, at, exc)
            raise
        self._tracker.sent(session_id, message, at)

    def peer_disconnected(self, session_id: str) -> bool:
        dead = bool(self._inner.peer_disconnected(session_id))
        if dead:
            self._tracker.dead_answer(session_id, time.monotonic())
        return dead

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class TrackedManager(KVManager):
    """A :class:`KVManager` that tells a :class:`NoticeTracker` about every opening and
    every purge (``purge_room`` is also what ``clear``/``failure_exception``/``close`` call).
    Behaviour is the base class's."""

    def __init__(self, *args: Any, tracker: NoticeTracker, **kwargs: Any) -> None:
        self.tracker = tracker
        events = kwargs.get("events")
        kwargs["events"] = tracker if events is None else FanOut(events, tracker)
        # The openings purged last, for the drain-honest observer (deque appends and
        # snapshots are atomic).
        self.recent_purges: collections.deque[RoomHandle] = collections.deque(maxlen=64)
        super().__init__(*args, **kwargs)

    def open_room(self, room: int, session_ids: Sequence[str]) -> RoomHandle:
        """:meth:`KVManager.open_room`, recorded. Raises: as the base class."""
        handle = super().open_room(room, session_ids)
        self.tracker.opened(handle, session_ids, time.monotonic())
        return handle

    def purge_room(self, room: int | RoomHandle) -> ManagerPurge:
        """:meth:`KVManager.purge_room`, recorded. Raises: as the base class."""
        purge = super().purge_room(room)
        self.tracker.purged(purge, time.monotonic())
        gen = purge.staging.generation if purge.staging is not None else None
        if purge.was_open and gen is not None:
            self.recent_purges.append(RoomHandle(purge.room, gen))
        return purge


def peer_start_bound(monitor: Monitor, peers: int = 1) -> float:
    """How long starting ``peers`` decode peer processes one after another may go without
    progress before the watchdog calls it stuck: each start is bounded by
    :data:`PEER_START_TIMEOUT_S` (it fails by itself past that), plus one watchdog period."""
    return peers * PEER_START_TIMEOUT_S + monitor.watchdog_s


def final_checks_bound(monitor: Monitor, sessions: int) -> float:
    """The watchdog's allowance for :meth:`SenderRig.check_end` (no room progress there):
    the drain (``wait_drained`` and the injector's quiesce, :data:`DRAIN_TIMEOUT_S` each),
    ``decode-told``'s wait (:data:`TOLD_WAIT_S`), three control-channel reads per session
    (notices, digests; each bounded by the peer's 2 s RPC timeout), plus one period."""
    return 2 * DRAIN_TIMEOUT_S + TOLD_WAIT_S + sessions * 3 * 2.0 + monitor.watchdog_s


MANAGER_CLOSE_TIMEOUT_S = 5.0
"""``KVManager.close``'s own bound (its default ``timeout_s``): the drain, the notices
and the workers' join."""


def close_bound(monitor: Monitor, peers: Iterable[PeerProcess]) -> float:
    """The watchdog's allowance for :meth:`SenderRig.close` (no room progress there): the
    manager's close (:data:`MANAGER_CLOSE_TIMEOUT_S`), each peer process's reap
    (``PeerProcess.close_timeout_s``: its SIGTERM grace and the wait after SIGKILL), plus
    one period. Each part fails by itself past its own bound, so a close stuck for good is
    still reported."""
    reaps = sum(p.close_timeout_s for p in peers)
    return MANAGER_CLOSE_TIMEOUT_S + reaps + monitor.watchdog_s


class SenderRig:
    """One prefill sender talking to ``len(sessions)`` decode peer processes.

    ``extra_pools``: more staging pools, region name -> slots (one page each), registered
    with the transport next to the default ``"staging"`` pool (e.g. a starved one).
    ``monitor``: the set-up (starting the peers) is declared to its watchdog as a long step
    (:func:`peer_start_bound`).
    """

    def __init__(
        self,
        config: StressConfig,
        sessions: tuple[str, ...],
        peer_pages: int,
        *,
        extra_pools: Mapping[str, int] | None = None,
        monitor: Monitor | None = None,
    ) -> None:
        self.config = config
        self.scenario = monitor.scenario if monitor is not None else "sender"
        self.sessions = sessions
        self.peer_pages = peer_pages
        self.stats = RigStats()
        self.peers: dict[str, PeerProcess] = {}
        self.pools: dict[str, StagingBufferPool] = {}
        self._stack = contextlib.ExitStack()
        self.peer_lock = threading.Lock()  # serialises peer restarts against digests
        self.rooms_used: list[int] = []
        self.phase = ""
        """The part of the run now on (set by a scenario with phases): names the group of
        the rooms' latencies (:meth:`latency_group`); ``""``: none."""
        self.next_room = 0
        self.notices = NoticeTracker()
        # When each manager of the rig concluded each opening (the sender's time, not the
        # scheduler's, which does the harness's own work between its polls).
        self.conclusions = ConclusionClock()
        self.ledger = TransferLedger()
        self._drain_reported: set[RoomHandle] = set()
        self._drain_checks = 0
        try:
            if monitor is None:
                self._setup(config, sessions, peer_pages, dict(extra_pools or {}))
            else:
                bound = peer_start_bound(monitor, len(sessions))
                with monitor.long_step(f"start {len(sessions)} decode peers", bound):
                    self._setup(config, sessions, peer_pages, dict(extra_pools or {}))
        except BaseException:
            self._stack.close()
            raise

    def _setup(
        self,
        config: StressConfig,
        sessions: tuple[str, ...],
        peer_pages: int,
        extra_pools: dict[str, int],
    ) -> None:
        gen = torch.Generator().manual_seed(config.seed)
        self.kv = torch.randint(0, 256, (KV_PAGES, PAGE_BYTES), dtype=torch.uint8, generator=gen)
        self.audit = PageAudit(page_digests(self.kv))
        self.tx = NixlTransport(f"stress-prefill-{config.seed}")
        self._stack.callback(self.tx.close)
        # Diagnostic: the transport's NIXL calls over SLOW_S, named in findings.
        self.nixl_calls = SlowCalls(self.tx._xfer_agent)
        self.tx._xfer_agent = self.nixl_calls
        self.tx.register_region("kv", self.kv, PAGE_BYTES)
        for region, slots in {"staging": STAGING_SLOTS, **extra_pools}.items():
            pool = StagingBufferPool(slots, 1, PAGE_BYTES, debug=True)
            self._stack.callback(pool.close)
            self.tx.register_region(region, pool.tensor, PAGE_BYTES)
            self.pools[region] = pool
        self.pool = self.pools["staging"]
        for sid in sessions:
            peer = PeerProcess(
                peer_pages,
                PAGE_BYTES,
                name=sid,
                rpc_timeout_s=2.0,
                start_timeout_s=PEER_START_TIMEOUT_S,
                stderr=subprocess.DEVNULL,
            )
            self._stack.callback(peer.close)
            self.peers[sid] = peer
            self.tx.add_peer(sid, peer.metadata)
        self.injector = FaultInjectingTransport(
            self.tx, rate=config.fault_rate, seed=config.seed, points=("write", "poll")
        )
        self._stack.callback(self.injector.close)
        self.mgr = self.make_manager()

    def _events(self) -> ManagerEvents:
        """The managers' listener: the run's metrics (when on) and :attr:`conclusions`."""
        shared = metrics_sink.listener()
        return self.conclusions if shared is None else FanOut(shared, self.conclusions)

    def make_manager(
        self,
        *,
        num_workers: int | None = None,
        staging: StagingContext | None = None,
        region: str = "staging",
        slot_timeout_s: float = 5.0,
        transfer_timeout_s: float = TRANSFER_TIMEOUT_S,
        wrap: Callable[[Any], Any] | None = None,
    ) -> KVManager:
        """A new manager over the rig's transport (it becomes ``self.mgr``); close the old
        one first (:meth:`finish_manager`). It reports its openings, purges and room notices
        to ``self.notices`` (the ``decode-told`` check); under ``--plant-bug no-notices`` it
        sends no room notice. ``wrap``: what the manager sees of the transport is
        ``wrap(transport)`` (a planted bug's seam; harness only).

        Raises:
            TypeError, ValueError: as ``KVManager`` for a bad argument.
        """
        transport: Any = _NoticeClock(self.injector, self.notices, self.ledger)
        self.mgr = TrackedManager(
            transport if wrap is None else wrap(transport),
            self.kv,
            num_workers=max(1, self.config.threads) if num_workers is None else num_workers,
            staging=staging or StagingContext(lock=self.config.lock, debug=True),
            staging_pool=self.pools[region],
            transfer_timeout_s=transfer_timeout_s,
            slot_timeout_s=slot_timeout_s,
            lock="mutex",
            debug=True,
            staging_region=region,
            notify_decode=self.config.plant_bug != PLANT_NO_NOTICES,
            fail_session_on_disconnect=self.config.plant_bug != PLANT_NO_FAIL_SESSION,
            tracker=self.notices,
            events=self._events(),
        )
        metrics_sink.watch(self.scenario, self.mgr)
        self.rooms_used = []
        self._tx_done_before = self.tx.stats().transfers_done
        return self.mgr

    def close(self) -> None:
        try:
            self.mgr.close(MANAGER_CLOSE_TIMEOUT_S)
        finally:
            self._stack.close()

    # ------------------------------------------------------------------ the scheduler

    def digest(self, session_id: str, pages: Sequence[int]) -> list[str]:
        with self.peer_lock:
            peer = self.peers[session_id]
        return peer.page_digest(pages)

    def new_driver(
        self,
        bootstrap: BootstrapFn | None = None,
        *,
        monitor: Monitor | None = None,
        audit_reuse: bool = False,
    ) -> SchedulerDriver:
        """A driver over the current manager and every session. Its rooms are recorded in
        the page audit as they conclude; with ``audit_reuse`` (and a ``monitor``) the pages
        are also judged each time before they are handed to a new room (one digest read per
        room: the audit then sees an overwrite before a later room hides it)."""
        driver = SchedulerDriver(
            self.mgr,
            dict.fromkeys(self.sessions, self.peer_pages),
            self.digest,
            bootstrap=bootstrap,
        )
        driver.on_conclude = self.audit.record
        if audit_reuse and monitor is not None:
            audit, mon = self.audit, monitor

            def before_reuse(session_id: str, pages: Sequence[int]) -> None:
                for text in audit.check_pages(self.digest, session_id, pages):
                    mon.violation(DECODE_PAGE_AUDIT, text)

            driver.before_reuse = before_reuse
        return driver

    def scheduler(
        self,
        monitor: Monitor,
        on_outcome: Callable[[RoomOutcome], None] | None = None,
        *,
        driver: SchedulerDriver | None = None,
        running: Callable[[], bool] | None = None,
        overrides: Mapping[str, Any] | None = None,
    ) -> Callable[[], None]:
        """The scheduler thread's body: batches of rooms while ``running()`` (default: until
        the deadline). ``overrides``: :class:`DriverConfig` fields to set."""
        keep_going = running if running is not None else monitor.running
        chosen = driver

        def run() -> None:
            counters = monitor.counters()
            faults_before = self.injector.stats().faults
            drv = chosen if chosen is not None else self.new_driver()
            # Rooms are counted per batch (below); the watchdog sees each one conclude.
            observer = drv.progress

            def beat(done: int, total: int) -> None:
                counters.beats += 1
                if observer is not None:
                    observer(done, total)

            drv.progress = beat
            cfg = self.config
            while keep_going():
                base = self.next_room
                self.next_room += cfg.rooms
                dcfg = DriverConfig(
                    rooms=cfg.rooms,
                    chunks=cfg.chunks,
                    pages_per_chunk=1,
                    max_active=max(4, cfg.rooms // 2),
                    room_base=base,
                    seed=cfg.seed + base,
                    deadline_s=max(5.0, monitor.watchdog_s / 2),
                )
                if overrides:
                    dcfg = dataclasses.replace(dcfg, **overrides)
                result = drv.run(dcfg)
                self._account(monitor, counters, result, on_outcome)
                counters.faults = self.injector.stats().faults - faults_before

        return run

    def latency_group(self, o: RoomOutcome) -> str:
        """The group of a room's latency (:meth:`Monitor.latency`, for the latency
        pictures): the phase now on, else whether a fault of its session's peer overlapped
        the room's life, and how it ended. Raises: nothing."""
        if self.phase:
            return self.phase
        faulted = self.notices.overlaps_fault(o.session_id, o.started_at, o.concluded_at)
        when = "during a peer fault" if faulted else "no peer fault"
        ended = "succeeded" if o.status is KVPoll.Success else "failed"
        return f"{when}, {ended}"

    def account(
        self,
        monitor: Monitor,
        counters: WorkerCounters,
        result: DriverResult,
        on_outcome: Callable[[RoomOutcome], None] | None = None,
    ) -> None:
        """Count a driver run's outcomes (rooms, latencies) and report what breaks the
        sender invariants (escaped exceptions, unconcluded rooms, wrong bytes, leftovers),
        as the rig's scheduler does; for scenarios that drive their own runs. Raises:
        whatever ``on_outcome`` raises."""
        self._account(monitor, counters, result, on_outcome)

    def _account(
        self,
        monitor: Monitor,
        counters: WorkerCounters,
        result: DriverResult,
        on_outcome: Callable[[RoomOutcome], None] | None,
    ) -> None:
        for text in result.escaped:
            if text.startswith(CONTRACT_PREFIX):
                monitor.violation(FAILURE_CONTRACT, text[len(CONTRACT_PREFIX) :])
            else:
                monitor.violation(NO_ESCAPED_EXCEPTION, text)
        if result.unconcluded:
            monitor.violation(
                ROOMS_CONCLUDED, f"{result.unconcluded} rooms not concluded before the deadline"
            )
        self.stats.refused_opens += result.refused
        for o in result.outcomes:
            self.rooms_used.append(o.room)
            counters.rooms += 1
            counters.ops += self.config.chunks
            monitor.latency(o.latency_s, self.latency_group(o))
            if o.status is KVPoll.Success:
                self.stats.succeeded += 1
                if o.verified is False:
                    monitor.violation(BYTES_VERIFIED, f"room {o.room}: bytes differ at the peer")
                elif o.verified:
                    self.stats.verified += 1
                else:
                    self.stats.unverified += 1
            elif o.status is KVPoll.Failed:
                self.stats.failed += 1
                key = o.error or "none"
                self.stats.errors[key] = self.stats.errors.get(key, 0) + 1
            else:
                monitor.violation(ROOMS_CONCLUDED, f"room {o.room} ended as {o.status!r}")
            if o.footprint:
                monitor.violation(NO_LEAK, f"room {o.room} left in {o.footprint} at conclusion")
            if on_outcome is not None:
                on_outcome(o)

    # ------------------------------------------------------------------ chaos

    def reaper(
        self, monitor: Monitor, index: int, running: Callable[[], bool] | None = None
    ) -> Callable[[], None]:
        """Another thread purging random open rooms (an engine aborting requests)."""
        keep_going = running if running is not None else monitor.running

        def run() -> None:
            rng: random.Random = self.config.rng(index)
            while keep_going():
                time.sleep(REAP_EVERY_S)
                self.observe_drain(monitor)
                mgr = self.mgr
                rooms = list(mgr.request_status)
                if rooms and rng.random() < REAP_PROBABILITY and mgr.purge_room(
                    rng.choice(rooms)
                ).was_open:
                    self.stats.reaped += 1

        return run

    def observe_drain(self, monitor: Monitor) -> None:
        """``drain-honest``: for the openings purged last, whenever the manager says nothing
        of one is left (``draining(handle) == 0``, or ``wait_drained(handle, 0)``), the
        ground truth must agree: no transfer of the room unreleased (the ledger), no slot
        leased to it (the pool). A purged opening gets no new post or lease (the fence), so
        what the truth shows after the answer was already held at the answer. Never
        raises."""
        mgr = self.mgr
        recent = getattr(mgr, "recent_purges", None)
        if not recent:
            return
        pool = mgr.staging_pool
        self._drain_checks += 1
        ask_wait = self._drain_checks % 4 == 0
        try:
            for handle in recent.copy():  # a C-level copy: atomic against appends
                if handle in self._drain_reported:
                    continue
                if ask_wait:
                    nothing_left = mgr.wait_drained(handle, 0)
                    how = "wait_drained(handle, 0) was True"
                else:
                    nothing_left = mgr.draining(handle) == 0
                    how = "draining(handle) was 0"
                if not nothing_left:
                    continue
                live = self.ledger.live_of(handle.room)
                slots = pool.owner_slots(handle) if pool is not None else 0
                if live or slots:
                    self._drain_reported.add(handle)
                    monitor.violation(
                        DRAIN_HONEST,
                        f"room {handle.room} gen {handle.generation}: {how} while {live} of its "
                        f"transfers were unreleased and {slots} staging slots leased to it",
                    )
        except Exception as exc:  # draining/wait_drained are documented never to raise
            monitor.exception(exc, "drain observer")

    # ------------------------------------------------------------------ end checks

    def drain(self, monitor: Monitor, mgr: KVManager) -> None:
        """Wait until no transfer of a purged room is in flight (``wait_drained``), and until
        the injector posted and finished every delayed write."""
        wait = getattr(mgr, "wait_drained", None)
        if wait is None:
            time.sleep(LEGACY_DRAIN_S)
        else:
            try:
                if not wait(timeout_s=DRAIN_TIMEOUT_S):
                    left = getattr(mgr, "draining", lambda: "?")()
                    monitor.violation(
                        NO_LEAK,
                        f"{left} transfers still draining {DRAIN_TIMEOUT_S:g} s after close",
                    )
            except Exception as exc:  # documented never to raise
                monitor.exception(exc, "wait_drained")
        if not self.injector.quiesce(DRAIN_TIMEOUT_S):
            monitor.violation(NO_LEAK, "delayed writes still pending at the fault injector")

    def finish_manager(self, monitor: Monitor) -> None:
        """Close the current manager, let everything drain, then nothing may be left."""
        mgr = self.mgr
        try:
            mgr.close()
        except Exception as exc:  # a worker that does not stop
            monitor.exception(exc, "KVManager.close")
        self.drain(monitor, mgr)
        for room in self.rooms_used:
            left = mgr.footprint(room)
            if left:
                monitor.violation(NO_RESURRECTION, f"room {room} reappeared in {left}")
        st = mgr.stats()
        if st.open_rooms or st.transfers_inflight or getattr(st, "transfers_draining", 0):
            monitor.violation(NO_LEAK, f"manager: {st}")
        snap = mgr.staging.snapshot()
        if snap.open_rooms or snap.prefetched_rooms or snap.prefetch_requested:
            monitor.violation(NO_LEAK, f"staging: {len(snap.prefetch_requested)} keys left")
        pool = mgr.staging_pool
        ps = pool.stats() if pool is not None else None
        if ps is not None and (ps.in_use or ps.owners):
            monitor.violation(NO_LEAK, f"staging pool: {ps.in_use} slots still leased")
        tx = self.tx.stats()
        if tx.live_transfers:
            monitor.violation(
                NO_LEAK, f"transport: {tx.live_transfers} transfer handles never released"
            )
        done = tx.transfers_done - self._tx_done_before
        if st.chunks_done > done:
            monitor.violation(
                CHUNKS_ONCE,
                f"manager counted {st.chunks_done} chunks done; the transport saw only {done} "
                "transfers reach DONE",
            )
        for text in self.ledger.double_released:
            monitor.violation(CHUNKS_ONCE, f"the manager ended a chunk twice: {text}")
        self.ledger.double_released.clear()
        drained = getattr(st, "chunks_drained", None)
        if drained is not None:  # every chunk ends exactly once, as one of these four
            ended = st.chunks_done + st.chunks_failed + st.chunks_skipped + drained
            if ended != st.chunks_submitted:
                monitor.violation(
                    CHUNKS_ONCE,
                    f"{st.chunks_submitted} chunks submitted but {ended} ended (done "
                    f"{st.chunks_done}, failed {st.chunks_failed}, skipped {st.chunks_skipped}, "
                    f"drained {drained})",
                )
        self.check_told(monitor, mgr)

    def check_told(self, monitor: Monitor, mgr: KVManager) -> None:
        """``decode-told`` for the rooms of ``mgr`` (closed and drained): see
        :class:`NoticeTracker`. Its figures go to ``stats.told``."""
        with self.peer_lock:
            peers = {sid: p for sid, p in self.peers.items() if p.alive}
        self.notices.check(monitor, peers, mgr)
        self.stats.told = self.notices.summary()

    def harvest_notices(self, session_id: str) -> bool:
        """Fetch what the session's peer learnt so far (call right before killing or
        replacing it: the new process knows nothing). Never raises."""
        return self.notices.harvest(session_id, self.peers[session_id])

    def audit_pages(self, monitor: Monitor) -> None:
        """Judge every decode page used so far (call when nothing is in flight)."""
        report = self.audit.check(self.digest)
        for text in report.violations:
            monitor.violation(DECODE_PAGE_AUDIT, text)
        self.stats.pages_judged += report.judged
        self.stats.pages_unjudged += report.unjudged

    def check_end(self, monitor: Monitor) -> None:
        """After the scheduler stopped: close, drain, nothing left, then the page audit
        (declared to the watchdog as a long step, :func:`final_checks_bound`)."""
        bound = final_checks_bound(monitor, len(self.peers))
        with monitor.long_step("final drain and checks", bound):
            self.finish_manager(monitor)
            self.audit_pages(monitor)


@contextlib.contextmanager
def sender_rig(
    config: StressConfig,
    sessions: tuple[str, ...],
    peer_pages: int,
    *,
    extra_pools: Mapping[str, int] | None = None,
    monitor: Monitor | None = None,
) -> Iterator[SenderRig]:
    """A started :class:`SenderRig`, always closed (peers reaped) on exit."""
    rig = SenderRig(config, sessions, peer_pages, extra_pools=extra_pools, monitor=monitor)
    try:
        yield rig
    finally:
        rig.close()
