"""Regression tests for the eight sender defects of issue 9 (an audit of 8343a9b).

Every defect has at least one test here that fails on 8343a9b for the defect's own reason
(wrong bytes at the decode side, a false ``Success``, a room stuck ``Transferring``, a dead
worker, ``clear()`` raising, another opening's exception, a room surviving ``close()``, too
few destination pages accepted), checked with API that existed then; checks of the API added
by the fix (``wait_drained``, ...) come after those, separately.

Real parts only: real NIXL agents over UCX on loopback move real bytes into an in-process
decode peer. Interleavings are forced, not hoped for, by wrapping real parts:

* :class:`ScriptedTransport` wraps the real transport; by write number its transfers can be
  *held* (the real transfer is polled, so a release by the transport still shows, but the
  answer is ``"PROC"`` until the hold ends; past the deadline it raises
  ``TransferTimeoutError`` like a transfer to a hung peer) or *met* (two threads polling the
  same DONE transfer rendezvous inside ``poll``, so both see ``DONE``).
* :class:`SignallingPool` is a real staging pool that tells when a worker waits for a slot.
* A long reader hammers ``snapshot()`` of a staging context holding 200k keys, made with a
  small ``lock_timeout`` (defects 4 and 5).
* A per-thread profile hook pauses ``open_room`` just before it takes the room lock (7).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

import numpy as np
import pytest
import torch

from sender.errors import TRANSPORT_ERRORS, KVTransferError, TransferTimeoutError
from sender.manager import KVManager, make_transfer_info
from sender.nixl_sender import NixlKVSender
from sender.poll import KVPoll
from staging.buffers import StagingBufferPool, StagingSlot
from staging.context import RoomHandle, StagingContext
from stress.harness.faults import nixl_error
from tests.fixtures_nixl import PAGE_BYTES, SenderPool, requires_nixl
from tests.polling import conclude, wait_until

pytestmark = [pytest.mark.nixl, requires_nixl]

SESSION = "decode-0"


# ----------------------------------------------------------------------------- helpers


class ScriptedTransfer:
    """A real transfer whose answers follow the script of its :class:`ScriptedTransport`."""

    def __init__(self, inner: Any, owner: ScriptedTransport, write_no: int) -> None:
        self.inner = inner
        self.write_no = write_no
        self._owner = owner

    @property
    def held(self) -> bool:
        return self.write_no in self._owner.hold and not self._owner.unheld.is_set()

    @property
    def done(self) -> bool:
        return bool(self.inner.done) and not self.held

    def poll(self) -> str:
        state: str = self.inner.poll()  # raises TransferReleasedError once released
        if self.held:
            if time.monotonic() >= self.inner.started_at + self.inner.timeout_s:
                raise TransferTimeoutError(self.inner.session_id, self.inner.timeout_s)
            return "PROC"
        if state == "DONE" and self.write_no in self._owner.meet:
            # Only one thread came (the barrier breaks): that is what a fixed sender does.
            with contextlib.suppress(threading.BrokenBarrierError):
                self._owner.barrier.wait()
        return state

    def wait(self, timeout_s: float | None = None, interval_s: float = 0.0002) -> None:
        end = None if timeout_s is None else time.monotonic() + timeout_s
        while self.poll() != "DONE":
            if end is not None and time.monotonic() >= end:
                raise TimeoutError(f"wait({timeout_s}) elapsed")
            time.sleep(interval_s)

    def release(self) -> None:
        self.inner.release()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class ScriptedTransport:
    """A real transport whose transfers are held or met by write number (1-based).

    Thread-safe: the write counter is under ``_lock`` (never held while calling NIXL).
    """

    def __init__(self, inner: Any, *, hold: Sequence[int] = (), meet: Sequence[int] = ()) -> None:
        self.inner = inner
        self.hold = frozenset(hold)
        self.meet = frozenset(meet)
        self.unheld = threading.Event()
        self.barrier = threading.Barrier(2, timeout=0.5)
        self._lock = threading.Lock()
        self._writes = 0
        self.transfers: list[ScriptedTransfer] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __enter__(self) -> ScriptedTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        """End every hold, so that workers polling a held transfer can stop."""
        self.unheld.set()

    def write_pages(
        self, session_id: str, src_pages: Any, dst_pages: Any, notif: bytes | None = None,
        **kw: Any,
    ) -> ScriptedTransfer:
        with self._lock:
            self._writes += 1
            write_no = self._writes
        xfer = ScriptedTransfer(
            self.inner.write_pages(session_id, src_pages, dst_pages, notif, **kw), self, write_no
        )
        with self._lock:
            self.transfers.append(xfer)
        return xfer


class SignallingPool(StagingBufferPool):
    """A real staging pool that sets ``waiting`` when a lease finds no free slot (a worker
    then parks its chunk and tries again; an inline send waits in ``acquire``)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.waiting = threading.Event()

    def try_acquire(self, owner: Any, **kw: Any) -> StagingSlot | None:
        slot = super().try_acquire(owner, **kw)
        if slot is None:
            self.waiting.set()
        return slot


