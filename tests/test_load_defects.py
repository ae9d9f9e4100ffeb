"""Regression tests for the three defects of issue 16 (an audit of 668dd63, under load) and
the smaller faults seen beside them.

Each defect test fails on 668dd63 for the defect's own reason:

1. a hung chunk whose write has settled is never ended while the manager is busy (its slot
   and ``draining`` stay held under steady traffic);
2. bad timeouts are accepted at the entry point and break later (``close(inf)``,
   ``close(1e12)``, ``slot_timeout_s=1e10``, ``poll_interval_s=1e10``);
3. repeated destination pages are refused or silently accepted depending on chunking.

Real parts only: real NIXL agents over UCX, a decode peer *process* that is really stopped
(SIGSTOP) to hang a write, and an in-process decode peer for steady traffic.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from sender.errors import TransportClosedError
from sender.manager import KVManager, TransferInfo, make_transfer_info
from sender.nixl_sender import NixlKVSender
from sender.poll import KVPoll
from staging.buffers import StagingBufferPool
from tests import polling
from tests.fixtures_nixl import PAGE_BYTES, SenderPool, requires_nixl

pytestmark = [pytest.mark.nixl, requires_nixl]

CONCLUDED = polling.CONCLUDED


# This file's polling cadences; tests/polling.py has the loops.
def wait_until(cond: Callable[[], bool], timeout_s: float, interval_s: float = 0.002) -> bool:
    return polling.wait_until(cond, timeout_s, interval_s)


def conclude(s: NixlKVSender, timeout_s: float) -> KVPoll:
    return polling.conclude(s, timeout_s, interval_s=0.0005)


SWEEP_S = 0.05  # sender.manager._HUNG_SWEEP_S
TRAFFIC_PERIODS = 200
"""Defect 1: how many sweep periods of steady traffic a settled hung chunk may take to end.
The fix ends it at the first sweep due after it settled (one period, plus a job's time); the
bound is 200 periods so that a loaded machine (a worker descheduled for seconds) cannot miss
it, while the old code, which never sweeps while busy, fails it every time."""





def threads_named(prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(prefix) and t.is_alive()]


class SignallingPool(StagingBufferPool):
    """A real staging pool that sets ``waiting`` when a lease finds no free slot (a worker
    then parks its chunk and tries again; an inline send waits in ``acquire``)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.waiting = threading.Event()

    def try_acquire(self, owner: Any, **kw: Any) -> Any:
        slot = super().try_acquire(owner, **kw)
        if slot is None:
            self.waiting.set()
        return slot


@pytest.fixture
def staging_pool(sender_pool: SenderPool) -> Iterator[SignallingPool]:
    pool = SignallingPool(2, 1, PAGE_BYTES)
    sender_pool.transport.register_region("staging", pool.tensor, PAGE_BYTES)
    try:
        yield pool
    finally:
        pool.close()


# ------------------------------------------------ defect 1: hung chunks under steady traffic


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scheduler_polls", [True, False])
def test_d1_settled_hung_chunk_ends_under_steady_traffic(
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
    their status (``handle_status``): then the busy worker's own sweep must come."""
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
        assert conclude(warm, 30) is KVPoll.Success  # the connection to it is up
        warm.clear()
        hung_peer.stop()
        doomed = NixlKVSender(mgr, 2, ["hung"], [make_transfer_info("hung", [1])])
        doomed.init(1)
        doomed.send([6])
        assert conclude(doomed, 30) is KVPoll.Failed  # its deadline passed
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
                            conclude(s, 30)
                        else:
                            wait_until(
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
            assert wait_until(lambda: rooms_done[0] >= 8, 60), "no steady traffic"
            hung_peer.cont()  # the write can land now; NIXL reports it done when polled
            drained = wait_until(
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
        assert wait_until(lambda: staging_pool.stats().in_use == 0, 10)


# -------------------------------------------------------- defect 2: bad timeouts


def _manager(sp: SenderPool, **kw: Any) -> KVManager:
    return KVManager(sp.transport, sp.pool, **kw)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("timeout_s", [math.inf, 1e12])
def test_d2_close_with_a_huge_timeout_closes(sender_pool: SenderPool, timeout_s: float) -> None:
    """``close(inf)`` / ``close(1e12)`` close as asked. At 668dd63 they raised (ValueError
    from wait_drained, OverflowError from join) after purging every room and queueing the
    stop sentinels: workers and notifier were left running."""
    mgr = _manager(sender_pool, num_workers=2)
    handle = mgr.open_room(7, ["d0"])
    mgr.close(timeout_s)
    assert not mgr.is_open(handle)
    assert all(not w.is_alive() for w in mgr._workers)
    assert mgr.notifier.thread is None or not mgr.notifier.thread.is_alive()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("timeout_s", "exc"), [(-1.0, ValueError), (math.nan, ValueError), ("1", TypeError)]
)
def test_d2_bad_close_timeout_changes_nothing(
    sender_pool: SenderPool, timeout_s: Any, exc: type[Exception]
) -> None:
    """A bad ``close`` timeout raises before anything changes: rooms stay open, workers run."""
    mgr = _manager(sender_pool, num_workers=1)
    try:
        handle = mgr.open_room(7, ["d0"])
        with pytest.raises(exc):
            mgr.close(timeout_s)
        assert mgr.is_open(handle)
        assert all(w.is_alive() for w in mgr._workers)
        mgr.open_room(8, ["d0"])  # not closing
    finally:
        mgr.close()


@pytest.mark.timeout(60)
def test_d2_huge_slot_timeout_waits_instead_of_failing(
    sender_pool: SenderPool, staging_pool: SignallingPool, decode_peer: Any
) -> None:
    """``slot_timeout_s=1e10``: a chunk that finds no free slot waits for one. At 668dd63
    ``Condition.wait(1e10)`` raised OverflowError inside the worker: the room failed as an
    internal error."""
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
        wait_until(lambda: mgr.stats().worker_errors > 0, 0.5)
        assert mgr.stats().worker_errors == 0
        assert s.poll() is KVPoll.Transferring
        for slot in held:
            staging_pool.release(slot)
        assert conclude(s, 30) is KVPoll.Success
        assert mgr.stats().worker_errors == 0
        s.clear()


@pytest.mark.timeout(60)
def test_d2_poll_interval_past_the_deadline_is_refused(sender_pool: SenderPool) -> None:
    """``poll_interval_s=1e10`` is refused by the constructor, before any thread starts. At
    668dd63 it was accepted; ``time.sleep(1e10)`` then overflowed in a worker, which
    abandoned its posted chunk."""
    before = len(threads_named("kv-"))
    with pytest.raises(ValueError, match="poll_interval_s"):
        _manager(sender_pool, num_workers=1, poll_interval_s=1e10, transfer_timeout_s=30)
    assert len(threads_named("kv-")) == before
    _manager(sender_pool, num_workers=0, poll_interval_s=30.0, transfer_timeout_s=30).close()


# ------------------------------------------------ defect 3: repeated destination pages


@pytest.mark.parametrize(
    "pages", [[5, 6, 5, 7], [5, 5], [9, 1, 4, 1], np.array([3, 2, 3], dtype=np.int32)]
)
def test_d3_repeated_destination_pages_are_refused(pages: Any) -> None:
    """A repeat anywhere in a session's destination pages is a ValueError when the info is
    made, whatever the chunking later. At 668dd63 ``make_transfer_info`` accepted it: sent
    in two chunks, the room reported Success with decode page 5 holding the wrong page."""
    with pytest.raises(ValueError, match="repeats page"):
        make_transfer_info("d", pages)


def test_d3_unaddressable_destination_page_is_refused() -> None:
    with pytest.raises(ValueError, match="2\\*\\*31"):
        make_transfer_info("d", [1, 2**31])


@pytest.mark.timeout(60)
def test_d3_a_built_info_with_repeats_is_refused_and_changes_nothing(
    sender_pool: SenderPool,
) -> None:
    """An info built directly (bypassing ``make_transfer_info``) is checked when added: a
    repeat is a ValueError and the room is unchanged."""
    with _manager(sender_pool, num_workers=0) as mgr:
        handle = mgr.open_room(3, ["d"])
        arr = np.array([5, 6, 5, 7], dtype=np.int64)
        with pytest.raises(ValueError, match="repeats page"):
            mgr.add_transfer_info(handle, TransferInfo("d", arr))
        assert mgr.status(3) is KVPoll.Bootstrapping
        assert 3 not in mgr.transfer_infos


@pytest.mark.timeout(60)
def test_d3_two_chunks_never_write_one_decode_page_twice(
    sender_pool: SenderPool, decode_peer: Any
) -> None:
    """The audit's reproduction: ``[5, 6, 5, 7]`` in two chunks. It cannot get past the
    info any more; the same room with distinct pages lands byte-exact."""
    tx = sender_pool.transport
    tx.add_peer("d", decode_peer.metadata())
    with pytest.raises(ValueError):
        make_transfer_info("d", [5, 6, 5, 7])
    with _manager(sender_pool, num_workers=0) as mgr:
        s = NixlKVSender(mgr, 4, ["d"], [make_transfer_info("d", [5, 6, 8, 7])])
        s.init(4)
        s.send([0, 1])
        s.send([2, 3])
        assert conclude(s, 30) is KVPoll.Success
        assert decode_peer.read_pages([5, 6, 8, 7]) == sender_pool.page_bytes_of([0, 1, 2, 3])
        s.clear()


# ------------------------------------------------------------- seen beside the defects


@pytest.mark.timeout(60)
def test_write_pages_racing_close_raises_transport_closed(
    sender_pool: SenderPool, decode_peer: Any
) -> None:
    """``close()`` running between ``write_pages``' lock-free look-ups: the write is refused
    as a closed transport, never as a missing region or peer. The interleaving is forced: the
    region table's ``get`` runs ``close()`` (on the writer's thread, which holds no lock
    there) before answering. At 668dd63 this raised ``TransportParamError("no local
    region")``."""
    tx = sender_pool.transport
    tx.add_peer("d", decode_peer.metadata())

    class ClosingDict(dict):  # type: ignore[type-arg]
        def get(self, key: Any, default: Any = None) -> Any:
            tx.close()
            return super().get(key, default)

    tx._regions = ClosingDict(tx._regions)
    with pytest.raises(TransportClosedError):
        tx.write_pages("d", [0], [0])
    assert tx.stats().live_transfers == 0


@pytest.mark.timeout(120)
def test_write_pages_racing_close_only_ever_raises_transport_closed(
    sender_pool: SenderPool, decode_peer: Any
) -> None:
    """The same race left to the scheduler (switch interval 1e-6, 4 writers, close at a
    random moment, 20 rounds): every write either returns a transfer that close() releases
    or raises ``TransportClosedError``; nothing is left live."""
    import random
    import sys

    from tests.fixtures_nixl import make_sender_pool

    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    tx0 = sender_pool.transport
    tx0.close()
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(20):
            sp = make_sender_pool(64)
            tx = sp.transport
            tx.add_peer("d", decode_peer.metadata())
            wrong: list[BaseException] = []
            got: list[Any] = []
            start = threading.Barrier(5)

            def writer(
                tx: Any = tx,
                got: list[Any] = got,
                wrong: list[BaseException] = wrong,
                start: threading.Barrier = start,
            ) -> None:
                start.wait(10)
                for i in range(200):
                    try:
                        got.append(tx.write_pages("d", [i % 64], [i % 64]))
                    except TransportClosedError:
                        return
                    except BaseException as exc:
                        wrong.append(exc)
                        return

            threads = [threading.Thread(target=writer, daemon=True) for _ in range(4)]
            for t in threads:
                t.start()
            start.wait(10)
            time.sleep(rng.random() * 0.002)
            tx.close()
            for t in threads:
                t.join(30)
            assert not any(t.is_alive() for t in threads)
            assert wrong == [], f"seed {seed}: {wrong[:3]}"
            assert tx.stats().live_transfers == 0
            assert all(x.released for x in got)
    finally:
        sys.setswitchinterval(old)


class _SlowReleaseTransport:
    """A real transport whose transfers' ``release()`` blocks ``hold_s`` once ``armed``."""

    def __init__(self, inner: Any, hold_s: float) -> None:
        self.inner = inner
        self.hold_s = hold_s
        self.armed = threading.Event()
        self.releasing = threading.Event()

    def write_pages(self, *args: Any, **kw: Any) -> Any:
        outer = self
        real = self.inner.write_pages(*args, **kw)

        class Slow:
            def poll(self) -> str:
                return "PROC" if not outer.armed.is_set() else str(real.poll())

            def settled(self) -> bool:
                return bool(real.settled())

            def release(self) -> None:
                if outer.armed.is_set():
                    outer.releasing.set()
                    time.sleep(outer.hold_s)
                real.release()

        return Slow()

    def send_notif(self, session_id: str, message: bytes) -> None:
        self.inner.send_notif(session_id, message)


@pytest.mark.timeout(60)
def test_close_does_not_withhold_the_notice_of_a_chunk_ending_elsewhere(
    sender_pool: SenderPool, decode_peer: Any
) -> None:
    """A purged room's last chunk is being ended by its worker (claimed, its release slow)
    when ``close()``'s timeout expires: nothing was abandoned, so the room's notice must be
    sent, not counted as withheld. At 668dd63 close() counted it withheld and the worker,
    finishing later, found no notice to queue."""
    tx = sender_pool.transport
    tx.add_peer("d", decode_peer.metadata())
    slow = _SlowReleaseTransport(tx, hold_s=0.2)
    mgr = KVManager(slow, sender_pool.pool, num_workers=1)  # type: ignore[arg-type]
    s = NixlKVSender(mgr, 5, ["d"], [make_transfer_info("d", [0])])
    s.init(1)
    s.send([1])
    assert wait_until(lambda: mgr.stats().transfers_inflight == 1, 10)
    s.clear()  # the chunk drains; the notice waits for it
    slow.armed.set()  # the worker sees DONE now and ends the chunk, slowly
    assert slow.releasing.wait(10)
    # The engine's shutdown thread closes the manager while the worker is in that release.
    import sys

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        closer = threading.Thread(target=mgr.close, kwargs={"timeout_s": 0.01}, daemon=True)
        closer.start()
        closer.join(30)
    finally:
        sys.setswitchinterval(old)
    assert not closer.is_alive()
    st = mgr.stats()
    assert st.transfers_abandoned == 0
    assert st.notices_withheld == 0, "a notice was withheld although nothing was abandoned"
    assert wait_until(lambda: mgr.stats().notices_sent == 1, 10)
    assert decode_peer.wait_room_failed(5, s.handle.generation, 10) is not None
