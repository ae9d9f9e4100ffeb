"""The chunk pipeline: staging, the post under the room's post gate, polling, hung-chunk
sweeps, ending each chunk exactly once, and the transfer workers.

State changes go through the room table (:mod:`sender.rooms`); no lock of the model of its
own, but a room's post gate (ROOM_GATE) around a send's check-and-register and posts, and
``_tracked_lock``, a leaf lock outside the model. A send's chunks are one *unit* without a
staging pool, one unit per chunk with one (docs/THREADING.md, 'The batched send').
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
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
from sender.transport import POLL_PAUSE_FRACTION, POLL_PAUSE_MIN_S, PageIndices, pause_between_polls
from staging.buffers import PoolClosedError, PoolExhaustedError, StagingBufferPool, StagingSlot
from staging.context import RoomHandle
from staging.validate import bounded_wait, check_chunk_idx, check_index

__all__ = [
    "FAILED_BY_US", "HUNG_SWEEP_S", "SESSION_FATAL_ERRORS", "ChunkPipeline",
    "SlotsHeldByHungError", "TransportLike",
]

logger = logging.getLogger("sender.manager")

# Errors meaning the decode peer is gone or hung: all its rooms fail (``fail_session``).
_DISCONNECT = getattr(_nixl.bindings, "nixlRemoteDisconnectError", None)
SESSION_FATAL_ERRORS: tuple[type[BaseException], ...] = (
    (TransferTimeoutError,) if _DISCONNECT is None else (TransferTimeoutError, _DISCONNECT)
)

FAILED_BY_US: tuple[type[BaseException], ...] = (
    TransferTimeoutError, PeerNotFoundError, RegionRetiredError
)
"""Transfer errors of our doing (a deadline, ``remove_peer``, ``deregister_region``): NIXL
may still move the bytes, so the chunk ends only once ``settled()``."""

WORKER_SPIN_S = 200e-6
"""A chunk is polled at every pass for its first ``WORKER_SPIN_S`` (short: spinning workers
would take the CPU from NIXL's progress thread)."""

HUNG_SWEEP_S = 0.05
"""Hung chunks are re-checked this often (:meth:`ChunkPipeline.maybe_sweep`), busy or idle."""

INLINE_SLOT_POLL_S = 0.001
"""Inline mode: how often a send waiting for a slot polls the chunks holding slots (nobody
else would end them)."""

PARKED_RETRY_S = 0.001
"""Workers retry parked chunks (no slot for their session yet) at least this often."""

_Tracked = tuple[float, int, float, Chunk]
"""``(due, seq, posted_at, chunk)``: a polled chunk (``seq`` breaks ties)."""


_IDLE: list[Chunk] = []
"""What :meth:`ChunkPipeline._next_unit` returns when no unit came (never changed)."""

_End = tuple[Chunk, BaseException | None, bool, bool]
"""``(chunk, exc, abandoned, already_failed)``: one chunk to end."""


class SlotsHeldByHungError(PoolExhaustedError):
    """A chunk gave up waiting for a staging slot at once: every slot of the pool, or of its
    session's cap (``session_slots``), is leased to a hung chunk, which returns it only once
    NIXL settles its transfer. A :class:`PoolExhaustedError`.

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
        self, session_id: str, src_pages: PageIndices, dst_pages: PageIndices,
        notif: bytes | None = None, *, src_region: str = "kv", dst_region: str = "kv",
        timeout_s: float | None = None,
    ) -> TransferLike: ...


def _out_of_range(kv_indices: Any, num_pages: int) -> str:
    """The message for a chunk with a page outside ``[0, num_pages)``."""
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

    Thread-safety: every public method may be called from any thread; no lock of the model
    of its own.
    """

    def __init__(
        self, rooms: RoomTable, transport: TransportLike, kv_pool: torch.Tensor, *,
        staging_pool: StagingBufferPool | None, num_workers: int, transfer_timeout_s: float,
        slot_timeout_s: float, session_slots: int, poll_interval_s: float | None, kv_region: str,
        staging_region: str, fail_session_on_disconnect: bool,
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
        # One sweeper at a time (non-blocking claim); _sweep_due is written only by it and
        # read without it (a stale read delays a sweep by one call).
        self._sweep_claim = threading.Lock()
        self._sweep_due = 0.0
        # The worker queue: units of chunks; None = stop. _enqueue: how submit queues (None:
        # inline), a send's chunks as one unit, or one unit per chunk with a pool.
        self._queue: queue.SimpleQueue[list[Chunk] | None] = queue.SimpleQueue()
        self._enqueue: Callable[[list[Chunk]], None] | None = (
            None if not num_workers else self._queue.put if staging_pool is None
            else self._enqueue_each
        )
        self._stopped = False
        # _tracked: heap of posted chunks by due time; guarded by _tracked_lock (a leaf lock
        # outside the model). _pass_claim: one worker at a time polls them.
        self._tracked_lock = threading.Lock()
        self._tracked: list[_Tracked] = []
        self._tracked_seq = itertools.count()
        # _parked: session -> its units with no slot yet, oldest first, with when first
        # parked. Guarded by _tracked_lock.
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
            # One check of the pages (bounds, an int32 copy the transport uses as is).
            with contextlib.suppress(TransportParamError):
                src_checked = CheckedPages(kv_indices, unique=False)
            if src_checked is None or src_checked.max_page >= self._num_pages:
                raise ValueError(_out_of_range(kv_indices, self._num_pages))
        rooms = self.rooms
        if self.workers or self.pool is not None:
            # mutant-site: submit-set-chunks
            chunks = rooms.begin_chunk(
                handle, chunk_idx, start, kv_indices, src_checked, is_last, enqueue=self._enqueue
            )
            if chunks is not None and not self.workers:  # inline with a pool: one by one
                for chunk in chunks:
                    self._run_unit([chunk])
            return 0 if chunks is None else len(chunks)
        # Inline, no pool: one gate section checks, makes, registers and posts every chunk.
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
        self._posted(chunks, ends)
        return len(chunks)

    def _enqueue_each(self, chunks: list[Chunk]) -> None:
        for chunk in chunks:
            self._queue.put([chunk])

    def _run_unit(self, unit: list[Chunk]) -> list[Chunk]:
        """Stage, check-and-post under the gate; the chunks to poll. Never raises."""
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
        # An early look; rooms.register decides under the gate.
        entry = rooms.peek(handle)
        if entry is None or rooms.request_status.get(handle.room) is KVPoll.Failed:
            self._return_slots(unit)
            rooms.skip(unit)
            return []
        if self.pool is not None and not self._stage(entry, unit[0]):  # a pool's unit: 1 chunk
            return []
        skipped = After()
        # mutant-site: start-with
        with entry.gate.write_untimed():
            registered = rooms.register(handle, entry, unit, skipped)
            ends = self._post_all(unit) if registered else []
        if not registered:
            self._return_slots(unit)
            rooms.publish(skipped)
            return []
        self._posted(unit, ends)
        return [c for c in unit if not c.ended]

    def _stage(self, entry: RoomEntry, chunk: Chunk) -> bool:
        """Lease a slot for ``chunk`` and gather into it; whether it is ready to post."""
        pool = self.pool
        assert pool is not None
        rooms = self.rooms
        if not rooms.note_prefetched(chunk):  # its room is gone: it was skipped
            self._return_slots([chunk])
            return False
        if not chunk.num_pages:  # nothing to stage
            return True
        try:
            try:
                # A worker leased it already (_run_pool_unit); inline, wait here.
                if chunk.slot is None:
                    chunk.slot = self._wait_for_slot(chunk)
            except (PoolExhaustedError, PoolClosedError) as exc:
                self._slot_failed(chunk, exc)
                return False
            if not rooms.still_postable(entry.handle, entry):  # the wait may have been long
                self._return_slots([chunk])
                rooms.skip([chunk])
                return False
            pages = np.asarray(chunk.src_checked, dtype=np.int64)  # a writable copy for torch
            pool.gather(chunk.slot, self.kv_pool, pages, chunk.byte_range)
            return True
        except BaseException as exc:
            self._return_slots([chunk])
            rooms.internal_error(chunk, exc, chunk_ends=True)
            return False

    def _wait_for_slot(self, chunk: Chunk) -> StagingSlot:
        """Inline: lease a slot under the session's cap, ending slot holders while waiting.

        Raises:
            PoolExhaustedError (or SlotsHeldByHungError), PoolClosedError.
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
        """Raise :class:`SlotsHeldByHungError` when ``session``'s cap, or the pool's slots,
        are all held by hung chunks (the session's own first: its peer is the one that hangs).
        (A hung chunk returns its slot before leaving ``rooms.hung``, so a racing end shows
        as a free slot.)"""
        pool = self.pool
        assert pool is not None
        if not self.rooms.hung:
            return
        hung_slots = [c.session_id for c in self.rooms.hung_chunks() if c.slot is not None]
        num_slots = pool.num_slots
        cap = self.session_slots
        if pool.group_slots(session) >= cap and hung_slots.count(session) >= cap:
            raise SlotsHeldByHungError(num_slots, hung_slots.count(session), session, cap)
        if pool.stats().in_use >= num_slots and len(hung_slots) >= num_slots:
            raise SlotsHeldByHungError(num_slots, len(hung_slots))

    def _run_pool_unit(self, unit: list[Chunk], parked_at: float | None) -> list[Chunk] | None:
        """Run ``unit`` once its slot is leased; ``None``: it stays parked. Past
        ``slot_timeout_s`` since ``parked_at``, or with only hung holders, it fails its room."""
        chunk = unit[0]
        rooms = self.rooms
        pool = self.pool
        assert pool is not None
        try:
            # Skip before leasing: a purged opening's lease would raise its draining() again.
            entry = rooms.peek(chunk.handle)
            if entry is None or rooms.request_status.get(chunk.handle.room) is KVPoll.Failed:
                return self._run_unit(unit)  # skipped there
            if chunk.slot is None and chunk.num_pages:  # under the session's cap, no wait
                # mutant-site: lease-or-park
                chunk.slot = pool.try_acquire(
                    chunk.handle, group=chunk.session_id, group_cap=self.session_slots
                )
            if chunk.slot is not None or not chunk.num_pages:
                return self._run_unit(unit)
            now = time.monotonic()
            # mutant-site: run-pool-unit
            if parked_at is None:
                parked_at = now
            self._give_up_if_slots_all_hung(chunk.session_id)
            if now - parked_at >= self.slot_timeout_s:
                pool.note_exhausted()
                raise PoolExhaustedError(pool.num_slots, self.slot_timeout_s)
        except (PoolExhaustedError, PoolClosedError) as exc:
            self._slot_failed(chunk, exc)
            return []
        return None

    def _slot_failed(self, chunk: Chunk, exc: BaseException) -> None:
        """No slot for ``chunk``: its room fails with code ``peer-failed`` when every slot its
        session may hold is held by that session's hung chunks (its decode peer hangs), else
        ``internal``."""
        own = isinstance(exc, SlotsHeldByHungError) and exc.session_id == chunk.session_id
        self.rooms.slot_failed(chunk, exc, code="peer-failed" if own else "internal")

    def _admit_pool_unit(self, unit: list[Chunk]) -> list[Chunk]:
        """Park a new pool unit behind its session's parked units, else run it; to poll."""
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
        """Retry parked units (one worker at a time), each session's oldest first."""
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
        """A stopping worker ends the parked units (their rooms were purged: skipped)."""
        with self._tracked_lock:
            parked, self._parked = self._parked, {}
        for waiting in parked.values():
            for unit, _ in waiting:
                self._run_unit(unit)

    def _end_slot_holders(self) -> None:
        """Poll every posted chunk holding a slot once, then sweep if due. Never raises."""
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
        """Post every registered chunk (gate held); the ends known at once."""
        ends: list[_End] = []
        for chunk in chunks:
            if not chunk.num_pages:  # all in the decode prefix
                ends.append((chunk, None, False, False))
                continue
            try:
                transfer = self._write(chunk)
            except BaseException as exc:
                ends.append((chunk, exc, False, False))
                continue
            chunk.transfer = transfer
            # The marker is looked up on the type: a wrapper's __getattr__ must not forward it.
            if getattr(type(transfer), "REPORTS_DONE_AT_POST", False) and getattr(
                transfer, "done", False
            ):
                ends.append((chunk, None, False, False))
        return ends

    def _posted(self, chunks: Sequence[Chunk], ends: Sequence[_End]) -> None:
        """After a unit's gate: DEBUG lines for its posts, then end the chunks ended at once."""
        if logger.isEnabledFor(logging.DEBUG):
            for chunk in chunks:
                if chunk.transfer is not None:
                    logger.debug(
                        "room %d gen %d chunk %d -> %r: posted %d pages",
                        chunk.handle.room, chunk.handle.generation, chunk.chunk_idx,
                        chunk.session_id, chunk.num_pages,
                    )
        self.end_many(ends)

    def _write(self, chunk: Chunk) -> TransferLike:
        handle = chunk.handle
        notif = f"room={handle.room};chunk={chunk.chunk_idx};last={int(chunk.is_last)}".encode()
        src, dst = chunk.src_checked, chunk.dst_checked
        assert src is not None and dst is not None  # it has pages (_post_all)
        region = self.kv_region
        if chunk.slot is not None:
            src = CheckedPages.span(chunk.slot.first_page, chunk.num_pages)
            region = self.staging_region
        return self.transport.write_pages(
            chunk.session_id, src, dst, notif, src_region=region, dst_region=chunk.dst_region,
            timeout_s=self.transfer_timeout_s,
        )

    # ------------------------------------------------------------------ polling, ending

    def poll_once(self, chunk: Chunk) -> tuple[bool, _End | None]:
        """Poll ``chunk`` once: ``(done_for_caller, end)``, done once it ended or is hung;
        ``end`` for :meth:`end_many` when this poll saw its end. Never raises."""
        if chunk.ended:
            return True, None
        transfer = chunk.transfer
        if transfer is None:  # still being posted
            # mutant-site: poll-once-return
            return False, None
        if chunk.hung is not None:  # ends once it settles
            settled = getattr(transfer, "settled", None)
            # mutant-site: poll-once-if-1
            if settled is None or settled():
                return True, (chunk, chunk.hung, False, True)
            self._retire_if_peer_removed(chunk)
            return True, None
        try:
            state = transfer.poll()
        except BaseException as exc:
            # Failed by us: over only once NIXL settles it. A failure NIXL reported is.
            # mutant-site: poll-once-if-2
            if isinstance(exc, FAILED_BY_US):
                settled = getattr(transfer, "settled", None)
                if settled is not None and not settled():
                    self._hang(chunk, exc)
                    self._retire_if_peer_removed(chunk)
                    return True, None
            return True, (chunk, exc, False, False)
        if state != "DONE":
            return False, None
        return True, (chunk, None, False, False)

    def poll_all(self, chunks: Sequence[Chunk]) -> list[Chunk]:
        """Poll each chunk once and end those that ended; the chunks still to poll."""
        ends: list[_End] = []
        still = [chunk for chunk in chunks if self._poll_into(chunk, ends)]
        self._end_many(ends)
        return still

    def _poll_into(self, chunk: Chunk, ends: list[_End]) -> bool:
        """:meth:`poll_once`, its end added to ``ends``; whether ``chunk`` is still to poll."""
        done, end = self.poll_once(chunk)
        if end is not None:
            ends.append(end)
        return not done

    def _retire_if_peer_removed(self, chunk: Chunk) -> None:
        """Retire a hung chunk's slot (uncounted, not reused) once its peer was removed."""
        slot = chunk.slot
        if slot is not None and self.pool is not None and getattr(
            chunk.transfer, "peer_removed", False
        ):
            # mutant-site: retire-if-peer-removed
            self.pool.retire(slot)

    def _hang(self, chunk: Chunk, exc: BaseException) -> None:
        """Fail the room (and a fatal error's session) of a chunk NIXL still has."""
        self.rooms.mark_hung(chunk, exc, fail_session=self._fatal(exc))

    def _fatal(self, exc: BaseException | None) -> bool:
        return self.fail_session_on_disconnect and isinstance(exc, SESSION_FATAL_ERRORS)

    def _nbytes(self, chunk: Chunk) -> int:
        per_page = self._page_bytes if chunk.byte_range is None else chunk.byte_range[1]
        return chunk.num_pages * per_page

    def _end_many(self, ends: Sequence[_End]) -> int:
        """End the chunks this call claims, accounted in one section; how many. A release
        error is re-raised after."""
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
            if logger.isEnabledFor(logging.DEBUG):
                for chunk, outcome, abandoned, _ in claimed:
                    logger.debug(
                        "room %d gen %d chunk %d -> %r ended: %s",
                        chunk.handle.room, chunk.handle.generation, chunk.chunk_idx,
                        chunk.session_id,
                        "abandoned" if abandoned else "done" if outcome is None else repr(outcome),
                    )
            self.rooms.publish(after)
        if error is not None:
            raise error
        return len(claimed)

    def end_many(self, ends: Sequence[_End]) -> int:
        """:meth:`_end_many` that never raises (a release error fails the room); how many
        it claimed."""
        try:
            return self._end_many(ends)
        except BaseException as exc:
            self.rooms.internal_error(ends[0][0], exc, chunk_ends=False)
            return 0

    # ------------------------------------------------------------------ sweeps, draining

    def maybe_sweep(self) -> None:
        """Sweep hung chunks if a sweep is due and no other thread sweeps. Never raises;
        never blocks."""
        rooms = self.rooms
        if not rooms.hung or time.monotonic() < self._sweep_due:
            return
        # mutant-site: maybe-sweep
        if not self._sweep_claim.acquire(False):
            return
        try:
            self._sweep_due = time.monotonic() + HUNG_SWEEP_S
            self.poll_all(rooms.hung_chunks())
        except BaseException:
            rooms.unaccounted_errors += 1
        finally:
            self._sweep_claim.release()

    def progress(self, handle: RoomHandle) -> None:
        """See :meth:`sender.manager.KVManager.progress`."""
        if self.workers:
            self.maybe_sweep()
            return
        rooms = self.rooms
        entry = rooms.peek(handle)
        # A lock-free first look: a stale answer only defers a poll to the next call.
        if (entry is None or not entry.inflight) and not rooms.draining and not rooms.hung:
            return
        pending = rooms.pending_of(handle)
        if pending:
            self.poll_all(pending)

    def wait_drained(self, handle: RoomHandle | None, timeout_s: float) -> bool:
        """See :meth:`sender.manager.KVManager.wait_drained` (``timeout_s`` checked)."""
        rooms = self.rooms
        deadline = time.monotonic() + timeout_s
        expired = False
        while True:
            self.maybe_sweep()
            with rooms.lock.read():
                pending = rooms.draining_of_locked(handle)
                unpublished = rooms.pending_locked()
                # mutant-site: wait-drained
                left = rooms.lingering_locked(handle)
            rooms.await_published(unpublished)  # the ends it saw are logged and told first
            if not left or expired:  # past the deadline: checked once more after a poll
                return not left
            try:
                self.poll_all(pending)
            except BaseException:  # a release error: the chunk ended; keep waiting
                rooms.unaccounted_errors += 1
            expired = time.monotonic() >= deadline
            if not expired:
                time.sleep(0.0002)

    def abandon_draining(self) -> int:
        """``close()`` past its wait: poll the draining chunks once; how many are still in
        flight. Of those, only transfers without ``settled()`` are released (abandoned);
        the others stay draining until settled."""
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
            self.end_many([(c, None, True, False) for c in unknowable])
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
        """Join the workers until ``deadline`` (each at least 0.5 s), except the calling
        thread (``close()`` from a listener); the names still alive."""
        me = threading.current_thread()
        for worker in self.workers:
            # mutant-site: join-workers
            if worker is not me:
                worker.join(bounded_wait(max(0.5, deadline - time.monotonic())))
        return [w.name for w in self.workers if w is not me and w.is_alive()]

    def _track(self, chunks: list[Chunk]) -> None:
        """Hand posted chunks to the shared poll, due at once."""
        now = time.monotonic()
        with self._tracked_lock:
            for chunk in chunks:
                heapq.heappush(self._tracked, (now, next(self._tracked_seq), now, chunk))

    def _poll_in(self, age_s: float) -> float:
        """When to poll again a chunk posted ``age_s`` ago."""
        if self.poll_interval_s is not None:
            return self.poll_interval_s
        if age_s < WORKER_SPIN_S:
            return 0.0
        return min(HUNG_SWEEP_S, max(POLL_PAUSE_MIN_S, age_s * POLL_PAUSE_FRACTION))

    def _poll_pass(self) -> bool:
        """Poll each due tracked chunk once (one worker at a time); whether any left. Never
        raises."""
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
            still = [entry for entry in due if self._poll_into(entry[3], ends)]
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
                self.end_many(ends)
            return len(still) < len(due)
        finally:
            self._pass_claim.release()

    def _idle_wait(self) -> float:
        """How long a worker may wait for a unit: until the next poll, parked retry or sweep."""
        with self._tracked_lock:
            next_due = self._tracked[0][0] if self._tracked else None
            parked = bool(self._parked)
        wait = PARKED_RETRY_S if parked else HUNG_SWEEP_S
        if next_due is not None:
            wait = min(wait, max(0.0, next_due - time.monotonic()))
        return wait

    def _next_unit(self, pause_s: float) -> list[Chunk] | None:
        """The next queued unit, waiting at most ``pause_s`` (``0``: check and yield)."""
        try:
            if pause_s > 0:
                return self._queue.get(timeout=bounded_wait(pause_s))
            return self._queue.get_nowait()
        except queue.Empty:
            if pause_s <= 0:
                pause_between_polls(0.0)
            return _IDLE

    def _worker_main(self) -> None:
        """A worker: run queued units and, between them, poll the chunks in flight; it never
        waits on one chunk (docs/THREADING.md, 'Peer isolation')."""
        while True:
            pause = self._idle_wait()
            unit = self._next_unit(pause)
            if unit is None:
                self._drop_parked()
                return
            try:
                if self._parked:  # older than the new unit
                    self._retry_parked()
                if unit is not _IDLE:
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
                if unit is not _IDLE:
                    self.rooms.internal_error(unit[0], exc, chunk_ends=False)
                else:
                    self.rooms.unaccounted_errors += 1
            # mutant-site: worker-main-call-maybe-sweep
            self.maybe_sweep()  # busy or idle
