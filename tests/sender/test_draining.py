"""Draining (docs/THREADING.md, "Draining", "Hung chunks", "Removed peers"): when a failed or
cleared room's pages and staging slots may be reused, slot waits that give up only for hung
holders, and hung or kept writes that end once they settle."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from sender.errors import PeerNotFoundError
from sender.manager import KVManager, make_transfer_info
from sender.nixl_sender import NixlKVSender
from sender.poll import KVPoll
from staging.buffers import PoolExhaustedError, StagingBufferPool
from tests import polling
from tests.fixtures_nixl import PAGE_BYTES, SenderPool, requires_nixl
from tests.polling import conclude
from tests.sender._instant_transport import InstantTransport, _mem_manager
from tests.sender._real_wrappers import HeldTransport, SignallingPool
from tests.sender._sessions import SessionsRig, one_session_sender, two_session_sender
from tests.sender._stub_transport import (
    BOUND_S,
    STUB_PAGE_BYTES,
    StubTransport,
    _sender,
    _stub_manager,
    _stub_wait,
)

CONCLUDED = polling.CONCLUDED


# This file's polling cadences; tests/polling.py has the loops.
def wait_until_fast(cond: Callable[[], bool], timeout_s: float, interval_s: float = 0.002) -> bool:
    return polling.wait_until(cond, timeout_s, interval_s)


def conclude_fast(s: NixlKVSender, timeout_s: float) -> KVPoll:
    return polling.conclude(s, timeout_s, interval_s=0.0005)


SWEEP_S = 0.05  # sender.manager._HUNG_SWEEP_S


TRAFFIC_PERIODS = 200


@pytest.fixture
def staging_pool(sender_pool: SenderPool) -> Iterator[SignallingPool]:
    pool = SignallingPool(2, 1, PAGE_BYTES)
    sender_pool.transport.register_region("staging", pool.tensor, PAGE_BYTES)
    try:
        yield pool
    finally:
        pool.close()


def _manager(sp: SenderPool, **kw: Any) -> KVManager:
    return KVManager(sp.transport, sp.pool, **kw)


@pytest.mark.nixl
@requires_nixl
@pytest.mark.timeout(60)
def test_inline_pool_one_slot_two_sessions_succeeds(sessions_rig: SessionsRig) -> None:
    """Inline, one staging slot, a two-session room: the second session's chunk waits for
    the slot the first one holds; that write completes but only this thread could poll it.
    On 3a76f2e the send waits ``slot_timeout_s`` and fails the room "no staging slot"; now
    the waiting send ends the completed chunk and takes its slot.

    Found by the audit of issue 25 (section 1, defect 1, at 3a76f2e).
    """
    pool = sessions_rig.with_pool(1, 4)
    tx = HeldTransport(sessions_rig.tx, held=False)  # never "done at post": polled, as in flight
    # slot_timeout_s bounds the old code's stall; the fixed code needs one poll of a done
    # write (well under it even at load 8+).
    with KVManager(
        tx,
        sessions_rig.kv,
        num_workers=0,
        staging_pool=pool,  # type: ignore[arg-type]
        slot_timeout_s=5.0,
    ) as mgr:
        for room in range(3):  # and again: no slot is lost
            s = two_session_sender(mgr, room, 4)
            s.send([10, 11, 12, 13])
            assert conclude(s, 20.0) is KVPoll.Success, mgr.failure_records
            assert torch.equal(sessions_rig.dst[0:4], sessions_rig.kv[10:14])
            assert torch.equal(sessions_rig.dst[4:8], sessions_rig.kv[10:14])
            s.clear()
        st = mgr.stats()
        assert st.rooms_failed == 0 and st.chunks_done == 6
        assert pool.stats().in_use == 0


@pytest.mark.nixl
@requires_nixl
@pytest.mark.timeout(60)
def test_inline_scheduler_step_with_fewer_slots_than_chunks(sessions_rig: SessionsRig) -> None:
    """An ordinary scheduler step: send to every room, then poll them; 2 slots, 4 rooms.

    Found by the audit of issue 25 (section 1, defect 1, at 3a76f2e).
    """
    pool = sessions_rig.with_pool(2, 4)
    tx = HeldTransport(sessions_rig.tx, held=False)
    with KVManager(
        tx,
        sessions_rig.kv,
        num_workers=0,
        staging_pool=pool,  # type: ignore[arg-type]
        slot_timeout_s=5.0,
    ) as mgr:
        senders = [one_session_sender(mgr, r, [4 * r + i for i in range(4)]) for r in range(4)]
        for r, s in enumerate(senders):
            s.send([20 + 4 * r + i for i in range(4)])
        for s in senders:
            assert conclude(s, 20.0) is KVPoll.Success, mgr.failure_records
        for r in range(4):
            assert torch.equal(
                sessions_rig.dst[4 * r : 4 * r + 4], sessions_rig.kv[20 + 4 * r : 24 + 4 * r]
            )
        for s in senders:
            s.clear()
        assert mgr.stats().rooms_failed == 0


@pytest.mark.nixl
@requires_nixl
@pytest.mark.timeout(120)
@pytest.mark.parametrize("scheduler_polls", [True, False])
def test_settled_hung_chunk_ends_under_steady_traffic(
    sender_pool: SenderPool,
    staging_pool: SignallingPool,
    decode_peer: Any,
    peer_factory: Callable[..., Any],
    scheduler_polls: bool,
) -> None:
    """A chunk to a stopped peer passes its deadline (hung: room failed, chunk kept with its
    slot); the peer resumes and the write settles. While one worker is kept busy by steady
    traffic to a healthy peer, the hung chunk must still end (``draining`` 0, slot back).
    At 668dd63 only an idle worker swept hung chunks: under traffic it stayed draining. The
    traffic's schedulers either poll their rooms (``poll()``, which sweeps too) or only read
    their status (``handle_status``): then the busy worker's own sweep must come.

    Found by the audit of issue 16, under load (defect 1, at 668dd63).
    """
    tx = sender_pool.transport
    hung_peer = peer_factory()
    tx.add_peer("hung", hung_peer.metadata)
    tx.add_peer("live", decode_peer.metadata())
    with KVManager(
        tx,
        sender_pool.pool,
        num_workers=1,
        staging_pool=staging_pool,
        transfer_timeout_s=0.3,
        fail_session_on_disconnect=False,
    ) as mgr:
        warm = NixlKVSender(mgr, 1, ["hung"], [make_transfer_info("hung", [0])])
        warm.init(1)
        warm.send([5])
        assert conclude_fast(warm, 30) is KVPoll.Success  # the connection to it is up
        warm.clear()
        hung_peer.stop()
        doomed = NixlKVSender(mgr, 2, ["hung"], [make_transfer_info("hung", [1])])
        doomed.init(1)
        doomed.send([6])
        assert conclude_fast(doomed, 30) is KVPoll.Failed  # its deadline passed
        doomed.clear()
        assert mgr.draining(doomed.handle) == 1, "the hung chunk must keep its slot"
        assert staging_pool.stats().in_use == 1

        stop = threading.Event()
        rooms_done = [0]
        errors: list[BaseException] = []

        def traffic(k: int) -> None:
            # Two feeders with 4 rooms in flight each: the one worker's queue never empties.
            room = 1000 * (k + 1)
            try:
                while not stop.is_set():
                    batch = []
                    for _ in range(4):
                        room += 1
                        info = make_transfer_info("live", [64 * k + room % 64])
                        s = NixlKVSender(mgr, room, ["live"], [info])
                        s.init(1)
                        s.send([room % 200])
                        batch.append(s)
                    for s in batch:
                        if scheduler_polls:
                            conclude_fast(s, 30)
                        else:
                            wait_until_fast(
                                lambda s=s: mgr.handle_status(s.handle) in CONCLUDED, 30, 0.0005
                            )
                        s.clear()
                        rooms_done[0] += 1
            except BaseException as exc:
                errors.append(exc)

        feeders = [
            threading.Thread(target=traffic, args=(k,), name=f"test-traffic-{k}", daemon=True)
            for k in range(2)
        ]
        for feeder in feeders:
            feeder.start()
        try:
            assert wait_until_fast(lambda: rooms_done[0] >= 8, 60), "no steady traffic"
            hung_peer.cont()  # the write can land now; NIXL reports it done when polled
            drained = wait_until_fast(
                lambda: mgr.draining(doomed.handle) == 0, TRAFFIC_PERIODS * SWEEP_S
            )
            busy = all(f.is_alive() for f in feeders) and not errors
        finally:
            stop.set()
            for feeder in feeders:
                feeder.join(60)
        assert not any(f.is_alive() for f in feeders), "a traffic thread did not stop"
        assert errors == [], errors
        assert busy, "the traffic stopped: the check would not be under load"
        assert drained, (
            f"the settled hung chunk was not ended within {TRAFFIC_PERIODS} sweep periods of "
            f"steady traffic ({rooms_done[0]} rooms went by)"
        )
        assert wait_until_fast(lambda: staging_pool.stats().in_use == 0, 10)


@pytest.mark.nixl
@requires_nixl
@pytest.mark.timeout(60)
def test_huge_slot_timeout_waits_instead_of_failing(
    sender_pool: SenderPool, staging_pool: SignallingPool, decode_peer: Any
) -> None:
    """``slot_timeout_s=1e10``: a chunk that finds no free slot waits for one. At 668dd63
    ``Condition.wait(1e10)`` raised OverflowError inside the worker: the room failed as an
    internal error.

    Found by the audit of issue 16, under load (defect 2, at 668dd63).
    """
    tx = sender_pool.transport
    tx.add_peer("live", decode_peer.metadata())
    held = [staging_pool.acquire("test", timeout=1.0), staging_pool.acquire("test", timeout=1.0)]
    with _manager(
        sender_pool, num_workers=1, staging_pool=staging_pool, slot_timeout_s=1e10
    ) as mgr:
        s = NixlKVSender(mgr, 1, ["live"], [make_transfer_info("live", [3])])
        s.init(1)
        s.send([9])
        assert staging_pool.waiting.wait(10), "the worker never waited for a slot"
        # The old code failed the room within microseconds of starting to wait.
        wait_until_fast(lambda: mgr.stats().worker_errors > 0, 0.5)
        assert mgr.stats().worker_errors == 0
        assert s.poll() is KVPoll.Transferring
        for slot in held:
            staging_pool.release(slot)
        assert conclude_fast(s, 30) is KVPoll.Success
        assert mgr.stats().worker_errors == 0
        s.clear()


@pytest.mark.parametrize("slot_timeout_s", [0.0, 60.0])
def test_inline_slot_wait_checks_for_hung_holders_before_it_waits(
    slot_timeout_s: float,
) -> None:
    """THREADING.md, Draining (and the ``send`` row): "a chunk waiting for a staging slot
    gives up as soon as every slot is leased to a hung chunk (checked between the wait's
    50 ms pieces, and inline also before it)". Inline, the only slot is held by room 1's
    chunk, hung (past its deadline, NIXL still has it). Room 2's ``send`` must fail its room
    with ``SlotsHeldByHungError`` (a ``PoolExhaustedError``), at once: with
    ``slot_timeout_s=0`` there is no wait to check in, so only the check before it can name
    the cause; with 60 s the send must not wait it out. The hung chunk keeps its slot.

    Found by issue 33, item 0 (sentence (a): planted bugs an outside set got past).
    """
    from sender.pipeline import SlotsHeldByHungError

    transport = StubTransport()
    pool = StagingBufferPool(1, 4, STUB_PAGE_BYTES)
    mgr = _stub_manager(transport, staging_pool=pool, slot_timeout_s=slot_timeout_s,
                   fail_session_on_disconnect=False, notify_decode=False)  # fmt: skip
    try:
        holder = _sender(mgr, 1)
        holder.send(np.array([3]))
        assert len(transport.transfers) == 1 and pool.stats().in_use == 1
        transport.transfers[0].hang()
        assert holder.poll() is KVPoll.Failed, "the hung chunk did not fail its room"
        assert pool.stats().in_use == 1, "the hung chunk gave its slot back before it settled"
        exhausted = pool.stats().exhausted

        late = _sender(mgr, 2)
        began = time.monotonic()
        late.send(np.array([4]))
        took = time.monotonic() - began
        assert late.poll() is KVPoll.Failed, f"room 2 is {late.poll()!r}: {mgr.stats()}"
        exc = mgr.exceptions.get(2)
        assert isinstance(exc, SlotsHeldByHungError), (
            f"room 2 failed with {exc!r}, not SlotsHeldByHungError: the slot wait did not "
            "check for hung holders before it waited"
        )
        assert isinstance(exc, PoolExhaustedError)
        by_code = dict(mgr.stats().rooms_failed_by_code)  # its peer hangs: not an internal error
        assert by_code == {"timeout": 1, "peer-failed": 1}, by_code
        assert took < BOUND_S, f"the send waited {took:.1f} s for a slot only a hung chunk holds"
        assert pool.stats().exhausted == exhausted, "the slot wait timed out instead"
        assert pool.stats().in_use == 1, "giving up freed the hung chunk's slot"
        assert len(transport.transfers) == 1, "room 2's chunk was posted"
        for s in (holder, late):
            s.clear()
        transport.transfers[0].land()
        assert mgr.wait_drained(None, BOUND_S), "the settled hung chunk never ended"
        assert pool.stats().in_use == 0
    finally:
        mgr.close(1.0)
        pool.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 2])
def test_a_write_kept_at_remove_peer_fails_its_room_not_its_session(workers: int) -> None:
    """THREADING.md, Removed peers: a write ``remove_peer`` kept (its polls raise
    ``PeerNotFoundError`` while NIXL still has it) fails its room at once, "its session is
    not failed: the id may already name a new peer". ``fail_session_on_disconnect=True``
    (the default): a deadline would fail the session, a removal must not. Room 1's write is
    kept; room 2 already writes to the same session id (the new peer), and room 3 opens on it
    after room 1 failed. With workers, both writes are polled by worker threads at once.

    Found by issue 33, item 0 (sentence (b): planted bugs an outside set got past).
    """
    transport = StubTransport()
    mgr = _stub_manager(transport, num_workers=workers, notify_decode=False)
    try:
        old = _sender(mgr, 1)
        old.send(np.array([3]))
        new = _sender(mgr, 2)
        new.send(np.array([4]))
        assert _stub_wait(lambda: len(transport.transfers) == 2)
        kept = next(t for t in transport.transfers if t.notif and t.notif.startswith(b"room=1;"))
        fresh = next(t for t in transport.transfers if t is not kept)
        kept.keep_at_removal()
        if workers:
            assert _stub_wait(lambda: old.poll() is KVPoll.Failed), (
                "the kept write's room never failed"
            )
        else:
            assert old.poll() is KVPoll.Failed, "the kept write did not fail its room at once"
        assert isinstance(mgr.exceptions.get(1), PeerNotFoundError), mgr.exceptions.get(1)
        assert new.poll() is KVPoll.Transferring, (
            f"room 2 of the same session id is {new.poll()!r}: the kept write failed its "
            f"session ({mgr.failure_records.get(2)!r})"
        )
        assert mgr.stats().sessions_failed == 0, mgr.stats()
        later = _sender(mgr, 3)
        later.send(np.array([5]))
        assert _stub_wait(lambda: len(transport.transfers) == 3), "room 3's write was not posted"
        fresh.land()
        transport.transfers[2].land()
        assert _stub_wait(lambda: new.poll() is KVPoll.Success), f"room 2: {new.poll()!r}"
        assert _stub_wait(lambda: later.poll() is KVPoll.Success), f"room 3: {later.poll()!r}"
        old.clear()
        assert mgr.draining(old.handle) == 1, "the kept write stopped draining before it settled"
        kept.land()
        assert mgr.wait_drained(old.handle, BOUND_S)
    finally:
        mgr.close(1.0)


@pytest.mark.timeout(120)
def test_progress_ends_a_purged_rooms_draining_chunk() -> None:
    """Found by issue 23, section 3 (planted bugs an outside set got past)."""
    tx = InstantTransport(states=["PROC"])
    mgr = _mem_manager(tx)
    try:
        a = NixlKVSender(mgr, 5, ["d0"], [make_transfer_info("d0", range(4))])
        b = NixlKVSender(mgr, 6, ["d0"], [make_transfer_info("d0", range(4))])
        a.init(4)
        a.send(np.array([0, 1, 2, 3]))  # one chunk in flight (its write still PROC)
        a.clear()  # purged: the chunk drains
        assert mgr.draining() == 1
        tx.transfers[0].state = "DONE"  # the write lands
        mgr.progress(b.handle)  # another room's scheduler step
        assert mgr.draining() == 0, "progress() left a purged room's landed chunk draining"
        assert tx.transfers[0].raw_releases == 1
        assert mgr.stats().transfers_draining == 0
    finally:
        mgr.close(0)
