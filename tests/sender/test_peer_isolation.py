"""Peer isolation (THREADING.md, "Peer isolation"): a hung or removed decode peer costs only
its own rooms and its own share of the sender's resources.

Every check here is bounded by progress, not by the clock: the hung peer is a real decode
process stopped with SIGSTOP (NIXL keeps its writes in progress for as long as it stays
stopped), and the transfer deadline is far past each check's bound, so nothing but the
sender's own design can make a healthy peer's room wait for the hung one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from sender.manager import KVManager, make_transfer_info
from sender.nixl_sender import NixlKVSender
from sender.poll import KVPoll
from staging.buffers import StagingBufferPool
from tests.fixtures_nixl import PAGE_BYTES, SenderPool, requires_nixl
from tests.polling import conclude, wait_until

pytestmark = [requires_nixl, pytest.mark.nixl]

DEADLINE_S = 600.0
"""The transfer deadline: far past every bound below, so no chunk of the hung peer ends by
its deadline while a check runs."""

BOUND_S = 60.0
"""How long a healthy room may take here: a progress bound (a loaded machine concludes a
one-page room in milliseconds); a sender that waits on the hung peer's chunks would wait
:data:`DEADLINE_S`."""


def _room(mgr: KVManager, room: int, session: str, src: int, dst: int) -> NixlKVSender:
    s = NixlKVSender(mgr, room, [session], [make_transfer_info(session, [dst])])
    s.init(1)
    s.send([src])
    return s


def _succeeds(mgr: KVManager, room: int, session: str, src: int, dst: int) -> None:
    s = _room(mgr, room, session, src, dst)
    assert conclude(s, BOUND_S) is KVPoll.Success, (room, mgr.exceptions.get(room))
    s.clear()


@contextmanager
def _two_peers(
    sender_pool: SenderPool,
    peer_factory: Callable[..., Any],
    num_workers: int,
    pool: StagingBufferPool | None,
    **kw: Any,
) -> Iterator[tuple[KVManager, Any, Any]]:
    """A manager with two warm decode peers: ``"hung"`` (to be stopped) and ``"ok"``."""
    hung, ok = peer_factory(), peer_factory()
    tx = sender_pool.transport
    tx.add_peer("hung", hung.metadata)
    tx.add_peer("ok", ok.metadata)
    if pool is not None:
        tx.register_region("staging", pool.tensor, PAGE_BYTES)
    mgr = KVManager(
        tx,
        sender_pool.pool,
        num_workers=num_workers,
        staging_pool=pool,
        transfer_timeout_s=DEADLINE_S,
        **kw,
    )
    try:
        _succeeds(mgr, 1, "hung", 1, 1)  # each first write sets up its connection
        _succeeds(mgr, 2, "ok", 2, 2)
        yield mgr, hung, ok
    finally:
        hung.cont()
        mgr.close()
        if pool is not None:
            pool.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("num_workers", [1, 4])
def test_workers_do_not_wait_on_a_hung_peers_chunks(
    sender_pool: SenderPool, peer_factory: Callable[..., Any], num_workers: int
) -> None:
    """Finding 1 of issue 33: with ``num_workers`` chunks in flight to a stopped peer, a
    room to a healthy peer concludes while they are still in flight. Fails on ff9b06c,
    where each worker polled its own chunk until it ended (here: its 600 s deadline)."""
    with _two_peers(sender_pool, peer_factory, num_workers, None) as (mgr, hung, ok):
        hung.stop()
        stuck = [_room(mgr, 10 + i, "hung", 10 + i, 10 + i) for i in range(num_workers)]
        assert wait_until(
            lambda: mgr.stats().transfers_inflight == num_workers, BOUND_S
        ), mgr.stats()
        for i in range(3):
            _succeeds(mgr, 20 + i, "ok", 20 + i, 20 + i)
        assert ok.page_digest([20, 21, 22]) == sender_pool.digests([20, 21, 22])
        assert all(s.poll() is KVPoll.Transferring for s in stuck)
        hung.cont()
        for s in stuck:
            assert conclude(s, BOUND_S) is KVPoll.Success, mgr.exceptions.get(s.handle.room)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("num_workers", [1, 4])
def test_a_hung_peer_holds_at_most_its_share_of_the_staging_slots(
    sender_pool: SenderPool, peer_factory: Callable[..., Any], num_workers: int
) -> None:
    """Finding 2 of issue 33: rooms to a stopped peer hold at most its cap of the pool's
    slots (``session_slots``, half the pool by default) and park the rest of their chunks
    without holding a worker, so rooms to a healthy peer get slots and succeed. Fails on
    ff9b06c, where the stopped peer's chunks held both slots and the healthy rooms waited
    for one (here up to ``slot_timeout_s``, 600 s)."""
    pool = StagingBufferPool(2, 1, PAGE_BYTES)
    with _two_peers(
        sender_pool, peer_factory, num_workers, pool, slot_timeout_s=DEADLINE_S
    ) as (mgr, hung, ok):
        hung.stop()
        stuck = [_room(mgr, 10 + i, "hung", 10 + i, 10 + i) for i in range(3)]
        assert wait_until(lambda: mgr.stats().transfers_inflight == 1, BOUND_S), mgr.stats()
        assert pool.group_slots("hung") == 1
        for i in range(3):
            _succeeds(mgr, 20 + i, "ok", 20 + i, 20 + i)
        assert ok.page_digest([20, 21, 22]) == sender_pool.digests([20, 21, 22])
        assert all(s.poll() is KVPoll.Transferring for s in stuck)
        assert mgr.stats().transfers_inflight == 1, "a parked chunk was posted past the cap"
        hung.cont()
        for s in stuck:
            assert conclude(s, BOUND_S) is KVPoll.Success, mgr.exceptions.get(s.handle.room)
        assert hung.page_digest([10, 11, 12]) == sender_pool.digests([10, 11, 12])


HELD_S = 1.0
"""How long a write held by a stopped peer is watched still draining. Not a bound a slow
machine can miss: while the peer is stopped NIXL cannot complete the write."""


@pytest.mark.timeout(240)
@pytest.mark.parametrize("path", ["deregister_region", "close"])
def test_the_drain_rule_holds_when_the_region_goes_or_the_manager_closes(
    sender_pool: SenderPool, peer_factory: Callable[..., Any], path: str
) -> None:
    """Findings 3 and 4 of issue 33 (THREADING.md, "Draining"): a purged room's pages may
    be reused once ``draining(handle) == 0``. The sender's ``deregister_region("kv")``, or
    ``close()`` past its timeout, while NIXL still has a write of the room in progress
    (its peer stopped) must not make ``draining`` say 0 or ``wait_drained`` True: the
    bytes land once the peer resumes. On ff9b06c both did (the write was released and its
    chunk ended at once); the bytes landed afterwards."""
    peer = peer_factory()
    tx = sender_pool.transport
    tx.add_peer("d", peer.metadata)
    mgr = KVManager(tx, sender_pool.pool, num_workers=1, transfer_timeout_s=DEADLINE_S)
    try:
        _succeeds(mgr, 1, "d", 1, 1)
        peer.stop()
        room = _room(mgr, 2, "d", 5, 9)
        assert wait_until(lambda: mgr.stats().transfers_inflight == 1, BOUND_S), mgr.stats()
        if path == "deregister_region":
            room.clear()
            assert tx.deregister_region("kv")
        else:
            mgr.close(timeout_s=0.0)
        assert mgr.draining(room.handle) == 1
        assert not mgr.wait_drained(room.handle, HELD_S), (
            f"after {path} the opening drained while NIXL still had its write"
        )
        assert mgr.draining(room.handle) == 1
        peer.cont()
        assert mgr.wait_drained(room.handle, BOUND_S), "the settled write never ended"
        assert peer.page_digest([9]) == sender_pool.digests([5])
        assert wait_until(lambda: tx.stats().live_transfers == 0, BOUND_S), tx.stats()
    finally:
        peer.cont()
        mgr.close()


@pytest.mark.timeout(240)
def test_remove_peer_gives_back_the_hung_peers_slots(
    sender_pool: SenderPool, peer_factory: Callable[..., Any]
) -> None:
    """Finding 2 of issue 33, second half: after ``remove_peer`` of a stopped peer, the slot
    its kept write holds is *retired* within one sweep: it no longer counts against the
    pool or the session's cap, a spare slot stands in for it (so the pool has all its
    usable slots again), and it is not leased to anyone while NIXL may still read it. Once
    the write settles, its memory becomes the spare again. On ff9b06c the slot stayed
    leased until the write settled ("A peer that never comes back keeps them")."""
    pool = StagingBufferPool(2, 1, PAGE_BYTES, spare_slots=1)
    with _two_peers(sender_pool, peer_factory, 2, pool) as (mgr, hung, _ok):
        hung.stop()
        stuck = _room(mgr, 10, "hung", 10, 10)
        assert wait_until(lambda: pool.stats().in_use == 1, BOUND_S), pool.stats()
        held = pool.stats()
        assert (held.free, held.retired, held.spare) == (1, 0, 1), held
        assert sender_pool.transport.remove_peer("hung")
        assert wait_until(lambda: pool.stats().retired == 1, BOUND_S), pool.stats()
        given_back = pool.stats()
        assert (given_back.free, given_back.in_use, given_back.spare) == (2, 0, 0), given_back
        assert pool.group_slots("hung") == 0
        assert conclude(stuck, BOUND_S) is KVPoll.Failed  # its room fails at once
        probes = [pool.try_acquire("probe"), pool.try_acquire("probe")]
        assert all(p is not None for p in probes), "the pool did not get its slots back"
        assert pool.try_acquire("probe") is None, "the retired slot was leased again"
        for p in probes:
            assert p is not None and pool.release(p)
        _succeeds(mgr, 20, "ok", 20, 20)
        stuck.clear()
        assert mgr.draining(stuck.handle) == 1  # the write is still NIXL's
        hung.cont()
        assert mgr.wait_drained(stuck.handle, BOUND_S), "the settled write never ended"
        assert hung.page_digest([10]) == sender_pool.digests([10])  # from the retired slot
        settled = pool.stats()
        assert (settled.free, settled.retired, settled.spare, settled.in_use) == (2, 0, 1, 0)


class _LeaseLog(StagingBufferPool):
    """A real pool that logs every lease it grants and refuses, and can hold one owner's
    next lease attempt until ``go`` is set (``entered`` says it is held)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.leases: list[Any] = []
        self.refused: list[Any] = []
        self.hold_owner: Any = None
        self.entered = threading.Event()
        self.go = threading.Event()

    def try_acquire(self, owner: Any, **kw: Any) -> Any:
        if owner == self.hold_owner:
            self.hold_owner = None
            self.entered.set()
            assert self.go.wait(BOUND_S)
        slot = super().try_acquire(owner, **kw)
        (self.refused if slot is None else self.leases).append(owner)
        return slot


