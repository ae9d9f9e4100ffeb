"""``KVManager``: the per-room tables of a prefill sender, its transfer workers, and purge.

One object an engine holds per prefill sender, made of three parts, each in a module of its
own with the lock it owns stated where it is defined:

* the **room table** (:mod:`sender.rooms`): ``request_status``, ``transfer_infos``,
  ``req_to_decode_prefix_len``, ``exceptions`` and ``failure_records`` -- the dicts upstream
  engines keep bare on their KV manager, under the same names -- plus each room's entry,
  the chunks draining after a purge, and every change to them (open, infos, fail, purge,
  chunk registration and end accounting). Owns the ROOM and FAILURE locks.
* the **chunk pipeline** (:mod:`sender.pipeline`): staging, the post under the room's post
  gate, polling, hung-chunk sweeps, the transfer workers. Owns no lock of the model.
* the **notifier** (:mod:`sender.notifier`): room notices to the decode side, held until an
  opening drained, sent by one thread. Owns a plain counter lock outside the model.

Rooms follow the staging layer's lifecycle: every write names the :class:`RoomHandle` of the
opening it belongs to, and a write for a purged (or reopened) room is refused and counted,
never allowed to re-create the room. A chunk of a purged or failed room is skipped; a chunk
already posted when its room is purged *drains* (NIXL cannot cancel a write): see
:meth:`KVManager.draining` and :meth:`KVManager.wait_drained`.

Lock hierarchy (``staging.locks.LockLevel``; a thread takes them in this order only): a
room's post gate (ROOM_GATE) -> the room table's lock (ROOM) -> the staging context's lock
(STAGING) -> the slot pool's lock (POOL) -> the failure lock (FAILURE). The transport's own
locks are outside the model and innermost. The one lock of the model held across a NIXL call
is a room's post gate, across the posts of one send (it makes check-and-post atomic against
that room's purge); NIXL calls are otherwise never made while a lock of the model is held.
See docs/THREADING.md.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

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
    "SESSION_FATAL_ERRORS",
    "Chunk",
    "KVManager",
    "ManagerPurge",
    "ManagerStats",
    "PageArray",
    "TransferInfo",
    "TransferLike",
    "TransportLike",
    "make_transfer_info",
]

_CLAIMED_END_GRACE_S = 0.5
"""``close()`` waits at least this long for chunk ends that other threads claimed before it
abandoned the rest (a release and a few dict updates each), so that their rooms' notices are
queued before the notifier stops."""


@dataclass(frozen=True, slots=True)
class ManagerStats:
    """Counters and gauges of one manager (a consistent snapshot, taken under its lock).

    Every submitted chunk ends exactly once as one of ``chunks_done`` (its room was open),
    ``chunks_failed`` (its transfer or its start failed while its room was open, including
    an unexpected error, which also counts in ``worker_errors``), ``chunks_skipped`` (never
    posted: its room was purged or failed first) or ``chunks_drained`` (posted, then its
    room was purged before it ended). So at a quiescent point (nothing queued, in flight or
    draining) ``chunks_submitted`` is their sum.

    Rooms: each opened room concludes at most once, as ``rooms_succeeded``,
    ``rooms_failed`` (by reason code in ``rooms_failed_by_code``: the room-notice codes of
    :mod:`sender.notices`) or ``rooms_cleared`` (purged before it concluded). Gauges:
    ``open_rooms``, ``transfers_inflight``, ``transfers_draining``, ``notices_pending``.
    Notices: each session message queued ends as ``notices_sent``, ``notices_failed`` or
    ``notices_skipped_dead`` (its session's peer had reported a disconnect);
    ``notices_withheld`` counts notices of rooms whose writes ``close()`` abandoned.
    ``bytes_posted``: payload bytes of every chunk whose write was posted, whatever its end
    (done, failed, drained or abandoned), counted when the chunk ends.
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
            ``write_pages``) with the prefill KV pool registered as region ``kv_region``.
        kv_pool: the prefill KV pool tensor, ``[num_pages, page_bytes]`` uint8 (the same
            tensor registered as ``kv_region``).
        num_workers: transfer-worker threads; ``0`` runs transfers inline on the caller's
            thread (``submit_chunk`` starts them, ``progress`` polls them). Inline with a
            staging pool, a ``submit_chunk`` that waits for a slot polls the posted chunks
            holding slots and ends those that completed (only a poll on this thread would
            end them), so it never waits for its own finished writes.
        staging: the staging context (one is made if ``None``).
        staging_pool: staging slots; when given, every chunk is gathered into a slot and
            sent with one bulk write from region ``staging_region`` (which the caller
            registered with the transport). ``None`` sends pages directly from ``kv_region``.
            Its ``page_bytes`` is a KV page's size, or the size of the ``byte_range`` slice
            that the sessions' infos take (checked per info by :meth:`add_transfer_info`).
        transfer_timeout_s: deadline of every transfer (a hung peer is never detected
            otherwise).
        slot_timeout_s: how long a chunk waits for a free staging slot (a worker does not
            wait: it parks the chunk and retries it between its other work).
        session_slots: the most staging slots the chunks to one decode session may hold at
            once (``None``: half the pool, at least 1), so that a hung peer holds at most
            its share and the other sessions keep the rest (THREADING.md, "Peer
            isolation").
        lock: kind of the room table's lock (``"mutex"`` or ``"rw"``).
        debug: lock debug mode (``None`` reads env ``NIXL_STAGING_DEBUG_LOCKS``).
        poll_interval_s: how long a worker sleeps between polls of a pending transfer
            (at most ``transfer_timeout_s``); ``None`` (default) adapts, as
            :meth:`sender.transport.Transfer.wait` does
            (:func:`sender.transport.poll_pauses`: polls with only a ``sched_yield``
            between them for 200 µs, then pauses of 1/16 of the time polled so far, 20 µs
            to 1 ms).
        fail_session_on_disconnect: when a transfer fails because its peer is gone or hung
            (a transport error), fail every room with a transfer to that session at once.
        notify_decode: tell each decode session of a room that failed or was cleared before
            ``Success`` (a room notice, :mod:`sender.notices`), once the room's posted chunks
            have drained; needs a transport with ``send_notif``. Sent by one notifier thread,
            best effort (counted in ``stats()``), never on the caller's thread.
        events: a listener told of every room's conclusion and every chunk's end, outside
            the manager's locks (:mod:`sender.events`, :mod:`sender.metrics`).

    Raises:
        TypeError, ValueError: bad arguments (every timeout is checked here: a finite number,
            ``poll_interval_s`` not above ``transfer_timeout_s``; a wait longer than
            ``threading.TIMEOUT_MAX`` is cut to it); a ``staging_pool`` whose pages are larger
            than a KV page (nothing could ever be staged into it). With a transport that has
            ``closed`` and ``regions()`` (:class:`sender.transport.NixlTransport`), also: a
            closed transport, ``kv_region`` (or, with a pool, ``staging_region``) not
            registered with it, or ``kv_pool`` not the tensor registered as ``kv_region``
            (another page count, page size or address): each a ``ValueError`` naming the
            value, raised here rather than as a transport fault of the first transfer.
    """

    def __init__(
        self,
        transport: TransportLike,
        kv_pool: torch.Tensor,
        *,
        num_workers: int = 2,
        staging: StagingContext | None = None,
        staging_pool: StagingBufferPool | None = None,
        transfer_timeout_s: float = 30.0,
        slot_timeout_s: float = 5.0,
        session_slots: int | None = None,
        lock: str = "mutex",
        debug: bool | None = None,
        poll_interval_s: float | None = None,
        kv_region: str = "kv",
        staging_region: str = "staging",
        fail_session_on_disconnect: bool = True,
        notify_decode: bool = True,
        events: ManagerEvents | None = None,
    ) -> None:
        """Make a :class:`KVManager`: every argument and what it raises are in the
        class docstring (``help(KVManager)``)."""
        check_index(num_workers, "num_workers")
        if kv_pool.dim() != 2 or kv_pool.dtype != torch.uint8:
            raise TypeError("kv_pool must be a 2-D uint8 tensor [num_pages, page_bytes]")
        check_seconds(transfer_timeout_s, "transfer_timeout_s")
        check_seconds(slot_timeout_s, "slot_timeout_s", allow_zero=True)
        if staging_pool is not None and staging_pool.page_bytes > int(kv_pool.shape[1]):
            # A staged page is a whole KV page or a slice of one (byte_range): it can never
            # be larger than a KV page, so no chunk could ever be staged into this pool.
            raise ValueError(
                f"staging_pool page_bytes {staging_pool.page_bytes} > the KV pool's page "
                f"size {int(kv_pool.shape[1])} B: no page or slice of one fits its slots"
            )
        # Then against the transport (its regions): after the checks of the arguments alone.
        _check_transport(transport, kv_pool, kv_region, staging_region, staging_pool)
        if poll_interval_s is not None:
            check_seconds(poll_interval_s, "poll_interval_s", allow_zero=True)
            if poll_interval_s > transfer_timeout_s:
                # A worker that pauses longer than a transfer's deadline between polls would
                # keep its room Transferring past the deadline (the contract's bound).
                raise ValueError(
                    f"poll_interval_s {poll_interval_s} > transfer_timeout_s {transfer_timeout_s}"
                )
        self.transport = transport
        self.kv_pool = kv_pool
        self.staging = staging if staging is not None else StagingContext(debug=debug)
        self.staging_pool = staging_pool
        self.transfer_timeout_s = float(transfer_timeout_s)
        self.slot_timeout_s = float(slot_timeout_s)
        num_slots = staging_pool.num_slots if staging_pool is not None else 1
        if session_slots is None:
            session_slots = max(1, num_slots // 2)
        elif not 1 <= check_index(session_slots, "session_slots") <= num_slots:
            raise ValueError(f"session_slots must be in [1, {num_slots}], got {session_slots}")
        self.session_slots = int(session_slots)
        self.poll_interval_s = None if poll_interval_s is None else float(poll_interval_s)
        self.kv_region = kv_region
        self.staging_region = staging_region
        self.fail_session_on_disconnect = fail_session_on_disconnect
        send_notif = getattr(transport, "send_notif", None)
        disconnected = getattr(transport, "peer_disconnected", None)
        self.notifier = Notifier(
            send_notif if notify_decode and callable(send_notif) else None,
            disconnected if callable(disconnected) else None,
        )
        self.rooms = RoomTable(
            self.staging,
            pool=staging_pool,
            notifier=self.notifier,
            lock=lock,
            debug=debug,
            events=events,
        )
        self.failure_lock: RWLock | MutexLock = self.rooms.failure_lock
        self._room_lock: RWLock | MutexLock = self.rooms.lock
        self.pipeline = ChunkPipeline(
            self.rooms,
            transport,
            kv_pool,
            staging_pool=staging_pool,
            num_workers=num_workers,
            transfer_timeout_s=self.transfer_timeout_s,
            slot_timeout_s=self.slot_timeout_s,
            session_slots=self.session_slots,
            poll_interval_s=self.poll_interval_s,
            kv_region=kv_region,
            staging_region=staging_region,
            fail_session_on_disconnect=fail_session_on_disconnect,
        )
        self._workers = self.pipeline.workers

    # ------------------------------------------------------------------ read-only views

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    @property
    def debug(self) -> bool:
        """Debug mode (the ``debug`` argument, or env ``NIXL_STAGING_DEBUG_LOCKS`` where it was
        ``None``): the room table's locks check their order, and each ``NixlKVSender`` checks
        that one thread at a time uses it (docs/THREADING.md). Never raises."""
        return self._room_lock.debug

    @property
    def request_status(self) -> Mapping[int, KVPoll]:
        """Snapshot (read-only) of room -> status. Thread-safe; read lock."""
        with self._room_lock.read():
            return MappingProxyType(dict(self.rooms.request_status))

    @property
    def transfer_infos(self) -> Mapping[int, Mapping[str, TransferInfo]]:
        """Snapshot (read-only) of room -> {session: info}. Thread-safe; read lock."""
        with self._room_lock.read():
            return MappingProxyType(
                {r: MappingProxyType(dict(i)) for r, i in self.rooms.transfer_infos.items()}
            )

    @property
    def req_to_decode_prefix_len(self) -> Mapping[int, int]:
        """Snapshot (read-only) of room -> decode prefix length. Thread-safe; read lock."""
        with self._room_lock.read():
            return MappingProxyType(dict(self.rooms.req_to_decode_prefix_len))

    @property
    def exceptions(self) -> Mapping[int, BaseException]:
        """Snapshot (read-only) of room -> stored exception. Thread-safe; read lock."""
        with self._room_lock.read():
            return MappingProxyType(dict(self.rooms.exceptions))

    @property
    def failure_records(self) -> Mapping[int, str]:
        """Snapshot (read-only) of room -> failure reason. Thread-safe; failure lock."""
        with self.failure_lock.read():
            return MappingProxyType(dict(self.rooms.failure_records))

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
        One read-lock acquisition. Thread-safe.

        Agrees with the counters and the listener: before it returns, the log lines and
        :class:`~sender.events.ManagerEvents` calls of every change it shows were made (it
        makes those that no thread started yet itself, and waits for those in progress on
        another thread; a listener calling back into the manager never waits). So once
        ``poll()`` says ``Failed``, ``stats()``, the room's WARNING and the listener's
        metrics already show the failure.

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
        """What a purged opening (every purged opening with ``None``) still has in flight:
        its posted chunks that have not ended, plus the staging slots that workers still
        hold for it (a worker that leased a slot before the purge returns it when it reaches
        the post fence and skips the chunk). 0 for an open room.

        A purged room's destination pages at the decode side, and its staging slots, may be
        reused once this is 0 for its handle (NIXL cannot cancel a posted write). Thread-safe;
        read lock (and the slot pool's lock inside it); does not poll (see
        :meth:`wait_drained`).

        Raises:
            TypeError: ``handle`` is neither ``None`` nor a :class:`RoomHandle`.
        """
        if handle is not None:
            _check_handle(handle)
        with self._room_lock.read():
            return self.rooms.lingering_locked(handle)

    def wait_drained(self, handle: RoomHandle | None = None, timeout_s: float = 5.0) -> bool:
        """Poll the draining transfers of that opening (all of them with ``None``) until
        :meth:`draining` is 0 -- each posted chunk has ended (done, failed, past its
        deadline, or released by the transport) and no worker holds a slot for it -- or
        until ``timeout_s``. ``True`` when nothing is left. Never raises for a transport
        error (it is the chunk's outcome). Thread-safe; safe concurrently with the workers
        (each chunk still ends exactly once).

        Raises:
            TypeError, ValueError: bad ``handle`` or ``timeout_s`` (not a number >= 0;
                ``inf`` waits as long as it takes).
        """
        if handle is not None:
            _check_handle(handle)
        timeout_s = check_seconds(timeout_s, "timeout_s", allow_zero=True, allow_inf=True)
        return self.pipeline.wait_drained(handle, timeout_s)

    def footprint(self, room: int) -> tuple[str, ...]:
        """Names of every table, the staging context or the pool still holding ``room``.

        Empty for a purged room once :meth:`draining` is 0 for it: that is the no-leak
        invariant (``"draining"`` stays until the room's posted chunks end and
        ``"staging_pool"`` until the workers holding slots for it have skipped their chunks;
        :meth:`wait_drained` waits for both). Thread-safe.

        Raises:
            TypeError, ValueError: bad ``room``.
            LockTimeoutError: the staging context's ``lock_timeout`` elapsed.
        """
        room = check_room_id(room)
        held: list[str] = []
        rooms = self.rooms
        with self._room_lock.read():
            entry = rooms.rooms.get(room)
            for name, table in (("rooms", rooms.rooms), *rooms.tables_locked()):
                if room in table:
                    held.append(name)
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
        """Frozen counters and gauges. Thread-safe; read lock. Like :meth:`handle_status`,
        returns once the log lines and listener calls of what they count were made."""
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
            open_rooms=open_rooms,
            transfers_inflight=inflight,
            transfers_draining=draining,
            rooms_failed_by_code=by_code,
            notices_sent=notices.sent,
            notices_failed=notices.failed,
            notices_withheld=notices.withheld,
            notices_queued=notices.queued,
            notices_pending=notices.pending,
            notices_skipped_dead=notices.skipped_dead,
            **counts,
        )

    # ------------------------------------------------------------------ lifecycle

    def open_room(self, room: int, session_ids: Sequence[str]) -> RoomHandle:
        """Open ``room`` for ``session_ids`` (status ``Bootstrapping``). Thread-safe; atomic,
        also against :meth:`close` (a room opened before ``close`` is purged by it).

        Raises:
            RoomAlreadyOpenError: the room is open.
            TypeError, ValueError: bad room or session ids (a ``str`` instead of a sequence
                of them, none, duplicates, empty).
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
        """Record where ``info.session_id`` wants the room's pages (bootstrap thread).

        When every session of the room has its info the status becomes ``WaitingForInput``.
        A purged room refuses (``False``, counted). When the transport knows its peers
        (``peer_regions``), the info is checked against the peer's published region first:
        a session that is not a peer of the transport (never added, or removed after a
        fault) fails the room at once (``False``; its stored exception says why), and a
        destination page past the peer's region is a ``ValueError`` (no change).
        Thread-safe; write lock; atomic.

        Raises:
            TypeError: ``handle`` or ``info`` of the wrong type.
            ValueError: the session is not one of the room's, a destination page past the
                peer's region, a repeated destination page (an info not made by
                :func:`make_transfer_info`), a byte range without a staging pool, or (with a
                staging pool) a staged page -- the KV page, or its ``byte_range`` slice --
                whose size is not the pool's ``page_bytes`` or a ``byte_range`` past the end
                of a KV page (nothing changes); or ``info`` has fewer destination pages than the
                ``num_kv_indices`` already declared by ``init_room``: then the info is not
                stored and the room is **failed** (its stored exception is a
                :class:`KVTransferError` saying why), so that its scheduler sees ``Failed``.
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
        self,
        info: TransferInfo,
        session_ids: Sequence[str] | None,
        room: int,
        *,
        peers: bool = True,
    ) -> tuple[TransferInfo, bool]:
        """The checks :meth:`add_transfer_info` makes before it changes anything, without a
        room (``NixlKVSender`` makes them before it opens one): ``(info normalised, whether
        its session is a peer of the transport)`` for room ``room`` whose sessions are
        ``session_ids`` (``None``: not checked). A session that is not a peer passes here
        (:meth:`add_transfer_info` then fails the room); ``peers=False`` skips the checks
        against the transport's peers. Reads only; thread-safe.

        Raises:
            TypeError: ``info`` is not a :class:`TransferInfo`.
            ValueError: as :meth:`add_transfer_info` (session not one of ``session_ids``,
                destination past the peer's region, byte range without a pool, ...).
        """
        if not isinstance(info, TransferInfo):
            raise TypeError(f"info must be a TransferInfo, got {type(info).__name__}")
        # An info built directly, bypassing make_transfer_info, is checked and normalised
        # here (exact str id, read-only int64 pages of our own); one it made is as is.
        info = checked_info(info)
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
                raise ValueError(
                    f"session {info.session_id!r} has no region {info.dst_region!r}"
                )
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
            TypeError, ValueError: bad count, or larger than a session's ``dst_pages``
                (nothing changes; an info that comes later is checked by
                :meth:`add_transfer_info`).
        """
        _check_handle(handle)
        num_kv_indices = check_index(num_kv_indices, "num_kv_indices")
        return self.rooms.init(handle, num_kv_indices)

    def ready(self, handle: RoomHandle) -> bool:
        """``True`` when every session's info is in and ``init_room`` was called.
        Thread-safe; read lock."""
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
        """Queue chunk ``chunk_idx`` (room pages ``[start, start+len)``) for every session.

        Returns the number of chunks made (one per session; 0 if the room is purged or
        failed: refused). Without a staging pool the chunks of one call are registered in
        one critical section and posted together, one NIXL write per session. With
        ``num_workers=0`` the transfers are started here, on the caller's thread; a
        transport error there fails the room (it is never raised). Thread-safe.

        Raises:
            TypeError, ValueError: bad ``chunk_idx``/``start``; the room is not ready (no
                infos / no init), ``chunk_idx`` already submitted, indices out of range of
                the KV pool, or past ``num_kv_indices``; with a staging pool, more pages for
                a session (past its decode prefix) than a slot holds. Nothing changes in
                these cases.
        """
        _check_handle(handle)
        return self.pipeline.submit(handle, chunk_idx, start, kv_indices, is_last)

    def progress(self, handle: RoomHandle) -> None:
        """Inline mode: poll the room's pending transfers, and every draining one, once each.

        A transport error fails the chunk's room (never raised). Safe from several threads
        at once: each chunk still ends exactly once. With workers it only sweeps hung chunks
        when a sweep is due (every 50 ms). Thread-safe.

        Raises:
            TypeError: ``handle`` is not a :class:`RoomHandle`.
        """
        _check_handle(handle)
        self.pipeline.progress(handle)

    def record_failure(self, handle: RoomHandle, exc: BaseException | None, reason: str) -> bool:
        """Fail the room: status ``Failed``, keep ``exc`` (first one wins) and ``reason``.

        Refused (``False``, counted) for a purged room. Thread-safe; write lock, then the
        failure lock; atomic.
        """
        return self.rooms.fail(handle, exc, reason)

    def pop_exception(self, handle: RoomHandle) -> BaseException | None:
        """Remove and return the stored exception of that opening (``None`` if the opening is
        purged or none is stored). Thread-safe; write lock; atomic with the ownership check.

        Raises:
            TypeError: ``handle`` is not a :class:`RoomHandle`.
        """
        _check_handle(handle)
        with self._room_lock.write():
            if self.rooms.live_locked(handle) is None:
                return None
            return self.rooms.exceptions.pop(handle.room, None)

    def pop_failure_record(self, handle: RoomHandle) -> str | None:
        """Remove and return the failure reason of that opening (``None`` if the opening is
        purged or none is recorded). Thread-safe; write lock, then the failure lock; atomic
        with the ownership check.

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

        All-or-nothing and never raises for a state reason: it waits for the room's post
        gate (a thread that is posting chunks of the room finishes posting first; no chunk
        of this opening is posted after this returns) and takes the staging lock without
        its ``lock_timeout``. Posted transfers of the room are not released (NIXL cannot
        cancel a write): they *drain* (see :meth:`draining`, :meth:`wait_drained`); their
        slots go back to the pool when they end. Idempotent; a stale handle never purges a
        newer opening. A room purged before it concluded is logged (INFO). Thread-safe: post
        gate, then one write critical section (room table -> staging -> failure lock).

        Raises:
            TypeError, ValueError: bad ``room``.
        """
        if isinstance(room, RoomHandle):
            room_id, generation = room.room, room.generation
        else:
            room_id, generation = room, None
        return self.rooms.purge(check_room_id(room_id), generation)

    def fail_session(self, session_id: str, reason: str) -> frozenset[int]:
        """A decode peer died: fail every open, unconcluded room with a transfer to it.

        Drops the session's staging keys (``purge_session``, which never times out). Returns
        the rooms failed. Logged once (WARNING), naming the rooms. Thread-safe; one write
        critical section; never raises for a state reason.

        Raises:
            TypeError, ValueError: bad ``session_id``.
        """
        return self.rooms.fail_session(check_session_id(session_id), reason)

    def close(self, timeout_s: float = 5.0) -> None:
        """Refuse new rooms, purge every open room, drain, stop the workers. Idempotent.

        ``close`` and :meth:`open_room` are mutually atomic: a room is either refused or
        purged here. Transfers still in flight after ``timeout_s`` are *abandoned*: counted
        in ``stats().transfers_abandoned``, and their rooms get no room notice (counted in
        ``stats().notices_withheld``). An abandoned transfer that NIXL may still move bytes
        for is not released: its chunk stays draining (``draining()`` counts it) until a
        later :meth:`wait_drained` sees NIXL settle it, or the transport is closed (which
        releases it; after ``NixlTransport.close`` nothing of it moves any more). So
        ``draining(handle) == 0`` still means the opening's pages may be reused. A chunk
        that another thread had claimed is not abandoned: ``close`` waits for its end (at
        least 0.5 s) so its room's notice is queued. Notices already queued are sent within the same
        ``timeout_s`` (at least 0.5 s); a notifier blocked on an unreachable peer is left
        behind (a daemon thread) rather than failing ``close``. Safe from any thread, also
        from a transfer worker (a listener callback runs there): that worker is not joined (a
        thread cannot join itself); its stop is queued and it exits once the callback
        returns. A worker's pause between polls (``poll_interval_s``) is a wait on its unit
        queue, which the stop ends at once, so a long pause never outlasts the join.

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
        # A chunk that another thread claimed before us is not abandoned: its end (a release
        # and its accounting) is in progress and queues its room's notice. Wait for those
        # ends before the notifier is told to stop, at least _CLAIMED_END_GRACE_S.
        # mutant-site: close-set-settle-until
        settle_until = max(deadline, time.monotonic() + _CLAIMED_END_GRACE_S)
        while True:
            with self._room_lock.read():
                ending = sum(1 for c in rooms.draining.values() if c.ended)
            if not ending or time.monotonic() >= settle_until:
                break
            time.sleep(0.0005)
        # What is still held belongs to ends still in progress after the grace (a release
        # stuck in NIXL): withheld, its bytes are not known to have drained.
        self.notifier.withhold_all()
        alive = pipeline.join_workers(deadline)
        # Best effort: a notice to a partitioned peer may block inside NIXL; the notifier is
        # a daemon and is left behind rather than failing close(). It gets at least the
        # grace, as the workers do: the notices of a close are what the decode side waits for.
        # mutant-site: close-call-stop
        self.notifier.stop(max(_CLAIMED_END_GRACE_S, deadline - time.monotonic()))
        if alive:
            raise RuntimeError(f"transfer workers did not stop: {alive}")

    def __enter__(self) -> KVManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_staged_page(info: TransferInfo, kv_page_bytes: int, pool_page_bytes: int) -> None:
    """The info's staged page (its ``byte_range`` slice of a KV page, or the whole page)
    fits the staging pool's pages exactly. Raises ValueError, naming the sizes."""
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
    transport: object,
    kv_pool: torch.Tensor,
    kv_region: str,
    staging_region: str,
    staging_pool: StagingBufferPool | None,
) -> None:
    """Refuse a configuration the first transfer would fail on (see ``KVManager``'s
    ``Raises``). A transport without ``closed``/``regions`` (a test double) is not checked.

    Raises:
        ValueError: the transport is closed, a region is not registered, or ``kv_pool`` is
            not the registered ``kv_region``.
    """
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


def _check_handle(handle: object) -> None:
    if type(handle) is not RoomHandle:
        raise TypeError(f"expected a RoomHandle, got {type(handle).__name__}")

