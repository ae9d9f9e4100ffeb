"""The room table: every per-room table of a prefill sender, and every change to them.

Upstream's per-room dicts under their names (``request_status``, ``transfer_infos``,
``req_to_decode_prefix_len``, ``exceptions``; ``failure_records`` under ``failure_lock``),
one :class:`RoomEntry` per open room, and the chunks *draining* after their room's purge.
Every write names its opening's :class:`RoomHandle`; a write for a purged opening is refused
and counted. Nothing here calls NIXL or waits; after-lock work is collected in an
:class:`After` (see docs/THREADING.md, 'The sender').

Lock order: a room's post gate (ROOM_GATE) -> ``lock`` (ROOM) -> staging (STAGING) -> slot
pool (POOL) -> ``failure_lock`` (FAILURE); the notifier's counter lock is innermost.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from sender.chunks import Chunk
from sender.errors import KVTransferError, TransferFailedError, TransferReleasedError
from sender.events import ManagerEvents
from sender.infos import TransferInfo
from sender.notices import RoomNotice, code_for
from sender.notifier import Notifier
from sender.pages import CheckedPages
from sender.poll import KVPoll, is_concluded, merge_status
from staging.buffers import StagingBufferPool
from staging.context import RoomHandle, RoomPurge, StagingContext
from staging.errors import RoomAlreadyOpenError
from staging.locks import LockLevel, MutexLock, RWLock, debug_from_env, make_lock

__all__ = ["COUNTERS", "After", "ManagerEvents", "ManagerPurge", "RoomEntry", "RoomTable"]

logger = logging.getLogger("sender.manager")

COUNTERS = (
    "rooms_opened", "rooms_succeeded", "rooms_failed", "rooms_cleared", "purges",
    "chunks_submitted", "chunks_done", "chunks_skipped", "chunks_failed", "chunks_drained",
    "chunks_released_by_transport", "bytes_posted", "transfers_abandoned",
    "refused_late_writes", "sessions_failed", "worker_errors",
)
"""The room table's counters (``ManagerStats`` fields of the same names)."""

MAX_ROOMS_LOGGED = 64
"""A session failed as a whole is logged once, naming at most this many of its rooms."""


@dataclass(slots=True, eq=False)
class After:
    """What a locked section decided to do after its lock: listener events and log lines.
    Filled under the lock, :meth:`run` after it. Not thread-safe."""

    concluded: list[tuple[int, int, str, str, float]] = field(default_factory=list)
    ended: list[tuple[str, str, float, int]] = field(default_factory=list)
    logs: list[tuple[int, str, tuple[Any, ...]]] = field(default_factory=list)

    def log(self, level: int, msg: str, *args: Any) -> None:
        """A log line for after the lock."""
        self.logs.append((level, msg, args))

    def must_seal(self) -> bool:
        """Whether readers must see it emitted: listener events or a ``WARNING``+ line."""
        if self.concluded or self.ended:
            return True
        for rec in self.logs:  # noqa: SIM110 (a plain loop, no generator: cheap under DPOR)
            if rec[0] >= logging.WARNING:
                return True
        return False

    def run(self, events: ManagerEvents | None) -> None:
        """Emit the events and log lines (never raises: a listener error is logged)."""
        for level, msg, args in self.logs:
            logger.log(level, msg, *args)
        if events is None:
            return
        try:
            for rec in self.concluded:
                events.room_concluded(*rec)
            for end in self.ended:
                events.chunk_ended(*end)
        except Exception:  # a listener must never break a manager thread
            logger.exception("a ManagerEvents listener raised")


@dataclass(slots=True, eq=False)
class RoomEntry:
    """Bookkeeping of one open room. Guarded by the room table's ``lock``, except ``gate``
    (ROOM_GATE), ``handle``, ``sessions`` and ``opened_at``, which never change."""

    handle: RoomHandle
    sessions: tuple[str, ...]
    gate: RWLock | MutexLock | PlainGate
    opened_at: float
    num_kv_indices: int | None = None
    jobs_total: int = 0
    jobs_done: int = 0
    last_chunk_seen: bool = False
    prefetch_requests: int = 0
    concluded: bool = False  # its conclusion was counted and told
    succeeded: bool = False  # it concluded Success
    failure_code: str | None = None
    chunk_idxs: set[int] = field(default_factory=set)
    inflight: dict[int, Chunk] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ManagerPurge:
    """What :meth:`KVManager.purge_room` removed for one opening of a room.

    Attributes:
        room: the room id.
        was_open: ``False`` when there was nothing to purge; the other fields are empty.
        status: the room's status at the purge.
        tables: names of the per-room tables that held the room.
        staging: what the staging context removed.
        exception: the opening's stored exception, removed.
        failure_record: the room's failure reason, removed.
        draining: this opening's posted transfers still in flight; its pages and slots are
            reusable only once :meth:`KVManager.draining` for the handle is 0.
    """

    room: int
    was_open: bool
    status: KVPoll | None
    tables: tuple[str, ...]
    staging: RoomPurge | None
    exception: BaseException | None = None
    failure_record: str | None = None
    draining: int = 0


