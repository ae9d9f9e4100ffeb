"""Regression tests for the defects at the sender's edges of issue 25 (an audit of 3a76f2e),
section 1: defects 1-6 and 8, and the suspicions settled by a fix.

Each test fails on 3a76f2e for the defect's own reason (a room failed "no staging slot", a
room id accepted that no message can carry, a listener short of events, a succeeded room
counted by failure code, an oversize chunk failing its room as an internal error, ``close()``
raising in a worker, a drained chunk's bytes missing from ``bytes_posted``, a chunk never
polled again, a disconnect flag never cleared, ``close()`` outwaited by a worker's pause, a
room never marked prefetched) and passes now.

Real parts only: two real NIXL agents (UCX on loopback) in this process move real bytes
between torch tensors. Interleavings are forced by wrapping the real transport:
:class:`HeldTransport` returns the real transfers behind a wrapper that answers ``"PROC"``
until the test lets them go (the real write is still polled, so a release by the transport
shows), and never claims a write completed inside its post (the pipeline then polls it,
as it must for a write still in flight).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from sender import _nixl
from sender.manager import KVManager, make_transfer_info
from sender.nixl_sender import NixlKVSender
from sender.notices import MAX_NOTICE_BYTES, RoomNotice, decode_notice
from sender.poll import KVPoll
from sender.transport import NixlTransport
from staging.buffers import StagingBufferPool, StagingSlot
from staging.context import StagingContext
from stress.harness.faults import nixl_error
from tests.fixtures_nixl import requires_nixl
from tests.polling import conclude, wait_until

pytestmark = [pytest.mark.nixl, requires_nixl]

PAGES = 64
PAGE_BYTES = 4096
A, B = "decode-a", "decode-b"


# ----------------------------------------------------------------------------- helpers


@dataclass
class Rig:
    tx: NixlTransport
    rx: NixlTransport
    kv: torch.Tensor
    dst: torch.Tensor

    def with_pool(self, num_slots: int, slot_pages: int, page_bytes: int = PAGE_BYTES,
                  cls: type[StagingBufferPool] = StagingBufferPool, **kw: Any) -> Any:
        pool = cls(num_slots, slot_pages, page_bytes, **kw)
        self.tx.register_region("staging", pool.tensor, page_bytes)
        return pool


@pytest.fixture
def rig() -> Iterator[Rig]:
    """A prefill transport (KV pool ``kv``) and a decode transport (``kv``), with the decode
    agent added twice, as sessions A and B (two decode sessions, one agent)."""
    gen = torch.Generator().manual_seed(25)
    kv = torch.randint(0, 256, (PAGES, PAGE_BYTES), dtype=torch.uint8, generator=gen)
    dst = torch.zeros((PAGES, PAGE_BYTES), dtype=torch.uint8)
    with NixlTransport("prefill-edge") as tx, NixlTransport("decode-edge") as rx:
        tx.register_region("kv", kv, PAGE_BYTES)
        rx.register_region("kv", dst, PAGE_BYTES)
        md = rx.metadata()
        tx.add_peer(A, md)
        tx.add_peer(B, md)
        yield Rig(tx, rx, kv, dst)


class HeldTransfer:
    """A real transfer that answers ``"PROC"`` while its transport holds it."""

    def __init__(self, inner: Any, owner: HeldTransport) -> None:
        self.inner = inner
        self.owner = owner

    def poll(self) -> str:
        state: str = self.inner.poll()  # raises TransferReleasedError once released
        self.owner.polls += 1
        return "PROC" if not self.owner.go.is_set() else state

    def release(self) -> None:
        self.inner.release()

    def settled(self) -> bool:
        return True


class HeldTransport:
    """The real transport; its writes are :class:`HeldTransfer` (held until ``go``)."""

    def __init__(self, inner: NixlTransport, *, held: bool = True) -> None:
        self.inner = inner
        self.go = threading.Event()
        if not held:
            self.go.set()
        self.polls = 0
        self.transfers: list[HeldTransfer] = []

    def write_pages(self, *args: Any, **kw: Any) -> HeldTransfer:
        t = HeldTransfer(self.inner.write_pages(*args, **kw), self)
        self.transfers.append(t)
        return t

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class Recorder:
    """A listener that counts chunk ends and room conclusions by outcome (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.chunks: Counter[str] = Counter()
        self.nbytes: Counter[str] = Counter()
        self.rooms: Counter[str] = Counter()

    def room_concluded(self, room: int, gen: int, outcome: str, code: str, s: float) -> None:
        with self._lock:
            self.rooms[outcome] += 1

    def chunk_ended(self, session_id: str, outcome: str, seconds: float, nbytes: int) -> None:
        with self._lock:
            self.chunks[outcome] += 1
            self.nbytes[outcome] += nbytes






def two_session_sender(mgr: KVManager, room: int, n: int, **info_kw: Any) -> NixlKVSender:
    infos = [
        make_transfer_info(A, list(range(0, n)), **info_kw),
        make_transfer_info(B, list(range(n, 2 * n)), **info_kw),
    ]
    s = NixlKVSender(mgr, room, [A, B], infos)
    s.init(n)
    return s


def one_session_sender(mgr: KVManager, room: int, dst: list[int], **info_kw: Any) -> NixlKVSender:
    s = NixlKVSender(mgr, room, [A], [make_transfer_info(A, dst, **info_kw)])
    s.init(len(dst))
    return s


def quiescent_sum(mgr: KVManager) -> tuple[int, int]:
    st = mgr.stats()
    return st.chunks_submitted, (
        st.chunks_done + st.chunks_failed + st.chunks_skipped + st.chunks_drained
    )


# ------------------------------------------- defect 1: inline mode + pool waits for itself


@pytest.mark.timeout(60)
def test_d1_inline_pool_one_slot_two_sessions_succeeds(rig: Rig) -> None:
    """Inline, one staging slot, a two-session room: the second session's chunk waits for
    the slot the first one holds; that write completes but only this thread could poll it.
    On 3a76f2e the send waits ``slot_timeout_s`` and fails the room "no staging slot"; now
    the waiting send ends the completed chunk and takes its slot."""
    pool = rig.with_pool(1, 4)
    tx = HeldTransport(rig.tx, held=False)  # never "done at post": polled, as in flight
    # slot_timeout_s bounds the old code's stall; the fixed code needs one poll of a done
    # write (well under it even at load 8+).
    with KVManager(tx, rig.kv, num_workers=0, staging_pool=pool,  # type: ignore[arg-type]
                   slot_timeout_s=5.0) as mgr:
        for room in range(3):  # and again: no slot is lost
            s = two_session_sender(mgr, room, 4)
            s.send([10, 11, 12, 13])
            assert conclude(s, 20.0) is KVPoll.Success, mgr.failure_records
            assert torch.equal(rig.dst[0:4], rig.kv[10:14])
            assert torch.equal(rig.dst[4:8], rig.kv[10:14])
            s.clear()
        st = mgr.stats()
        assert st.rooms_failed == 0 and st.chunks_done == 6
        assert pool.stats().in_use == 0


@pytest.mark.timeout(60)
def test_d1_inline_scheduler_step_with_fewer_slots_than_chunks(rig: Rig) -> None:
    """An ordinary scheduler step: send to every room, then poll them; 2 slots, 4 rooms."""
    pool = rig.with_pool(2, 4)
    tx = HeldTransport(rig.tx, held=False)
    with KVManager(tx, rig.kv, num_workers=0, staging_pool=pool,  # type: ignore[arg-type]
                   slot_timeout_s=5.0) as mgr:
        senders = [one_session_sender(mgr, r, [4 * r + i for i in range(4)]) for r in range(4)]
        for r, s in enumerate(senders):
            s.send([20 + 4 * r + i for i in range(4)])
        for s in senders:
            assert conclude(s, 20.0) is KVPoll.Success, mgr.failure_records
        for r in range(4):
            assert torch.equal(rig.dst[4 * r : 4 * r + 4], rig.kv[20 + 4 * r : 24 + 4 * r])
        for s in senders:
            s.clear()
        assert mgr.stats().rooms_failed == 0


# ---------------------------------------------------------- defect 2: room ids are bounded


@pytest.mark.timeout(30)
def test_d2_room_id_bound_refused_at_entry_naming_it(rig: Rig) -> None:
    """A room id >= 2**63 is refused at entry (nothing opened); a 4,300-digit one too, with
    a message that can be formatted. On 3a76f2e both were accepted (the room then never
    concluded, or its notice was over the decode side's limit)."""
    with KVManager(rig.tx, rig.kv, num_workers=0) as mgr:
        with pytest.raises(ValueError, match=r"room must be < 2\*\*63, got 9223372036854775808"):
            mgr.open_room(2**63, [A])
        with pytest.raises(ValueError, match=r"an int of \d+ bits"):
            NixlKVSender(mgr, 10**4300, [A], [make_transfer_info(A, [0])])
        with pytest.raises(ValueError, match="room"):
            StagingContext().open_room(10**480)
        assert mgr.stats().rooms_opened == 0
        # The largest id works end to end, and its notice decodes at the decode side.
        s = one_session_sender(mgr, 2**63 - 1, [0, 1])
        s.send([3, 4])
        assert conclude(s, 10.0) is KVPoll.Success
        s.clear()
    big = RoomNotice(2**63 - 1, 2**63 - 1, "failed", "peer-failed").encode()
    assert len(big) <= MAX_NOTICE_BYTES
    assert decode_notice(big).room == 2**63 - 1


@pytest.mark.timeout(30)
def test_d2_chunk_index_bound(rig: Rig) -> None:
    with KVManager(rig.tx, rig.kv, num_workers=0) as mgr:
        s = one_session_sender(mgr, 1, [0, 1])
        with pytest.raises(ValueError, match="chunk_idx"):
            mgr.submit_chunk(s.handle, 2**63, 0, np.array([3, 4]), True)
        assert mgr.stats().chunks_submitted == 0
        s.clear()


# --------------------------------------------- defect 3: every chunk end reaches listeners


class GatedPool(StagingBufferPool):
    """A real pool whose first lease waits until ``gate`` is set (the one worker is then
    busy with that chunk while the test purges other rooms' queued chunks)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.gate = threading.Event()
        self.entered = threading.Event()
        self._first = True

    def try_acquire(self, owner: Any, **kw: Any) -> StagingSlot | None:
        if self._first:
            self._first = False
            self.entered.set()
            assert self.gate.wait(30)
        return super().try_acquire(owner, **kw)


@pytest.mark.timeout(60)
def test_d3_listener_sees_skipped_and_slot_failed_chunks(rig: Rig) -> None:
    """Skipped chunks (room purged before its queued chunks ran) and a chunk failing before
    its post (no staging slot) each reach the listener, so its counts by outcome equal
    ``stats()``. On 3a76f2e the listener saw neither (0 skipped, 0 failed)."""
    pool = rig.with_pool(2, 4, cls=GatedPool)
    rec = Recorder()
    with KVManager(rig.tx, rig.kv, num_workers=1, staging_pool=pool, events=rec,
                   slot_timeout_s=0.05) as mgr:
        first = one_session_sender(mgr, 1, [0, 1, 2, 3])
        first.send([10, 11, 12, 13])
        assert pool.entered.wait(10)  # the one worker waits in its lease: queued units wait
        second = two_session_sender(mgr, 2, 4)
        second.send([20, 21, 22, 23])  # 2 units queued behind the gate
        second.clear()  # purged before they run: both are skipped
        pool.gate.set()
        assert conclude(first, 10.0) is KVPoll.Success
        first.clear()
        held = [pool.try_acquire("test"), pool.try_acquire("test")]  # no slot for room 3
        third = one_session_sender(mgr, 3, [0, 1, 2, 3])
        third.send([30, 31, 32, 33])
        assert conclude(third, 10.0) is KVPoll.Failed
        third.clear()
        for slot in held:
            assert slot is not None and pool.release(slot)
        assert mgr.wait_drained(None, 10.0)
        st = mgr.stats()
        assert (st.chunks_done, st.chunks_skipped, st.chunks_failed) == (1, 2, 1)
        ended = dict(rec.chunks)
        assert ended == {
            k: v
            for k, v in {
                "done": st.chunks_done, "failed": st.chunks_failed,
                "skipped": st.chunks_skipped, "drained": st.chunks_drained,
            }.items()
            if v
        }
        assert sum(ended.values()) == st.chunks_submitted
        assert rec.nbytes["skipped"] == 2 * 4 * PAGE_BYTES  # what they would have carried


# ------------------------------------ defect 4: a succeeded room is not counted as failed


@pytest.mark.timeout(30)
def test_d4_abort_after_success_counts_no_failure_and_sends_no_notice(rig: Rig) -> None:
    """Success, then ``abort()`` before ``clear()``: not in ``rooms_failed`` and not in
    ``rooms_failed_by_code`` (they sum to each other), and no "failed" notice (the decode
    side has the whole transfer). On 3a76f2e ``rooms_failed_by_code`` had ``aborted: 1``."""
    with KVManager(rig.tx, rig.kv, num_workers=0) as mgr:
        s = one_session_sender(mgr, 1, [0, 1])
        s.send([5, 6])
        assert conclude(s, 10.0) is KVPoll.Success
        s.abort()
        mgr.record_failure(s.handle, None, "aborted again")
        s.clear()
        st = mgr.stats()
        assert st.rooms_succeeded == 1 and st.rooms_failed == 0
        assert sum(st.rooms_failed_by_code.values()) == st.rooms_failed
        assert st.notices_queued == 0
        # A room that fails before concluding is still counted and notified.
        f = one_session_sender(mgr, 2, [2, 3])
        f.abort()
        f.clear()
        st = mgr.stats()
        assert st.rooms_failed == 1 and dict(st.rooms_failed_by_code) == {"aborted": 1}
        assert st.notices_queued == 1


# ----------------------------- defect 5: a chunk that cannot be staged is refused at send()


@pytest.mark.timeout(30)
def test_d5_chunk_larger_than_a_slot_is_a_value_error_at_send(rig: Rig) -> None:
    """On 3a76f2e the send was accepted and the room failed as an internal error."""
    pool = rig.with_pool(2, 2)
    with KVManager(rig.tx, rig.kv, num_workers=0, staging_pool=pool) as mgr:
        s = one_session_sender(mgr, 1, [0, 1, 2, 3])
        with pytest.raises(ValueError, match="a staging slot holds 2"):
            s.send([10, 11, 12, 13])
        st = mgr.stats()
        assert st.chunks_submitted == 0 and st.rooms_failed == 0 and st.worker_errors == 0
        assert mgr.handle_status(s.handle) is KVPoll.WaitingForInput
        s.send([10, 11])  # the sender's state did not move either
        s.send([12, 13])
        assert conclude(s, 10.0) is KVPoll.Success
        assert torch.equal(rig.dst[0:4], rig.kv[10:14])
        s.clear()
        # A chunk whose pages past the decode prefix fit a slot is fine.
        p = one_session_sender(mgr, 2, [0, 1, 2, 3], decode_prefix_len=2)
        p.send([10, 11, 12, 13])
        assert conclude(p, 10.0) is KVPoll.Success
        p.clear()


@pytest.mark.timeout(30)
def test_d5_pool_of_another_page_size_is_refused(rig: Rig) -> None:
    """A pool with larger pages than the KV pool's: refused at construction. A pool with
    smaller pages: a session that would stage whole pages into it is refused when its info
    is added (nothing changes). On 3a76f2e both were accepted and the room failed as an
    internal error at its first send."""
    big = StagingBufferPool(1, 4, 2 * PAGE_BYTES)
    made: list[KVManager] = []
    try:
        with pytest.raises(ValueError, match="page_bytes"):
            made.append(KVManager(rig.tx, rig.kv, num_workers=0, staging_pool=big))
    finally:
        for m in made:  # accepted (the old code): closed, so that no thread leaks
            m.close()
    half = rig.with_pool(1, 4, PAGE_BYTES // 2)
    with KVManager(rig.tx, rig.kv, num_workers=0, staging_pool=half) as mgr:
        h = mgr.open_room(1, [A])
        with pytest.raises(ValueError, match="page_bytes is 2048"):
            mgr.add_transfer_info(h, make_transfer_info(A, [0, 1]))
        assert mgr.handle_status(h) is KVPoll.Bootstrapping
        assert mgr.transfer_infos == {}
        with pytest.raises(ValueError, match="ends past a KV page"):
            mgr.add_transfer_info(
                h, make_transfer_info(A, [0, 1], byte_range=(PAGE_BYTES - 1, PAGE_BYTES // 2))
            )
        assert mgr.add_transfer_info(
            h, make_transfer_info(A, [0, 1], byte_range=(0, PAGE_BYTES // 2))
        )
        mgr.purge_room(h)
        assert mgr.stats().rooms_failed == 0


# ------------------------------------------------- defect 6: close() from a worker thread


@pytest.mark.timeout(60)
def test_d6_close_from_a_listener_callback_on_a_worker(rig: Rig) -> None:
    """A listener that closes the manager when a room concludes (it runs on the worker that
    ended the chunk). On 3a76f2e close() raised "cannot join current thread" half-way and
    left the notifier thread running."""
    errors: list[BaseException] = []
    closed = threading.Event()
    box: list[KVManager] = []

    class Closer(Recorder):
        def room_concluded(self, room: int, gen: int, outcome: str, code: str,
                           s: float) -> None:
            if closed.is_set():
                return
            closed.set()
            try:
                box[0].close(timeout_s=5.0)
            except BaseException as exc:
                errors.append(exc)

    mgr = KVManager(rig.tx, rig.kv, num_workers=2, events=Closer())
    box.append(mgr)
    try:
        s = one_session_sender(mgr, 1, [0, 1])
        other = one_session_sender(mgr, 2, [2, 3])  # open: close() purges it
        s.send([7, 8])
        assert closed.wait(20), "the room never concluded"
        for w in mgr._workers:
            w.join(10)
        assert [w.name for w in mgr._workers if w.is_alive()] == []
        notifier = mgr.notifier.thread
        assert notifier is not None
        notifier.join(10)
        assert errors == []
        assert not notifier.is_alive()
        assert other.poll() is KVPoll.Failed  # purged by the close
        with pytest.raises(RuntimeError, match="closed"):
            mgr.open_room(3, [A])
    finally:
        mgr.close()


# -------------------------------------- defect 8: posted_bytes counts every posted write


@pytest.mark.timeout(30)
def test_d8_posted_bytes_counts_drained_chunks(rig: Rig) -> None:
    """3 chunks of 8 KiB posted, then their room cleared while they are in flight: they
    drain, and all 24,576 bytes were posted. On 3a76f2e ``bytes_posted`` was 0 (only chunks
    that completed for open rooms counted)."""
    tx = HeldTransport(rig.tx)
    with KVManager(tx, rig.kv, num_workers=0) as mgr:  # type: ignore[arg-type]
        s = one_session_sender(mgr, 1, list(range(6)))
        for i in range(3):
            s.send([10 + 2 * i, 11 + 2 * i])
        assert len(tx.transfers) == 3
        s.clear()
        tx.go.set()
        assert mgr.wait_drained(None, 10.0)
        st = mgr.stats()
        assert st.chunks_drained == 3
        assert st.bytes_posted == 3 * 2 * PAGE_BYTES


# ------------------------- suspicion: _end_many raising inside _start drops pending chunks


class ReleaseRaises:
    """A real transfer that says it completed inside its post and whose first release
    raises (then releases the real transfer)."""

    REPORTS_DONE_AT_POST = True

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.done = True

    def poll(self) -> str:
        return "DONE"

    def release(self) -> None:
        self.inner.release()
        raise RuntimeError("planted release error")


class MixedTransport(HeldTransport):
    """Session A's writes report done at post and raise on release; session B's are held
    (in flight) until ``go``."""

    def write_pages(self, session_id: str, *args: Any, **kw: Any) -> Any:
        real = self.inner.write_pages(session_id, *args, **kw)
        if session_id == A:
            while real.poll() != "DONE":  # really done before we say so
                time.sleep(0.0005)
            return ReleaseRaises(real)
        t = HeldTransfer(real, self)
        self.transfers.append(t)
        return t


@pytest.mark.timeout(60)
def test_s_release_error_at_post_keeps_the_units_other_chunks_polled(rig: Rig) -> None:
    """Worker mode, no pool: one unit holds both sessions' chunks. A's completes at its post
    and its release raises; B's is still in flight. On 3a76f2e the worker dropped B's chunk
    from its list: nobody polled it and the room stayed Transferring. Now the room fails
    (internal error) and B's chunk still ends."""
    tx = MixedTransport(rig.tx)
    with KVManager(tx, rig.kv, num_workers=1) as mgr:  # type: ignore[arg-type]
        s = two_session_sender(mgr, 1, 2)
        s.send([3, 4])
        assert wait_until(lambda: len(tx.transfers) == 1, 10.0)
        tx.go.set()
        assert conclude(s, 10.0) is KVPoll.Failed
        assert "planted release error" in (mgr.failure_records.get(1) or "")
        # B's chunk is polled by the worker and ends (not left in flight).
        assert wait_until(lambda: mgr.stats().transfers_inflight == 0, 10.0)
        submitted, ended = quiescent_sum(mgr)
        assert submitted == ended == 2
        s.clear()


# ------------------------------- suspicion: peer_disconnected is cleared by a later write


@pytest.mark.timeout(30)
def test_s_peer_disconnected_cleared_once_a_write_completes(rig: Rig) -> None:
    """A disconnect reported by NIXL (the real agent's ``send_notif`` raising NIXL's own
    ``nixlRemoteDisconnectError`` once), then a write to the same peer completes: the peer
    is reachable, the flag is cleared (notices to it are sent again). On 3a76f2e it stayed
    set for as long as the session was added."""
    if _nixl.bindings is None or not hasattr(_nixl.bindings, "nixlRemoteDisconnectError"):
        pytest.skip("NIXL has no nixlRemoteDisconnectError")
    agent = rig.tx._agent
    real_send = agent.send_notif
    calls = [0]

    def flaky(name: Any, msg: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            raise nixl_error("nixlRemoteDisconnectError")
        return real_send(name, msg)

    agent.send_notif = flaky
    try:
        with pytest.raises(Exception, match="DISCONNECT"):
            rig.tx.send_notif(A, b"hello")
        assert rig.tx.peer_disconnected(A)
        t = rig.tx.write_pages(A, [1], [1])
        t.wait(10.0)
        t.release()
        assert not rig.tx.peer_disconnected(A)
        rig.tx.send_notif(A, b"hello again")
    finally:
        agent.send_notif = real_send


# ----------------- suspicion: a long poll_interval_s never outlasts close()'s join time


@pytest.mark.timeout(60)
def test_s_long_poll_interval_does_not_fail_close(rig: Rig) -> None:
    """``poll_interval_s=20`` (legal: below ``transfer_timeout_s``): the worker pauses 20 s
    between polls of its in-flight chunk. ``close(timeout_s=1)`` abandons the chunk; on
    3a76f2e the worker was still asleep when close() stopped joining ("transfer workers did
    not stop"); now close() wakes it."""
    tx = HeldTransport(rig.tx)
    mgr = KVManager(tx, rig.kv, num_workers=1, poll_interval_s=20.0,  # type: ignore[arg-type]
                    transfer_timeout_s=30.0)
    s = one_session_sender(mgr, 1, [0, 1])
    s.send([5, 6])
    assert wait_until(lambda: tx.polls >= 1, 10.0)  # the worker polled it: now it pauses
    try:
        mgr.close(timeout_s=1.0)
    finally:
        tx.go.set()
        for w in mgr._workers:
            w.join(30)
    assert mgr.stats().transfers_abandoned == 1


# ------------- suspicion: a chunk wholly inside the decode prefix counts as prefetched


@pytest.mark.timeout(30)
@pytest.mark.parametrize("workers", [0, 1])
def test_s_room_with_a_chunk_inside_the_decode_prefix_is_marked_prefetched(
    rig: Rig, workers: int
) -> None:
    """With a pool, a room whose first chunk lies wholly inside the decode prefix (nothing
    to stage) is still marked prefetched once its other chunks are. On 3a76f2e it never
    was (the chunk was never counted toward the room's prefetches)."""
    pool = rig.with_pool(2, 4)
    with KVManager(rig.tx, rig.kv, num_workers=workers, staging_pool=pool) as mgr:
        s = one_session_sender(mgr, 1, [0, 1, 2, 3], decode_prefix_len=2)
        s.send([10, 11])  # all in the prefix
        s.send([12, 13])
        assert conclude(s, 10.0) is KVPoll.Success
        assert 1 in mgr.staging.prefetched_rooms
        s.clear()


# ------------- concurrency check: listener counts equal stats() under racing clears


@pytest.mark.timeout(180)
def test_listener_counts_equal_stats_with_clears_racing_sends(rig: Rig) -> None:
    """The contract's sentence (docs/METRICS.md): every chunk end reaches the listener once,
    so at a quiescent point its counts by outcome equal ``stats()``. A scheduler thread
    sends 4 one-page chunks to each of 24 two-session rooms while a second thread clears
    the rooms in a random order (switch interval 1 µs), two workers and one staging slot
    with a short slot timeout: chunks end done, skipped (before the worker, at the fence,
    after the slot wait), failed (no slot) and drained, in whatever interleaving the run
    gets. Seeded (printed) for replay of the clear order."""
    import random
    import sys

    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    pool = rig.with_pool(1, 1)  # two workers contend for it: some chunks get no slot
    rec = Recorder()
    rooms = 24
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    errors: list[BaseException] = []
    try:
        with KVManager(rig.tx, rig.kv, num_workers=2, staging_pool=pool, events=rec,
                       slot_timeout_s=0.002) as mgr:
            senders = [two_session_sender(mgr, r, 4) for r in range(rooms)]
            order = list(range(rooms))
            rng.shuffle(order)
            pauses = [rng.randrange(3) for _ in order]
            started = threading.Event()

            def scheduler() -> None:
                try:
                    started.set()
                    for page in range(4):
                        for s in senders:
                            s.send([page])
                except BaseException as exc:
                    errors.append(exc)

            def clearer() -> None:
                try:
                    assert started.wait(10)
                    for r, pause in zip(order, pauses, strict=True):
                        if pause:
                            time.sleep(0.003 * pause)
                        senders[r].clear()
                except BaseException as exc:
                    errors.append(exc)

            threads = [threading.Thread(target=f, daemon=True) for f in (scheduler, clearer)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert [t for t in threads if t.is_alive()] == []
            assert errors == []
            assert mgr.wait_drained(None, 30.0)
            # Queued units of purged rooms end (skipped) when a worker reaches them.
            assert wait_until(lambda: (lambda a, b: a == b)(*quiescent_sum(mgr)), 30.0)
            st = mgr.stats()
    finally:
        sys.setswitchinterval(old)
    want = {
        "done": st.chunks_done, "failed": st.chunks_failed,
        "skipped": st.chunks_skipped, "drained": st.chunks_drained,
    }
    assert dict(rec.chunks) == {k: v for k, v in want.items() if v}, f"seed {seed}: {want}"
    assert sum(rec.chunks.values()) == st.chunks_submitted
    print(f"seed {seed}: {want}")