@dataclass
class Rig:
    """The sender transport + pool (``sp``) and an in-process decode peer added as SESSION."""

    sp: SenderPool
    peer: Any  # stress.harness.peer.DecodePeer

    @property
    def tx(self) -> Any:
        return self.sp.transport

    @property
    def kv(self) -> torch.Tensor:
        return self.sp.pool


@pytest.fixture
def rig(sender_pool: SenderPool, decode_peer: Any) -> Rig:
    sender_pool.transport.add_peer(SESSION, decode_peer.metadata())
    return Rig(sender_pool, decode_peer)


FILLER_KEYS = 200_000


@pytest.fixture(scope="module")
def crowded_staging() -> StagingContext:
    """A staging context with a small lock timeout and 200k keys of filler rooms (ids >=
    1_000_000): its ``snapshot()`` holds the read lock ~0.1 s, 20x the lock timeout."""
    ctx = StagingContext(lock_timeout=0.005)
    per_room = 64
    for i in range(FILLER_KEYS // per_room):
        ctx.request_prefetches(ctx.open_room(1_000_000 + i), range(per_room), "filler")
    return ctx


@contextlib.contextmanager
def long_reader(ctx: StagingContext) -> Iterator[list[int]]:
    """A daemon thread calling ``ctx.snapshot()`` back to back until the block ends."""
    stop = threading.Event()
    count = [0]
    errors: list[BaseException] = []

    def run() -> None:
        try:
            while not stop.is_set():
                ctx.snapshot()
                count[0] += 1
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=run, name="long-reader", daemon=True)
    t.start()
    while count[0] == 0 and not errors and t.is_alive():  # one done: the next one runs
        time.sleep(0.001)
    try:
        yield count
    finally:
        stop.set()
        t.join(10)
        assert not t.is_alive(), "the long reader did not stop"
    assert errors == [], errors






def sender(mgr: KVManager, room: int, dst: Sequence[int], session: str = SESSION) -> NixlKVSender:
    s = NixlKVSender(mgr, room, [session], [make_transfer_info(session, dst)])
    s.init(len(dst))
    return s


def worker_threads(mgr: KVManager) -> list[threading.Thread]:
    return list(getattr(mgr, "_workers", ()))


# ------------------------------------------------------------- defect 1: post after clear


