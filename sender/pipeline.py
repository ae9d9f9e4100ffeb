"""The chunk pipeline: what moves a room's chunks -- staging, the post under the room's post
gate, polling, hung-chunk sweeps, ending each chunk exactly once -- and the transfer workers.

Every state change goes through the room table (:mod:`sender.rooms`); this module holds no
lock of the model of its own. It takes a room's post gate (ROOM_GATE) around the
check-and-register and the posts of a send, the staging pool's lock (inside the pool's
methods) and the transport's locks (inside the transport).

A ``send`` becomes one chunk per decode session. Without a staging pool the chunks of one
send are one *unit*: one gate section registers all of them (one room-lock section) and
posts one NIXL write per session, and the writes that completed inside their post are ended
together in one room-lock section. With a staging pool each session's chunk is its own unit
(each needs a slot of its own; waiting for a second slot while holding the first could wait
for itself). In worker mode (``num_workers > 0``) units are queued; a worker runs each and
hands its posted chunks to one shared list that the workers pass over, one at a time, one
status check per chunk (:meth:`ChunkPipeline._poll_pass`): no thread waits on one chunk, so
a hung peer never holds up another peer's rooms. With a pool a worker leases each chunk's
slot under its session's cap (``session_slots``) without waiting, and parks the chunk when
none is free for it (:meth:`ChunkPipeline._run_pool_unit`). Inline (``num_workers=0``) the
caller of ``send`` runs the unit (waiting there for a slot) and ``progress()`` polls.

Hung chunks (past their deadline while NIXL still has them in progress) are *swept* every
:data:`HUNG_SWEEP_S` wherever the manager runs: every worker loop iteration, busy or idle,
inline while a send waits for a staging slot, in ``progress()`` and ``wait_drained()``.
"""

from __future__ import annotations

import collections
import functools
import heapq
import itertools
import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

from sender import _nixl
from sender.chunks import Chunk, TransferLike
from sender.errors import (
    PeerNotFoundError,
    RegionRetiredError,
    TransferTimeoutError,
    TransportParamError,
)
from sender.pages import CheckedPages
from sender.poll import KVPoll
from sender.rooms import After, RoomEntry, RoomTable
from sender.transport import (
    POLL_PAUSE_FRACTION,
    POLL_PAUSE_MIN_S,
    PageIndices,
    pause_between_polls,
)
from staging.buffers import (
    PoolClosedError,
    PoolExhaustedError,
    StagingBufferPool,
    StagingSlot,
)
from staging.context import RoomHandle
from staging.validate import bounded_wait, check_chunk_idx, check_index

__all__ = [
    "FAILED_BY_US",
    "HUNG_SWEEP_S",
    "SESSION_FATAL_ERRORS",
    "ChunkPipeline",
    "SlotsHeldByHungError",
    "TransportLike",
]

logger = logging.getLogger("sender.manager")

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

FAILED_BY_US: tuple[type[BaseException], ...] = (
    TransferTimeoutError,
    PeerNotFoundError,
    RegionRetiredError,
)
"""Transfer errors that are our doing, not NIXL's (a deadline; a write kept by
``remove_peer`` or ``deregister_region``): NIXL may still move the write's bytes, so its chunk
ends only once ``settled()`` says so."""

WORKER_SPIN_S = 200e-6
"""A chunk is polled at every pass for its first ``WORKER_SPIN_S`` (a pass then only yields
the CPU before the next), less than ``Transfer.wait`` spins: several workers run at once,
and on a small machine their spinning would take the CPU from NIXL's progress thread and the
peer."""

HUNG_SWEEP_S = 0.05
"""Hung chunks are re-checked this often (:meth:`ChunkPipeline.maybe_sweep`), busy or idle."""

INLINE_SLOT_POLL_S = 0.001
"""Inline mode (``num_workers=0``): a send waiting for a staging slot polls the in-flight
chunks that hold slots this often (:meth:`ChunkPipeline._end_slot_holders`). Nobody else
would end them: their writes may have completed long ago, but only a ``poll()`` on this very
thread would see it, and this thread is the one waiting."""

PARKED_RETRY_S = 0.001
"""Workers retry parked chunks (no slot for their session yet) at least this often."""

_Tracked = tuple[float, int, float, Chunk]
"""A chunk the workers poll: ``(due, seq, posted_at, chunk)`` (monotonic seconds; ``seq``
breaks ties, so chunks are never compared)."""


class _Idle:
    """What :meth:`ChunkPipeline._next_unit` returns when no unit came."""


_IDLE = _Idle()

_debug_enabled = functools.partial(logger.isEnabledFor, logging.DEBUG)

_End = tuple[Chunk, BaseException | None, bool, bool]
"""``(chunk, exc, abandoned, already_failed)``: one chunk to end (see ``_end_many``)."""