def _note(exc: BaseException, text: str) -> None:
    """Add ``text`` to ``exc``'s notes once (also on Python 3.10, without ``add_note``)."""
    notes = getattr(exc, "__notes__", None)
    if notes is not None and text in notes:
        return
    try:
        exc.add_note(text)
    except AttributeError:  # Python 3.10
        exc.__notes__ = [*(notes or ()), text]


class PlainGate:
    """A room's post gate outside debug mode (debug: a ``MutexLock`` of level ROOM_GATE): a
    bare ``threading.Lock``, made at open time so DPOR explorers see it."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def write_untimed(self) -> threading.Lock:
        # mutant-site: write-untimed
        return self._lock


class RoomTable:
    """The per-room tables and their locks.

    Args:
        staging: the staging context (its rooms open and close with ours).
        pool: the staging slot pool, or ``None``.
        notifier: where room notices go.
        lock: kind of ``lock`` (``"mutex"`` or ``"rw"``).
        debug: lock debug mode.
        events: a :class:`ManagerEvents` listener, or ``None``.

    Thread-safety: every public method is safe from any thread and is one section of
    ``lock`` unless it says otherwise; ``*_locked`` methods expect ``lock`` held for write.
    """

    def __init__(
        self, staging: StagingContext, *, pool: StagingBufferPool | None, notifier: Notifier,
        lock: str, debug: bool | None, events: ManagerEvents | None = None,
    ) -> None:
        self.staging = staging
        self.pool = pool
        self.notifier = notifier
        self.events = events
        self._debug_gates = debug_from_env() if debug is None else bool(debug)
        self.lock = make_lock(lock, "kv-manager", LockLevel.ROOM, debug=debug)
        self.failure_lock = make_lock("mutex", "kv-failure", LockLevel.FAILURE, debug=debug)
        # --- Guarded by lock (read under read(), mutate under write()). ---
        # A room id is a key of a per-room table only while it is in rooms.
        self.rooms: dict[int, RoomEntry] = {}
        self.request_status: dict[int, KVPoll] = {}
        self.transfer_infos: dict[int, dict[str, TransferInfo]] = {}
        self.req_to_decode_prefix_len: dict[int, int] = {}
        self.exceptions: dict[int, BaseException] = {}
        # draining: chunk id -> posted chunk of a purged room, until it ends; counted per
        # opening in draining_by_handle.
        self.draining: dict[int, Chunk] = {}
        self.draining_by_handle: dict[RoomHandle, int] = {}
        # hung: chunk id -> chunk failed by us that NIXL still has (also in inflight or
        # draining); swept until it settles.
        self.hung: dict[int, Chunk] = {}
        # closing: set once by close_begin(); open() checks it under the same lock.
        self.closing = False
        self.counts: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.failed_by_code: dict[str, int] = {}
        # --- Guarded by failure_lock (taken alone or inside lock). ---
        self.failure_records: dict[int, str] = {}
        # Worker errors whose own accounting failed (plain int, no lock).
        self.unaccounted_errors = 0
        self._chunk_ids = itertools.count(1)
        # A chunk's payload in bytes (set by the pipeline before any chunk exists).
        self.nbytes: Callable[[Chunk], int] = lambda chunk: 0
        # --- Publication, guarded by _publish_lock (a leaf lock, never held across a
        # listener call): _unpublished maps each sealed After not yet emitted to the lock its
        # publisher holds while emitting it (None: nobody took it on yet). Readers publish or
        # await what they saw (docs/THREADING.md, 'The sender'). Plain locks: DPOR sees them.
        self._publish_lock = threading.Lock()
        self._unpublished: dict[After, threading.Lock | None] = {}
        self._publishing = threading.local()  # .active: this thread runs a publication

    # ------------------------------------------------------------------ publication

    def seal_locked(self, after: After) -> None:
        """End of a deciding section (``lock`` held for write): if ``after`` must be seen
        emitted, later readers publish it (or wait for its publisher) before returning."""
        if after.must_seal():
            with self._publish_lock:
                self._unpublished[after] = None

    @contextlib.contextmanager
    def deciding(self, *, untimed: bool = True) -> Iterator[After]:
        """A write section of ``lock`` (timed unless ``untimed``) whose After is sealed in it
        and published after it (an exception skips both)."""
        after = After()
        # mutant-site: deciding-with
        with self.lock.write_untimed() if untimed else self.lock.write():
            yield after
            self.seal_locked(after)
        self.publish(after)

    def publish(self, after: After) -> None:
        """Emit ``after`` unless a reader took it over (after the lock). Never raises."""
        if not after.must_seal():
            after.run(self.events)
        else:
            self._emit(after, wait=False)  # unless a reader emitted it, or is emitting it

    def _emit(self, after: After, *, wait: bool) -> None:
        """Emit ``after`` if sealed and not yet taken on, holding a fresh lock until done;
        ``wait``: else wait for the thread emitting it."""
        # mutant-site: emit-claim-with
        with self._publish_lock:
            if after not in self._unpublished:
                return  # emitted meanwhile
            done = self._unpublished[after]
            if done is None:
                claim = threading.Lock()
                claim.acquire()  # a fresh lock: never blocks
                self._unpublished[after] = claim
        if done is not None:
            # mutant-site: emit-wait-if
            if wait:  # its lock is free once it was emitted
                with done:
                    pass
            return
        mark = self._publishing
        outer = getattr(mark, "active", False)
        mark.active = True
        try:
            after.run(self.events)
        finally:
            mark.active = outer
            with self._publish_lock:
                done = self._unpublished.pop(after, None)
            if done is not None:
                done.release()  # wakes the readers waiting for it

    def pending_locked(self) -> list[After] | None:
        """The Afters sealed and not yet emitted (``None``: none); ``lock`` held, any mode."""
        if not self._unpublished:  # racy, but a seal in a section we saw is visible
            return None
        with self._publish_lock:
            return list(self._unpublished)

    def await_published(self, pending: list[After] | None) -> None:
        """Emit each of ``pending`` no thread took on yet; wait for those being emitted. A
        thread that is itself emitting (a listener calling back) does not wait. Never raises."""
        if not pending or getattr(self._publishing, "active", False):
            return
        for after in pending:
            self._emit(after, wait=True)

    # ------------------------------------------------------------------ reads

    def peek(self, handle: RoomHandle) -> RoomEntry | None:
        """The opening's entry, read without the lock: an early look only."""
        return self.live_locked(handle)

    def live_locked(self, handle: RoomHandle, *, count: bool = False) -> RoomEntry | None:
        """The opening's entry, or ``None`` (``count``: counted as a refused late write; then
        ``lock`` held for write)."""
        entry = self.rooms.get(handle.room)
        if entry is None or entry.handle.generation != handle.generation:
            if count:
                self.counts["refused_late_writes"] += 1
            return None
        return entry

    def postable_locked(
        self, handle: RoomHandle, entry: RoomEntry, *, count: bool = False
    ) -> bool:
        """``entry`` is still ``handle``'s open, unfailed entry. Caller holds ``lock``."""
        return (
            self.live_locked(handle, count=count) is entry
            and self.request_status.get(handle.room) is not KVPoll.Failed
        )

    def tables_locked(self) -> tuple[tuple[str, dict[int, Any]], ...]:
        """The per-room tables guarded by ``lock``, by name. Caller holds ``lock``."""
        return (
            ("request_status", self.request_status),
            ("transfer_infos", self.transfer_infos),
            ("req_to_decode_prefix_len", self.req_to_decode_prefix_len),
            ("exceptions", self.exceptions),
        )

    def lingering_locked(self, handle: RoomHandle | None) -> int:
        """See ``KVManager.draining``. Caller holds ``lock``."""
        n = len(self.draining) if handle is None else self.draining_by_handle.get(handle, 0)
        if self.pool is None:
            return n
        held = sum(
            self.pool.owner_slots(o)
            for o in (self.pool.owners() if handle is None else [handle])
            if isinstance(o, RoomHandle) and self.live_locked(o) is None
        )
        under_chunks = sum(1 for c in self.draining_of_locked(handle) if c.slot is not None)
        # mutant-site: lingering-locked
        return n + max(0, held - under_chunks)

    def draining_of_locked(self, handle: RoomHandle | None) -> list[Chunk]:
        """The opening's draining chunks (all with ``None``). Caller holds ``lock``."""
        return [c for c in self.draining.values() if handle is None or c.handle == handle]

    # ------------------------------------------------------------------ status helpers

    def set_status_locked(self, room: int, status: KVPoll) -> None:
        """Caller holds ``lock`` (write) and checked the room is live."""
        self.request_status[room] = merge_status(self.request_status.get(room), status)

    def maybe_succeed_locked(self, entry: RoomEntry, after: After | None) -> None:
        """Caller holds ``lock`` (write)."""
        if entry.last_chunk_seen and entry.jobs_done == entry.jobs_total:
            room = entry.handle.room
            self.set_status_locked(room, KVPoll.Success)
            if not entry.concluded and self.request_status[room] is KVPoll.Success:
                entry.concluded = True
                entry.succeeded = True
                self.counts["rooms_succeeded"] += 1
                self._told_locked(entry, after, "success", "ok")

    def _told_locked(self, entry: RoomEntry, after: After | None, outcome: str, code: str) -> None:
        """The listener is told ``entry``'s room concluded (into ``after``, if any)."""
        if after is not None and self.events is not None:
            after.concluded.append(
                (entry.handle.room, entry.handle.generation, outcome, code,
                 time.monotonic() - entry.opened_at)
            )

    def fail_locked(
        self, handle: RoomHandle, exc: BaseException | None, reason: str, after: After | None, *,
        code: str | None = None, session_id: str | None = None, chunk_idx: int | None = None,
        quiet: bool = False,
    ) -> bool:
        """Fail the opening, keeping the first exception and reason; its first failure is
        counted by code, told and logged (``quiet``: the caller logs). ``False`` for a purged
        opening (a refused late write). Caller holds ``lock`` (write)."""
        entry = self.live_locked(handle, count=True)
        if entry is None:
            return False
        room = handle.room
        first = self.request_status.get(room) is not KVPoll.Failed
        if exc is not None and room not in self.exceptions:
            where = f"room {room} generation {handle.generation}"
            if session_id is not None:
                where += f", session {session_id!r}"
            if chunk_idx is not None:
                where += f", chunk {chunk_idx}"
            _note(exc, f"nixl-staging: {where}")
            self.exceptions[room] = exc
        self.set_status_locked(room, KVPoll.Failed)
        with self.failure_lock.write():
            self.failure_records.setdefault(room, reason)
        # mutant-site: fail-locked
        if first and not entry.concluded:
            # A room failed after it succeeded is not counted: by-code sums to rooms_failed.
            code = code or code_for(reason, exc)
            entry.failure_code = code
            self.failed_by_code[code] = self.failed_by_code.get(code, 0) + 1
            entry.concluded = True
            self.counts["rooms_failed"] += 1
            self._told_locked(entry, after, "failed", code)
            if after is not None and not quiet:
                after.log(
                    logging.WARNING, "room %d generation %d failed (sessions %s): %s: %s",
                    room, handle.generation, ", ".join(entry.sessions), code, reason,
                )
        return True

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to a counter (one write section)."""
        with self.lock.write():
            self.counts[name] += n

    # ------------------------------------------------------------------ lifecycle

    def open(self, room: int, sessions: tuple[str, ...]) -> RoomHandle:
        """Open ``room`` (status ``Bootstrapping``). Atomic, also against ``close_begin``.

        Raises:
            RoomAlreadyOpenError, RuntimeError (closed), LockTimeoutError (staging).
        """
        gate: RWLock | MutexLock | PlainGate = (
            make_lock("mutex", "kv-room-gate", LockLevel.ROOM_GATE, debug=True)
            if self._debug_gates
            else PlainGate()
        )
        now = time.monotonic()
        with self.lock.write():
            if self.closing:
                raise RuntimeError("KVManager is closed")
            if room in self.rooms:
                raise RoomAlreadyOpenError(room)
            handle = self.staging.open_room(room)
            self.rooms[room] = RoomEntry(handle, sessions, gate, now)
            self.request_status[room] = KVPoll.Bootstrapping
            self.counts["rooms_opened"] += 1
        return handle

    def add_info(self, handle: RoomHandle, info: TransferInfo) -> bool:
        """Store ``info`` (see ``KVManager.add_transfer_info``). One write section.

        Raises:
            ValueError: not a session of the room; or too few destination pages for the
                declared ``num_kv_indices`` (then the room is failed, the info not stored).
        """
        short = False
        reason = ""
        with self.deciding(untimed=False) as after:
            entry = self.live_locked(handle, count=True)
            if entry is None:
                return False
            if info.session_id not in entry.sessions:
                raise ValueError(
                    f"session {info.session_id!r} is not a session of room {handle.room}"
                )
            # mutant-site: add-info
            short = entry.num_kv_indices is not None and (
                info.dst_pages.size < entry.num_kv_indices
            )
            if short:
                reason = (
                    f"session {info.session_id!r} gave {info.dst_pages.size} destination "
                    f"pages; the room sends num_kv_indices={entry.num_kv_indices}"
                )
                self.fail_locked(
                    handle, KVTransferError(handle.room, reason), reason, after,
                    code="bad-input", session_id=info.session_id,
                )
            else:
                infos = self.transfer_infos.setdefault(handle.room, {})
                infos[info.session_id] = info
                self.req_to_decode_prefix_len[handle.room] = max(
                    self.req_to_decode_prefix_len.get(handle.room, 0), info.decode_prefix_len
                )
                if len(infos) == len(entry.sessions):
                    self.set_status_locked(handle.room, KVPoll.WaitingForInput)
        if short:
            raise ValueError(f"room {handle.room} failed: {reason}")
        return True

    def init(self, handle: RoomHandle, num_kv_indices: int) -> bool:
        """Set ``num_kv_indices``. One write section.

        Raises:
            ValueError: larger than a stored info's ``dst_pages`` (nothing changes).
        """
        with self.lock.write():
            entry = self.live_locked(handle)
            if entry is None:
                return False
            for info in self.transfer_infos.get(handle.room, {}).values():
                if num_kv_indices > info.dst_pages.size:
                    raise ValueError(
                        f"num_kv_indices {num_kv_indices} > {info.dst_pages.size} destination "
                        f"pages of session {info.session_id!r}"
                    )
            entry.num_kv_indices = num_kv_indices
            return True

    def fail(
        self, handle: RoomHandle, exc: BaseException | None, reason: str, *,
        code: str | None = None, session_id: str | None = None, chunk_idx: int | None = None,
    ) -> bool:
        """:meth:`fail_locked` in one write section. Never raises for a state reason."""
        with self.deciding() as after:
            return self.fail_locked(
                handle, exc, reason, after, code=code, session_id=session_id,
                chunk_idx=chunk_idx,
            )

    def purge(self, room: int, generation: int | None) -> ManagerPurge:
        """See ``KVManager.purge_room``: under the post gate, one untimed write section.
        Never raises for a state reason."""
        # mutant-site: purge-peek
        with self.lock.read():
            entry = self.rooms.get(room)
        # mutant-site: purge-if-1
        if entry is None or (generation is not None and entry.handle.generation != generation):
            return ManagerPurge(room, False, None, (), None)
        after = After()
        gate = entry.gate  # mutant-site: purge-gate
        with gate.write_untimed(), self.lock.write_untimed():
            # mutant-site: purge-if-2
            if self.rooms.get(room) is not entry:  # another purge won
                return ManagerPurge(room, False, None, (), None)
            del self.rooms[room]  # mutant-site: purge-close
            status = self.request_status.get(room)  # mutant-site: purge-status
            exception = self.exceptions.get(room)
            tables: list[str] = []
            for name, table in self.tables_locked():  # a plain loop: DPOR traces it precisely
                if table.pop(room, None) is not None:
                    tables.append(name)
            # mutant-site: purge-set-staged
            staged = self.staging.purge_room(entry.handle)
            # Slots are not returned here: their holders return them when their chunk ends
            # or is skipped (a posted transfer may still read one).
            with self.failure_lock.write():
                record = self.failure_records.pop(room, None)
                if record is not None:
                    tables.append("failure_records")
            for chunk_id, chunk in entry.inflight.items():
                self.draining[chunk_id] = chunk
            draining = len(entry.inflight)
            if draining:
                self.draining_by_handle[entry.handle] = draining
            entry.inflight.clear()
            self.counts["purges"] += 1  # mutant-site: purge-count
            if not is_concluded(status):
                self.counts["rooms_cleared"] += 1
                entry.concluded = True
                after.log(
                    logging.INFO,
                    "room %d generation %d cleared before it concluded (status %s, "
                    "%d chunks draining)",
                    room, entry.handle.generation, getattr(status, "name", status), draining,
                )
                self._told_locked(entry, after, "cleared", "cleared")
            # None for a room that succeeded, then failed (docs/PROTOCOL.md).
            if self.notifier.enabled and status is not KVPoll.Success and not entry.succeeded:
                failed = status is KVPoll.Failed
                notice = RoomNotice(
                    room, entry.handle.generation, "failed" if failed else "cleared",
                    (entry.failure_code or code_for(record, exception)) if failed else "cleared",
                )
                # mutant-site: purge-hold
                if draining:
                    self.notifier.hold(entry.handle, notice, entry.sessions)
                else:
                    self.notifier.enqueue(notice, entry.sessions)
            self.seal_locked(after)
        self.publish(after)  # mutant-site: purge-publish
        return ManagerPurge(room, True, status, tuple(tables), staged, exception, record, draining)

    def fail_session(self, session_id: str, reason: str) -> frozenset[int]:
        """Fail every open, unconcluded room of ``session_id`` and drop its staging keys, in
        one untimed write section. Never raises for a state reason."""
        with self.deciding() as after:
            return self.fail_session_locked(session_id, reason, after)

    def fail_session_locked(self, session_id: str, reason: str, after: After) -> frozenset[int]:
        """:meth:`fail_session` in the caller's write section (rooms and counter together)."""
        failed: list[tuple[int, int]] = []
        for room_id, entry in self.rooms.items():
            if session_id not in entry.sessions:
                continue
            if is_concluded(self.request_status.get(room_id)):
                continue
            exc = KVTransferError(
                room_id,
                f"decode peer {session_id!r} failed: {reason}",
                generation=entry.handle.generation,
                session_id=session_id,
            )
            self.fail_locked(
                entry.handle, exc, exc.reason, after, code="peer-failed",
                session_id=session_id, quiet=True,
            )
            failed.append((room_id, entry.handle.generation))
        # mutant-site: fail-session-locked
        self.staging.purge_session(session_id)
        self.counts["sessions_failed"] += 1
        # Later chunks with the same error fail it again with nothing left: DEBUG then.
        level = logging.WARNING if failed else logging.DEBUG
        if failed or logger.isEnabledFor(logging.DEBUG):
            named = ", ".join(f"{r} (gen {g})" for r, g in failed[:MAX_ROOMS_LOGGED])
            more = len(failed) - MAX_ROOMS_LOGGED
            after.log(
                level, "decode session %r failed (%s): %d unconcluded rooms failed%s%s",
                session_id, reason, len(failed), f": {named}" if failed else "",
                f" and {more} more" if more > 0 else "",
            )
        return frozenset(r for r, _ in failed)

    def close_begin(self) -> list[RoomHandle]:
        """Refuse new rooms from now on; the handles of the rooms open now (one section)."""
        handles: list[RoomHandle] = []
        # mutant-site: close-begin
        with self.lock.write_untimed():
            self.closing = True
            for entry in self.rooms.values():  # a plain loop: DPOR traces it precisely
                handles.append(entry.handle)
        return handles

    # ------------------------------------------------------------------ chunks

    def begin_chunk(
        self, handle: RoomHandle, chunk_idx: int, start: int, kv_indices: Any,
        src_checked: CheckedPages | None, is_last: bool, *, entry_expected: RoomEntry | None = None,
        enqueue: Callable[[list[Chunk]], None] | None = None,
    ) -> list[Chunk] | None:
        """Check a send and make one chunk per session, in one write section; ``None`` if
        the opening is purged or failed. ``entry_expected`` (its gate held): also register
        them in flight; ``enqueue``: hand them to it under the lock.

        Raises:
            ValueError: room not ready, ``chunk_idx`` already submitted, the chunk ends past
                ``num_kv_indices`` or a session's pages, or exceeds a staging slot. Nothing
                changes then.
        """
        n = int(kv_indices.shape[0])
        end = start + n
        now = time.monotonic() if self.events is not None else 0.0
        with self.deciding(untimed=False) as after:
            entry = entry_expected or self.live_locked(handle)
            if entry is None or not self.postable_locked(handle, entry):
                return None
            infos = self.transfer_infos.get(handle.room)
            if entry.num_kv_indices is None or infos is None or len(infos) != len(entry.sessions):
                raise ValueError(f"room {handle.room} is not ready: no transfer info or no init")
            if chunk_idx in entry.chunk_idxs:
                raise ValueError(f"chunk {chunk_idx} of room {handle.room} was already submitted")
            if end > entry.num_kv_indices:
                raise ValueError(
                    f"chunk ends at page {end}, past num_kv_indices={entry.num_kv_indices}"
                )
            chunks: list[Chunk] = []
            for info in infos.values():  # nothing changes until every info passed
                # Pages in the decode prefix are already at the peer.
                skip = min(max(info.decode_prefix_len - start, 0), n)
                sends = skip < n
                if self.pool is not None and n - skip > self.pool.slot_pages:
                    raise ValueError(
                        f"chunk {chunk_idx} of room {handle.room} sends {n - skip} pages to "
                        f"session {info.session_id!r}; a staging slot holds "
                        f"{self.pool.slot_pages}"
                    )
                src = dst = None
                # Both checked when it sends: kv_indices and the session's pages are not empty.
                if sends and src_checked is not None and info.dst_checked is not None:
                    src, dst = src_checked[skip:], info.dst_checked[start + skip : end]
                chunks.append(
                    Chunk(
                        handle, chunk_idx, info.session_id, src, dst, info.byte_range,
                        info.dst_region, is_last, next(self._chunk_ids), now,
                    )
                )
            entry.chunk_idxs.add(chunk_idx)
            entry.jobs_total += len(chunks)
            entry.last_chunk_seen = entry.last_chunk_seen or is_last
            self.counts["chunks_submitted"] += len(chunks)
            self.set_status_locked(handle.room, KVPoll.Transferring)
            if is_last and not chunks:
                self.maybe_succeed_locked(entry, after)
            if entry_expected is not None:
                for chunk in chunks:
                    entry.inflight[chunk.chunk_id] = chunk
            elif enqueue is not None:
                enqueue(chunks)
        return chunks

    def register(
        self, handle: RoomHandle, entry: RoomEntry, chunks: Sequence[Chunk], after: After
    ) -> bool:
        """The post fence (``entry.gate`` held): register ``chunks`` in flight if the
        opening is postable (``True``); else count them skipped into ``after``, sealed, for
        the caller to publish after the gate (``False``)."""
        with self.lock.write():
            # mutant-site: register
            if self.postable_locked(handle, entry, count=True):
                for chunk in chunks:
                    entry.inflight[chunk.chunk_id] = chunk
                return True
            self.skipped_locked(chunks, after)
            self.seal_locked(after)
            return False

    def still_postable(self, handle: RoomHandle, entry: RoomEntry) -> bool:
        """May a chunk of it still be staged? (:meth:`register` decides.)"""
        with self.lock.read():
            return self.postable_locked(handle, entry)

    def note_prefetched(self, chunk: Chunk) -> bool:
        """Record ``chunk``'s prefetch key if it has pages and count it on its room; mark the
        room prefetched once all its chunks are in. ``False``: its key was not recorded (its
        room is gone: the chunk is counted skipped)."""
        staged = chunk.num_pages > 0
        kept = not staged or self.staging.request_prefetch(
            chunk.handle, chunk.chunk_idx, chunk.session_id
        )
        complete = False
        with self.deciding(untimed=False) as after:
            entry = self.live_locked(chunk.handle, count=staged and kept)
            if entry is not None and kept:
                entry.prefetch_requests += 1
                complete = entry.last_chunk_seen and entry.prefetch_requests == entry.jobs_total
            elif staged:
                kept = False
                self.skipped_locked((chunk,), after)
        if complete:
            self.staging.mark_prefetched(chunk.handle)
        return kept

    def skipped_locked(self, chunks: Sequence[Chunk], after: After) -> None:
        """Count ``chunks`` skipped (never posted), events into ``after``; ``lock`` held."""
        self.counts["chunks_skipped"] += len(chunks)
        # mutant-site: skipped-locked
        if self.events is not None and chunks:
            now = time.monotonic()
            for chunk in chunks:
                after.ended.append(
                    (chunk.session_id, "skipped", now - chunk.made_at, self.nbytes(chunk))
                )

    def skip(self, chunks: Sequence[Chunk]) -> None:
        """:meth:`skipped_locked` in one write section."""
        with self.deciding(untimed=False) as after:
            self.skipped_locked(chunks, after)

    def slot_failed(self, chunk: Chunk, exc: BaseException, *, code: str) -> None:
        """No staging slot for ``chunk``: fail its room with ``code``; the chunk ends failed
        (or skipped)."""
        self._fail_chunk(chunk, exc, f"no staging slot: {exc}", untimed=False, code=code)

    def internal_error(self, chunk: Chunk, exc: BaseException, *, chunk_ends: bool) -> None:
        """An unexpected error handling ``chunk``: count it, fail the room, and with
        ``chunk_ends`` end the chunk. Never raises."""
        try:
            self._fail_chunk(
                chunk, exc, f"internal error in transfer worker: {exc!r}",
                chunk_ends=chunk_ends, worker_error=True,
            )
        except BaseException:
            self.unaccounted_errors += 1

    def _fail_chunk(
        self, chunk: Chunk, exc: BaseException, reason: str, *, untimed: bool = True,
        chunk_ends: bool = True, worker_error: bool = False, code: str = "internal",
    ) -> None:
        """Fail ``chunk``'s room with ``code``; with ``chunk_ends`` the unposted chunk ends
        failed (skipped)."""
        with self.deciding(untimed=untimed) as after:
            if worker_error:
                self.counts["worker_errors"] += 1
            failed = self.fail_locked(
                chunk.handle, exc, reason, after, code=code,
                session_id=chunk.session_id, chunk_idx=chunk.chunk_idx,
            )
            if chunk_ends and not failed:  # a purged opening's unposted chunk: skipped
                self.skipped_locked((chunk,), after)
            elif chunk_ends:
                self.counts["chunks_failed"] += 1
                # mutant-site: ended-locked
                if self.events is not None:
                    after.ended.append(
                        (chunk.session_id, "failed", time.monotonic() - chunk.made_at,
                         self.nbytes(chunk))
                    )

    def mark_hung(self, chunk: Chunk, exc: BaseException, *, fail_session: bool = False) -> bool:
        """The chunk failed by us while NIXL still has it: fail its room (and its session
        with ``fail_session``), keep the chunk until it settles. ``False`` if hung or ended
        already."""
        with self.deciding() as after:
            if chunk.hung is not None or chunk.ended:
                return False
            chunk.hung = exc
            self.hung[chunk.chunk_id] = chunk
            reason = (
                f"transfer of chunk {chunk.chunk_idx} to {chunk.session_id!r} failed: {exc!r}"
            )
            self.fail_locked(
                chunk.handle, exc, reason, after, code=code_for(reason, exc),
                session_id=chunk.session_id, chunk_idx=chunk.chunk_idx,
            )
            if fail_session:
                self.fail_session_locked(chunk.session_id, f"{type(exc).__name__}: {exc}", after)
        return True

    def account_ends(
        self, ends: Sequence[tuple[Chunk, BaseException | None, bool, bool]],
        nbytes: Callable[[Chunk], int], fatal: Callable[[BaseException], bool],
    ) -> After:
        """The locked half of ending claimed chunks ``(chunk, exc, abandoned,
        already_failed)``, in one write section: unregister, count, advance or fail the
        room, release a held notice, fail fatal sessions. Returns the sealed After."""
        after = After()
        fatal_ends: list[tuple[str, BaseException]] = []
        now = time.monotonic()
        with self.lock.write_untimed():
            counts = self.counts
            for chunk, exc, abandoned, already_failed in ends:
                handle = chunk.handle
                chunk_id = chunk.chunk_id
                released = isinstance(exc, TransferReleasedError)
                if chunk.transfer is not None:  # its write was posted, whatever its end
                    counts["bytes_posted"] += nbytes(chunk)
                self.hung.pop(chunk_id, None)
                drained = bool(self.draining) and self.draining.pop(chunk_id, None) is not None
                left = 0
                if drained:
                    left = self.draining_by_handle.get(handle, 1) - 1
                    if left > 0:
                        self.draining_by_handle[handle] = left
                    else:
                        self.draining_by_handle.pop(handle, None)
                # mutant-site: account-ends-if-1
                if abandoned:
                    # Its writes may still land: the decode side must not reuse the pages.
                    self.notifier.withhold(handle)
                elif drained and left == 0:
                    self.notifier.drained(handle)  # its opening's last posted chunk ended
                entry = self.live_locked(handle)
                if not drained and entry is not None:
                    entry.inflight.pop(chunk_id, None)
                # mutant-site: account-ends-if-2
                if drained or entry is None or abandoned:
                    counts["chunks_drained"] += 1
                    if released:
                        counts["chunks_released_by_transport"] += 1
                    outcome = "drained"
                elif exc is None:
                    entry.jobs_done += 1
                    counts["chunks_done"] += 1
                    if entry.last_chunk_seen and entry.jobs_done == entry.jobs_total:
                        self.maybe_succeed_locked(entry, after)
                    outcome = "done"
                else:
                    counts["chunks_failed"] += 1
                    outcome = "failed"
                if self.events is not None:
                    after.ended.append(
                        (chunk.session_id, outcome, now - chunk.made_at, nbytes(chunk))
                    )
                if outcome != "failed" or already_failed:
                    continue
                assert exc is not None
                what = f"transfer of chunk {chunk.chunk_idx} to {chunk.session_id!r}"
                stored: BaseException = exc
                if released:
                    counts["chunks_released_by_transport"] += 1
                    reason = (
                        f"{what} was released by the transport (peer removed or transport "
                        "closed)"
                    )
                    code = "transport"
                else:
                    reason = f"{what} failed: {exc!r}"
                    code = code_for(reason, exc)
                if released or isinstance(exc, TransferFailedError):
                    stored = KVTransferError(
                        handle.room, reason if released else f"transfer in error state ({exc})",
                        generation=handle.generation, session_id=chunk.session_id,
                        chunk_idx=chunk.chunk_idx,
                    )
                    stored.__cause__ = exc
                self.fail_locked(
                    handle, stored, reason, after, code=code, session_id=chunk.session_id,
                    chunk_idx=chunk.chunk_idx,
                )
                if fatal(exc):
                    fatal_ends.append((chunk.session_id, exc))
            # In this section: a reader sees the room and its session failed together.
            for session_id, fatal_exc in fatal_ends:
                self.fail_session_locked(
                    session_id, f"{type(fatal_exc).__name__}: {fatal_exc}", after
                )
            self.seal_locked(after)
        return after

    def pending_of(self, handle: RoomHandle) -> list[Chunk]:
        """What inline ``progress(handle)`` polls: the room's in-flight chunks, every
        draining chunk and other rooms' hung chunks."""
        with self.lock.read():
            entry = self.live_locked(handle)
            pending = [] if entry is None else list(entry.inflight.values())
            # mutant-site: pending-of
            pending.extend(self.draining.values())
            for hung in self.hung.values():  # hung chunks of other open rooms
                if hung.handle.room != handle.room:
                    pending.append(hung)
        return pending

    def slot_holders(self) -> list[Chunk]:
        """The posted chunks that hold a staging slot, open rooms' and draining."""
        with self.lock.read():
            chunks = itertools.chain(*(e.inflight.values() for e in self.rooms.values()))
            return [
                c
                for c in itertools.chain(chunks, self.draining.values())
                if c.slot is not None and c.transfer is not None
            ]

    def hung_chunks(self) -> list[Chunk]:
        """A snapshot of the hung chunks."""
        with self.lock.read():
            # mutant-site: hung-chunks
            return list(self.hung.values())

    # ------------------------------------------------------------------ snapshots

    def gauges(self) -> tuple[int, int, int]:
        """``(open rooms, in-flight chunks, draining chunks)``; caller holds ``lock``."""
        return (
            len(self.rooms),
            sum(len(e.inflight) for e in self.rooms.values()),
            len(self.draining),
        )
