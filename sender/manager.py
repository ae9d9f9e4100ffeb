"""``KVManager``: the per-room tables of a prefill sender, its transfer workers, and purge.

The manager owns what upstream engines keep as bare dicts on their KV manager, under the
same names, and keeps them consistent under threads:

* ``request_status`` (room -> :class:`~sender.poll.KVPoll`),
* ``transfer_infos`` (room -> {session_id: :class:`TransferInfo`}),
* ``req_to_decode_prefix_len`` (room -> pages the decode side already has),
* ``exceptions`` (room -> the exception that failed it),
* ``failure_records`` (room -> reason), guarded by its own ``failure_lock``,

plus the room's staging prefetch state (a :class:`~staging.context.StagingContext`), its
leased staging slots (a :class:`~staging.buffers.StagingBufferPool`) and its in-flight
transfers. :meth:`KVManager.purge_room` removes a room from all of them in one step.

Rooms follow the staging layer's lifecycle: every write names the :class:`RoomHandle` of the
opening it belongs to, and a write for a purged (or reopened) room is refused and counted,
never allowed to re-create the room. A worker that dequeues a chunk of a purged or failed
room skips it; a chunk already posted when its room is purged *drains* (NIXL cannot cancel a
write): see :meth:`KVManager.draining` and :meth:`KVManager.wait_drained`.

Lock hierarchy (``staging.locks.LockLevel``; a thread takes them in this order only): a
room's post gate (ROOM_GATE) -> ``_room_lock`` (ROOM) -> the staging context's lock
(STAGING) -> the slot pool's lock (POOL) -> ``failure_lock`` (FAILURE). The transport's own
locks are outside the model and innermost. The one lock of the model held across a NIXL call
is a room's post gate, across the post of one chunk (it makes check-and-post atomic against
that room's purge); NIXL calls are otherwise never made while a lock of the model is held.
See docs/THREADING.md.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch

from sender import _nixl
from sender.errors import (
    KVTransferError,
    TransferFailedError,
    TransferReleasedError,
    TransferTimeoutError,
    TransportParamError,
)
from sender.notices import RoomNotice, code_for
from sender.pages import CheckedPages
from sender.poll import KVPoll, is_concluded, merge_status
from sender.transport import PageIndices, pause_between_polls, poll_pauses
from staging.buffers import PoolClosedError, PoolExhaustedError, StagingBufferPool, StagingSlot
from staging.context import RoomHandle, RoomPurge, StagingContext
from staging.errors import RoomAlreadyOpenError
from staging.locks import LockLevel, MutexLock, RWLock, make_lock
from staging.validate import (
    bounded_wait,
    check_chunk_idx,
    check_index,
    check_room_id,
    check_seconds,
    check_session_id,
)

PageArray = npt.NDArray[np.int64]


class TransferLike(Protocol):
    """What the manager needs of a transport transfer (``settled()``, when a transfer has
    it, tells whether a write that timed out can still move bytes; without it a timed-out
    transfer counts as settled)."""

    def poll(self) -> str: ...

    def release(self) -> None: ...


class TransportLike(Protocol):
    """What the manager needs of :class:`sender.transport.NixlTransport`."""

    def write_pages(
        self,
        session_id: str,
        src_pages: PageIndices,
        dst_pages: PageIndices,
        notif: bytes | None = None,
        *,
        src_region: str = "kv",
        dst_region: str = "kv",
        timeout_s: float | None = None,
    ) -> TransferLike: ...


@dataclass(frozen=True, slots=True, weakref_slot=True)
class TransferInfo:
    """Where one decode session wants a room's pages (sent by the bootstrap thread).

    Attributes:
        session_id: the decode peer (its transport session id).
        dst_pages: destination page index of each of the room's KV pages, in order.
        decode_prefix_len: leading pages the decode side already holds (not sent).
        byte_range: ``(start, length)``: only these bytes of each prefill page go to this
            session (its TP rank's heads); requires a staging pool. ``None`` = whole pages.
        dst_region: the peer's registered region to write into.
    """

    session_id: str
    dst_pages: PageArray
    decode_prefix_len: int = 0
    byte_range: tuple[int, int] | None = None
    dst_region: str = "kv"
    dst_checked: CheckedPages | None = field(default=None, compare=False, repr=False)
    """``dst_pages`` checked once (distinct, < 2**31; :mod:`sender.pages`): chunks pass
    slices of it, so the transport does not check them again per write. ``None`` only when
    ``dst_pages`` is empty (:func:`make_transfer_info` refuses repeated pages)."""


_MADE_INFOS: weakref.WeakValueDictionary[int, TransferInfo] = weakref.WeakValueDictionary()
"""The infos :func:`make_transfer_info` made and that are still alive, by ``id``:
``add_transfer_info`` takes those as they are and checks any other again (an info built
directly, or copied with ``dataclasses.replace``, bypassed the checks). A dead info's entry
goes with it, so a later object with the same ``id`` is never mistaken for it."""


def make_transfer_info(
    session_id: str,
    dst_pages: Sequence[int] | PageArray,
    *,
    decode_prefix_len: int = 0,
    byte_range: tuple[int, int] | None = None,
    dst_region: str = "kv",
) -> TransferInfo:
    """Validate and freeze a :class:`TransferInfo`.

    Raises:
        TypeError: a page list that does not hold ints (floats and bools are refused), a bad
            session id, prefix length or byte range type.
        ValueError: a page list that is not 1-D, has a negative page, a page of ``2**31`` or
            more, or a page that repeats (anywhere in the list: whatever the chunking, two
            room pages would land on one decode page); a bad prefix length or byte range.
    """
    session_id = check_session_id(session_id)
    raw = np.asarray(dst_pages)
    # dtype.kind, not np.issubdtype (~2.5 us a call): this runs once per room.
    if raw.dtype.kind == "b" or (raw.size and raw.dtype.kind not in "iu"):
        # float or bool page numbers would be truncated/cast silently: KV pages would land
        # in the wrong decode slots.
        raise TypeError(f"dst_pages must hold ints, got dtype {raw.dtype}")
    try:
        arr = np.array(raw, dtype=np.int64, copy=True)
    except OverflowError:
        raise ValueError("dst_pages holds a page index beyond int64") from None
    if arr.ndim != 1:
        raise ValueError("dst_pages must be a 1-D sequence of page indices")
    checked = _checked_dst(arr)
    arr.setflags(write=False)
    check_index(decode_prefix_len, "decode_prefix_len")
    if decode_prefix_len > arr.size:
        raise ValueError(f"decode_prefix_len {decode_prefix_len} > {arr.size} dst pages")
    if byte_range is not None:
        start, length = byte_range
        check_index(start, "byte_range start")
        if check_index(length, "byte_range length") < 1:
            raise ValueError("byte_range length must be >= 1")
    info = TransferInfo(session_id, arr, decode_prefix_len, byte_range, dst_region, checked)
    _MADE_INFOS[id(info)] = info
    return info


def _checked_dst(pages: PageArray) -> CheckedPages | None:
    """``pages`` as :class:`CheckedPages` (distinct), or ``None`` if empty.

    A session's destination pages are refused as a whole, whatever the chunking: a page that
    repeats would be written twice (by two chunks: the second write silently overwrites the
    first room page; by one chunk: the transport refuses the write), and a page NIXL cannot
    address (its indices are 32-bit) would fail every write.

    Raises:
        ValueError: a negative page, a page of ``2**31`` or more, or a repeated page.
    """
    if pages.size == 0:
        return None
    try:
        return CheckedPages(pages, unique=True)
    except TransportParamError:
        pass
    if int(pages.min()) < 0:
        raise ValueError("dst_pages must be >= 0")
    if int(pages.max()) >= 1 << 31:
        raise ValueError(f"dst_pages holds page {int(pages.max())}: NIXL page indices are < 2**31")
    ordered = np.sort(pages)
    repeated = int(ordered[1:][ordered[1:] == ordered[:-1]][0])
    raise ValueError(
        f"dst_pages repeats page {repeated}: each decode page receives one room page"
    )


@dataclass(frozen=True, slots=True)
class ChunkJob:
    """One chunk of one room bound for one session: the unit a worker transfers."""

    handle: RoomHandle
    chunk_idx: int
    session_id: str
    src_pages: PageArray
    dst_pages: PageArray
    byte_range: tuple[int, int] | None
    dst_region: str
    is_last: bool
    job_id: int
    # The same pages checked once (sender/pages.py), for the transport; None: use the arrays.
    src_checked: CheckedPages | None = None
    dst_checked: CheckedPages | None = None


class _Inflight:
    """A started chunk: its transfer and slot.

    Registered in its room entry's ``inflight`` while the room is open, in the manager's
    ``_draining`` after the room's purge, and in neither once it ended. A chunk *ends* exactly
    once: the thread that wins ``_claim`` (a non-blocking acquire, so an atomic test-and-set)
    alone releases its transfer and slot and does its accounting, whichever thread saw the
    terminal state first.
    """

    __slots__ = ("_claim", "hung", "job", "slot", "transfer")

    def __init__(self, job: ChunkJob) -> None:
        self.job = job
        # The deadline error of a chunk that timed out while NIXL still had it in progress:
        # its room is failed, but the chunk has not ended (it may still write) until the
        # transfer settles. Set once, under the manager's write lock.
        self.hung: BaseException | None = None
        # Set by the posting thread, before the chunk is visible to any other thread
        # (``transfer`` is None while registered-but-not-yet-posted; pollers skip it).
        self.transfer: TransferLike | None = None
        self.slot: StagingSlot | None = None
        self._claim = threading.Lock()  # looked up at call time: DPOR explorers see it

    def claim(self) -> bool:
        """``True`` for the one caller that gets to end this chunk; ``False`` for all later."""
        return self._claim.acquire(False)

    @property
    def ended(self) -> bool:
        """``True`` once some thread claimed the chunk's end."""
        return self._claim.locked()


@dataclass(slots=True, eq=False)
class _RoomEntry:
    """Bookkeeping of one open room. Guarded by the manager's ``_room_lock``, except
    ``gate`` (the room's post gate, a lock of level ``ROOM_GATE``)."""

    handle: RoomHandle
    sessions: tuple[str, ...]
    gate: RWLock | MutexLock
    num_kv_indices: int | None = None
    jobs_total: int = 0
    jobs_done: int = 0
    last_chunk_seen: bool = False
    prefetch_requests: int = 0
    chunk_idxs: set[int] = field(default_factory=set)
    inflight: dict[int, _Inflight] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ManagerPurge:
    """What :meth:`KVManager.purge_room` removed for one opening of a room.

    Attributes:
        room: the room id.
        was_open: ``False`` when there was nothing to purge (already purged, or a stale
            handle); every other field is then empty.
        status: the room's status at the purge.
        tables: names of the per-room tables that held the room.
        staging: what the staging context removed.
        slots_released: always 0: a purge returns no staging slot (each is returned by the
            worker holding it, when it skips its chunk or when the chunk's transfer ends).
        transfers_released: always 0 since transfers are drained, not released, by a purge
            (kept for compatibility).
        exception: the room's stored exception, removed by this purge (this opening's only).
        failure_record: the room's failure reason, removed by this purge.
        draining: posted transfers of this opening that were still in flight when the purge
            returned. Its destination pages (and slots) are safe to reuse only once
            :meth:`KVManager.draining` for the handle is 0.
    """

    room: int
    was_open: bool
    status: KVPoll | None
    tables: tuple[str, ...]
    staging: RoomPurge | None
    slots_released: int
    transfers_released: int
    exception: BaseException | None = None
    failure_record: str | None = None
    draining: int = 0


@dataclass(frozen=True, slots=True)
class ManagerStats:
    """Counters of one manager (taken under its lock).

    Every submitted chunk ends exactly once as one of ``chunks_done`` (its room was open),
    ``chunks_failed`` (its transfer or its start failed while its room was open, including
    an unexpected error, which also counts in ``worker_errors``),
    ``chunks_skipped`` (never posted: its room was purged or failed first) or
    ``chunks_drained`` (posted, then its room was purged before it ended). So at a quiescent
    point (nothing queued, in flight or draining) ``chunks_submitted`` is their sum.
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


# Errors that mean the whole decode peer is gone or hung, not just one transfer: every room
# with a transfer to that session fails at once (``fail_session``).
SESSION_FATAL_ERRORS: tuple[type[BaseException], ...] = (
    TransferTimeoutError,
    *(
        (_nixl.bindings.nixlRemoteDisconnectError,)
        if _nixl.bindings is not None and hasattr(_nixl.bindings, "nixlRemoteDisconnectError")
        else ()
    ),
)

_WORKER_SPIN_S = 200e-6
"""Workers spin (poll with only a ``sched_yield`` between polls) for less than
``Transfer.wait`` does: several of them poll at once, and on a small machine their spinning
would take the CPU from NIXL's progress thread and the peer."""

_HUNG_SWEEP_S = 0.05
"""Hung chunks are re-checked this often (:meth:`KVManager._maybe_sweep`), busy or idle."""

_CLAIMED_END_GRACE_S = 0.5
"""``close()`` waits at least this long for chunk ends that other threads claimed before it
abandoned the rest (a release and a few dict updates each), so that their rooms' notices are
queued before the notifier stops."""

_COUNTERS = (
    "rooms_opened",
    "purges",
    "chunks_submitted",
    "chunks_done",
    "chunks_skipped",
    "chunks_failed",
    "chunks_drained",
    "chunks_released_by_transport",
    "transfers_abandoned",
    "refused_late_writes",
    "sessions_failed",
    "worker_errors",
    "notices_sent",
    "notices_failed",
    "notices_withheld",
)

class KVManager:
    """Per-room state, transfer workers and purge for one prefill sender.

    Args:
        transport: a started :class:`sender.transport.NixlTransport` (or anything with its
            ``write_pages``) with the prefill KV pool registered as region ``kv_region``.
        kv_pool: the prefill KV pool tensor, ``[num_pages, page_bytes]`` uint8 (the same
            tensor registered as ``kv_region``).
        num_workers: transfer-worker threads; ``0`` runs transfers inline on the caller's
            thread (``submit_chunk`` starts them, ``progress`` polls them).
        staging: the staging context (one is made if ``None``).
        staging_pool: staging slots; when given, every chunk is gathered into a slot and
            sent with one bulk write from region ``staging_region`` (which the caller
            registered with the transport). ``None`` sends pages directly from ``kv_region``.
        transfer_timeout_s: deadline of every transfer (a hung peer is never detected
            otherwise).
        slot_timeout_s: how long a worker waits for a free staging slot.
        lock: kind of the manager's room lock (``"mutex"`` or ``"rw"``).
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

    Raises:
        TypeError, ValueError: bad arguments (every timeout is checked here: a finite number,
            ``poll_interval_s`` not above ``transfer_timeout_s``; a wait longer than
            ``threading.TIMEOUT_MAX`` is cut to it).
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
        lock: str = "mutex",
        debug: bool | None = None,
        poll_interval_s: float | None = None,
        kv_region: str = "kv",
        staging_region: str = "staging",
        fail_session_on_disconnect: bool = True,
        notify_decode: bool = True,
    ) -> None:
        check_index(num_workers, "num_workers")
        if kv_pool.dim() != 2 or kv_pool.dtype != torch.uint8:
            raise TypeError("kv_pool must be a 2-D uint8 tensor [num_pages, page_bytes]")
        check_seconds(transfer_timeout_s, "transfer_timeout_s")
        check_seconds(slot_timeout_s, "slot_timeout_s", allow_zero=True)
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
        self.poll_interval_s = None if poll_interval_s is None else float(poll_interval_s)
        self.kv_region = kv_region
        self.staging_region = staging_region
        self.fail_session_on_disconnect = fail_session_on_disconnect
        self._debug = debug

        self._room_lock = make_lock(lock, "kv-manager", LockLevel.ROOM, debug=debug)
        self.failure_lock = make_lock("mutex", "kv-failure", LockLevel.FAILURE, debug=debug)
        # --- Guarded by _room_lock (read under read(), mutate under write()). ---
        # _rooms: open rooms. A room id is a key of any per-room table only while it is in
        # _rooms, and only for the generation recorded there (writes carry the handle).
        self._rooms: dict[int, _RoomEntry] = {}
        self._request_status: dict[int, KVPoll] = {}
        self._transfer_infos: dict[int, dict[str, TransferInfo]] = {}
        self._req_to_decode_prefix_len: dict[int, int] = {}
        self._exceptions: dict[int, BaseException] = {}
        # _draining: job id -> chunk posted for a room that has since been purged, until the
        # chunk ends (NIXL cannot cancel a posted write: its bytes may still land, so its
        # room's destination pages and its staging slot are not free until then).
        self._draining: dict[int, _Inflight] = {}
        # _hung: job id -> chunk that timed out while NIXL still had it in progress (still in
        # its entry's inflight or in _draining too). Swept by idle workers, progress() and
        # wait_drained() until its transfer settles.
        self._hung: dict[int, _Inflight] = {}
        # _sweep_claim: one thread at a time sweeps hung chunks (a non-blocking acquire, so
        # nobody waits for it); _sweep_due (monotonic s) is written only by its holder and
        # read without it (a float read is atomic; a stale read delays a sweep by one call).
        self._sweep_claim = threading.Lock()
        self._sweep_due = 0.0
        # _closing: set once by close(), under the write lock, so that open_room (which
        # checks it under the same lock) and close() are mutually atomic.
        self._closing = False
        self._counts: dict[str, int] = dict.fromkeys(_COUNTERS, 0)
        # --- Guarded by failure_lock (taken alone or inside _room_lock). ---
        self._failure_records: dict[int, str] = {}
        # Last-resort count of worker errors whose own accounting failed (plain int; only
        # ever incremented by a worker that could not take the lock; read by stats()).
        self._unaccounted_worker_errors = 0

        # _pending_notices: room notices of purged openings whose posted chunks are still
        # draining; queued for the notifier when the last one ends. Guarded by _room_lock.
        self._pending_notices: dict[RoomHandle, tuple[RoomNotice, tuple[str, ...]]] = {}
        self._notices: queue.SimpleQueue[tuple[RoomNotice, tuple[str, ...]] | None] = (
            queue.SimpleQueue()
        )
        send_notif = getattr(transport, "send_notif", None)
        self._send_notif: Any = send_notif if notify_decode and callable(send_notif) else None
        self._notifier: threading.Thread | None = None
        if self._send_notif is not None:
            self._notifier = threading.Thread(
                target=self._notifier_main, name="kv-notifier", daemon=True
            )
            self._notifier.start()

        self._job_ids = itertools.count(1)
        self._queue: queue.SimpleQueue[ChunkJob | None] = queue.SimpleQueue()
        self._closed = threading.Event()
        self._workers = [
            threading.Thread(target=self._worker_main, name=f"kv-worker-{i}", daemon=True)
            for i in range(num_workers)
        ]
        for worker in self._workers:
            worker.start()

    # ------------------------------------------------------------------ read-only views

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    @property
    def request_status(self) -> Mapping[int, KVPoll]:
        """Snapshot (read-only) of room -> status. Thread-safe; read lock."""
        with self._room_lock.read():
            return MappingProxyType(dict(self._request_status))

    @property
    def transfer_infos(self) -> Mapping[int, Mapping[str, TransferInfo]]:
        """Snapshot (read-only) of room -> {session: info}. Thread-safe; read lock."""
        with self._room_lock.read():
            return MappingProxyType(
                {r: MappingProxyType(dict(i)) for r, i in self._transfer_infos.items()}
            )

    @property
    def req_to_decode_prefix_len(self) -> Mapping[int, int]:
        """Snapshot (read-only) of room -> decode prefix length. Thread-safe; read lock."""
        with self._room_lock.read():
            return MappingProxyType(dict(self._req_to_decode_prefix_len))

    @property
    def exceptions(self) -> Mapping[int, BaseException]:
        """Snapshot (read-only) of room -> stored exception. Thread-safe; read lock."""
        with self._room_lock.read():
            return MappingProxyType(dict(self._exceptions))

    @property
    def failure_records(self) -> Mapping[int, str]:
        """Snapshot (read-only) of room -> failure reason. Thread-safe; failure lock."""
        with self.failure_lock.read():
            return MappingProxyType(dict(self._failure_records))

    def status(self, room: int) -> KVPoll | None:
        """The room's status, or ``None`` if it is not open. Thread-safe; read lock.

        Raises:
            TypeError, ValueError: bad ``room``.
        """
        room = check_room_id(room)
        with self._room_lock.read():
            return self._request_status.get(room)

    def handle_status(self, handle: RoomHandle) -> KVPoll | None:
        """The status of that opening, or ``None`` once it is purged (or ``handle`` is stale).
        One read-lock acquisition. Thread-safe.

        Raises:
            TypeError: ``handle`` is not a :class:`RoomHandle`.
        """
        _check_handle(handle)
        with self._room_lock.read():
            if self._live(handle) is None:
                return None
            return self._request_status.get(handle.room)

    def is_open(self, handle: RoomHandle) -> bool:
        """``True`` while that opening of the room is open. Thread-safe; read lock.

        Raises:
            TypeError: ``handle`` is not a :class:`RoomHandle`.
        """
        _check_handle(handle)
        with self._room_lock.read():
            return self._live(handle) is not None

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
            return self._lingering(handle)

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
        deadline = time.monotonic() + timeout_s
        while True:
            self._maybe_sweep()
            with self._room_lock.read():
                pending = [
                    i
                    for i in self._draining.values()
                    if handle is None or i.job.handle == handle
                ]
                left = self._lingering(handle)
            if not left:
                return True
            for inflight in pending:
                self._check(inflight)
            if time.monotonic() >= deadline:
                return self.draining(handle) == 0
            time.sleep(0.0002)

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
        with self._room_lock.read():
            entry = self._rooms.get(room)
            for name, table in (("rooms", self._rooms), *self._room_tables()):
                if room in table:
                    held.append(name)
            if entry is not None and entry.inflight:
                held.append("inflight")
            if any(i.job.handle.room == room for i in self._draining.values()):
                held.append("draining")
        with self.failure_lock.read():
            if room in self._failure_records:
                held.append("failure_records")
        if self.staging.is_open(room) or self.staging.room_requests(room):
            held.append("staging")
        if self.staging_pool is not None and any(
            getattr(owner, "room", None) == room for owner in self.staging_pool.owners()
        ):
            held.append("staging_pool")
        return tuple(held)

    def stats(self) -> ManagerStats:
        """Frozen counters. Thread-safe; read lock."""
        with self._room_lock.read():
            counts = dict(self._counts)
            counts["worker_errors"] += self._unaccounted_worker_errors
            return ManagerStats(
                open_rooms=len(self._rooms),
                transfers_inflight=sum(len(e.inflight) for e in self._rooms.values()),
                transfers_draining=len(self._draining),
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
        gate = make_lock("mutex", "kv-room-gate", LockLevel.ROOM_GATE, debug=self._debug)
        with self._room_lock.write():
            if self._closing:
                raise RuntimeError("KVManager is closed")
            if room in self._rooms:
                raise RoomAlreadyOpenError(room)
            handle = self.staging.open_room(room)
            self._rooms[room] = _RoomEntry(handle, sessions, gate)
            self._request_status[room] = KVPoll.Bootstrapping
            self._counts["rooms_opened"] += 1
        return handle

    def add_transfer_info(self, handle: RoomHandle, info: TransferInfo) -> bool:
        """Record where ``info.session_id`` wants the room's pages (bootstrap thread).

        When every session of the room has its info the status becomes ``WaitingForInput``.
        A purged room refuses (``False``, counted). Thread-safe; write lock; atomic.

        Raises:
            TypeError: ``handle`` or ``info`` of the wrong type.
            ValueError: the session is not one of the room's, or a byte range without a
                staging pool (nothing changes); or ``info`` has fewer destination pages than
                the ``num_kv_indices`` already declared by ``init_room``: then the info is not
                stored and the room is **failed** (its stored exception is a
                :class:`KVTransferError` saying why), so that its scheduler sees ``Failed``.
        """
        _check_handle(handle)
        if not isinstance(info, TransferInfo):
            raise TypeError(f"info must be a TransferInfo, got {type(info).__name__}")
        # An info built directly, bypassing make_transfer_info, is checked and normalised
        # here (exact str id, read-only int64 pages of our own); one it made is as is.
        if _MADE_INFOS.get(id(info)) is not info:
            info = make_transfer_info(
                info.session_id,
                info.dst_pages,
                decode_prefix_len=info.decode_prefix_len,
                byte_range=info.byte_range,
                dst_region=info.dst_region,
            )
        if info.byte_range is not None and self.staging_pool is None:
            raise ValueError("byte_range (a TP slice of each page) needs a staging pool")
        with self._room_lock.write():
            entry = self._live(handle, count=True)
            if entry is None:
                return False
            if info.session_id not in entry.sessions:
                raise ValueError(
                    f"session {info.session_id!r} is not a session of room {handle.room}"
                )
            short = entry.num_kv_indices is not None and (
                info.dst_pages.size < entry.num_kv_indices
            )
            if short:
                reason = (
                    f"session {info.session_id!r} gave {info.dst_pages.size} destination "
                    f"pages; the room sends num_kv_indices={entry.num_kv_indices}"
                )
                self._fail_unlocked(handle, KVTransferError(handle.room, reason), reason)
            else:
                infos = self._transfer_infos.setdefault(handle.room, {})
                infos[info.session_id] = info
                self._req_to_decode_prefix_len[handle.room] = max(
                    self._req_to_decode_prefix_len.get(handle.room, 0), info.decode_prefix_len
                )
                if len(infos) == len(entry.sessions):
                    self._set_status(handle.room, KVPoll.WaitingForInput)
        if short:
            raise ValueError(f"room {handle.room} failed: {reason}")
        return True

    def init_room(self, handle: RoomHandle, num_kv_indices: int) -> bool:
        """Set how many KV pages the room will send (``init``). Thread-safe; atomic.

        Raises:
            TypeError, ValueError: bad count, or larger than a session's ``dst_pages``
                (nothing changes; an info that comes later is checked by
                :meth:`add_transfer_info`).
        """
        _check_handle(handle)
        num_kv_indices = check_index(num_kv_indices, "num_kv_indices")
        with self._room_lock.write():
            entry = self._live(handle)
            if entry is None:
                return False
            for info in self._transfer_infos.get(handle.room, {}).values():
                if num_kv_indices > info.dst_pages.size:
                    raise ValueError(
                        f"num_kv_indices {num_kv_indices} > {info.dst_pages.size} destination "
                        f"pages of session {info.session_id!r}"
                    )
            entry.num_kv_indices = num_kv_indices
            return True

    def ready(self, handle: RoomHandle) -> bool:
        """``True`` when every session's info is in and ``init_room`` was called.
        Thread-safe; read lock."""
        with self._room_lock.read():
            entry = self._live(handle)
            return (
                entry is not None
                and entry.num_kv_indices is not None
                and len(self._transfer_infos.get(handle.room, {})) == len(entry.sessions)
            )

    def submit_chunk(
        self, handle: RoomHandle, chunk_idx: int, start: int, kv_indices: PageArray, is_last: bool
    ) -> int:
        """Queue chunk ``chunk_idx`` (room pages ``[start, start+len)``) for every session.

        Returns the number of jobs queued (0 if the room is purged or failed: refused).
        With ``num_workers=0`` the transfers are started here, on the caller's thread; a
        transport error there fails the room (it is never raised). Thread-safe.

        Raises:
            TypeError, ValueError: bad ``chunk_idx``/``start``; the room is not ready (no
                infos / no init), ``chunk_idx`` already submitted, indices out of range of
                the KV pool, or past ``num_kv_indices``. Nothing changes in these cases.
        """
        _check_handle(handle)
        chunk_idx = check_chunk_idx(chunk_idx)
        start = check_index(start, "start")
        src_checked: CheckedPages | None = None
        if kv_indices.size:
            # One check of the chunk's pages (bounds, then an int32 copy the transport uses
            # as is; sender/pages.py) instead of one here and another per write.
            try:
                src_checked = CheckedPages(kv_indices, unique=False)
            except TransportParamError:
                src_checked = None
            if src_checked is None or src_checked.max_page >= self.kv_pool.shape[0]:
                raise ValueError(f"kv_indices out of range [0, {self.kv_pool.shape[0]})")
        jobs: list[ChunkJob] = []
        with self._room_lock.write():
            entry = self._live(handle)
            if entry is None:
                return 0
            status = self._request_status.get(handle.room)
            if status is KVPoll.Failed:
                return 0
            infos = self._transfer_infos.get(handle.room, {})
            if entry.num_kv_indices is None or len(infos) != len(entry.sessions):
                raise ValueError(f"room {handle.room} is not ready: no transfer info or no init")
            if chunk_idx in entry.chunk_idxs:
                raise ValueError(f"chunk {chunk_idx} of room {handle.room} was already submitted")
            end = start + int(kv_indices.size)
            if end > entry.num_kv_indices:
                raise ValueError(
                    f"chunk ends at page {end}, past num_kv_indices={entry.num_kv_indices}"
                )
            for info in infos.values():
                if info.dst_pages.size < end:  # add_transfer_info refuses these; be sure
                    raise ValueError(
                        f"session {info.session_id!r} has {info.dst_pages.size} destination "
                        f"pages; chunk ends at page {end}"
                    )
            for info in infos.values():
                # Pages before the decode prefix are already at the peer: skip them.
                skip = min(max(info.decode_prefix_len - start, 0), end - start)
                sends = skip < end - start  # anything left after the prefix
                jobs.append(
                    ChunkJob(
                        handle,
                        chunk_idx,
                        info.session_id,
                        np.ascontiguousarray(kv_indices[skip:], dtype=np.int64),
                        info.dst_pages[start + skip : end],
                        info.byte_range,
                        info.dst_region,
                        is_last,
                        next(self._job_ids),
                        src_checked[skip:] if sends and src_checked is not None else None,
                        (
                            info.dst_checked[start + skip : end]
                            if sends and info.dst_checked is not None
                            else None
                        ),
                    )
                )
            entry.chunk_idxs.add(chunk_idx)
            entry.jobs_total += len(jobs)
            entry.last_chunk_seen = entry.last_chunk_seen or is_last
            self._counts["chunks_submitted"] += len(jobs)
            self._set_status(handle.room, KVPoll.Transferring)
            if is_last and not jobs:
                self._maybe_succeed(entry)
            if self._workers:
                # Queued under the lock (SimpleQueue.put never blocks): close() purges this
                # room after we let go, so its stop sentinels queue behind these jobs and
                # every submitted chunk is still taken (and skipped) by a worker.
                for job in jobs:
                    self._queue.put(job)
        if not self._workers:
            for job in jobs:
                self._launch(job)
        return len(jobs)

    def progress(self, handle: RoomHandle) -> None:
        """Inline mode: poll the room's pending transfers, and every draining one, once each.

        A transport error fails the chunk's room (never raised). Safe from several threads
        at once: each chunk still ends exactly once. With workers it only sweeps hung chunks
        when a sweep is due (every 50 ms). Thread-safe.

        Raises:
            TypeError: ``handle`` is not a :class:`RoomHandle`.
        """
        _check_handle(handle)
        if self._workers:
            self._maybe_sweep()  # hung chunks are swept wherever the manager runs
            return
        with self._room_lock.read():
            entry = self._live(handle)
            pending = [] if entry is None else list(entry.inflight.values())
            pending.extend(self._draining.values())
            for hung in self._hung.values():  # hung chunks of other open rooms
                if hung.job.handle.room != handle.room:
                    pending.append(hung)
        for inflight in pending:
            self._check(inflight)

    def record_failure(self, handle: RoomHandle, exc: BaseException | None, reason: str) -> bool:
        """Fail the room: status ``Failed``, keep ``exc`` (first one wins) and ``reason``.

        Refused (``False``, counted) for a purged room. Thread-safe; write lock, then the
        failure lock; atomic.
        """
        with self._room_lock.write():
            return self._fail_unlocked(handle, exc, reason)

    def pop_exception(self, handle: RoomHandle) -> BaseException | None:
        """Remove and return the stored exception of that opening (``None`` if the opening is
        purged or none is stored). Thread-safe; write lock; atomic with the ownership check.

        Raises:
            TypeError: ``handle`` is not a :class:`RoomHandle`.
        """
        _check_handle(handle)
        with self._room_lock.write():
            if self._live(handle) is None:
                return None
            return self._exceptions.pop(handle.room, None)

    def pop_failure_record(self, handle: RoomHandle) -> str | None:
        """Remove and return the failure reason of that opening (``None`` if the opening is
        purged or none is recorded). Thread-safe; write lock, then the failure lock; atomic
        with the ownership check.

        Raises:
            TypeError: ``handle`` is not a :class:`RoomHandle`.
        """
        _check_handle(handle)
        with self._room_lock.write():
            if self._live(handle) is None:
                return None
            with self.failure_lock.write():
                return self._failure_records.pop(handle.room, None)

    def purge_room(self, room: int | RoomHandle) -> ManagerPurge:
        """Remove the room from every table, the staging context and the slot pool at once.

        All-or-nothing and never raises for a state reason: it waits for the room's post
        gate (a worker that is posting one of the room's chunks finishes posting first; no
        chunk of this opening is posted after this returns) and takes the staging lock
        without its ``lock_timeout``. Posted transfers of the room are not released (NIXL
        cannot cancel a write): they *drain* (see :meth:`draining`, :meth:`wait_drained`);
        their slots go back to the pool when they end. Idempotent; a stale handle never
        purges a newer opening. Thread-safe: post gate, then one write critical section
        (manager -> staging -> failure lock).

        Raises:
            TypeError, ValueError: bad ``room``.
        """
        if isinstance(room, RoomHandle):
            room_id, generation = room.room, room.generation
        else:
            room_id, generation = check_room_id(room), None
        room_id = check_room_id(room_id)
        with self._room_lock.read():
            entry = self._rooms.get(room_id)
        if entry is None or (generation is not None and entry.handle.generation != generation):
            return ManagerPurge(room_id, False, None, (), None, 0, 0)
        with entry.gate.write_untimed(), self._room_lock.write_untimed():
            if self._rooms.get(room_id) is not entry:  # another purge won
                return ManagerPurge(room_id, False, None, (), None, 0, 0)
            del self._rooms[room_id]
            status = self._request_status.get(room_id)
            exception = self._exceptions.get(room_id)
            tables: list[str] = []
            for name, table in self._room_tables():  # a plain loop: DPOR traces it precisely
                if table.pop(room_id, None) is not None:
                    tables.append(name)
            staged = self.staging.purge_room(entry.handle)
            # Staging slots are not returned here: every slot of this opening is held by a
            # worker (gathering into it, or under a posted chunk), and that worker returns it
            # when it skips the chunk or when the chunk ends. Returning it now would let
            # another room lease and overwrite a slot that a transfer still reads from.
            with self.failure_lock.write():
                record = self._failure_records.pop(room_id, None)
                if record is not None:
                    tables.append("failure_records")
            for job_id, inflight in entry.inflight.items():
                self._draining[job_id] = inflight
            draining = len(entry.inflight)
            entry.inflight.clear()
            self._counts["purges"] += 1
            if self._send_notif is not None and status is not KVPoll.Success:
                notice = RoomNotice(
                    room_id,
                    entry.handle.generation,
                    "failed" if status is KVPoll.Failed else "cleared",
                    code_for(record, exception) if status is KVPoll.Failed else "cleared",
                )
                if draining:
                    self._pending_notices[entry.handle] = (notice, entry.sessions)
                else:
                    self._notices.put((notice, entry.sessions))
        return ManagerPurge(
            room_id, True, status, tuple(tables), staged, 0, 0, exception, record, draining
        )

    def fail_session(self, session_id: str, reason: str) -> frozenset[int]:
        """A decode peer died: fail every open, unconcluded room with a transfer to it.

        Drops the session's staging keys (``purge_session``, which never times out). Returns
        the rooms failed. Thread-safe; one write critical section; never raises for a state
        reason.

        Raises:
            TypeError, ValueError: bad ``session_id``.
        """
        session_id = check_session_id(session_id)
        failed: list[int] = []
        with self._room_lock.write_untimed():
            for room_id, entry in self._rooms.items():
                if session_id not in entry.sessions:
                    continue
                if is_concluded(self._request_status.get(room_id)):
                    continue
                exc = KVTransferError(room_id, f"decode peer {session_id!r} failed: {reason}")
                self._fail_unlocked(entry.handle, exc, exc.reason)
                failed.append(room_id)
            self.staging.purge_session(session_id)
            self._counts["sessions_failed"] += 1
        return frozenset(failed)

    def close(self, timeout_s: float = 5.0) -> None:
        """Refuse new rooms, purge every open room, drain, stop the workers. Idempotent.

        ``close`` and :meth:`open_room` are mutually atomic: a room is either refused or
        purged here. Transfers still in flight after ``timeout_s`` are *abandoned*: released
        (NIXL tries to cancel; their bytes may still land) and counted in
        ``stats().transfers_abandoned``; their rooms get no room notice (their bytes may
        still land: counted in ``stats().notices_withheld``). Notices already queued are sent
        within the same ``timeout_s``; a notifier blocked on an unreachable peer is left
        behind (a daemon thread) rather than failing ``close``.

        Raises:
            TypeError, ValueError: bad ``timeout_s`` (not a number >= 0; ``inf`` waits as long
                as it takes), checked before anything changes.
            RuntimeError: a worker did not stop within ``timeout_s``.
        """
        timeout_s = check_seconds(timeout_s, "timeout_s", allow_zero=True, allow_inf=True)
        deadline = time.monotonic() + timeout_s
        with self._room_lock.write_untimed():
            self._closing = True
            rooms = [e.handle for e in self._rooms.values()]
        for handle in rooms:
            self.purge_room(handle)
        if not self._closed.is_set():
            self._closed.set()
            for _ in self._workers:
                self._queue.put(None)
        self.wait_drained(None, max(0.0, deadline - time.monotonic()))
        with self._room_lock.read():
            left = list(self._draining.values())
        for inflight in left:
            if self._end(inflight, None, abandoned=True):
                self._count("transfers_abandoned")
        # A chunk that another thread claimed before us is not abandoned: its end (a release
        # and its accounting) is in progress and queues its room's notice. Wait for those
        # ends before the notifier is told to stop, at least _CLAIMED_END_GRACE_S.
        settle_until = max(deadline, time.monotonic() + _CLAIMED_END_GRACE_S)
        while True:
            with self._room_lock.read():
                ending = len(self._draining)
            if not ending or time.monotonic() >= settle_until:
                break
            time.sleep(0.0005)
        with self._room_lock.write_untimed():
            # Rooms whose writes were abandoned had their notice withheld as they were (the
            # bytes may still land). What is left belongs to ends still in progress after the
            # grace (a release stuck in NIXL): withheld too, the bytes are not known drained.
            self._counts["notices_withheld"] += len(self._pending_notices)
            self._pending_notices.clear()
        if self._notifier is not None:
            self._notices.put(None)
        for worker in self._workers:
            # At least a moment, even if abandoning used up timeout_s: a worker polling an
            # abandoned chunk sees it released and exits at once.
            worker.join(bounded_wait(max(0.5, deadline - time.monotonic())))
        if self._notifier is not None:
            # Best effort: a notice to a partitioned peer may block inside NIXL; the
            # notifier is a daemon and is left behind rather than failing close().
            self._notifier.join(bounded_wait(deadline - time.monotonic()))
        alive = [w.name for w in self._workers if w.is_alive()]
        if alive:
            raise RuntimeError(f"transfer workers did not stop: {alive}")

    def __enter__(self) -> KVManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ workers

    def _worker_main(self) -> None:
        while True:
            try:
                job = self._queue.get(timeout=_HUNG_SWEEP_S)
            except queue.Empty:
                self._maybe_sweep()
                continue
            if job is None:
                return
            try:
                inflight = self._launch(job)
                pauses = (
                    poll_pauses(_WORKER_SPIN_S)
                    if self.poll_interval_s is None
                    else itertools.repeat(self.poll_interval_s)
                )
                while inflight is not None and not self._check(inflight):
                    self._maybe_sweep()
                    pause = next(pauses)
                    pause_between_polls(min(pause, _HUNG_SWEEP_S) if self._hung else pause)
            except BaseException as exc:  # a worker never dies: the room fails instead
                self._on_internal_error(job, exc)
            self._maybe_sweep()  # also under steady traffic, when the queue is never empty

    def _notifier_main(self) -> None:
        """Send queued room notices to each session of their room (best effort)."""
        while True:
            item = self._notices.get()
            if item is None:
                return
            notice, sessions = item
            try:
                payload = notice.encode()
            except BaseException:
                self._count("notices_failed")
                continue
            for session_id in sessions:
                try:
                    self._send_notif(session_id, payload)
                except BaseException:  # a dead or removed peer: best effort, counted
                    self._count("notices_failed")
                else:
                    self._count("notices_sent")

    def _maybe_sweep(self) -> None:
        """Sweep hung chunks if any and a sweep is due (every :data:`_HUNG_SWEEP_S`), unless
        another thread is sweeping. Called wherever the manager runs -- every worker loop
        iteration (busy or idle), between the polls of a worker's own chunk, while a worker
        waits for a staging slot, in ``progress()`` and ``wait_drained()`` -- so a hung chunk
        whose write has settled ends within about one sweep period of its settling, busy or
        idle, and returns its slot. Never raises; never blocks."""
        if not self._hung or time.monotonic() < self._sweep_due:
            return
        if not self._sweep_claim.acquire(False):
            return
        try:
            self._sweep_due = time.monotonic() + _HUNG_SWEEP_S
            self._sweep_hung()
        finally:
            self._sweep_claim.release()

    def _sweep_hung(self) -> None:
        """Re-check chunks that timed out while still in progress. Never raises."""
        try:
            with self._room_lock.read():
                hung = list(self._hung.values())
            for inflight in hung:
                self._check(inflight)
        except BaseException:  # a worker never dies
            self._unaccounted_worker_errors += 1

    def _launch(self, job: ChunkJob) -> _Inflight | None:
        """Start one chunk; any error fails its room (never raised). ``None`` = nothing to
        poll (skipped, finished at once, or failed)."""
        try:
            return self._start_job(job)
        except BaseException as exc:  # before the chunk was registered: it ends here
            self._on_internal_error(job, exc, chunk_ends=True)
            return None

    def _on_internal_error(
        self, job: ChunkJob, exc: BaseException, *, chunk_ends: bool = False
    ) -> None:
        """An unexpected error while handling ``job``: count it and fail the room; with
        ``chunk_ends`` the chunk also ends here (failed, or skipped if its room is gone).
        Never raises (if even that fails, the error is still counted)."""
        try:
            with self._room_lock.write_untimed():
                self._counts["worker_errors"] += 1
                failed = self._fail_unlocked(
                    job.handle, exc, f"internal error in transfer worker: {exc!r}"
                )
                if chunk_ends:
                    self._counts["chunks_failed" if failed else "chunks_skipped"] += 1
        except BaseException:
            self._unaccounted_worker_errors += 1

    def _start_job(self, job: ChunkJob) -> _Inflight | None:
        """Stage (optionally), then check-and-post one chunk under its room's post gate.

        Returns the registered chunk to poll, or ``None`` when it is skipped (room purged or
        failed), finished at once (nothing to send) or failed to post (its room is failed).
        """
        handle = job.handle
        # Lock-free early look (a dict read is atomic under the GIL): only to skip a chunk
        # of a purged or failed room cheaply and to find the room's gate. The decision that
        # counts is taken again under the gate and the write lock, right before the post.
        entry = self._rooms.get(handle.room)
        if (
            entry is None
            or entry.handle.generation != handle.generation
            or self._request_status.get(handle.room) is KVPoll.Failed
        ):
            self._count("chunks_skipped")
            return None
        inflight = _Inflight(job)
        src_region = self.kv_region
        src: PageArray = job.src_pages
        if job.src_pages.size == 0:  # every page is in the decode prefix: nothing to send
            self._complete_unposted(job)
            return None
        if self.staging_pool is not None:
            if not self._request_prefetch(job):
                self._count("chunks_skipped")
                return None
            try:
                # Sweep while waiting: the slots waited for may be held by hung chunks.
                inflight.slot = self.staging_pool.acquire(
                    handle, self.slot_timeout_s, on_wake=self._maybe_sweep, wake_s=_HUNG_SWEEP_S
                )
            except (PoolExhaustedError, PoolClosedError) as exc:
                with self._room_lock.write():
                    if self._fail_unlocked(handle, exc, f"no staging slot: {exc}"):
                        self._counts["chunks_failed"] += 1
                    else:
                        self._counts["chunks_skipped"] += 1
                return None
            with self._room_lock.read():  # the slot wait may have been long: still wanted?
                wanted = self._postable(handle, entry)
            if not wanted:
                self.staging_pool.release(inflight.slot)
                self._count("chunks_skipped")
                return None
            try:
                n = self.staging_pool.gather(inflight.slot, self.kv_pool, src, job.byte_range)
            except BaseException:
                self.staging_pool.release(inflight.slot)
                raise
            src = np.arange(inflight.slot.first_page, inflight.slot.first_page + n)
            src_region = self.staging_region
            src_pages: PageIndices = CheckedPages.span(inflight.slot.first_page, n)
        else:
            src_pages = job.src_checked if job.src_checked is not None else src
        notif = f"room={handle.room};chunk={job.chunk_idx};last={int(job.is_last)}".encode()
        post_error: BaseException | None = None
        # The post fence: the room's purge takes this gate too, so "live and not failed" is
        # still true when the write is posted, and a purge that returned saw this chunk
        # registered (it drains) or made us skip it.
        with entry.gate.write_untimed():
            with self._room_lock.write():
                registered = self._postable(handle, entry, count=True)
                if registered:
                    entry.inflight[job.job_id] = inflight
                else:
                    self._counts["chunks_skipped"] += 1
            if registered:
                try:
                    inflight.transfer = self.transport.write_pages(
                        job.session_id,
                        src_pages,
                        job.dst_checked if job.dst_checked is not None else job.dst_pages,
                        notif,
                        src_region=src_region,
                        dst_region=job.dst_region,
                        timeout_s=self.transfer_timeout_s,
                    )
                except BaseException as exc:
                    post_error = exc
        if not registered:
            if inflight.slot is not None and self.staging_pool is not None:
                self.staging_pool.release(inflight.slot)
            return None
        if post_error is not None:
            self._end(inflight, post_error)
            return None
        return inflight

    def _check(self, inflight: _Inflight) -> bool:
        """Poll once; ``True`` when this caller is done with the chunk: it ended (here or in
        another thread), or it is *hung* (past its deadline, still in progress in NIXL: its
        room is failed and it ends once it settles, see ``_sweep_hung``). Never raises: a
        transfer error ends the chunk as failed (and fails its room)."""
        transfer = inflight.transfer
        if inflight.ended:
            return True
        if transfer is None:  # registered, still being posted by its worker
            return False
        if inflight.hung is not None:  # its room already failed; ends once it settles
            settled = getattr(transfer, "settled", None)
            if settled is None or settled():
                self._end(inflight, inflight.hung, already_failed=True)
            return True
        try:
            state = transfer.poll()
        except TransferTimeoutError as exc:
            settled = getattr(transfer, "settled", None)
            if settled is not None and not settled():
                self._hang(inflight, exc)  # NIXL still has it: it may yet write
            else:
                self._end(inflight, exc)
            return True
        except BaseException as exc:
            self._end(inflight, exc)
            return True
        if state != "DONE":
            return False
        self._end(inflight, None)
        return True

    def _hang(self, inflight: _Inflight, exc: BaseException) -> None:
        """The chunk passed its deadline while NIXL still has it in progress: fail its room
        now (and its session), but keep the chunk (transfer and slot) until it settles: the
        write may still happen, so its pages and slot are not free. Never raises."""
        job = inflight.job
        with self._room_lock.write_untimed():
            if inflight.hung is not None or inflight.ended:
                return
            inflight.hung = exc
            self._hung[job.job_id] = inflight
            reason = f"transfer of chunk {job.chunk_idx} to {job.session_id!r} failed: {exc!r}"
            self._fail_unlocked(job.handle, exc, reason)
        if self.fail_session_on_disconnect:
            self.fail_session(job.session_id, f"{type(exc).__name__}: {exc}")

    def _end(
        self,
        inflight: _Inflight,
        exc: BaseException | None,
        *,
        abandoned: bool = False,
        already_failed: bool = False,
    ) -> bool:
        """End a chunk exactly once: release its transfer and slot, unregister it, count it,
        and (when its room is open) count it done or fail the room with ``exc``. ``False``
        if another thread had already ended it. Never raises for a state reason."""
        if not inflight.claim():
            return False
        job = inflight.job
        try:
            if inflight.transfer is not None:
                inflight.transfer.release()
        finally:
            if inflight.slot is not None and self.staging_pool is not None:
                self.staging_pool.release(inflight.slot)
            fatal = self._account_end(
                inflight, exc, abandoned=abandoned, already_failed=already_failed
            )
        if fatal and exc is not None:
            self.fail_session(job.session_id, f"{type(exc).__name__}: {exc}")
        return True

    def _account_end(
        self,
        inflight: _Inflight,
        exc: BaseException | None,
        *,
        abandoned: bool,
        already_failed: bool = False,
    ) -> bool:
        """The locked half of :meth:`_end`. Returns whether the error is session-fatal (and
        not yet reported: a hung chunk's room and session were failed by ``_hang``)."""
        job = inflight.job
        released = isinstance(exc, TransferReleasedError)
        with self._room_lock.write_untimed():
            self._hung.pop(job.job_id, None)
            drained = self._draining.pop(job.job_id, None) is not None
            if abandoned and self._pending_notices.pop(job.handle, None) is not None:
                # Its writes were given up, not drained: they may still land, so the decode
                # side must not be told it may reuse the room's pages.
                self._counts["notices_withheld"] += 1
            elif drained and job.handle in self._pending_notices and not any(
                i.job.handle == job.handle for i in self._draining.values()
            ):
                self._notices.put(self._pending_notices.pop(job.handle))
            entry = self._live(job.handle)
            if not drained and entry is not None:
                entry.inflight.pop(job.job_id, None)
            if drained or entry is None or abandoned:
                self._counts["chunks_drained"] += 1
                if released:
                    self._counts["chunks_released_by_transport"] += 1
                return False
            if exc is None:
                entry.jobs_done += 1
                self._counts["chunks_done"] += 1
                self._maybe_succeed(entry)
                return False
            self._counts["chunks_failed"] += 1
            if already_failed:
                return False
            if released:
                self._counts["chunks_released_by_transport"] += 1
                reason = (
                    f"transfer of chunk {job.chunk_idx} to {job.session_id!r} was released by "
                    "the transport (peer removed or transport closed)"
                )
                stored: BaseException = KVTransferError(job.handle.room, reason)
                stored.__cause__ = exc
            else:
                reason = f"transfer of chunk {job.chunk_idx} to {job.session_id!r} failed: {exc!r}"
                stored = exc
                if isinstance(exc, TransferFailedError):
                    # NIXL reported an error *state*: the room fails with an error naming it.
                    stored = KVTransferError(job.handle.room, f"transfer in error state ({exc})")
                    stored.__cause__ = exc
            self._fail_unlocked(job.handle, stored, reason)
        return self.fail_session_on_disconnect and isinstance(exc, SESSION_FATAL_ERRORS)

    def _complete_unposted(self, job: ChunkJob) -> None:
        """A chunk with no page to send is done at once (if its room is still open)."""
        with self._room_lock.write():
            entry = self._live(job.handle, count=True)
            if entry is None:
                self._counts["chunks_skipped"] += 1
                return
            entry.jobs_done += 1
            self._counts["chunks_done"] += 1
            self._maybe_succeed(entry)

    def _request_prefetch(self, job: ChunkJob) -> bool:
        """Record the staging prefetch key; mark the room prefetched once all are in."""
        if not self.staging.request_prefetch(job.handle, job.chunk_idx, job.session_id):
            return False
        with self._room_lock.write():
            entry = self._live(job.handle, count=True)
            if entry is None:
                return False
            entry.prefetch_requests += 1
            complete = entry.last_chunk_seen and entry.prefetch_requests == entry.jobs_total
        if complete:
            self.staging.mark_prefetched(job.handle)
        return True

    # ------------------------------------------------------------------ helpers (locked)

    def _live(self, handle: RoomHandle, *, count: bool = False) -> _RoomEntry | None:
        """The entry of that opening, or ``None``. Caller holds ``_room_lock``
        (the write mode when ``count`` is set, which counts a refused late write)."""
        entry = self._rooms.get(handle.room)
        if entry is None or entry.handle.generation != handle.generation:
            if count:
                self._counts["refused_late_writes"] += 1
            return None
        return entry

    def _lingering(self, handle: RoomHandle | None) -> int:
        """See :meth:`draining`. Caller holds ``_room_lock``."""
        chunks = [
            i for i in self._draining.values() if handle is None or i.job.handle == handle
        ]
        if self.staging_pool is None:
            return len(chunks)
        if handle is not None:
            owners = [] if self._live(handle) is not None else [handle]
        else:
            owners = [
                o
                for o in self.staging_pool.owners()
                if isinstance(o, RoomHandle) and self._live(o) is None
            ]
        held = sum(self.staging_pool.owner_slots(o) for o in owners)
        under_chunks = sum(1 for i in chunks if i.slot is not None)
        return len(chunks) + max(0, held - under_chunks)

    def _postable(self, handle: RoomHandle, entry: _RoomEntry, *, count: bool = False) -> bool:
        """``entry`` is still the open entry of ``handle`` and its room has not failed: a
        chunk of it may be staged and posted. Caller holds ``_room_lock`` (write mode with
        ``count``, see :meth:`_live`)."""
        return (
            self._live(handle, count=count) is entry
            and self._request_status.get(handle.room) is not KVPoll.Failed
        )

    def _room_tables(self) -> tuple[tuple[str, dict[int, Any]], ...]:
        """The per-room tables guarded by ``_room_lock``, by name (``failure_records`` has
        its own lock). Caller holds ``_room_lock``."""
        return (
            ("request_status", self._request_status),
            ("transfer_infos", self._transfer_infos),
            ("req_to_decode_prefix_len", self._req_to_decode_prefix_len),
            ("exceptions", self._exceptions),
        )

    def _set_status(self, room: int, status: KVPoll) -> None:
        """Caller holds the write lock and checked the room is live."""
        self._request_status[room] = merge_status(self._request_status.get(room), status)

    def _maybe_succeed(self, entry: _RoomEntry) -> None:
        """Caller holds the write lock."""
        if entry.last_chunk_seen and entry.jobs_done == entry.jobs_total:
            self._set_status(entry.handle.room, KVPoll.Success)

    def _fail_unlocked(self, handle: RoomHandle, exc: BaseException | None, reason: str) -> bool:
        """Caller holds the write lock."""
        entry = self._live(handle, count=True)
        if entry is None:
            return False
        if exc is not None:
            self._exceptions.setdefault(handle.room, exc)
        self._set_status(handle.room, KVPoll.Failed)
        with self.failure_lock.write():
            self._failure_records.setdefault(handle.room, reason)
        return True

    def _count(self, name: str) -> None:
        with self._room_lock.write():
            self._counts[name] += 1


def _check_handle(handle: object) -> None:
    if type(handle) is not RoomHandle:
        raise TypeError(f"expected a RoomHandle, got {type(handle).__name__}")