class SlotsHeldByHungError(PoolExhaustedError):
    """A chunk gave up waiting for a staging slot at once: every slot is leased to a hung
    chunk (a transfer past its deadline that NIXL still has in progress).

    Such a slot comes back only when NIXL settles its transfer (the peer answers again) or
    the peer is removed (``remove_peer``); waiting ``slot_timeout_s`` for it, chunk after
    chunk on each worker, made rooms opened during a hung peer or a partition fail only
    after whole multiples of ``slot_timeout_s``. A :class:`PoolExhaustedError`, so code
    that handles exhaustion handles this too.

    Also raised when the chunk's session holds its whole cap of slots
    (``KVManager(session_slots=...)``) and each of them is leased to a hung chunk: the other
    sessions keep the rest of the pool.

    Attributes:
        num_slots: The pool's slots.
        hung: The hung chunks that held a slot when the wait gave up.
        session_id: The session at its cap, or ``None`` when every slot of the pool is held.
    """

    def __init__(
        self, num_slots: int, hung: int, session_id: str | None = None, cap: int | None = None
    ) -> None:
        super().__init__(num_slots, 0.0)
        held = (
            f"all {num_slots} staging slots are"
            if session_id is None
            else f"the {cap} staging slots session {session_id!r} may hold (its cap) are all"
        )
        self.args = (
            f"{held} held by hung transfers ({hung} chunks past their deadline that NIXL "
            "still has in progress); none comes back before NIXL settles its transfer (the "
            "peer answers again): removing the peer does not free them",
        )
        self.hung = hung
        self.session_id = session_id


class TransportLike(Protocol):
    """What the pipeline needs of :class:`sender.transport.NixlTransport`."""

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


def _out_of_range(kv_indices: Any, num_pages: int) -> str:
    """The message for a chunk with a page outside ``[0, num_pages)``: the first such value
    and its position (only on the error path: one more pass over the chunk)."""
    values = np.asarray(kv_indices).reshape(-1)
    bad = np.flatnonzero((values < 0) | (values >= num_pages))
    if not bad.size:  # e.g. a page past the transport's int32 limit, caught by CheckedPages
        return f"kv_indices out of range [0, {num_pages})"
    position = int(bad[0])
    more = f" (and {bad.size - 1} more)" if bad.size > 1 else ""
    return (
        f"kv_indices out of range [0, {num_pages}): {int(values[position])} at position "
        f"{position}{more}"
    )


