"""``NixlKVSender``: the per-request sender object an engine's scheduler drives.

The scheduler creates one per request (room), calls ``init`` once the number of KV pages is
known, ``send`` once per chunk (the last chunk concludes the room), ``poll`` every step, and
then ``clear()`` on ``Success`` or ``failure_exception()`` on ``Failed``. The attribute names
(``bootstrap_room``, ``conclude_state``, ``_send_failed``, ``_send_error``, ``kv_mgr``)
mirror upstream senders so that their users recognise them.

Contract (see ``docs/THREADING.md``): ``send`` and ``poll`` never raise for a transport
failure — they report ``KVPoll.Failed`` and keep the exception; only bad arguments raise.
``failure_exception`` raises by design, after purging the room. ``clear`` is idempotent and
safe from any thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

import numpy as np

from sender._one_thread import OneThreadCheck
from sender.errors import ConcurrentSenderUseError, KVTransferError, RoomNotFailedError
from sender.manager import KVManager, PageArray, TransferInfo
from sender.poll import KVPoll, is_concluded
from staging.context import RoomHandle
from staging.validate import check_index, check_room_id, check_session_id

_INT64 = np.dtype(np.int64)


_INT64_MAX = int(np.iinfo(np.int64).max)


def _as_indices(kv_indices: Sequence[int] | PageArray, what: str, num_pages: int) -> PageArray:
    """Validate a 1-D list/array of integer page indices (bools refused); an index outside
    ``[0, num_pages)`` is named with its position (the rest of the bounds check is the
    manager's, one pass)."""
    if (
        type(kv_indices) is np.ndarray
        and kv_indices.dtype is _INT64
        and kv_indices.ndim == 1
        and kv_indices.flags.c_contiguous
    ):
        return kv_indices  # the common case: already what the manager takes
    arr = np.asarray(kv_indices)
    # dtype.kind, not np.issubdtype (~2.5 us a call here): this runs once per chunk.
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
    # Negative and too large indices: KVManager.submit_chunk checks both in one pass.
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
        TypeError, ValueError: bad room or sessions (a ``str`` instead of a sequence of
            session ids is refused), or a bad transfer info (the room is then purged).
        RuntimeError: the manager is closed.

    Thread-safety: ``init``, ``send``, ``poll``, ``failure_exception`` and ``abort`` are
    called by the scheduler thread (one thread per sender). ``clear`` is safe from any
    thread, concurrently with everything. In debug mode (``mgr.debug``) the sender notices a
    second thread entering one of the scheduler-thread methods while another thread is inside
    one: ``init``, ``send`` and ``failure_exception`` raise
    :class:`~sender.errors.ConcurrentSenderUseError` naming both threads, ``poll`` and
    ``abort`` (which never raise) fail the room with it. Handing the sender to another
    thread between calls is allowed. Outside debug mode nothing is checked (the cost is one
    attribute test per call).
    """

    def __init__(
        self,
        mgr: KVManager,
        bootstrap_room: int,
        session_ids: Sequence[str],
        transfer_infos: Sequence[TransferInfo] = (),
    ) -> None:
        """Make a :class:`NixlKVSender`: every argument and what it raises are in the
        class docstring (``help(NixlKVSender)``)."""
        if isinstance(session_ids, (str, bytes)):
            raise TypeError(
                f"session_ids must be a sequence of session id strings, got {session_ids!r}"
            )
        # Every check that can refuse an argument runs before the room opens: a constructor
        # that raises leaves no room opened, cleared, counted or noticed behind.
        room = check_room_id(bootstrap_room)
        sessions = tuple(check_session_id(s) for s in session_ids)
        infos = tuple(mgr.vet_info(info, sessions, room)[0] for info in transfer_infos)
        self.kv_mgr = mgr
        self.bootstrap_room = room
        self.session_ids = sessions
        self._handle: RoomHandle = mgr.open_room(room, sessions)
        # Debug mode only: notices two threads inside the scheduler-thread methods at once.
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
        check = self._one_thread
        if check is not None:
            check.enter("init")  # ConcurrentSenderUseError: another thread is inside
        try:
            num_kv_indices = check_index(num_kv_indices, "num_kv_indices")
            if aux_index is not None:
                aux_index = check_index(aux_index, "aux_index")
            if self.num_kv_indices is not None:
                raise ValueError(f"init() already called for room {self.bootstrap_room}")
            self.kv_mgr.init_room(self._handle, num_kv_indices)
            self.num_kv_indices = num_kv_indices
            self.aux_index = aux_index
        finally:
            if check is not None:
                check.leave()

    def send(self, kv_indices: Sequence[int] | PageArray) -> None:
        """Send the next chunk: ``kv_indices`` are prefill KV pages, in room order.

        The chunk that reaches ``num_kv_indices`` pages is the last one and concludes the
        room. After a failure ``send`` is a no-op. A transport error never propagates: the
        sender records it (``_send_failed``, ``_send_error``) and ``poll`` says ``Failed``.
        Scheduler thread.

        Raises:
            RuntimeError: ``send`` before ``init``.
            TypeError, ValueError: indices not 1-D ints >= 0, out of the KV pool, past
                ``num_kv_indices``, an empty chunk that is not the last one, or the room not
                ready (no decode info yet). No state changes in any of these cases.
            ConcurrentSenderUseError: debug mode only: another thread is inside a
                scheduler-thread method of this sender. No state changes.
        """
        check = self._one_thread
        if check is not None:
            check.enter("send")  # ConcurrentSenderUseError: another thread is inside
        try:
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
        finally:
            if check is not None:
                check.leave()

    def poll(self) -> KVPoll:
        """The room's status; never raises. Scheduler thread.

        Once ``Success`` or ``Failed`` is seen it is kept in ``conclude_state``.

        Raises: nothing. In debug mode, a ``poll`` that finds another thread inside a
        scheduler-thread method returns ``Failed`` (without caching it) and fails the room
        with a :class:`~sender.errors.ConcurrentSenderUseError` naming both threads, which
        ``failure_exception`` raises: a scheduler loop that trusts ``poll`` not to raise still
        learns of the misuse through its usual failure path.
        """
        check = self._one_thread
        if check is not None:
            try:
                check.enter("poll")
            except ConcurrentSenderUseError as exc:  # poll() never raises
                self.kv_mgr.record_failure(self._handle, exc, exc.reason)
                return KVPoll.Failed
        try:
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
            if status is None:
                # Cleared (or reopened by someone else) without a conclusion seen here.
                self.conclude_state = KVPoll.Failed
                return KVPoll.Failed
            if is_concluded(status):
                self.conclude_state = status
            return status
        finally:
            if check is not None:
                check.leave()

    def failure_exception(self) -> NoReturn:
        """Raise why this room failed, after purging every trace of it.

        Purges the room (``clear``) and takes the stored exception and failure record from
        that purge's result, which holds this opening's and nothing else (never another
        opening's of the same id), marks the sender ``Failed``, then raises (first that
        applies): ``_send_error`` (the same object); the stored exception (the same object);
        ``KVTransferError(room, reason)``; a :class:`~sender.errors.RoomNotFailedError` (a
        ``KVTransferError`` whose message says there is no failure to report) when the room
        had succeeded or was cleared before any failure was recorded;
        ``KVTransferError(room, ..., is_from_another_rank=True)``. A second call raises a
        ``KVTransferError`` saying the failure was already reported, and changes nothing.
        Scheduler thread.

        Raises:
            BaseException: always, as described.
            ConcurrentSenderUseError: debug mode only, instead of the above when another
                thread is inside a scheduler-thread method of this sender: nothing is purged
                or marked (the room's own error is still there for a later call; ``clear()``
                purges it).
        """
        check = self._one_thread
        if check is not None:
            check.enter("failure_exception")  # ConcurrentSenderUseError: another thread is inside
        try:
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
            if purge.was_open and purge.status is KVPoll.Success:
                raise RoomNotFailedError(
                    room,
                    "it succeeded; failure_exception() was called on a Success room (now cleared)",
                    generation=gen,
                )
            if not purge.was_open:
                raise RoomNotFailedError(
                    room,
                    "it was cleared before a failure was recorded (no error kept)",
                    generation=gen,
                )
            raise KVTransferError(
                room, "failed on another rank (no local error recorded)", is_from_another_rank=True,
                generation=gen,
            )
        finally:
            if check is not None:
                check.leave()

    def clear(self) -> None:
        """Purge every per-room table and the staging state; no chunk of this opening is
        posted after this returns, and chunks already posted drain (their slots and the
        room's decode pages are free once ``kv_mgr.draining(handle) == 0``). Idempotent;
        safe from any thread; never raises."""
        self.kv_mgr.purge_room(self._handle)

    def abort(self) -> None:
        """The caller gives the request up: the room becomes ``Failed`` (no further chunk is
        posted; posted ones drain after ``clear``/``failure_exception``). Scheduler thread.

        Raises: nothing. In debug mode, an ``abort`` that finds another thread inside a
        scheduler-thread method fails the room with a
        :class:`~sender.errors.ConcurrentSenderUseError` (which ``failure_exception`` then
        raises) instead of the usual "aborted by the caller" error, and leaves this sender's
        own attributes to the thread inside.
        """
        check = self._one_thread
        if check is not None:
            try:
                check.enter("abort")
            except ConcurrentSenderUseError as exc:  # abort() never raises
                self.kv_mgr.record_failure(self._handle, exc, exc.reason)
                return
            try:
                self._note_failure(None, "aborted by the caller")
            finally:
                check.leave()
            return
        self._note_failure(None, "aborted by the caller")

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
