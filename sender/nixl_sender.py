"""``NixlKVSender``: the per-request sender an engine's scheduler drives.

One per room: ``init`` once, ``send`` per chunk (the last concludes the room), ``poll`` every
step, then ``clear()`` on ``Success`` or ``failure_exception()`` on ``Failed``. Attribute
names (``bootstrap_room``, ``conclude_state``, ``_send_failed``, ``kv_mgr``, ...) mirror
upstream senders. ``send``/``poll`` never raise for a transport failure (docs/THREADING.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import NoReturn

import numpy as np

from sender._one_thread import OneThreadCheck
from sender.errors import ConcurrentSenderUseError, KVTransferError, RoomNotFailedError
from sender.manager import KVManager, PageArray, TransferInfo
from sender.poll import KVPoll, is_concluded
from staging.context import RoomHandle
from staging.validate import check_index, check_room_id, check_session_id

_INT64_MAX = int(np.iinfo(np.int64).max)


def _as_indices(kv_indices: Sequence[int] | PageArray, what: str, num_pages: int) -> PageArray:
    """Validate 1-D integer page indices (bools refused) as a contiguous int64 array; the
    bounds check is the manager's, except a uint64 past int64's range."""
    arr = np.asarray(kv_indices)
    if arr.dtype.kind == "b" or (arr.size and arr.dtype.kind not in "iu"):
        raise TypeError(f"{what} must hold ints, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got shape {arr.shape}")
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and arr.size and (
        int(arr.max()) > _INT64_MAX
    ):  # would wrap to a negative int64 and be reported as that
        position = int(np.argmax(arr > _INT64_MAX))
        raise ValueError(
            f"{what} out of range [0, {num_pages}): {int(arr[position])} at position {position}"
        )
    return np.ascontiguousarray(arr, dtype=np.int64)


class NixlKVSender:
    """Sends one room's KV pages to its decode session(s) through a :class:`KVManager`.

    Args:
        mgr: the manager (owns the transport, tables, workers).
        bootstrap_room: the room (request) id, an ``int`` >= 0.
        session_ids: the decode sessions that receive this room.
        transfer_infos: decode-side infos already known (else the bootstrap thread calls
            :meth:`KVManager.add_transfer_info` later).

    Raises:
        RoomAlreadyOpenError: a sender for this room is alive (not cleared).
        TypeError, ValueError: bad room or sessions (a ``str`` is refused), or a bad transfer
            info (the room is then purged).
        RuntimeError: the manager is closed.

    Thread-safety: ``init``, ``send``, ``poll``, ``failure_exception`` and ``abort`` are for
    one thread at a time (the scheduler's); ``clear`` is safe from any thread. In debug mode
    an overlap raises (or, in ``poll``/``abort``, fails the room with)
    :class:`~sender.errors.ConcurrentSenderUseError`.
    """

    def __init__(
        self, mgr: KVManager, bootstrap_room: int, session_ids: Sequence[str],
        transfer_infos: Sequence[TransferInfo] = (),
    ) -> None:
        """Make one: its arguments and what it raises are in ``help(NixlKVSender)``."""
        if isinstance(session_ids, (str, bytes)):
            raise TypeError(
                f"session_ids must be a sequence of session id strings, got {session_ids!r}"
            )
        # Every argument check runs before the room opens: a failed constructor leaves nothing.
        room = check_room_id(bootstrap_room)
        sessions = tuple(check_session_id(s) for s in session_ids)
        infos = tuple(mgr.vet_info(info, sessions, room)[0] for info in transfer_infos)
        self.kv_mgr = mgr
        self.bootstrap_room = room
        self.session_ids = sessions
        self._handle: RoomHandle = mgr.open_room(room, sessions)
        self._one_thread: OneThreadCheck | None = (
            OneThreadCheck(room, self._handle.generation) if mgr.debug else None
        )
        self.conclude_state: KVPoll | None = None
        self._send_failed = False
        self._send_error: BaseException | None = None
        self._failure_reported = False
        self.num_kv_indices: int | None = None
        self.aux_index: int | None = None
        self._pages_sent = 0
        self._chunk_idx = 0
        try:
            for info in infos:  # a check that can still fail here fails under the lock
                mgr.add_transfer_info(self._handle, info)
        except BaseException:
            mgr.purge_room(self._handle)
            raise

    @property
    def handle(self) -> RoomHandle:
        """The room's handle (room id and the generation of this opening)."""
        return self._handle

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        """Declare how many KV pages this room sends. Scheduler thread.

        Raises:
            TypeError, ValueError: bad count (or more pages than a session's destination),
                ``aux_index`` not an int >= 0, or ``init`` called twice. No state changes.
            ConcurrentSenderUseError: debug mode only: another thread is inside a
                scheduler-thread method of this sender. No state changes.
        """
        with self._inside("init"):
            num_kv_indices = check_index(num_kv_indices, "num_kv_indices")
            if aux_index is not None:
                aux_index = check_index(aux_index, "aux_index")
            if self.num_kv_indices is not None:
                raise ValueError(f"init() already called for room {self.bootstrap_room}")
            self.kv_mgr.init_room(self._handle, num_kv_indices)
            self.num_kv_indices = num_kv_indices
            self.aux_index = aux_index

    def send(self, kv_indices: Sequence[int] | PageArray) -> None:
        """Send the next chunk of prefill KV pages, in room order; the one reaching
        ``num_kv_indices`` concludes the room. After a failure a no-op; a transport error is
        recorded (``_send_error``) for ``poll``, never raised. Scheduler thread.

        Raises:
            RuntimeError: ``send`` before ``init``.
            TypeError, ValueError: indices not 1-D ints >= 0, out of the KV pool, past
                ``num_kv_indices``, an empty chunk that is not the last one, or the room not
                ready. No state changes.
            ConcurrentSenderUseError: debug mode only: another thread is inside a
                scheduler-thread method of this sender. No state changes.
        """
        with self._inside("send"):
            arr = _as_indices(kv_indices, "kv_indices", int(self.kv_mgr.kv_pool.shape[0]))
            if self.num_kv_indices is None:
                raise RuntimeError(f"send() before init() for room {self.bootstrap_room}")
            if self._send_failed or is_concluded(self.conclude_state):
                return
            start = self._pages_sent
            if start + arr.size > self.num_kv_indices:
                raise ValueError(
                    f"room {self.bootstrap_room}: {arr.size} more pages would make "
                    f"{start + arr.size} sent ({start} already), num_kv_indices is "
                    f"{self.num_kv_indices}"
                )
            is_last = start + int(arr.size) == self.num_kv_indices
            if arr.size == 0 and not is_last:
                raise ValueError(
                    f"room {self.bootstrap_room}: an empty chunk is allowed only as the last one"
                )
            try:
                self.kv_mgr.submit_chunk(self._handle, self._chunk_idx, start, arr, is_last)
            except (TypeError, ValueError):
                raise
            except Exception as exc:  # transport error (inline mode) or anything unexpected
                self._note_failure(exc, f"send of chunk {self._chunk_idx} failed: {exc!r}")
                return
            self._pages_sent = start + int(arr.size)
            self._chunk_idx += 1

    def poll(self) -> KVPoll:
        """The room's status; a conclusion is kept in ``conclude_state``. Scheduler thread.

        Raises: nothing. In debug mode an overlap returns ``Failed`` (not cached) and fails
        the room with a :class:`~sender.errors.ConcurrentSenderUseError`.
        """
        try:
            inside = self._inside("poll")
        except ConcurrentSenderUseError as exc:  # poll() never raises
            self.kv_mgr.record_failure(self._handle, exc, exc.reason)
            return KVPoll.Failed
        with inside:
            if self.conclude_state is not None:
                return self.conclude_state
            if self._send_failed:
                return KVPoll.Failed
            try:
                self.kv_mgr.progress(self._handle)
                status = self.kv_mgr.handle_status(self._handle)
            except Exception as exc:
                self._note_failure(exc, f"poll failed: {exc!r}")
                return KVPoll.Failed
            if status is None:  # cleared (or reopened) before a conclusion was seen here
                self.conclude_state = KVPoll.Failed
                return KVPoll.Failed
            if is_concluded(status):
                self.conclude_state = status
            return status

    def failure_exception(self) -> NoReturn:
        """Purge the room, mark the sender ``Failed`` and raise why it failed (this
        opening's error only). Scheduler thread.

        Raises:
            BaseException: always; the first that applies: ``_send_error``; the stored
                exception; ``KVTransferError(room, failure_record)``;
                :class:`~sender.errors.RoomNotFailedError` for a room that succeeded or was
                cleared first; ``KVTransferError(..., is_from_another_rank=True)``. A second
                call raises "already reported" and changes nothing.
            ConcurrentSenderUseError: debug mode, another thread inside: nothing is purged.
        """
        with self._inside("failure_exception"):
            room = self.bootstrap_room
            if self._failure_reported:
                raise KVTransferError(room, "failure already reported by failure_exception()")
            self._failure_reported = True
            # mutant-site: failure-exception
            purge = self.kv_mgr.purge_room(self._handle)
            if self.conclude_state is None:
                self.conclude_state = KVPoll.Failed
            self._send_failed = True
            if self._send_error is not None:
                raise self._send_error
            if purge.exception is not None:
                raise purge.exception
            gen = self._handle.generation
            if purge.failure_record is not None:
                raise KVTransferError(room, purge.failure_record, generation=gen)
            if not purge.was_open or purge.status is KVPoll.Success:
                raise RoomNotFailedError(
                    room,
                    "it succeeded; failure_exception() was called on a Success room (now cleared)"
                    if purge.was_open
                    else "it was cleared before a failure was recorded (no error kept)",
                    generation=gen,
                )
            raise KVTransferError(
                room, "failed on another rank (no local error recorded)", is_from_another_rank=True,
                generation=gen,
            )

    def clear(self) -> None:
        """Purge the room everywhere; posted chunks drain (its pages are free once
        ``kv_mgr.draining(handle) == 0``). Idempotent; any thread; never raises."""
        self.kv_mgr.purge_room(self._handle)

    def abort(self) -> None:
        """Give the request up: the room becomes ``Failed``. Scheduler thread.

        Raises: nothing. In debug mode an overlap fails the room with a
        :class:`~sender.errors.ConcurrentSenderUseError` instead.
        """
        try:
            inside = self._inside("abort")
        except ConcurrentSenderUseError as exc:  # abort() never raises
            self.kv_mgr.record_failure(self._handle, exc, exc.reason)
            return
        with inside:
            self._note_failure(None, "aborted by the caller")

    def _inside(self, method: str) -> AbstractContextManager[None]:
        """Debug mode: enter the one-thread check now (ConcurrentSenderUseError if another
        thread is inside), left when the returned context exits; else a no-op context."""
        check = self._one_thread
        return nullcontext() if check is None else check.enter(method)

    def _note_failure(self, exc: BaseException | None, reason: str) -> None:
        self._send_failed = True
        if exc is not None and self._send_error is None:
            self._send_error = exc
        stored = exc if exc is not None else KVTransferError(self.bootstrap_room, reason)
        self.kv_mgr.record_failure(self._handle, stored, reason)

    def __repr__(self) -> str:
        return (
            f"<NixlKVSender room={self.bootstrap_room} gen={self._handle.generation} "
            f"conclude_state={self.conclude_state!r} failed={self._send_failed}>"
        )