@pytest.mark.timeout(240)
def test_a_parked_chunk_of_a_purged_room_never_leases_a_slot(
    sender_pool: SenderPool, peer_factory: Callable[..., Any]
) -> None:
    """The drain rule (THREADING.md, "Draining"): once a purge returned with
    ``draining(handle) == 0``, nothing of that opening is held again, so its decode pages may
    be reused at once. A unit waiting for a slot (queued behind a parked one) whose room is
    purged meanwhile must be skipped without ever leasing a slot for the purged opening: a
    lease would make ``draining`` rise again after the purge (two-hosts' no-early-reuse
    caught it: 'decode page handed to a new room while failed room still drains'). The one
    worker is held inside the parked room's retry while the other room is sent and purged
    and the slots come free, so the order does not depend on the machine."""
    pool = _LeaseLog(3, 1, PAGE_BYTES)
    with _two_peers(
        sender_pool, peer_factory, 1, pool, slot_timeout_s=DEADLINE_S, session_slots=3
    ) as (mgr, _hung, _ok):
        held = [pool.try_acquire("test") for _ in range(3)]  # no slot for anyone
        waiting = _room(mgr, 10, "ok", 10, 10)
        assert wait_until(lambda: waiting.handle in pool.refused, BOUND_S), "never parked"
        pool.hold_owner = waiting.handle
        assert pool.entered.wait(BOUND_S), "the parked unit was never retried"
        purged = _room(mgr, 11, "ok", 11, 11)  # queued: the one worker is held
        purged.clear()
        assert mgr.draining(purged.handle) == 0
        for slot in held:
            assert slot is not None and pool.release(slot)
        skipped = mgr.stats().chunks_skipped
        pool.go.set()
        assert conclude(waiting, BOUND_S) is KVPoll.Success
        assert wait_until(lambda: mgr.stats().chunks_skipped > skipped, BOUND_S), mgr.stats()
        assert purged.handle not in pool.leases, "a slot was leased for a purged opening"
        assert mgr.draining(purged.handle) == 0