class ChunkPipeline:
    """Stages, posts, polls and ends the chunks of one manager; owns its transfer workers.

    Thread-safety: every public method may be called from any thread. Holds no lock of the
    model of its own; ``_sweep_claim`` (below) is a plain test-and-set outside the model.
    """

    def __init__(
        self,
        rooms: RoomTable,
        transport: TransportLike,
        kv_pool: torch.Tensor,
        *,
        staging_pool: StagingBufferPool | None,
        num_workers: int,
        transfer_timeout_s: float,
        slot_timeout_s: float,
        session_slots: int,
        poll_interval_s: float | None,
        kv_region: str,
        staging_region: str,
        fail_session_on_disconnect: bool,
    ) -> None:
        self.rooms = rooms
        self.transport = transport
        self.kv_pool = kv_pool
        self.pool = staging_pool
        self.transfer_timeout_s = transfer_timeout_s
        self.slot_timeout_s = slot_timeout_s
        self.session_slots = session_slots
        self.poll_interval_s = poll_interval_s
        self.kv_region = kv_region
        self.staging_region = staging_region
        self.fail_session_on_disconnect = fail_session_on_disconnect
        self._num_pages = int(kv_pool.shape[0])
        self._page_bytes = int(kv_pool.shape[1])
        rooms.nbytes = self._nbytes  # the payload of a chunk that ends before its post
        # _sweep_claim: one thread at a time sweeps hung chunks (a non-blocking acquire, so
        # nobody waits for it); _sweep_due (monotonic s) is written only by its holder and
        # read without it (a float read is atomic; a stale read delays a sweep by one call).
        self._sweep_claim = threading.Lock()
        self._sweep_due = 0.0
        # The worker queue: units of chunks (SimpleQueue.put never blocks); None = stop.
        self._queue: queue.SimpleQueue[list[Chunk] | None] = queue.SimpleQueue()
        self._stopped = False
        # _tracked: the posted chunks the workers poll (:meth:`_poll_pass`), a heap by when
        # each is due. Guarded by _tracked_lock (a leaf lock outside the model: held only to
        # push and pop). _pass_claim: one worker at a time passes over them (a
        # non-blocking acquire, so nobody waits for it).
        self._tracked_lock = threading.Lock()
        self._tracked: list[_Tracked] = []
        self._tracked_seq = itertools.count()
        # _parked: session -> its pool units (one chunk each) that found no slot under the
        # session's cap, oldest first, each with when it was first parked; retried by the
        # workers (:meth:`_retry_parked`). Guarded by _tracked_lock.
        self._parked: dict[str, collections.deque[tuple[list[Chunk], float]]] = {}
        self._park_claim = threading.Lock()  # one worker at a time retries them
        self._pass_claim = threading.Lock()
        self.workers = [
            threading.Thread(target=self._worker_main, name=f"kv-worker-{i}", daemon=True)
            for i in range(num_workers)
        ]
        for worker in self.workers:
            worker.start()

    # ------------------------------------------------------------------ sending

    def submit(
        self, handle: RoomHandle, chunk_idx: int, start: int, kv_indices: Any, is_last: bool
    ) -> int:
        """See :meth:`sender.manager.KVManager.submit_chunk`."""
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
            if src_checked is None or src_checked.max_page >= self._num_pages:
                raise ValueError(_out_of_range(kv_indices, self._num_pages))
        rooms = self.rooms
        if self.workers:
            enqueue = self._queue.put if self.pool is None else self._enqueue_each
            # mutant-site: submit-set-chunks
            chunks = rooms.begin_chunk(
                handle, chunk_idx, start, kv_indices, src_checked, is_last, enqueue=enqueue
            )
            return 0 if chunks is None else len(chunks)
        if self.pool is not None:
            chunks = rooms.begin_chunk(handle, chunk_idx, start, kv_indices, src_checked, is_last)
            if chunks is None:
                return 0
            for chunk in chunks:
                self._run_unit([chunk])
            return len(chunks)
        # Inline, direct: one gate section checks, makes and registers every session's chunk
        # and posts them; the writes done inside their post end together right after.
        entry = rooms.peek(handle)
        if entry is None:
            return 0
        ends: list[_End] = []
        # mutant-site: submit-with
        with entry.gate.write_untimed():
            chunks = rooms.begin_chunk(
                handle, chunk_idx, start, kv_indices, src_checked, is_last, entry_expected=entry
            )
            if chunks:
                ends = self._post_all(chunks)
        if chunks is None:
            return 0
        self._log_posts(chunks)
        if ends:
            self._end_many_safely(ends)
        return len(chunks)

    def _enqueue_each(self, chunks: list[Chunk]) -> None:
        for chunk in chunks:
            self._queue.put([chunk])

    def _run_unit(self, unit: list[Chunk]) -> list[Chunk]:
        """Stage (with a pool), check-and-post under the gate, end the writes done at their
        post. Returns the posted chunks still to poll. Never raises: an unexpected error
        fails the room (the chunks that were not registered end with it)."""
        try:
            return self._start(unit)
        except BaseException as exc:  # before the chunks were registered: they end here
            for chunk in unit:
                if not chunk.ended and chunk.transfer is None:
                    self._return_slots([chunk])
                    self.rooms.internal_error(chunk, exc, chunk_ends=True)
            return []

    def _start(self, unit: list[Chunk]) -> list[Chunk]:
        handle = unit[0].handle
        rooms = self.rooms
        # Lock-free early look: only to skip a unit of a purged or failed room cheaply and
        # to find the room's gate. The decision that counts is taken again under the gate
        # and the write lock, right before the post.
        entry = rooms.peek(handle)
        if entry is None or rooms.request_status.get(handle.room) is KVPoll.Failed:
            self._return_slots(unit)
            rooms.skip(unit)
            return []
        if self.pool is not None:
            unit = self._stage(entry, unit)
            if not unit:
                return []
        skipped = After()
        with entry.gate.write_untimed():
            registered = rooms.register(handle, entry, unit, skipped)
            ends = self._post_all(unit) if registered else []
        if not registered:
            self._return_slots(unit)
            rooms.publish(skipped)
            return []
        self._log_posts(unit)
        if ends:
            # Never raises: a release error fails the room, and the chunks of the unit still
            # in flight are returned to be polled all the same (a worker polls only what
            # this returns).
            self._end_many_safely(ends)
        return [c for c in unit if not c.ended]

    def _stage(self, entry: RoomEntry, unit: list[Chunk]) -> list[Chunk]:
        """Record the prefetch keys, lease a slot per chunk and gather into it. Returns the
        chunks ready to post; the others ended here (skipped or failed)."""
        pool = self.pool
        assert pool is not None
        rooms = self.rooms
        handle = entry.handle
        ready = [c for c in unit if not c.num_pages]  # nothing to stage
        prefetched = rooms.note_prefetched(unit)
        if len(prefetched) + len(ready) < len(unit):  # their room is gone: they were skipped
            ids = {c.chunk_id for c in prefetched}
            self._return_slots([c for c in unit if c.num_pages and c.chunk_id not in ids])
        for chunk in prefetched:
            try:
                try:
                    # A worker leased the slot before it ran the unit (_lease_or_park).
                    # Inline, the caller waits for one, and meanwhile ends the completed
                    # chunks that hold slots: they are its own (or another caller's of
                    # send/progress), and no worker would ever end them. The wait ends at
                    # once when the slots it waits for are held by hung chunks
                    # (_give_up_if_slots_all_hung): none comes back before NIXL settles it.
                    if chunk.slot is None:
                        chunk.slot = self._wait_for_slot(chunk)
                except (PoolExhaustedError, PoolClosedError) as exc:
                    rooms.slot_failed(chunk, exc)
                    continue
                if not rooms.still_postable(handle, entry):  # the wait may have been long
                    self._return_slots([chunk])
                    rooms.skip([chunk])
                    continue
                pool.gather(chunk.slot, self.kv_pool, chunk.src_pages, chunk.byte_range)
                ready.append(chunk)
            except BaseException as exc:
                self._return_slots([chunk])
                rooms.internal_error(chunk, exc, chunk_ends=True)
        return ready

    def _wait_for_slot(self, chunk: Chunk) -> StagingSlot:
        """Inline mode: lease ``chunk`` a slot under its session's cap, waiting up to
        ``slot_timeout_s``; polls the slot holders and sweeps while it waits.

        Raises:
            PoolExhaustedError: none in time, or (:class:`SlotsHeldByHungError`) at once
                when the slots it waits for are held by hung chunks.
            PoolClosedError: the pool is closed.
        """
        pool = self.pool
        assert pool is not None
        handle, session = chunk.handle, chunk.session_id

        # mutant-site: on-wake-1
        def on_wake() -> None:
            # mutant-site: on-wake-2
            self._end_slot_holders()
            self._give_up_if_slots_all_hung(session)

        slot = pool.try_acquire(handle, group=session, group_cap=self.session_slots)
        if slot is not None:
            return slot
        on_wake()  # before any wait (slot_timeout_s may be 0)
        return pool.acquire(
            handle, self.slot_timeout_s, on_wake=on_wake, wake_s=INLINE_SLOT_POLL_S,
            group=session, group_cap=self.session_slots,
        )

    def _give_up_if_slots_all_hung(self, session: str) -> None:
        """A slot wait's check (holding no lock): raise :class:`SlotsHeldByHungError` when
        the slots a chunk to ``session`` waits for are all held by hung chunks -- every slot
        of the pool, or the session's whole cap. The counts are read apart, so a slot freed
        in between (a hung chunk ending: its slot is returned before it leaves
        ``rooms.hung``) shows as a free slot and the wait goes on to take it."""
        pool = self.pool
        assert pool is not None
        if not self.rooms.hung:  # a single atomic read: nothing hung, the usual case
            return
        hung_slots = [c.session_id for c in self.rooms.hung_chunks() if c.slot is not None]
        num_slots = pool.num_slots
        if pool.stats().in_use >= num_slots and len(hung_slots) >= num_slots:
            raise SlotsHeldByHungError(num_slots, len(hung_slots))
        cap = self.session_slots
        if pool.group_slots(session) >= cap and hung_slots.count(session) >= cap:
            raise SlotsHeldByHungError(num_slots, hung_slots.count(session), session, cap)

    def _lease_or_park(self, unit: list[Chunk]) -> bool:
        """A worker, before it runs a pool unit (one chunk): lease its slot under its
        session's cap without waiting. ``False`` when none is free for it now: the unit is
        parked (:meth:`_retry_parked`) and the worker goes on with other work, so a chunk
        waiting for a slot never holds a worker. Raises what ``try_acquire`` raises."""
        chunk = unit[0]
        if chunk.slot is not None or not chunk.num_pages:
            return True
        pool = self.pool
        assert pool is not None
        # mutant-site: lease-or-park
        chunk.slot = pool.try_acquire(
            chunk.handle, group=chunk.session_id, group_cap=self.session_slots
        )
        return chunk.slot is not None

    def _run_pool_unit(self, unit: list[Chunk], parked_at: float | None) -> list[Chunk] | None:
        """A worker runs ``unit`` (one chunk) once its slot is leased; ``None`` when it must
        stay parked (first parked at ``parked_at``; ``None``: its first try). A parked chunk
        of a purged or failed room is skipped; one that waited ``slot_timeout_s``, or whose
        slots are all held by hung chunks, fails its room."""
        chunk = unit[0]
        rooms = self.rooms
        try:
            # Skip a purged or failed room's unit before leasing anything for it: a lease for
            # a purged opening would make its draining() count rise again after the purge.
            entry = rooms.peek(chunk.handle)
            if entry is None or rooms.request_status.get(chunk.handle.room) is KVPoll.Failed:
                return self._run_unit(unit)  # skipped there
            if self._lease_or_park(unit):
                return self._run_unit(unit)
            now = time.monotonic()
            # mutant-site: run-pool-unit
            if parked_at is None:
                parked_at = now
            self._give_up_if_slots_all_hung(chunk.session_id)
            if now - parked_at >= self.slot_timeout_s:
                assert self.pool is not None
                self.pool.note_exhausted()
                raise PoolExhaustedError(self.pool.num_slots, self.slot_timeout_s)
        except (PoolExhaustedError, PoolClosedError) as exc:
            rooms.slot_failed(chunk, exc)
            return []
        return None

    def _admit_pool_unit(self, unit: list[Chunk]) -> list[Chunk]:
        """A worker's new pool unit: behind its session's parked units if it has any (first
        in, first out per session), else tried at once and parked if no slot is free for
        it. Returns the chunks to poll."""
        session = unit[0].session_id
        now = time.monotonic()
        with self._tracked_lock:
            waiting = self._parked.get(session)
            if waiting:
                waiting.append((unit, now))
                return []
        pending = self._run_pool_unit(unit, None)
        if pending is None:
            with self._tracked_lock:
                self._parked.setdefault(session, collections.deque()).append((unit, now))
            return []
        return pending

    def _retry_parked(self) -> None:
        """Retry the parked units, one worker at a time (a non-blocking claim), each
        session's oldest first: a session's queue stops at its first unit that must stay
        parked (its cap is full), so a long backlog of a hung peer costs one lease attempt
        per retry, not one per parked chunk."""
        if not self._park_claim.acquire(False):
            return
        try:
            with self._tracked_lock:
                sessions = list(self._parked)
            for session in sessions:
                while True:
                    with self._tracked_lock:
                        waiting = self._parked.get(session)
                        if not waiting:
                            self._parked.pop(session, None)
                            break
                        unit, since = waiting.popleft()
                    pending = self._run_pool_unit(unit, since)
                    if pending is None:
                        with self._tracked_lock:
                            self._parked.setdefault(session, collections.deque()).appendleft(
                                (unit, since)
                            )
                        break
                    if pending:
                        self._track(pending)
        finally:
            self._park_claim.release()

    def _drop_parked(self) -> None:
        """A stopping worker: the parked units of its manager's close end (their rooms were
        purged: skipped)."""
        with self._tracked_lock:
            parked, self._parked = self._parked, {}
        for waiting in parked.values():
            for unit, _ in waiting:
                self._run_unit(unit)

    def _end_slot_holders(self) -> None:
        """Inline mode, while a send waits for a staging slot: poll once every posted chunk
        that holds a slot (of any room, draining ones included) and end those that ended,
        then sweep hung chunks if due. Never raises (a release error ends the chunk all the
        same and is counted in ``worker_errors``, as in :meth:`wait_drained`)."""
        try:
            self.poll_all(self.rooms.slot_holders())
        except BaseException:  # a release error: the chunk ended; the wait goes on
            self.rooms.unaccounted_errors += 1
        self.maybe_sweep()

    def _return_slots(self, chunks: Sequence[Chunk]) -> None:
        if self.pool is None:
            return
        for chunk in chunks:
            if chunk.slot is not None:
                self.pool.release(chunk.slot)
                chunk.slot = None

    def _post_all(self, chunks: Sequence[Chunk]) -> list[_End]:
        """Post every registered chunk (caller holds the room's gate). Returns the chunks
        that ended at once: nothing to send, the post failed, or the write completed inside
        its post."""
        ends: list[_End] = []
        for chunk in chunks:
            if not chunk.num_pages:  # every page is in the decode prefix: nothing to send
                ends.append((chunk, None, False, False))
                continue
            try:
                transfer = self._write(chunk)
            except BaseException as exc:
                ends.append((chunk, exc, False, False))
                continue
            chunk.transfer = transfer
            # A transfer type that declares it (ours) says whether the write completed inside
            # its post; a wrapper (a fault injector) is asked by a poll as usual: the marker
            # is looked up on the type, never forwarded by an instance's __getattr__.
            if getattr(type(transfer), "REPORTS_DONE_AT_POST", False) and getattr(
                transfer, "done", False
            ):
                ends.append((chunk, None, False, False))
        return ends

    @staticmethod
    def _log_posts(chunks: Sequence[Chunk]) -> None:
        """DEBUG lines for the posts of a unit (after its gate is released: never under a
        lock)."""
        if _debug_enabled():
            for chunk in chunks:
                if chunk.transfer is not None:
                    logger.debug(
                        "room %d gen %d chunk %d -> %r: posted %d pages",
                        chunk.handle.room, chunk.handle.generation, chunk.chunk_idx,
                        chunk.session_id, chunk.num_pages,
                    )

    def _write(self, chunk: Chunk) -> TransferLike:
        handle = chunk.handle
        notif = f"room={handle.room};chunk={chunk.chunk_idx};last={int(chunk.is_last)}".encode()
        if chunk.slot is not None:
            src: PageIndices = CheckedPages.span(chunk.slot.first_page, chunk.num_pages)
            region = self.staging_region
        else:
            src = chunk.src_checked if chunk.src_checked is not None else chunk.src_pages
            region = self.kv_region
        dst: Any = chunk.dst_checked if chunk.dst_checked is not None else chunk.dst_pages
        return self.transport.write_pages(
            chunk.session_id,
            src,
            dst,
            notif,
            src_region=region,
            dst_region=chunk.dst_region,
            timeout_s=self.transfer_timeout_s,
        )

    # ------------------------------------------------------------------ polling, ending

    def poll_once(self, chunk: Chunk) -> tuple[bool, _End | None]:
        """Poll ``chunk`` once. Returns ``(done_for_caller, end)``: ``done_for_caller`` once
        it ended (here or elsewhere) or is hung (its room failed; it ends once it settles,
        see :meth:`maybe_sweep`); ``end`` is what to pass to :meth:`end_many` when this poll
        saw its end. Never raises: a transfer error is the chunk's outcome."""
        if chunk.ended:
            return True, None
        transfer = chunk.transfer
        if transfer is None:  # registered, still being posted
            # mutant-site: poll-once-return
            return False, None
        if chunk.hung is not None:  # its room already failed; ends once it settles
            settled = getattr(transfer, "settled", None)
            # mutant-site: poll-once-if-1
            if settled is None or settled():
                return True, (chunk, chunk.hung, False, True)
            self._retire_if_peer_removed(chunk)
            return True, None
        try:
            state = transfer.poll()
        except BaseException as exc:
            # Failed by us (its deadline; remove_peer or deregister_region kept it): it is
            # over only once NIXL says so; releasing it would not stop its bytes. A failure
            # NIXL reported is settled at once.
            # mutant-site: poll-once-if-2
            if isinstance(exc, FAILED_BY_US):
                settled = getattr(transfer, "settled", None)
                if settled is not None and not settled():
                    self._hang(chunk, exc)  # NIXL still has it: it may yet write
                    self._retire_if_peer_removed(chunk)
                    return True, None
            return True, (chunk, exc, False, False)
        if state != "DONE":
            return False, None
        return True, (chunk, None, False, False)

    def poll_all(self, chunks: Sequence[Chunk]) -> list[Chunk]:
        """Poll each chunk once and end those that ended, together; the chunks still to poll
        (neither ended nor hung)."""
        ends: list[_End] = []
        still: list[Chunk] = []
        for chunk in chunks:
            done, end = self.poll_once(chunk)
            if end is not None:
                ends.append(end)
            if not done:
                still.append(chunk)
        if ends:
            self._end_many(ends)
        return still

    def _retire_if_peer_removed(self, chunk: Chunk) -> None:
        """A hung chunk whose peer was removed (``remove_peer`` kept its write): retire its
        staging slot. The slot is not reused while NIXL may still read it, but it no longer
        counts against the pool or its session's cap (a spare stands in, if the pool has
        one), so the removal gives the peer's share of the pool back."""
        slot = chunk.slot
        if slot is not None and self.pool is not None and getattr(
            chunk.transfer, "peer_removed", False
        ):
            # mutant-site: retire-if-peer-removed
            self.pool.retire(slot)

    def _hang(self, chunk: Chunk, exc: BaseException) -> None:
        """The chunk failed by our doing (its deadline passed, or its peer was removed)
        while NIXL still has it in progress: fail its room now (and, past a deadline, its
        session), but keep the chunk (transfer and slot) until it settles."""
        # Past a deadline the peer is hung: its session fails. A removed peer's kept write
        # fails its own room only (the session id may already name a new peer).
        self.rooms.mark_hung(chunk, exc, fail_session=self._fatal(exc))

    def _fatal(self, exc: BaseException | None) -> bool:
        return self.fail_session_on_disconnect and isinstance(exc, SESSION_FATAL_ERRORS)

    def _nbytes(self, chunk: Chunk) -> int:
        per_page = self._page_bytes if chunk.byte_range is None else chunk.byte_range[1]
        return chunk.num_pages * per_page

    def _end_many(self, ends: Sequence[_End]) -> int:
        """End each chunk exactly once: the claim, the transfer's release and the slot's
        return per chunk, then the accounting of all of them in one room-lock section, then
        the sessions to fail. Returns how many this call claimed. A release that raised is
        re-raised after the accounting (the room then fails as an internal error)."""
        claimed: list[_End] = []
        error: BaseException | None = None
        for end in ends:
            chunk = end[0]
            # mutant-site: end-many
            if not chunk.claim():
                continue
            try:
                if chunk.transfer is not None:
                    chunk.transfer.release()
            except BaseException as release_error:
                error = error or release_error
            finally:
                if chunk.slot is not None and self.pool is not None:
                    self.pool.release(chunk.slot)
            claimed.append(end)
        if claimed:
            after = self.rooms.account_ends(claimed, self._nbytes, self._fatal)
            if _debug_enabled():
                for chunk, outcome, abandoned, _ in claimed:
                    logger.debug(
                        "room %d gen %d chunk %d -> %r ended: %s",
                        chunk.handle.room, chunk.handle.generation, chunk.chunk_idx,
                        chunk.session_id,
                        "abandoned" if abandoned else "done" if outcome is None else repr(outcome),
                    )
            self.rooms.publish(after)  # the sessions to fail were failed in its section
        if error is not None:
            raise error
        return len(claimed)

    def _end_many_safely(self, ends: Sequence[_End]) -> int:
        """:meth:`_end_many` that never raises (a release error fails the room)."""
        try:
            return self._end_many(ends)
        except BaseException as exc:
            self.rooms.internal_error(ends[0][0], exc, chunk_ends=False)
            return 0

    def end_many(self, ends: Sequence[_End]) -> int:
        """Public :meth:`_end_many` that never raises; how many it claimed."""
        return self._end_many_safely(ends)

    # ------------------------------------------------------------------ sweeps, draining

    def maybe_sweep(self) -> None:
        """Sweep hung chunks if any and a sweep is due (every :data:`HUNG_SWEEP_S`), unless
        another thread is sweeping. Called wherever the manager runs, so a hung chunk whose
        write has settled ends within about one sweep period of settling, busy or idle, and
        returns its slot. Never raises; never blocks."""
        rooms = self.rooms
        if not rooms.hung or time.monotonic() < self._sweep_due:
            return
        # mutant-site: maybe-sweep
        if not self._sweep_claim.acquire(False):
            return
        try:
            self._sweep_due = time.monotonic() + HUNG_SWEEP_S
            self.poll_all(rooms.hung_chunks())
        except BaseException:  # never raises into the caller (a worker, a slot wait)
            rooms.unaccounted_errors += 1
        finally:
            self._sweep_claim.release()

    def progress(self, handle: RoomHandle) -> None:
        """See :meth:`sender.manager.KVManager.progress`."""
        if self.workers:
            self.maybe_sweep()  # hung chunks are swept wherever the manager runs
            return
        rooms = self.rooms
        entry = rooms.peek(handle)
        # A lock-free first look (each a single atomic read): nothing in flight, draining or
        # hung means nothing to poll; a stale answer only defers a poll to the next call.
        if (entry is None or not entry.inflight) and not rooms.draining and not rooms.hung:
            return
        pending = rooms.pending_of(handle)
        if pending:
            self.poll_all(pending)

    def wait_drained(self, handle: RoomHandle | None, timeout_s: float) -> bool:
        """See :meth:`sender.manager.KVManager.wait_drained` (``timeout_s`` checked)."""
        rooms = self.rooms
        deadline = time.monotonic() + timeout_s
        while True:
            self.maybe_sweep()
            with rooms.lock.read():
                pending = rooms.draining_of_locked(handle)
                unpublished = rooms.pending_locked()
                # mutant-site: wait-drained
                left = rooms.lingering_locked(handle)
            rooms.await_published(unpublished)  # the ends it saw are logged and told first
            if not left:
                return True
            try:
                self.poll_all(pending)
            except BaseException:  # a release error: the chunk ended; keep waiting
                rooms.unaccounted_errors += 1
            if time.monotonic() >= deadline:
                with rooms.lock.read():
                    nothing_left = rooms.lingering_locked(handle) == 0
                    unpublished = rooms.pending_locked()
                rooms.await_published(unpublished)
                return nothing_left
            time.sleep(0.0002)

    def abandon_draining(self) -> int:
        """``close()``, past its wait: poll every draining chunk once, then give up on those
        still in flight; how many it gave up on. A transfer that can say whether NIXL may
        still move its bytes (``settled``, as the transport's do) is *not* released: its
        chunk stays draining until a later :meth:`wait_drained` sees it settled, so that
        ``draining()`` never says 0 while its bytes may still land. One that cannot say
        (a wrapper without ``settled``) is released: its bytes may still land."""
        rooms = self.rooms
        with rooms.lock.read():
            left = list(rooms.draining.values())
        if not left:
            return 0
        try:
            self.poll_all(left)
        except BaseException:  # a release error: the chunk ended; it is not abandoned
            rooms.unaccounted_errors += 1
        with rooms.lock.read():
            left = [c for c in rooms.draining.values() if not c.ended]
        # mutant-site: abandon-draining
        unknowable = [c for c in left if getattr(c.transfer, "settled", None) is None]
        if unknowable:
            self._end_many_safely([(c, None, True, False) for c in unknowable])
        return len(left)

    # ------------------------------------------------------------------ workers

    def stop_workers(self) -> None:
        """Queue one stop sentinel per worker (behind every queued unit). Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        for _ in self.workers:
            self._queue.put(None)

    def join_workers(self, deadline: float) -> list[str]:
        """Join the workers until ``deadline`` (each at least 0.5 s: a worker polling an
        abandoned chunk sees it released and exits at once); the names still alive. The
        calling thread, when it is a worker (``close()`` from a listener callback), is not
        joined (a thread cannot join itself): it has its stop sentinel queued and exits
        once the callback returns."""
        me = threading.current_thread()
        for worker in self.workers:
            # mutant-site: join-workers
            if worker is not me:
                worker.join(bounded_wait(max(0.5, deadline - time.monotonic())))
        return [w.name for w in self.workers if w is not me and w.is_alive()]

    def _track(self, chunks: list[Chunk]) -> None:
        """Hand posted chunks to the shared poll (:meth:`_poll_pass`), due at once."""
        now = time.monotonic()
        with self._tracked_lock:
            for chunk in chunks:
                heapq.heappush(self._tracked, (now, next(self._tracked_seq), now, chunk))

    def _poll_in(self, age_s: float) -> float:
        """How long after a poll a chunk posted ``age_s`` ago is polled again: at once for
        :data:`WORKER_SPIN_S`, then a fixed fraction of its age (a write is seen done at
        most ~6 % after it completed), at most :data:`HUNG_SWEEP_S`; so a chunk that stays
        in flight (a hung peer's) costs ever fewer polls, and a fresh one is seen at once.
        ``poll_interval_s``, when set, is the pause for every chunk."""
        if self.poll_interval_s is not None:
            return self.poll_interval_s
        if age_s < WORKER_SPIN_S:
            return 0.0
        return min(HUNG_SWEEP_S, max(POLL_PAUSE_MIN_S, age_s * POLL_PAUSE_FRACTION))

    def _poll_pass(self) -> bool:
        """One pass over the tracked chunks that are due, by one worker at a time (others
        skip it: a non-blocking claim): poll each once, end those that ended, schedule the
        rest (:meth:`_poll_in`). Never blocks on a transfer; a chunk past its deadline leaves
        the pass as hung (swept from then on). Returns whether any chunk left the pass.
        Never raises: a release error fails the room of the first chunk ended with it."""
        if not self._pass_claim.acquire(False):
            return False
        try:
            now = time.monotonic()
            due: list[_Tracked] = []
            with self._tracked_lock:
                tracked = self._tracked
                while tracked and tracked[0][0] <= now:
                    due.append(heapq.heappop(tracked))
            if not due:
                return False
            ends: list[_End] = []
            still: list[_Tracked] = []
            for entry in due:
                done, end = self.poll_once(entry[3])
                if end is not None:
                    ends.append(end)
                if not done:
                    still.append(entry)
            if still:
                now = time.monotonic()
                with self._tracked_lock:
                    for _, _, posted_at, chunk in still:
                        heapq.heappush(
                            self._tracked,
                            (now + self._poll_in(now - posted_at), next(self._tracked_seq),
                             posted_at, chunk),
                        )
            if ends:
                self._end_many_safely(ends)
            return len(still) < len(due)
        finally:
            self._pass_claim.release()

    def _idle_wait(self) -> float:
        """How long a worker may wait for a unit: until the next tracked chunk is due, at
        most :data:`PARKED_RETRY_S` while chunks are parked, at most :data:`HUNG_SWEEP_S`."""
        with self._tracked_lock:
            next_due = self._tracked[0][0] if self._tracked else None
            parked = bool(self._parked)
        wait = PARKED_RETRY_S if parked else HUNG_SWEEP_S
        if next_due is not None:
            wait = min(wait, max(0.0, next_due - time.monotonic()))
        return wait

    def _next_unit(self, pause_s: float) -> list[Chunk] | _Idle | None:
        """The next queued unit, waiting at most ``pause_s`` (a new unit, or ``close()``'s
        stop, ends the wait at once); ``0`` only checks the queue and yields the CPU."""
        try:
            if pause_s > 0:
                return self._queue.get(timeout=bounded_wait(pause_s))
            unit = self._queue.get_nowait()
        except queue.Empty:
            if pause_s <= 0:
                pause_between_polls(0.0)
            return _IDLE
        return unit

    def _worker_main(self) -> None:
        """A worker: run queued units (stage, post) and, between them, pass over every
        chunk in flight (:meth:`_poll_pass`). It never waits on one chunk: a chunk of a
        hung peer costs each pass one status check, and other peers' units and chunks go
        on meanwhile."""
        while True:
            pause = self._idle_wait()
            unit = self._next_unit(pause)
            if unit is None:
                self._drop_parked()
                return
            try:
                if self._parked:  # older than the new unit
                    self._retry_parked()
                if not isinstance(unit, _Idle):
                    pending = (
                        self._run_unit(unit)
                        if self.pool is None
                        else self._admit_pool_unit(unit)
                    )
                    # mutant-site: worker-main-if
                    if pending:
                        self._track(pending)
                if self._tracked:
                    self._poll_pass()
            except BaseException as exc:  # a worker never dies: the room fails instead
                if not isinstance(unit, _Idle):
                    self.rooms.internal_error(unit[0], exc, chunk_ends=False)
                else:
                    self.rooms.unaccounted_errors += 1
            # mutant-site: worker-main-call-maybe-sweep
            self.maybe_sweep()  # every iteration, busy or idle