@pytest.mark.timeout(30)
def test_d1_cleared_room_never_writes_pages_given_to_another_room(rig: Rig) -> None:
    """Room A's worker waits for the only staging slot (held by another room); A is aborted
    and reported (``failure_exception``); the driver hands A's decode pages to room B, which
    writes and verifies them; then the slot frees. A's chunk must never be posted: B's
    pages must keep B's bytes. At 8343a9b the worker posted A's chunk onto B's pages."""
    pool = SignallingPool(1, 4, PAGE_BYTES)
    rig.tx.register_region("staging", pool.tensor, PAGE_BYTES)
    blocker = pool.acquire("another-room", timeout=1.0)
    dst, src_a, src_b = [20, 21, 22, 23], [100, 101, 102, 103], [200, 201, 202, 203]
    with KVManager(rig.tx, rig.kv, num_workers=1, staging_pool=pool, slot_timeout_s=20) as mgr_a, \
            KVManager(rig.tx, rig.kv, num_workers=0) as mgr_b:  # fmt: skip
        a = sender(mgr_a, 1, dst)
        a.send(src_a)
        assert pool.waiting.wait(10), "the worker never waited for a slot"
        time.sleep(0.05)  # let it settle inside acquire()
        a.abort()
        with pytest.raises(KVTransferError):
            a.failure_exception()
        # The decode side now reuses A's pages for B (B needs no staging slot).
        started = rig.tx.stats().transfers_started
        b = sender(mgr_b, 2, dst)
        b.send(src_b)
        assert conclude(b, 10) is KVPoll.Success
        assert rig.peer.read_pages(dst) == rig.sp.page_bytes_of(src_b), "B did not verify"
        b.clear()
        pool.release(blocker)  # the slot frees: A's worker gets it

        def worker_done() -> bool:
            st = mgr_a.stats()
            return st.chunks_skipped + st.chunks_done + st.chunks_failed >= 1

        assert wait_until(worker_done, 10), "A's worker never finished its chunk"
        assert wait_until(lambda: pool.stats().in_use == 0, 10)
        assert wait_until(lambda: rig.tx.stats().live_transfers == 0, 10)
        time.sleep(0.2)  # a late write would have landed by now
        landed = rig.peer.read_pages(dst)
        a_landed = landed == rig.sp.page_bytes_of(src_a)
        b_kept = landed == rig.sp.page_bytes_of(src_b)
        assert not a_landed, "A's bytes landed on B's pages"
        assert b_kept, "B's pages were overwritten"
        assert rig.tx.stats().transfers_started == started + 1, "A's chunk was posted"
        assert mgr_a.footprint(1) == () and mgr_a.stats().chunks_done == 0
    pool.close()


# -------------------------------------------------- defect 2: two inline progress() calls


@pytest.mark.timeout(30)
def test_d2_two_inline_progress_calls_never_count_a_chunk_twice(rig: Rig) -> None:
    """Inline mode, two chunks: the first is DONE, the second still in flight. Two threads
    call ``progress`` at once and both poll the DONE transfer (they meet inside its poll).
    The room must stay Transferring (1 of 2 chunks done), never report Success; at 8343a9b
    both threads finished the first chunk, jobs_done reached 2 and the room said Success."""
    script = ScriptedTransport(rig.tx, meet=[1], hold=[2])
    # "as mgr, script": leaving, the hold ends first, then the manager closes.
    with KVManager(
        script, rig.kv, num_workers=0, transfer_timeout_s=30
    ) as mgr, script:
        s = sender(mgr, 3, [40, 41])
        s.send([7])
        s.send([8])
        assert len(script.transfers) == 2
        script.transfers[0].inner.wait(10)  # the first chunk is really DONE at NIXL
        start = threading.Barrier(2, timeout=5)
        errors: list[BaseException] = []

        def progress() -> None:
            try:
                start.wait()
                mgr.progress(s.handle)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=progress, daemon=True) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert not any(t.is_alive() for t in threads)
        assert errors == []
        assert mgr.status(3) is KVPoll.Transferring, "a false Success (chunk counted twice)"
        assert mgr.stats().chunks_done == 1
        script.unheld.set()  # the second chunk completes now
        assert conclude(s, 10) is KVPoll.Success
        assert mgr.stats().chunks_done == 2
        assert rig.peer.read_pages([40, 41]) == rig.sp.page_bytes_of([7, 8])
        s.clear()
        assert mgr.footprint(3) == ()


# --------------------------------------- defect 3: transfer released by the transport


