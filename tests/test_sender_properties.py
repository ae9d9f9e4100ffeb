"""Concurrency checks written against sentences of docs/THREADING.md, each judged by ground
truth kept beside the manager (a ledger of the writes it posted and released, the slot pool's
leases, the peer's pages), never by the manager's own bookkeeping:

* **Every chunk ends exactly once on every end path** -- the worker's poll, ``progress()``,
  ``wait_drained()``, a hung sweep, and ``close()``'s abandon path -- also when the write
  lands after ``close()`` gave it up: each posted transfer is released by the manager exactly
  once, and the chunk counters add up.
* **A hung chunk keeps its handle and slot until its transfer settles**: checked with a peer
  that is really stopped (SIGSTOP), so the write stays in progress for the whole window;
  observers poll the answers the manager gives while workers, sweeps and other rooms run.
* **Duplicate destination pages are refused on every path** (sorted, unsorted, slices,
  checked and plain lists; when the info is made, and per write): a property test.

Real parts: NIXL agents over UCX, a decode peer process; the ledger wraps the real transport.
"""

from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sender.errors import TransportParamError
from sender.manager import KVManager, make_transfer_info
from sender.nixl_sender import NixlKVSender
from sender.pages import CheckedPages
from sender.poll import KVPoll
from staging.buffers import StagingBufferPool
from stress.scenarios._sender_rig import TransferLedger, _room_of
from tests.fixtures_nixl import PAGE_BYTES, SenderPool, requires_nixl

pytestmark = [pytest.mark.nixl, requires_nixl]

SWEEP_S = 0.05


