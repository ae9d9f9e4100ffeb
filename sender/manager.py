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
never allowed to re-create the room. A worker that dequeues a chunk of a purged room skips it.

Lock hierarchy (``staging.locks.LockLevel``; a thread takes them in this order only):
``_room_lock`` (ROOM) -> the staging context's lock (STAGING) -> the slot pool's lock (POOL)
-> ``failure_lock`` (FAILURE) -> a transport transfer's lock (TRANSFER). NIXL calls that may
block (posting, releasing) are never made while a lock of the model is held.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch

from sender import _nixl
from sender.errors import (
    TRANSPORT_ERRORS,
    KVTransferError,
    TransferFailedError,
    TransferReleasedError,
    TransferTimeoutError,
)
from sender.poll import KVPoll, is_concluded, merge_status
from staging.buffers import PoolClosedError, PoolExhaustedError, StagingBufferPool, StagingSlot
from staging.context import RoomHandle, RoomPurge, StagingContext
from staging.errors import RoomAlreadyOpenError
from staging.locks import LockLevel, make_lock
from staging.validate import check_index, check_room_id, check_session_id

PageArray = npt.NDArray[np.int64]


class TransferLike(Protocol):
    """What the manager needs of a transport transfer."""

    def poll(self) -> str: ...

    def release(self) -> None: ...


class TransportLike(Protocol):
    """What the manager needs of :class:`sender.transport.NixlTransport`."""

    def write_pages(
        self,
        session_id: str,
        src_pages: Sequence[int] | PageArray,
        dst_pages: Sequence[int] | PageArray,
        notif: bytes | None = None,
        *,
        src_region: str = "kv",
        dst_region: str = "kv",
        timeout_s: float | None = None,
    ) -> TransferLike: ...


@dataclass(frozen=True, slots=True)
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
        TypeError, ValueError: bad session id, page list (not 1-D non-negative ints),
            prefix length, or byte range.
    """
    check_session_id(session_id)
    arr = np.array(dst_pages, dtype=np.int64, copy=True)
    if arr.ndim != 1:
        raise ValueError("dst_pages must be a 1-D sequence of page indices")
    if arr.size and int(arr.min()) < 0:
        raise ValueError("dst_pages must be >= 0")
    arr.setflags(write=False)
    check_index(decode_prefix_len, "decode_prefix_len")
    if decode_prefix_len > arr.size:
        raise ValueError(f"decode_prefix_len {decode_prefix_len} > {arr.size} dst pages")
    if byte_range is not None:
        start, length = byte_range
        check_index(start, "byte_range start")
        if check_index(length, "byte_range length") < 1:
            raise ValueError("byte_range length must be >= 1")
    return TransferInfo(session_id, arr, decode_prefix_len, byte_range, dst_region)


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


@dataclass(slots=True)
class _Inflight:
    """A started chunk: its transfer and slot. Owned by the room entry while registered."""

    job: ChunkJob
    transfer: TransferLike | None = None
    slot: StagingSlot | None = None


@dataclass(slots=True)
class _RoomEntry:
    """Bookkeeping of one open room. Guarded by the manager's ``_room_lock``."""

    handle: RoomHandle
    sessions: tuple[str, ...]
    num_kv_indices: int | None = None
    jobs_total: int = 0
    jobs_done: int = 0
    last_chunk_seen: bool = False
    prefetch_requests: int = 0
    inflight: dict[int, _Inflight] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ManagerPurge:
    """What :meth:`KVManager.purge_room` removed, per table (``True`` = the room was there)."""

    room: int
    was_open: bool
    status: KVPoll | None
    tables: tuple[str, ...]
    staging: RoomPurge | None
    slots_released: int
    transfers_released: int