@pytest.mark.timeout(30)
@pytest.mark.parametrize("how", ["remove_peer", "close"])
@pytest.mark.parametrize("workers", [1, 0])
def test_d3_transfer_released_by_transport_fails_room_within_deadline(
    rig: Rig, workers: int, how: str
) -> None:
    """A chunk is in flight to a hung peer (held PROC); the transport releases it
    (``remove_peer`` or ``close``). The room must become Failed (within 10 deadlines: a
    bound, not a timing), never stay Transferring, and leave nothing once cleared and
    drained. At 8343a9b the poll's TransferReleasedError was taken for "room purged":
    Transferring forever."""
    deadline_s = 1.0
    script = ScriptedTransport(rig.tx, hold=[1])
    with KVManager(
        script, rig.kv, num_workers=workers, transfer_timeout_s=deadline_s
    ) as mgr, script:
        s = sender(mgr, 4, [0, 1, 2, 3])
        s.send([9, 10, 11, 12])
        t0 = time.monotonic()
        assert wait_until(lambda: mgr.stats().transfers_inflight == 1, 5)
        if how == "remove_peer":
            assert rig.tx.remove_peer(SESSION)
        else:
            rig.tx.close()
        # Bounded by 10 deadlines (a busy machine's margin), not timed: the room must not
        # stay Transferring (at 8343a9b it did, forever).
        status = conclude(s, 10 * deadline_s)
        elapsed = time.monotonic() - t0
        assert status is KVPoll.Failed, f"room still {status!r} {elapsed:.1f} s after release"
        # A write remove_peer kept (NIXL still had it in progress) stays in flight until NIXL
        # settles it (THREADING.md, "Removed peers"); on loopback that is at once, and the
        # next sweep or progress() ends it. Bounded like the conclusion above.

        def ended() -> bool:
            mgr.progress(s.handle)
            return mgr.stats().transfers_inflight == 0

        assert wait_until(ended, 10 * deadline_s), mgr.stats()
        with pytest.raises((KVTransferError, *TRANSPORT_ERRORS)):
            s.failure_exception()
        assert mgr.wait_drained(s.handle, timeout_s=5.0)
        assert mgr.footprint(4) == ()
        assert mgr.stats().open_rooms == 0
    assert rig.tx.stats().live_transfers == 0


# ----------------------------------------------------------- defect 4: a worker dies


@pytest.mark.timeout(40)
@pytest.mark.usefixtures("fast_switch")
def test_d4_worker_survives_fail_session_under_lock_timeout_and_long_reader(
    rig: Rig, crowded_staging: StagingContext, thread_excepthook: list[Any]
) -> None:
    """Three rooms, one per session, each with a chunk to a hung peer: each times out, which
    fails the session (``fail_session`` -> ``staging.purge_session``) while a long reader
    holds the staging context (``lock_timeout=0.005``). The one worker must survive every
    time, and a room of a healthy session must still be processed. At 8343a9b the
    LockTimeoutError escaped the except-handler and killed the worker: later rooms hung."""
    meta = rig.peer.metadata()
    hung = ["hung-a", "hung-b", "hung-c"]
    for sid in [*hung, "healthy"]:
        rig.tx.add_peer(sid, meta)
    script = ScriptedTransport(rig.tx, hold=[1, 2, 3])
    with KVManager(
        script, rig.kv, num_workers=1, staging=crowded_staging, transfer_timeout_s=0.3
    ) as mgr, script:
        rooms = [sender(mgr, 10 + i, [i], sid) for i, sid in enumerate(hung)]
        healthy = sender(mgr, 20, [30, 31], "healthy")
        with long_reader(crowded_staging) as snapshots:
            for r in rooms:
                r.send([50 + r.bootstrap_room])
                st = conclude(r, 5)
                assert st is KVPoll.Failed, f"room {r.bootstrap_room} {st!r}: worker dead?"
                # fail_session follows record_failure: let it run before the next room.
                time.sleep(0.1)
            healthy.send([60, 61])
            st = conclude(healthy, 5)
            reads = snapshots[0]
        assert reads > 0
        assert thread_excepthook == [], [a.exc_value for a in thread_excepthook]
        assert st is KVPoll.Success, f"healthy room {st!r}: the worker died"
        assert all(t.is_alive() for t in worker_threads(mgr))
        assert rig.peer.read_pages([30, 31]) == rig.sp.page_bytes_of([60, 61])
        healthy.clear()
        for r in rooms:
            with pytest.raises((KVTransferError, *TRANSPORT_ERRORS)):
                r.failure_exception()
        script.unheld.set()
        assert mgr.wait_drained(timeout_s=5.0)
        assert mgr.stats().open_rooms == 0


