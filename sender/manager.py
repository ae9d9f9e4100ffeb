"""``KVManager``: one prefill sender's room table, chunk pipeline and notifier.

* :mod:`sender.rooms`: the per-room tables (``request_status``, ``transfer_infos``, ...,
  named as upstream engines name them) and every change to them; owns the ROOM and FAILURE
  locks and each room's post gate.
* :mod:`sender.pipeline`: staging, posting, polling, hung-chunk sweeps, the workers.
* :mod:`sender.notifier`: room notices to the decode side, sent by one thread.

Every write names the :class:`RoomHandle` of its opening; one for a purged or reopened room
is refused and counted. Chunks posted before a purge drain (NIXL cannot cancel a write).
Lock order: ROOM_GATE -> ROOM -> STAGING -> POOL -> FAILURE; of these only a room's post gate
is held across a NIXL call. See docs/THREADING.md, "The sender" and "Lock hierarchy".
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from types import MappingProxyType
from typing import Any

import torch

from sender.chunks import Chunk, TransferLike
from sender.errors import KVTransferError, PeerNotFoundError
from sender.infos import PageArray, TransferInfo, checked_info, make_transfer_info
from sender.notifier import Notifier
from sender.pipeline import SESSION_FATAL_ERRORS, ChunkPipeline, TransportLike
from sender.poll import KVPoll
from sender.rooms import ManagerEvents, ManagerPurge, RoomTable
from staging.buffers import StagingBufferPool
from staging.context import RoomHandle, StagingContext
from staging.locks import MutexLock, RWLock
from staging.validate import check_index, check_room_id, check_seconds, check_session_id

__all__ = [
    "SESSION_FATAL_ERRORS", "Chunk", "KVManager", "ManagerPurge", "ManagerStats", "PageArray",
    "TransferInfo", "TransferLike", "TransportLike", "make_transfer_info",
]

_CLAIMED_END_GRACE_S = 0.5
"""Least time ``close()`` waits for chunk ends other threads claimed (so their notices queue)."""


def _pipeline_setting(name: str) -> Any:
    """A read-only property: the manager's pipeline's setting ``name``."""
    return property(attrgetter(f"pipeline.{name}"))


def _snapshot(table: str, doc: str, *, lock: str = "_room_lock") -> Any:
    """A read-only property: a frozen copy of the room table's ``table`` under ``lock``."""

    def read(self: KVManager) -> Mapping[Any, Any]:
        with getattr(self, lock).read():
            return MappingProxyType(dict(getattr(self.rooms, table)))

    return property(read, doc=doc)


@dataclass(frozen=True, slots=True)
class ManagerStats:
    """Counters and gauges of one manager (a consistent snapshot, taken under its lock).

    Each chunk ends once: at a quiescent point ``chunks_submitted == chunks_done +
    chunks_failed + chunks_skipped + chunks_drained``. Each room concludes at most once, as
    ``rooms_succeeded``, ``rooms_failed`` (by notice code in ``rooms_failed_by_code``) or
    ``rooms_cleared``. Gauges: ``open_rooms``, ``transfers_inflight``, ``transfers_draining``,
    ``notices_pending``. Meanings: docs/METRICS.md, "From `KVManager.stats()`".
    """

    open_rooms: int
    rooms_opened: int
    purges: int
    chunks_submitted: int
    chunks_done: int
    chunks_skipped: int
    chunks_failed: int
    chunks_drained: int
    chunks_released_by_transport: int
    transfers_inflight: int
    transfers_draining: int
    transfers_abandoned: int
    refused_late_writes: int
    sessions_failed: int
    worker_errors: int
    notices_sent: int
    notices_failed: int
    notices_withheld: int
    rooms_succeeded: int = 0
    rooms_failed: int = 0
    rooms_cleared: int = 0
    rooms_failed_by_code: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    bytes_posted: int = 0
    notices_queued: int = 0
    notices_pending: int = 0
    notices_skipped_dead: int = 0