class LedgerTransport:
    """The real transport, each write kept in a :class:`TransferLedger` (releases counted)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.ledger = TransferLedger()

    def write_pages(self, *args: Any, **kw: Any) -> Any:
        xfer = self.inner.write_pages(*args, **kw)
        notif = args[3] if len(args) > 3 else kw.get("notif")
        room = _room_of(notif)
        assert room is not None
        return self.ledger.track(room, xfer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _wait(cond: Callable[[], bool], timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() >= end:
            return cond()
        time.sleep(0.002)
    return True


def _ended_once(mgr: KVManager) -> None:
    s = mgr.stats()
    ended = s.chunks_done + s.chunks_failed + s.chunks_skipped + s.chunks_drained
    assert ended == s.chunks_submitted, f"chunks not ended exactly once: {s}"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("workers", [0, 3])
def test_every_chunk_ends_once_on_every_end_path_including_close_abandon(
    sender_pool: SenderPool, peer_factory: Callable[..., Any], workers: int
) -> None:
    """Rounds of 12 rooms to a peer that is stopped, so every write stays in progress; the
    rooms are cleared, and ``close(timeout_s=0)`` races ``wait_drained`` and ``progress``
    from other threads (switch interval 1 µs) -- so each chunk's end is claimed by one of
    them, or abandoned; then the peer resumes and the abandoned writes land. Every transfer
    must have been released exactly once, and every chunk counted once."""
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    peer = peer_factory()
    tx = LedgerTransport(sender_pool.transport)
    sender_pool.transport.add_peer("d", peer.metadata)
    old = sys.getswitchinterval()
    try:
        for round_no in range(4):
            mgr = KVManager(tx, sender_pool.pool, num_workers=workers, transfer_timeout_s=30)  # type: ignore[arg-type]
            warm = NixlKVSender(mgr, 10_000 + round_no, ["d"], [make_transfer_info("d", [99])])
            warm.init(1)
            warm.send([0])
            assert _wait(lambda w=warm: w.poll() is KVPoll.Success, 30)
            warm.clear()
            peer.stop()
            senders = []
            for i in range(12):
                room = 100 * round_no + i
                s = NixlKVSender(mgr, room, ["d"], [make_transfer_info("d", [2 * i, 2 * i + 1])])
                s.init(2)
                s.send([2 * i, 2 * i + 1])
                senders.append(s)
            # Each worker polls the chunk it posted until it ends: `workers` are in flight,
            # the rest wait in the queue (and are skipped once their rooms are cleared).
            posted = 12 if workers == 0 else workers
            assert _wait(lambda m=mgr, n=posted: m.stats().transfers_inflight >= n, 30)
            for s in senders:
                s.clear()
            sys.setswitchinterval(1e-6)
            errors: list[BaseException] = []
            start = threading.Barrier(3)
            victim = senders[rng.randrange(12)].handle

            def guard(
                fn: Callable[[], Any],
                errors: list[BaseException] = errors,
                start: threading.Barrier = start,
            ) -> None:
                try:
                    start.wait(10)
                    fn()
                except BaseException as exc:
                    errors.append(exc)

            def progress_many(m: KVManager = mgr, h: Any = victim) -> None:
                for _ in range(50):
                    m.progress(h)

            pollers = [
                threading.Thread(target=guard, args=(lambda m=mgr: m.wait_drained(None, 0.01),)),
                threading.Thread(target=guard, args=(progress_many,)),
            ]
            for t in pollers:
                t.daemon = True
                t.start()
            start.wait(10)
            time.sleep(rng.random() * 0.002)
            try:
                mgr.close(timeout_s=0.0)
            finally:
                peer.cont()
            for t in pollers:
                t.join(30)
            sys.setswitchinterval(old)
            assert not any(t.is_alive() for t in pollers)
            assert errors == [], errors
            # The peer resumed above: the abandoned writes may land now.
            assert _wait(lambda: sender_pool.transport.stats().live_transfers == 0, 30)
            assert tx.ledger.double_released == [], tx.ledger.double_released
            for s in senders:
                assert tx.ledger.live_of(s.bootstrap_room) == 0, "a transfer never released"
            _ended_once(mgr)
            st_ = mgr.stats()
            assert st_.chunks_drained == posted, st_  # posted, then purged: each drained once
            assert st_.chunks_skipped == 12 - posted, st_  # queued, never posted
    finally:
        sys.setswitchinterval(old)


@pytest.mark.timeout(180)
def test_a_hung_chunk_keeps_its_transfer_and_slot_until_it_settles(
    sender_pool: SenderPool, peer_factory: Callable[..., Any], decode_peer: Any
) -> None:
    """A chunk to a stopped peer passes its deadline: its room fails, but as long as the peer
    stays stopped the write stays in progress, so the chunk must keep its transfer (not
    released) and its staging slot (leased) and count as draining once purged -- while two
    workers serve other rooms, sweeps run every 50 ms, and observer threads ask ``draining``
    and ``wait_drained`` over 40 sweep periods. Once the peer resumes and the write settles,
    the chunk ends and returns both."""
    peer = peer_factory()
    tx = LedgerTransport(sender_pool.transport)
    sender_pool.transport.add_peer("hung", peer.metadata)
    sender_pool.transport.add_peer("live", decode_peer.metadata())
    pool = StagingBufferPool(4, 1, PAGE_BYTES)
    sender_pool.transport.register_region("staging", pool.tensor, PAGE_BYTES)
    mgr = KVManager(
        tx, sender_pool.pool, num_workers=2, staging_pool=pool,  # type: ignore[arg-type]
        transfer_timeout_s=0.2, fail_session_on_disconnect=False,
    )
    try:
        warm = NixlKVSender(mgr, 1, ["hung"], [make_transfer_info("hung", [0])])
        warm.init(1)
        warm.send([3])
        assert _wait(lambda: warm.poll() is KVPoll.Success, 30)
        warm.clear()
        peer.stop()
        doomed = NixlKVSender(mgr, 2, ["hung"], [make_transfer_info("hung", [1])])
        doomed.init(1)
        doomed.send([4])
        assert _wait(lambda: doomed.poll() is KVPoll.Failed, 30)  # past its deadline: hung
        doomed.clear()
        handle = doomed.handle
        stop = threading.Event()
        seen: list[str] = []

        def observe() -> None:
            while not stop.is_set():
                left = mgr.draining(handle)
                drained = mgr.wait_drained(handle, 0)
                live = tx.ledger.live_of(2)
                slots = pool.owner_slots(handle)
                if left != 1 or drained or live != 1 or slots != 1:
                    seen.append(f"draining={left} wait_drained={drained} live={live} slots={slots}")
                    return
                time.sleep(0.001)

        def traffic() -> None:
            room = 100
            while not stop.is_set():
                room += 1
                s = NixlKVSender(mgr, room, ["live"], [make_transfer_info("live", [room % 50])])
                s.init(1)
                s.send([room % 200])
                _wait(lambda s=s: s.poll() in (KVPoll.Success, KVPoll.Failed), 30)
                s.clear()

        threads = [threading.Thread(target=observe, daemon=True) for _ in range(2)]
        threads.append(threading.Thread(target=traffic, daemon=True))
        for t in threads:
            t.start()
        deadline = time.monotonic() + 40 * SWEEP_S
        while time.monotonic() < deadline and not seen:
            time.sleep(0.01)
        stop.set()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads)
        assert seen == [], f"while the peer was stopped the hung chunk showed {seen[0]}"
        peer.cont()
        assert mgr.wait_drained(handle, 30), "the settled hung chunk never ended"
        assert tx.ledger.live_of(2) == 0 and pool.owner_slots(handle) == 0
        assert tx.ledger.double_released == []
    finally:
        mgr.close()
        pool.close()
    _ended_once(mgr)


# ------------------------------------------------------- duplicates, on every path

PAGES = st.lists(st.integers(0, 60), min_size=1, max_size=40)


def _forms(pages: list[int]) -> list[Any]:
    arr = np.array(pages, dtype=np.int64)
    forms: list[Any] = [pages, arr, arr.astype(np.int32), np.sort(arr), arr[::-1].copy()]
    if len(pages) >= 3:
        forms.append(arr[1:])  # a slice (its own view)
    return forms


@settings(max_examples=150, deadline=None)
@given(PAGES)
def test_repeated_destination_pages_are_refused_on_every_path(pages: list[int]) -> None:
    """``make_transfer_info`` and ``CheckedPages(unique=True)`` refuse a page list exactly when
    it repeats a page, whatever its form: a list, int64/int32 arrays, sorted, reversed, a
    slice; and a slice of a checked list is still distinct."""
    for form in _forms(pages):
        values = [int(v) for v in form]
        repeats = len(set(values)) != len(values)
        if repeats:
            with pytest.raises(ValueError, match="repeats page"):
                make_transfer_info("d", form)
            with pytest.raises(TransportParamError):
                CheckedPages(form, unique=True)
        else:
            info = make_transfer_info("d", form)
            assert info.dst_checked is not None and info.dst_checked.unique
            checked = CheckedPages(form, unique=True)
            half = checked[: max(1, len(values) // 2)]
            assert len(set(half.tolist())) == len(half)


@pytest.mark.timeout(120)
@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 60), min_size=2, max_size=40))
def test_write_pages_refuses_repeated_destinations_before_nixl(
    shared_transport: Any, pages: list[int]
) -> None:
    """Per write: ``write_pages`` refuses a repeated destination page on every form it takes
    (plain lists, arrays of either int width, sorted or not, short lists done in Python and
    long ones in numpy), before anything reaches NIXL (a spy would see the call)."""
    tx, spy = shared_transport
    src = list(range(len(pages)))
    for form in _forms(pages):
        values = [int(v) for v in form]
        if len(set(values)) == len(values):
            continue
        calls = spy.calls
        with pytest.raises(TransportParamError, match="duplicates"):
            tx.write_pages("d", src[: len(values)], form)
        assert spy.calls == calls, "a refused write reached NIXL"


class _Spy:
    """Counts the calls that would reach NIXL's binding for a write."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        self.calls += 1
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def shared_transport() -> Any:
    from sender.peer import DecodePeer
    from tests.fixtures_nixl import make_sender_pool

    sp = make_sender_pool(64)
    peer = DecodePeer("dup-peer", 64, PAGE_BYTES)
    sp.transport.add_peer("d", peer.metadata())
    spy = _Spy(sp.transport._xfer_agent)
    sp.transport._xfer_agent = spy
    try:
        yield sp.transport, spy
    finally:
        sp.transport._xfer_agent = spy.inner
        sp.transport.close()
        peer.close()