class _FailingSessionPurge(StagingContext):
    """A staging context whose first ``purge_session`` raises (any unexpected error)."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = True

    def purge_session(self, session_id: str) -> frozenset[int]:
        if self.armed:
            self.armed = False
            raise RuntimeError("planted: purge_session failed")
        return super().purge_session(session_id)


@pytest.mark.timeout(30)
def test_d4_worker_survives_any_error_while_handling_a_transport_error(
    rig: Rig, thread_excepthook: list[Any]
) -> None:
    """The same path made deterministic: the session purge after a timeout raises an
    unexpected error. The worker goes on (the error is counted) and serves the next room."""
    rig.tx.add_peer("hung", rig.peer.metadata())
    script = ScriptedTransport(rig.tx, hold=[1])
    ctx = _FailingSessionPurge()
    with KVManager(
        script, rig.kv, num_workers=1, staging=ctx, transfer_timeout_s=0.2
    ) as mgr, script:
        doomed = sender(mgr, 1, [0], "hung")
        later = sender(mgr, 2, [5, 6])
        doomed.send([70])
        assert conclude(doomed, 5) is KVPoll.Failed
        assert wait_until(lambda: not ctx.armed, 5)
        later.send([71, 72])
        st = conclude(later, 5)
        assert thread_excepthook == [], [a.exc_value for a in thread_excepthook]
        assert st is KVPoll.Success, f"next room {st!r}: the worker died"
        assert all(t.is_alive() for t in worker_threads(mgr))
        assert mgr.stats().worker_errors >= 1
        later.clear()
        with pytest.raises((KVTransferError, *TRANSPORT_ERRORS)):
            doomed.failure_exception()
        script.unheld.set()
        assert mgr.wait_drained(timeout_s=5.0)


# ------------------------------------------------------ defect 5: clear() raises


@pytest.mark.timeout(40)
@pytest.mark.usefixtures("fast_switch")
def test_d5_clear_never_raises_and_purges_all_under_lock_timeout(
    rig: Rig, crowded_staging: StagingContext
) -> None:
    """Twelve rooms (inline mode), each with staging keys, a leased slot and a transfer in
    flight, are cleared while a long reader holds the staging context
    (``lock_timeout=0.005``). ``clear()`` must never raise and must purge everything: once
    drained nothing is left, and every room id can be opened again. At 8343a9b ``clear()``
    raised LockTimeoutError half-way: the staging room, slot and transfer leaked, and
    reopening the id failed."""
    n = 12
    pool = StagingBufferPool(n, 1, PAGE_BYTES)
    rig.tx.register_region("staging", pool.tensor, PAGE_BYTES)
    script = ScriptedTransport(rig.tx, hold=range(1, n + 1))
    raised: list[BaseException] = []
    with KVManager(
        script, rig.kv, num_workers=0, staging=crowded_staging, staging_pool=pool,
        transfer_timeout_s=20, session_slots=n,
    ) as mgr, script:
        senders = [sender(mgr, 100 + i, [i]) for i in range(n)]
        for s in senders:
            s.send([s.bootstrap_room])
        assert wait_until(lambda: mgr.stats().transfers_inflight == n, 10)
        assert all(mgr.staging.room_requests(s.bootstrap_room) for s in senders)
        with long_reader(crowded_staging):
            for s in senders:
                try:
                    s.clear()
                except BaseException as exc:
                    raised.append(exc)
        assert raised == [], f"clear() raised {len(raised)}/{n} times: {raised[0]!r}"
        opened = crowded_staging.open_rooms
        assert not [s.bootstrap_room for s in senders if s.bootstrap_room in opened]
        assert mgr.stats().open_rooms == 0
        reopened = [sender(mgr, s.bootstrap_room, [n + i]) for i, s in enumerate(senders)]
        for s in reopened:
            s.clear()
        script.unheld.set()
        assert mgr.wait_drained(timeout_s=10.0)
        for s in senders:
            assert mgr.footprint(s.bootstrap_room) == ()
        assert pool.stats().in_use == 0
    assert rig.tx.stats().live_transfers == 0
    pool.close()


# ------------------------------------ defect 6: another opening's exception


class _ReopenInTheGap(KVManager):
    """Once armed with a victim, the first of these calls does, on the calling thread, what
    another thread may do at that moment: clear the victim, open the same room id for a new
    sender (the intruder) and record the intruder's failure:

    * ``is_open(victim)`` answering True, just before it returns (the sender checked that it
      owns the room and goes on to take its exception: the gap of 8343a9b);
    * ``purge_room(victim)``, just before it runs (the room was cleared by another thread
      before the sender's own purge: what a fixed sender must cope with).
    """

    victim: RoomHandle | None = None
    intruder: NixlKVSender | None = None
    intruder_exc: BaseException | None = None

    def _interfere(self, handle: RoomHandle) -> None:
        self.victim = None
        super().purge_room(handle)
        self.intruder = sender(self, handle.room, [0, 1])
        assert self.intruder_exc is not None
        self.record_failure(self.intruder.handle, self.intruder_exc, "intruder failed")

    def is_open(self, handle: RoomHandle) -> bool:
        answer = super().is_open(handle)
        if answer and handle == self.victim:
            self._interfere(handle)
        return answer

    def purge_room(self, room: int | RoomHandle) -> Any:
        if isinstance(room, RoomHandle) and room == self.victim:
            self._interfere(room)
        return super().purge_room(room)


@pytest.mark.timeout(30)
def test_d6_failure_exception_never_raises_another_openings_exception(rig: Rig) -> None:
    """Sender A failed with its own exception. While A reports it, its room is cleared,
    reopened by sender B and B fails too (forced at A's ownership check or at A's purge,
    whichever A reaches first). A must raise its own exception or a KVTransferError, never
    B's, and B must raise its own. At 8343a9b A checked ownership, then popped by room id:
    it raised B's exception (and B a generic error)."""
    mgr = _ReopenInTheGap(rig.tx, rig.kv, num_workers=0)
    with mgr:
        exc_a, exc_b = nixl_error("nixlCancelledError"), nixl_error("nixlBackendError")
        a = sender(mgr, 6, [0, 1])
        mgr.record_failure(a.handle, exc_a, "A failed")
        assert a.poll() is KVPoll.Failed
        mgr.victim, mgr.intruder_exc = a.handle, exc_b
        with pytest.raises(BaseException) as info:
            a.failure_exception()
        got = info.value
        assert got is not exc_b, "A raised the exception of the room's next opening (B)"
        assert got is exc_a or (isinstance(got, KVTransferError) and got.room == 6), repr(got)
        b = mgr.intruder
        assert b is not None, "the interference never ran"
        assert b.poll() is KVPoll.Failed
        with pytest.raises(BaseException) as binfo:
            b.failure_exception()
        assert binfo.value is exc_b, f"B raised {binfo.value!r}, not its own exception"
        assert mgr.footprint(6) == ()
        assert mgr.stats().open_rooms == 0


# -------------------------------------------- defect 7: close() racing open_room


def _pause_open_room_at_room_lock(
    paused: threading.Event, resume: threading.Event
) -> Callable[[FrameType, str, Any], None]:
    """A profile hook: when the room table's ``open`` (``KVManager.open_room`` itself at
    8343a9b) calls a lock's ``write()`` (the room lock, after the closed check at 8343a9b),
    pause that thread until ``resume`` (<= 3 s)."""
    locks_py = os.path.join("staging", "locks.py")
    opener_files = (os.path.join("sender", "manager.py"), os.path.join("sender", "rooms.py"))

    def hook(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or paused.is_set() or frame.f_code.co_name != "write":
            return
        caller = frame.f_back
        if (
            frame.f_code.co_filename.endswith(locks_py)
            and caller is not None
            and caller.f_code.co_name in ("open_room", "open")
            and caller.f_code.co_filename.endswith(opener_files)
        ):
            paused.set()
            resume.wait(3.0)

    return hook


@pytest.mark.timeout(30)
def test_d7_room_opened_while_close_runs_does_not_survive_close(rig: Rig) -> None:
    """``open_room`` is paused just before it takes the room lock while ``close()`` runs to
    its end. Afterwards no room may be open (open_room raised RuntimeError, or close purged
    the room). At 8343a9b open_room had passed the closed check: the room survived close."""
    mgr = KVManager(rig.tx, rig.kv, num_workers=1)
    paused, resume = threading.Event(), threading.Event()
    result: list[Any] = []

    def opener() -> None:
        sys.setprofile(_pause_open_room_at_room_lock(paused, resume))
        try:
            result.append(mgr.open_room(7, [SESSION]))
        except BaseException as exc:
            result.append(exc)
        finally:
            sys.setprofile(None)

    def closer() -> None:
        try:
            mgr.close()
        finally:
            resume.set()

    t_open = threading.Thread(target=opener, daemon=True)
    t_open.start()
    try:
        assert paused.wait(5), "open_room never reached the room lock"
        t_close = threading.Thread(target=closer, daemon=True)
        t_close.start()
        t_close.join(10)
        assert not t_close.is_alive()
    finally:
        resume.set()
        t_open.join(10)
    assert not t_open.is_alive()
    assert len(result) == 1
    got = result[0]
    assert isinstance(got, (RoomHandle, RuntimeError)), repr(got)
    assert mgr.stats().open_rooms == 0, "a room survived close()"
    assert 7 not in mgr.staging.open_rooms
    assert mgr.footprint(7) == ()
    with pytest.raises(RuntimeError):
        mgr.open_room(8, [SESSION])
    mgr.close()


@pytest.mark.timeout(30)
@pytest.mark.usefixtures("fast_switch")
def test_d7_close_racing_open_room_repeatedly(rig: Rig) -> None:
    """300 rounds of two threads opening rooms in a loop while the main thread closes the
    manager: after close() returns no room is open and every later open_room raises."""
    errors: list[BaseException] = []
    for rnd in range(300):
        mgr = KVManager(rig.tx, rig.kv, num_workers=0)
        go = threading.Barrier(3, timeout=5)

        def opener(base: int, m: KVManager = mgr, b: threading.Barrier = go) -> None:
            try:
                b.wait()
                for i in range(50):
                    m.open_room(base + i, [SESSION])
            except RuntimeError:
                pass  # closed
            except BaseException as exc:
                errors.append(exc)

        threads = [
            threading.Thread(target=opener, args=(k * 100,), daemon=True) for k in (1, 2)
        ]
        for t in threads:
            t.start()
        go.wait()
        mgr.close()
        survivors = mgr.stats().open_rooms
        for t in threads:
            t.join(5)
        assert not any(t.is_alive() for t in threads)
        assert errors == []
        assert survivors == mgr.stats().open_rooms == 0, f"round {rnd}: a room survived close"
        assert mgr.staging.open_rooms == frozenset()


# ----------------------------------------- defect 8: too few destination pages


@pytest.mark.timeout(30)
@pytest.mark.parametrize("workers", [0, 1])
def test_d8_short_info_after_init_is_refused_and_fails_the_room(rig: Rig, workers: int) -> None:
    """``init(8)`` first, then the bootstrap thread brings an info with 4 destination pages.
    It must be refused (ValueError, nothing stored), the room Failed and reported with a
    KVTransferError, nothing left. At 8343a9b the info was accepted."""
    with KVManager(rig.tx, rig.kv, num_workers=workers) as mgr:
        s = NixlKVSender(mgr, 8, [SESSION])
        s.init(8)
        with pytest.raises(ValueError):
            mgr.add_transfer_info(s.handle, make_transfer_info(SESSION, range(4)))
        assert 8 not in mgr.transfer_infos
        assert mgr.status(8) is KVPoll.Failed
        assert s.poll() is KVPoll.Failed
        with pytest.raises(KVTransferError):
            s.failure_exception()
        assert mgr.footprint(8) == ()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("workers", [0, 1])
def test_d8_send_after_a_short_info_fails_cleanly(rig: Rig, workers: int) -> None:
    """The scheduler goes on after the bootstrap thread's short info (whatever it did with
    the error): ``send`` must not raise, nothing may be posted, the room must conclude
    Failed and report a KVTransferError. At 8343a9b inline ``send`` raised (the room stayed
    Transferring); with workers it failed as an internal worker error."""
    with KVManager(rig.tx, rig.kv, num_workers=workers) as mgr:
        s = NixlKVSender(mgr, 9, [SESSION])
        s.init(8)
        with contextlib.suppress(ValueError):  # the bootstrap thread logs it; we go on
            mgr.add_transfer_info(s.handle, make_transfer_info(SESSION, range(4)))
        started = rig.tx.stats().transfers_started
        s.send(np.arange(8))
        assert conclude(s, 5) is KVPoll.Failed
        with pytest.raises(KVTransferError):
            s.failure_exception()
        assert rig.tx.stats().transfers_started == started
        assert mgr.stats().worker_errors == 0
        assert mgr.footprint(9) == ()
        assert mgr.stats().open_rooms == 0