class KVManager:
    """Per-room state, transfer workers and purge for one prefill sender.

    Args:
        transport: a started :class:`sender.transport.NixlTransport` (or anything with its
            ``write_pages``) with ``kv_pool`` registered as region ``kv_region``.
        kv_pool: the prefill KV pool, ``[num_pages, page_bytes]`` uint8.
        num_workers: transfer-worker threads; ``0`` runs transfers inline on the caller's
            thread (``submit_chunk`` starts them, ``progress`` polls them).
        staging: the staging context (one is made if ``None``).
        staging_pool: staging slots: each chunk is gathered into one and sent with one write
            from region ``staging_region``; ``None`` sends straight from ``kv_region``. Its
            ``page_bytes`` is a KV page's size, or that of the infos' ``byte_range`` slice.
        transfer_timeout_s: deadline of every transfer (the only way a hung peer is seen).
        slot_timeout_s: how long a chunk waits for a free staging slot.
        session_slots: the most slots one decode session's chunks may hold at once
            (``None``: half the pool, at least 1); docs/THREADING.md, "Peer isolation".
        lock: kind of the room table's lock (``"mutex"`` or ``"rw"``).
        debug: lock debug mode (``None`` reads env ``NIXL_STAGING_DEBUG_LOCKS``).
        poll_interval_s: a worker's pause between polls of a pending transfer (at most
            ``transfer_timeout_s``); ``None`` adapts (:func:`sender.transport.poll_pauses`).
        fail_session_on_disconnect: a transport error fails every room with a transfer to
            that session at once.
        notify_decode: send a room notice (:mod:`sender.notices`) to the decode sessions of
            a room failed or cleared before ``Success``, once drained; needs ``send_notif``.
        events: a listener of room conclusions and chunk ends (:mod:`sender.events`).

    Raises:
        TypeError, ValueError: a bad argument or timeout (``poll_interval_s`` above
            ``transfer_timeout_s``), a ``staging_pool`` whose pages are larger than a KV
            page; with a transport that has ``closed`` and ``regions()``: a closed transport,
            ``kv_region`` (or ``staging_region``) not registered, or ``kv_pool`` not the
            tensor registered as ``kv_region``.
    """

    def __init__(
        self, transport: TransportLike, kv_pool: torch.Tensor, *, num_workers: int = 2,
        staging: StagingContext | None = None, staging_pool: StagingBufferPool | None = None,
        transfer_timeout_s: float = 30.0, slot_timeout_s: float = 5.0,
        session_slots: int | None = None, lock: str = "mutex", debug: bool | None = None,
        poll_interval_s: float | None = None, kv_region: str = "kv",
        staging_region: str = "staging", fail_session_on_disconnect: bool = True,
        notify_decode: bool = True, events: ManagerEvents | None = None,
    ) -> None:
        """Make one: its arguments and what it raises are in ``help(KVManager)``."""
        check_index(num_workers, "num_workers")
        if kv_pool.dim() != 2 or kv_pool.dtype != torch.uint8:
            raise TypeError("kv_pool must be a 2-D uint8 tensor [num_pages, page_bytes]")
        check_seconds(transfer_timeout_s, "transfer_timeout_s")
        check_seconds(slot_timeout_s, "slot_timeout_s", allow_zero=True)
        if staging_pool is not None and staging_pool.page_bytes > int(kv_pool.shape[1]):
            raise ValueError(
                f"staging_pool page_bytes {staging_pool.page_bytes} > the KV pool's page "
                f"size {int(kv_pool.shape[1])} B: no page or slice of one fits its slots"
            )
        # Against the transport only once the arguments alone passed.
        _check_transport(transport, kv_pool, kv_region, staging_region, staging_pool)
        if poll_interval_s is not None:
            check_seconds(poll_interval_s, "poll_interval_s", allow_zero=True)
            if poll_interval_s > transfer_timeout_s:
                # else a room could stay Transferring past its deadline
                raise ValueError(
                    f"poll_interval_s {poll_interval_s} > transfer_timeout_s {transfer_timeout_s}"
                )
        self.transport = transport
        self.kv_pool = kv_pool
        self.staging = staging if staging is not None else StagingContext(debug=debug)
        self.staging_pool = staging_pool
        num_slots = staging_pool.num_slots if staging_pool is not None else 1
        if session_slots is None:
            session_slots = max(1, num_slots // 2)
        elif not 1 <= check_index(session_slots, "session_slots") <= num_slots:
            raise ValueError(f"session_slots must be in [1, {num_slots}], got {session_slots}")
        send_notif = getattr(transport, "send_notif", None)
        disconnected = getattr(transport, "peer_disconnected", None)
        self.notifier = Notifier(
            send_notif if notify_decode and callable(send_notif) else None,
            disconnected if callable(disconnected) else None,
        )
        self.rooms = RoomTable(
            self.staging, pool=staging_pool, notifier=self.notifier, lock=lock, debug=debug,
            events=events,
        )
        self.failure_lock: RWLock | MutexLock = self.rooms.failure_lock
        self._room_lock: RWLock | MutexLock = self.rooms.lock
        self.pipeline = ChunkPipeline(
            self.rooms, transport, kv_pool, staging_pool=staging_pool, num_workers=num_workers,
            transfer_timeout_s=float(transfer_timeout_s), slot_timeout_s=float(slot_timeout_s),
            session_slots=int(session_slots),
            poll_interval_s=None if poll_interval_s is None else float(poll_interval_s),
            kv_region=kv_region, staging_region=staging_region,
            fail_session_on_disconnect=bool(fail_session_on_disconnect),
        )
        self._workers = self.pipeline.workers

    # The settings live in the pipeline, whose workers read them; the manager shows them
    # read-only, fixed at construction.
    transfer_timeout_s: float = _pipeline_setting("transfer_timeout_s")
    slot_timeout_s: float = _pipeline_setting("slot_timeout_s")
    session_slots: int = _pipeline_setting("session_slots")
    poll_interval_s: float | None = _pipeline_setting("poll_interval_s")
    kv_region: str = _pipeline_setting("kv_region")
    staging_region: str = _pipeline_setting("staging_region")
    fail_session_on_disconnect: bool = _pipeline_setting("fail_session_on_disconnect")

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    @property
    def debug(self) -> bool:
        """Debug mode: lock order checks, and each ``NixlKVSender``'s one-thread check.
        Never raises."""
        return self._room_lock.debug

    request_status: Mapping[int, KVPoll] = _snapshot(
        "request_status", "Snapshot (read-only) of room -> status. Thread-safe; read lock."
    )
    req_to_decode_prefix_len: Mapping[int, int] = _snapshot(
        "req_to_decode_prefix_len",
        "Snapshot (read-only) of room -> decode prefix length. Thread-safe; read lock.",
    )
    exceptions: Mapping[int, BaseException] = _snapshot(
        "exceptions", "Snapshot (read-only) of room -> stored exception. Thread-safe; read lock."
    )
    failure_records: Mapping[int, str] = _snapshot(
        "failure_records",
        "Snapshot (read-only) of room -> failure reason. Thread-safe; failure lock.",
        lock="failure_lock",
    )

    @property
    def transfer_infos(self) -> Mapping[int, Mapping[str, TransferInfo]]:
        """Snapshot (read-only) of room -> {session: info}. Thread-safe; read lock."""
        with self._room_lock.read():
            return MappingProxyType(
                {r: MappingProxyType(dict(i)) for r, i in self.rooms.transfer_infos.items()}
            )

    def status(self, room: int) -> KVPoll | None:
        """The room's status, or ``None`` if it is not open. Thread-safe; read lock.

        Raises:
            TypeError, ValueError: bad ``room``.
        """
        room = check_room_id(room)
        with self._room_lock.read():
            status = self.rooms.request_status.get(room)
            pending = self.rooms.pending_locked()
        self.rooms.await_published(pending)
        return status

    def handle_status(self, handle: RoomHandle) -> KVPoll | None:
        """The status of that opening, or ``None`` once it is purged (or ``handle`` is stale).
        Thread-safe; read lock. Returns once the log lines and listener calls of every change
        it shows were made, so ``stats()`` and the metrics agree with it.

        Raises:
            TypeError: ``handle`` is not a :class:`RoomHandle`.
        """
        _check_handle(handle)
        rooms = self.rooms
        with self._room_lock.read():
            live = rooms.live_locked(handle) is not None
            status = rooms.request_status.get(handle.room) if live else None
            pending = rooms.pending_locked()
        rooms.await_published(pending)  # what it shows is logged and told first
        return status

    def is_open(self, handle: RoomHandle) -> bool:
        """``True`` while that opening of the room is open. Thread-safe; read lock.

        Raises:
            TypeError: ``handle`` is not a :class:`RoomHandle`.
        """
        _check_handle(handle)
        with self._room_lock.read():
            return self.rooms.live_locked(handle) is not None

    def draining(self, handle: RoomHandle | None = None) -> int:
        """A purged opening's (every purged one's with ``None``) posted chunks not yet ended,
        plus the staging slots workers still hold for it; 0 for an open room. Its decode pages
        and slots may be reused once this is 0 (docs/THREADING.md, "Draining"). Thread-safe;
        read lock; does not poll.

        Raises:
            TypeError: ``handle`` is neither ``None`` nor a :class:`RoomHandle`.
        """
        _check_handle(handle, none_ok=True)
        with self._room_lock.read():
            return self.rooms.lingering_locked(handle)

    def wait_drained(self, handle: RoomHandle | None = None, timeout_s: float = 5.0) -> bool:
        """Poll the draining transfers of that opening (all with ``None``) until
        :meth:`draining` is 0 (``True``) or ``timeout_s`` passed (``False``). Never raises for
        a transport error. Thread-safe.

        Raises:
            TypeError, ValueError: bad ``handle`` or ``timeout_s`` (not a number >= 0;
                ``inf`` waits as long as it takes).
        """
        _check_handle(handle, none_ok=True)
        timeout_s = check_seconds(timeout_s, "timeout_s", allow_zero=True, allow_inf=True)
        return self.pipeline.wait_drained(handle, timeout_s)

    def footprint(self, room: int) -> tuple[str, ...]:
        """Names of every table, the staging context or the pool still holding ``room``:
        empty for a purged room once :meth:`draining` is 0 (no leak). Thread-safe.

        Raises:
            TypeError, ValueError: bad ``room``.
            LockTimeoutError: the staging context's ``lock_timeout`` elapsed.
        """
        room = check_room_id(room)
        rooms = self.rooms
        with self._room_lock.read():
            entry = rooms.rooms.get(room)
            tables = (("rooms", rooms.rooms), *rooms.tables_locked())
            held = [name for name, table in tables if room in table]
            if entry is not None and entry.inflight:
                held.append("inflight")
            if any(c.handle.room == room for c in rooms.draining.values()):
                held.append("draining")
        with self.failure_lock.read():
            if room in rooms.failure_records:
                held.append("failure_records")
        if self.staging.is_open(room) or self.staging.room_requests(room):
            held.append("staging")
        if self.staging_pool is not None and any(
            getattr(owner, "room", None) == room for owner in self.staging_pool.owners()
        ):
            held.append("staging_pool")
        return tuple(held)

    def stats(self) -> ManagerStats:
        """Frozen counters and gauges. Thread-safe; read lock; never raises. Like
        :meth:`handle_status`, returns once the log lines and listener calls of what they count
        were made."""
        rooms = self.rooms
        # mutant-site: stats-with
        with self._room_lock.read():
            counts = dict(rooms.counts)
            by_code = MappingProxyType(dict(rooms.failed_by_code))
            open_rooms, inflight, draining = rooms.gauges()
            pending = rooms.pending_locked()
        rooms.await_published(pending)
        counts["worker_errors"] += rooms.unaccounted_errors
        notices = self.notifier.counts()
        # mutant-site: stats-return
        return ManagerStats(
            open_rooms=open_rooms, transfers_inflight=inflight, transfers_draining=draining,
            rooms_failed_by_code=by_code, notices_sent=notices.sent, notices_failed=notices.failed,
            notices_withheld=notices.withheld, notices_queued=notices.queued,
            notices_pending=notices.pending, notices_skipped_dead=notices.skipped_dead, **counts,
        )

    def open_room(self, room: int, session_ids: Sequence[str]) -> RoomHandle:
        """Open ``room`` for ``session_ids`` (status ``Bootstrapping``). Thread-safe; atomic,
        also against :meth:`close`.

        Raises:
            RoomAlreadyOpenError: the room is open.
            TypeError, ValueError: bad room or session ids (a ``str``, none, duplicates).
            RuntimeError: the manager is closed.
            LockTimeoutError: the staging context's ``lock_timeout`` elapsed (nothing opened).
        """
        room = check_room_id(room)
        if isinstance(session_ids, (str, bytes)):
            raise TypeError(
                f"session_ids must be a sequence of session id strings, got {session_ids!r}"
            )
        sessions = tuple(check_session_id(s) for s in session_ids)
        if not sessions:
            raise ValueError("a room needs at least one decode session")
        if len(set(sessions)) != len(sessions):
            raise ValueError(f"duplicate session ids: {sessions}")
        return self.rooms.open(room, sessions)

    def add_transfer_info(self, handle: RoomHandle, info: TransferInfo) -> bool:
        """Record where ``info.session_id`` wants the room's pages; with every session's info
        in, the status becomes ``WaitingForInput``. ``False`` for a purged room (counted) and
        for a session that is not a peer of the transport (the room is failed). Thread-safe;
        write lock; atomic.

        Raises:
            TypeError: ``handle`` or ``info`` of the wrong type.
            ValueError: the session is not the room's; a destination page past the peer's
                region or repeated; a byte range without a staging pool or past a KV page; a
                staged page not of the pool's ``page_bytes`` (nothing changes). Or fewer
                destination pages than ``init_room`` declared: not stored, the room **failed**.
        """
        _check_handle(handle)
        entry = self.rooms.peek(handle)  # lock-free; add_info checks again under the lock
        sessions = entry.sessions if entry is not None else None
        info, known_peer = self.vet_info(info, sessions, handle.room, peers=entry is not None)
        if entry is not None and not known_peer:
            reason = (
                f"session {info.session_id!r} is not a peer of the transport (never "
                "added, or removed after a fault)"
            )
            exc = KVTransferError(
                handle.room, reason, generation=handle.generation, session_id=info.session_id
            )
            self.rooms.fail(handle, exc, reason, code="peer-failed", session_id=info.session_id)
            return False
        return self.rooms.add_info(handle, info)

    def vet_info(
        self, info: TransferInfo, session_ids: Sequence[str] | None, room: int, *,
        peers: bool = True,
    ) -> tuple[TransferInfo, bool]:
        """:meth:`add_transfer_info`'s checks without a room: ``(normalised info, whether its
        session is a peer of the transport)``. ``session_ids=None`` skips the session check,
        ``peers=False`` those against the peers. Reads only; thread-safe.

        Raises:
            TypeError: ``info`` is not a :class:`TransferInfo`.
            ValueError: as :meth:`add_transfer_info` (session not one of ``session_ids``,
                destination past the peer's region, byte range without a pool, ...).
        """
        if not isinstance(info, TransferInfo):
            raise TypeError(f"info must be a TransferInfo, got {type(info).__name__}")
        info = checked_info(info)  # one not made by make_transfer_info is checked here
        if info.byte_range is not None and self.staging_pool is None:
            raise ValueError("byte_range (a TP slice of each page) needs a staging pool")
        if self.staging_pool is not None:
            _check_staged_page(info, int(self.kv_pool.shape[1]), self.staging_pool.page_bytes)
        if session_ids is not None and info.session_id not in session_ids:
            raise ValueError(
                f"session {info.session_id!r} is not a session of room {room} "
                f"(its sessions: {list(session_ids)})"
            )
        peer_regions = getattr(self.transport, "peer_regions", None)
        if peers and callable(peer_regions):
            try:
                regions = peer_regions(info.session_id)
            except PeerNotFoundError:
                return info, False
            region = regions.get(info.dst_region)
            if region is None:
                raise ValueError(f"session {info.session_id!r} has no region {info.dst_region!r}")
            if info.dst_checked is not None and info.dst_checked.max_page >= region.num_pages:
                raise ValueError(
                    f"dst_pages of session {info.session_id!r} reach page "
                    f"{info.dst_checked.max_page}; its region {info.dst_region!r} has "
                    f"{region.num_pages} pages"
                )
        return info, True

    def init_room(self, handle: RoomHandle, num_kv_indices: int) -> bool:
        """Set how many KV pages the room will send (``init``). Thread-safe; atomic.

        Raises:
            TypeError, ValueError: bad count, or more than a session's ``dst_pages`` (nothing
                changes).
        """
        _check_handle(handle)
        num_kv_indices = check_index(num_kv_indices, "num_kv_indices")
        return self.rooms.init(handle, num_kv_indices)

    def ready(self, handle: RoomHandle) -> bool:
        """``True`` when every session's info is in and ``init_room`` was called.
        Thread-safe; read lock.

        Raises:
            TypeError: ``handle`` is not a :class:`RoomHandle`.
        """
        _check_handle(handle)
        rooms = self.rooms
        with self._room_lock.read():
            entry = rooms.live_locked(handle)
            return (
                entry is not None
                and entry.num_kv_indices is not None
                and len(rooms.transfer_infos.get(handle.room, {})) == len(entry.sessions)
            )

    def submit_chunk(
        self, handle: RoomHandle, chunk_idx: int, start: int, kv_indices: PageArray, is_last: bool
    ) -> int:
        """Queue chunk ``chunk_idx`` (room pages ``[start, start+len)``) for every session;
        the number of chunks made (0 for a purged or failed room). Inline
        (``num_workers=0``) the transfers start here; a transport error fails the room, never
        raised. Thread-safe.

        Raises:
            TypeError, ValueError: bad ``chunk_idx``/``start``, the room not ready,
                ``chunk_idx`` repeated, indices outside the KV pool or past
                ``num_kv_indices``, more pages for a session than a slot holds. Nothing
                changes.
        """
        _check_handle(handle)
        return self.pipeline.submit(handle, chunk_idx, start, kv_indices, is_last)

    def progress(self, handle: RoomHandle) -> None:
        """Inline mode: poll the room's pending transfers and every draining one, once each;
        with workers, sweep hung chunks when due. A transport error fails the chunk's room,
        never raised. Thread-safe.

        Raises:
            TypeError: ``handle`` is not a :class:`RoomHandle`.
        """
        _check_handle(handle)
        self.pipeline.progress(handle)

    def record_failure(self, handle: RoomHandle, exc: BaseException | None, reason: str) -> bool:
        """Fail the room: status ``Failed``, keep ``exc`` (first one wins) and ``reason``;
        ``False`` (counted) for a purged room. Thread-safe; atomic.

        Raises:
            TypeError: ``handle`` is not a :class:`RoomHandle`.
        """
        _check_handle(handle)
        return self.rooms.fail(handle, exc, reason)

    def pop_exception(self, handle: RoomHandle) -> BaseException | None:
        """Remove and return that opening's stored exception (``None`` if purged or none).
        Thread-safe; atomic with the ownership check.

        Raises:
            TypeError: ``handle`` is not a :class:`RoomHandle`.
        """
        _check_handle(handle)
        with self._room_lock.write():
            if self.rooms.live_locked(handle) is None:
                return None
            return self.rooms.exceptions.pop(handle.room, None)

    def pop_failure_record(self, handle: RoomHandle) -> str | None:
        """Remove and return that opening's failure reason (``None`` if purged or none).
        Thread-safe; atomic with the ownership check.

        Raises:
            TypeError: ``handle`` is not a :class:`RoomHandle`.
        """
        _check_handle(handle)
        # mutant-site: pop-failure-record
        with self._room_lock.write():
            if self.rooms.live_locked(handle) is None:
                return None
            with self.failure_lock.write():
                return self.rooms.failure_records.pop(handle.room, None)

    def purge_room(self, room: int | RoomHandle) -> ManagerPurge:
        """Remove the room from every table, the staging context and the slot pool at once.

        All-or-nothing, untimed, never raises for a state reason; no chunk of this opening
        is posted after it returns, and posted ones drain (:meth:`draining`). Idempotent; a
        stale handle never purges a newer opening. Thread-safe (docs/THREADING.md, "Why
        `clear()` is safe from any thread").

        Raises:
            TypeError, ValueError: bad ``room``.
        """
        if isinstance(room, RoomHandle):
            room_id, generation = room.room, room.generation
        else:
            room_id, generation = room, None
        return self.rooms.purge(check_room_id(room_id), generation)

    def fail_session(self, session_id: str, reason: str) -> frozenset[int]:
        """A decode peer died: fail every open, unconcluded room with a transfer to it, drop
        the session's staging keys; the rooms failed. Thread-safe; atomic; never raises for a
        state reason.

        Raises:
            TypeError, ValueError: bad ``session_id``.
        """
        return self.rooms.fail_session(check_session_id(session_id), reason)

    def close(self, timeout_s: float = 5.0) -> None:
        """Refuse new rooms, purge every open room, drain, stop the workers and the notifier.
        Idempotent; atomic against :meth:`open_room`; safe from any thread, also a listener
        callback on a worker (that worker exits once the callback returns).

        Transfers still in flight after ``timeout_s`` are abandoned (counted; their rooms'
        notices withheld) and stay draining until NIXL settles them or the transport closes.
        Chunk ends other threads claimed, and queued notices, get at least 0.5 s; a notifier
        blocked on an unreachable peer is left behind (a daemon thread).

        Raises:
            TypeError, ValueError: bad ``timeout_s`` (not a number >= 0; ``inf`` waits as long
                as it takes), checked before anything changes.
            RuntimeError: a worker did not stop within ``timeout_s``.
        """
        timeout_s = check_seconds(timeout_s, "timeout_s", allow_zero=True, allow_inf=True)
        deadline = time.monotonic() + timeout_s
        pipeline, rooms = self.pipeline, self.rooms
        for handle in rooms.close_begin():
            self.purge_room(handle)
        pipeline.stop_workers()
        pipeline.wait_drained(None, max(0.0, deadline - time.monotonic()))
        abandoned = pipeline.abandon_draining()
        if abandoned:
            rooms.count("transfers_abandoned", abandoned)
        # Chunks other threads claimed are ending and will queue their rooms' notices: wait.
        # mutant-site: close-set-settle-until
        settle_until = max(deadline, time.monotonic() + _CLAIMED_END_GRACE_S)
        while True:
            with self._room_lock.read():
                ending = sum(1 for c in rooms.draining.values() if c.ended)
            if not ending or time.monotonic() >= settle_until:
                break
            time.sleep(0.0005)
        # Still held after the grace: a release stuck in NIXL, its bytes may not have drained.
        self.notifier.withhold_all()
        alive = pipeline.join_workers(deadline)
        # At least the grace: a close's notices are what the decode side waits for.
        # mutant-site: close-call-stop
        self.notifier.stop(max(_CLAIMED_END_GRACE_S, deadline - time.monotonic()))
        if alive:
            raise RuntimeError(f"transfer workers did not stop: {alive}")

    def __enter__(self) -> KVManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_staged_page(info: TransferInfo, kv_page_bytes: int, pool_page_bytes: int) -> None:
    """ValueError unless the info's staged page (``byte_range`` slice or whole KV page) is
    the staging pool's page size."""
    if info.byte_range is None:
        start, length = 0, kv_page_bytes
    else:
        start, length = info.byte_range
        if start + length > kv_page_bytes:
            raise ValueError(
                f"byte_range {info.byte_range} of session {info.session_id!r} ends past a KV "
                f"page of {kv_page_bytes} B"
            )
    if length != pool_page_bytes:
        raise ValueError(
            f"session {info.session_id!r} stages pages of {length} B "
            f"({'byte_range ' + str(info.byte_range) if info.byte_range else 'whole KV pages'})"
            f" but the staging pool's page_bytes is {pool_page_bytes}"
        )


def _check_transport(
    transport: object, kv_pool: torch.Tensor, kv_region: str, staging_region: str,
    staging_pool: StagingBufferPool | None,
) -> None:
    """ValueError for a configuration the first transfer would fail on (a transport without
    ``closed``/``regions``, a test double, passes)."""
    if getattr(transport, "closed", False) is True:
        raise ValueError(f"transport {transport!r} is closed")
    regions_of = getattr(transport, "regions", None)
    if not callable(regions_of):
        return
    regions = regions_of()
    if not isinstance(regions, Mapping):
        return
    wanted = [("kv_region", kv_region)]
    if staging_pool is not None:
        wanted.append(("staging_region", staging_region))
    for what, name in wanted:
        if name not in regions:
            raise ValueError(
                f"{what} {name!r} is not registered with transport {transport!r} "
                f"(registered: {sorted(regions)})"
            )
    region = regions[kv_region]
    num_pages, page_bytes = int(kv_pool.shape[0]), int(kv_pool.shape[1])
    if (num_pages, page_bytes) != (region.num_pages, region.page_bytes):
        raise ValueError(
            f"kv_pool is [{num_pages}, {page_bytes}] (pages, page bytes) but region "
            f"{kv_region!r} has {region.num_pages} pages of {region.page_bytes} bytes: "
            "pass the tensor registered as kv_region"
        )
    if region.mem_type == "DRAM" and kv_pool.device.type == "cpu" and (
        kv_pool.data_ptr() != region.base_addr
    ):
        raise ValueError(
            f"kv_pool (at {kv_pool.data_ptr():#x}) is not the tensor registered as region "
            f"{kv_region!r} (at {region.base_addr:#x})"
        )


def _check_handle(handle: object, *, none_ok: bool = False) -> None:
    if type(handle) is not RoomHandle and not (none_ok and handle is None):
        raise TypeError(f"expected a RoomHandle, got {type(handle).__name__}")