@dataclass(frozen=True, slots=True)
class ManagerStats:
    """Counters of one manager (taken under its lock)."""

    open_rooms: int
    rooms_opened: int
    purges: int
    chunks_submitted: int
    chunks_done: int
    chunks_skipped: int
    chunks_failed: int
    transfers_inflight: int
    refused_late_writes: int
    sessions_failed: int
    worker_errors: int


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
        poll_interval_s: how long a worker sleeps between polls of a pending transfer.
        fail_session_on_disconnect: when a transfer fails because its peer is gone or hung
            (a transport error), fail every room with a transfer to that session at once.

    Raises:
        TypeError, ValueError: bad arguments.
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
        poll_interval_s: float = 0.0002,
        kv_region: str = "kv",
        staging_region: str = "staging",
        fail_session_on_disconnect: bool = True,
    ) -> None:
        check_index(num_workers, "num_workers")
        if kv_pool.dim() != 2 or kv_pool.dtype != torch.uint8:
            raise TypeError("kv_pool must be a 2-D uint8 tensor [num_pages, page_bytes]")
        if not transfer_timeout_s > 0 or not slot_timeout_s >= 0 or not poll_interval_s >= 0:
            raise ValueError("timeouts must be > 0 and poll_interval_s >= 0")
        self.transport = transport
        self.kv_pool = kv_pool
        self.staging = staging if staging is not None else StagingContext(debug=debug)
        self.staging_pool = staging_pool
        self.transfer_timeout_s = float(transfer_timeout_s)
        self.slot_timeout_s = float(slot_timeout_s)
        self.poll_interval_s = float(poll_interval_s)
        self.kv_region = kv_region
        self.staging_region = staging_region
        self.fail_session_on_disconnect = fail_session_on_disconnect

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
        self._counts: dict[str, int] = dict.fromkeys(
            (
                "rooms_opened",
                "purges",
                "chunks_submitted",
                "chunks_done",
                "chunks_skipped",
                "chunks_failed",
                "refused_late_writes",
                "sessions_failed",
                "worker_errors",
            ),
            0,
        )
        # --- Guarded by failure_lock (taken alone or inside _room_lock). ---
        self._failure_records: dict[int, str] = {}

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
        check_room_id(room)
        with self._room_lock.read():
            return self._request_status.get(room)

    def is_open(self, handle: RoomHandle) -> bool:
        """``True`` while that opening of the room is open. Thread-safe; read lock."""
        with self._room_lock.read():
            return self._live(handle) is not None

    def footprint(self, room: int) -> tuple[str, ...]:
        """Names of every table, the staging context or the pool still holding ``room``.

        Empty for a purged room: that is the no-leak invariant. Thread-safe.

        Raises:
            TypeError, ValueError: bad ``room``.
        """
        check_room_id(room)
        held: list[str] = []
        with self._room_lock.read():
            entry = self._rooms.get(room)
            for name, table in (("rooms", self._rooms), *self._room_tables()):
                if room in table:
                    held.append(name)
            if entry is not None and entry.inflight:
                held.append("inflight")
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
            return ManagerStats(
                open_rooms=len(self._rooms),
                transfers_inflight=sum(len(e.inflight) for e in self._rooms.values()),
                **self._counts,
            )

    # ------------------------------------------------------------------ lifecycle

    def open_room(self, room: int, session_ids: Sequence[str]) -> RoomHandle:
        """Open ``room`` for ``session_ids`` (status ``Bootstrapping``). Thread-safe; atomic.

        Raises:
            RoomAlreadyOpenError: the room is open.
            TypeError, ValueError: bad room or session ids (none, duplicates, empty).
            RuntimeError: the manager is closed.
        """
        check_room_id(room)
        sessions = tuple(session_ids)
        if not sessions:
            raise ValueError("a room needs at least one decode session")
        for s in sessions:
            check_session_id(s)
        if len(set(sessions)) != len(sessions):
            raise ValueError(f"duplicate session ids: {sessions}")
        if self._closed.is_set():
            raise RuntimeError("KVManager is closed")
        with self._room_lock.write():
            if room in self._rooms:
                raise RoomAlreadyOpenError(room)
            handle = self.staging.open_room(room)
            self._rooms[room] = _RoomEntry(handle, sessions)
            self._request_status[room] = KVPoll.Bootstrapping
            self._counts["rooms_opened"] += 1
        return handle

    def add_transfer_info(self, handle: RoomHandle, info: TransferInfo) -> bool:
        """Record where ``info.session_id`` wants the room's pages (bootstrap thread).

        When every session of the room has its info the status becomes ``WaitingForInput``.
        A purged room refuses (``False``, counted). Thread-safe; write lock; atomic.

        Raises:
            ValueError: the session is not one of the room's, or a byte range without a
                staging pool.
        """
        if info.byte_range is not None and self.staging_pool is None:
            raise ValueError("byte_range (a TP slice of each page) needs a staging pool")
        with self._room_lock.write():
            entry = self._live(handle)
            if entry is None:
                return False
            if info.session_id not in entry.sessions:
                raise ValueError(
                    f"session {info.session_id!r} is not a session of room {handle.room}"
                )
            infos = self._transfer_infos.setdefault(handle.room, {})
            infos[info.session_id] = info
            self._req_to_decode_prefix_len[handle.room] = max(
                self._req_to_decode_prefix_len.get(handle.room, 0), info.decode_prefix_len
            )
            if len(infos) == len(entry.sessions):
                self._set_status(handle.room, KVPoll.WaitingForInput)
            return True

    def init_room(self, handle: RoomHandle, num_kv_indices: int) -> bool:
        """Set how many KV pages the room will send (``init``). Thread-safe; atomic.

        Raises:
            TypeError, ValueError: bad count, or larger than a session's ``dst_pages``.
        """
        check_index(num_kv_indices, "num_kv_indices")
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
        """``True`` when every session's info is in and ``init_room`` was called."""
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
        With ``num_workers=0`` the transfers are started here, on the caller's thread, and a
        transport error propagates to the caller. Thread-safe.

        Raises:
            ValueError: the room is not ready (no infos / no init), indices out of range
                of the KV pool, or past ``num_kv_indices``.
            TRANSPORT_ERRORS members (inline mode only).
        """
        if kv_indices.size and (
            int(kv_indices.min()) < 0 or int(kv_indices.max()) >= self.kv_pool.shape[0]
        ):
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
            end = start + int(kv_indices.size)
            if end > entry.num_kv_indices:
                raise ValueError(
                    f"chunk ends at page {end}, past num_kv_indices={entry.num_kv_indices}"
                )
            for info in infos.values():
                # Pages before the decode prefix are already at the peer: skip them.
                skip = min(max(info.decode_prefix_len - start, 0), end - start)
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
                    )
                )
            entry.jobs_total += len(jobs)
            entry.last_chunk_seen = entry.last_chunk_seen or is_last
            self._counts["chunks_submitted"] += len(jobs)
            self._set_status(handle.room, KVPoll.Transferring)
            if is_last and not jobs:
                self._maybe_succeed(entry)
        if self._workers:
            for job in jobs:
                self._queue.put(job)
        else:
            for job in jobs:
                self._start_job(job)
        return len(jobs)

    def progress(self, handle: RoomHandle) -> None:
        """Inline mode: poll the room's pending transfers once each. Thread-safe.

        A transport error propagates (the caller records it with :meth:`record_failure`).
        No-op with workers.

        Raises:
            TRANSPORT_ERRORS members.
        """
        if self._workers:
            return
        with self._room_lock.read():
            entry = self._live(handle)
            pending = [] if entry is None else list(entry.inflight.values())
        for inflight in pending:
            self._check(inflight)

    def record_failure(self, handle: RoomHandle, exc: BaseException | None, reason: str) -> bool:
        """Fail the room: status ``Failed``, keep ``exc`` (first one wins) and ``reason``.

        Refused (``False``, counted) for a purged room. Thread-safe; write lock, then the
        failure lock; atomic.
        """
        with self._room_lock.write():
            return self._fail_unlocked(handle, exc, reason)

    def pop_exception(self, room: int) -> BaseException | None:
        """Remove and return the room's stored exception. Thread-safe; write lock."""
        with self._room_lock.write():
            return self._exceptions.pop(room, None)

    def pop_failure_record(self, room: int) -> str | None:
        """Remove and return the room's failure reason. Thread-safe; failure lock."""
        with self.failure_lock.write():
            return self._failure_records.pop(room, None)

    def purge_room(self, room: int | RoomHandle) -> ManagerPurge:
        """Remove the room from every table, the staging context and the slot pool at once.

        In-flight transfers of the room are released (after the locks are dropped; bytes
        already posted may still land at the peer). Idempotent; a stale handle never purges
        a newer opening. Thread-safe: one write critical section (manager -> staging -> pool
        -> failure lock), then the transfer releases.

        Raises:
            TypeError, ValueError: bad ``room``.
        """
        if isinstance(room, RoomHandle):
            room_id, generation = room.room, room.generation
        else:
            room_id, generation = check_room_id(room), None
        check_room_id(room_id)
        with self._room_lock.write():
            entry = self._rooms.get(room_id)
            if entry is None or (generation is not None and entry.handle.generation != generation):
                return ManagerPurge(room_id, False, None, (), None, 0, 0)
            del self._rooms[room_id]
            status = self._request_status.get(room_id)
            tables = [
                name
                for name, table in self._room_tables()
                if table.pop(room_id, None) is not None
            ]
            staged = self.staging.purge_room(entry.handle)
            slots = (
                0 if self.staging_pool is None else self.staging_pool.release_owner(entry.handle)
            )
            with self.failure_lock.write():
                if self._failure_records.pop(room_id, None) is not None:
                    tables.append("failure_records")
            inflight = list(entry.inflight.values())
            entry.inflight.clear()
            self._counts["purges"] += 1
        released = 0
        for item in inflight:
            if item.transfer is not None:
                item.transfer.release()
                released += 1
        return ManagerPurge(room_id, True, status, tuple(tables), staged, slots, released)

    def fail_session(self, session_id: str, reason: str) -> frozenset[int]:
        """A decode peer died: fail every open, unconcluded room with a transfer to it.

        Drops the session's staging keys (``purge_session``). Returns the rooms failed.
        Thread-safe; one write critical section.

        Raises:
            TypeError, ValueError: bad ``session_id``.
        """
        check_session_id(session_id)
        failed: list[int] = []
        with self._room_lock.write():
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
        """Stop the workers (bounded join), then purge every open room. Idempotent.

        Raises:
            RuntimeError: a worker did not stop within ``timeout_s``.
        """
        if not self._closed.is_set():
            self._closed.set()
            for _ in self._workers:
                self._queue.put(None)
        deadline = time.monotonic() + timeout_s
        for worker in self._workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        alive = [w.name for w in self._workers if w.is_alive()]
        with self._room_lock.read():
            rooms = [e.handle for e in self._rooms.values()]
        for handle in rooms:
            self.purge_room(handle)
        if alive:
            raise RuntimeError(f"transfer workers did not stop: {alive}")

    def __enter__(self) -> KVManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ workers

    def _worker_main(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                inflight = self._start_job(job)
                while inflight is not None and not self._check(inflight):
                    time.sleep(self.poll_interval_s)
            except TRANSPORT_ERRORS as exc:
                self._on_transport_error(job, exc)
            except BaseException as exc:  # a worker must never die or leak the room
                with self._room_lock.write():
                    self._counts["worker_errors"] += 1
                self.record_failure(job.handle, exc, f"internal error in transfer worker: {exc!r}")

    def _start_job(self, job: ChunkJob) -> _Inflight | None:
        """Stage (optionally) and post one chunk; register it with its room.

        Returns ``None`` when the room is gone (the chunk is skipped) or the chunk is empty.
        Raises TRANSPORT_ERRORS members from the transport.
        """
        handle = job.handle
        with self._room_lock.read():
            alive = (
                self._live(handle) is not None
                and self._request_status.get(handle.room) is not KVPoll.Failed
            )
        if not alive:
            self._count("chunks_skipped")
            return None
        inflight = _Inflight(job)
        try:
            src_region = self.kv_region
            src: PageArray = job.src_pages
            if self.staging_pool is not None:
                if not self._request_prefetch(job):
                    self._count("chunks_skipped")
                    return None
                try:
                    inflight.slot = self.staging_pool.acquire(handle, self.slot_timeout_s)
                except (PoolExhaustedError, PoolClosedError) as exc:
                    self.record_failure(handle, exc, f"no staging slot: {exc}")
                    self._count("chunks_failed")
                    return None
                n = self.staging_pool.gather(inflight.slot, self.kv_pool, src, job.byte_range)
                src = np.arange(inflight.slot.first_page, inflight.slot.first_page + n)
                src_region = self.staging_region
            if job.src_pages.size == 0:
                self._finish(inflight)
                return None
            notif = f"room={handle.room};chunk={job.chunk_idx};last={int(job.is_last)}".encode()
            inflight.transfer = self.transport.write_pages(
                job.session_id,
                src,
                job.dst_pages,
                notif,
                src_region=src_region,
                dst_region=job.dst_region,
                timeout_s=self.transfer_timeout_s,
            )
        except BaseException:
            self._discard(inflight)
            raise
        with self._room_lock.write():
            entry = self._live(handle, count=True)
            if entry is not None:
                entry.inflight[job.job_id] = inflight
        if entry is None:  # purged while we were posting: drop it
            self._discard(inflight)
            self._count("chunks_skipped")
            return None
        return inflight

    def _check(self, inflight: _Inflight) -> bool:
        """Poll once; ``True`` when the chunk is finished (done, or its room purged)."""
        assert inflight.transfer is not None
        try:
            state = inflight.transfer.poll()
        except TransferReleasedError:  # the room was purged under us
            self._discard(inflight)
            self._count("chunks_skipped")
            return True
        except BaseException:
            self._unregister(inflight)
            self._discard(inflight)
            raise
        if state != "DONE":
            return False
        self._finish(inflight)
        return True

    def _finish(self, inflight: _Inflight) -> None:
        job = inflight.job
        self._unregister(inflight)
        self._discard(inflight)
        with self._room_lock.write():
            entry = self._live(job.handle, count=True)
            if entry is None:
                return
            entry.jobs_done += 1
            self._counts["chunks_done"] += 1
            self._maybe_succeed(entry)

    def _on_transport_error(self, job: ChunkJob, exc: BaseException) -> None:
        self._count("chunks_failed")
        reason = f"transfer of chunk {job.chunk_idx} to {job.session_id!r} failed: {exc!r}"
        stored = exc
        if isinstance(exc, TransferFailedError):
            # NIXL reported an error *state*: the room fails with a RuntimeError naming it.
            stored = KVTransferError(job.handle.room, f"transfer in error state ({exc})")
            stored.__cause__ = exc
        self.record_failure(job.handle, stored, reason)
        if self.fail_session_on_disconnect and isinstance(exc, SESSION_FATAL_ERRORS):
            self.fail_session(job.session_id, f"{type(exc).__name__}: {exc}")

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

    def _unregister(self, inflight: _Inflight) -> None:
        with self._room_lock.write():
            entry = self._live(inflight.job.handle)
            if entry is not None:
                entry.inflight.pop(inflight.job.job_id, None)

    def _discard(self, inflight: _Inflight) -> None:
        """Release the transfer and slot of a chunk (idempotent; no lock held)."""
        if inflight.transfer is not None:
            inflight.transfer.release()
        if inflight.slot is not None and self.staging_pool is not None:
            self.staging_pool.release(inflight.slot)

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
