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
import torch
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


class _SlowRelease:
    """A real transfer whose ``release()`` takes ``delay_s`` first: it widens the window
    between a chunk's claim and the end of its accounting, where ``close()`` may come."""

    def __init__(self, inner: Any, delay_s: float) -> None:
        self._inner = inner
        self._delay_s = delay_s

    def release(self) -> None:
        time.sleep(self._delay_s)
        self._inner.release()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class LedgerTransport:
    """The real transport, each write kept in a :class:`TransferLedger` (releases counted);
    with ``release_delay_s`` each release first takes that long."""

    def __init__(self, inner: Any, release_delay_s: float = 0.0) -> None:
        self.inner = inner
        self.ledger = TransferLedger()
        self.release_delay_s = release_delay_s

    def write_pages(self, *args: Any, **kw: Any) -> Any:
        xfer = self.inner.write_pages(*args, **kw)
        if self.release_delay_s:
            xfer = _SlowRelease(xfer, self.release_delay_s)
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


def _warm_up(mgr: KVManager, session: str, attempts: int = 20) -> None:
    """One room to ``session`` that succeeds (its first write sets up the connection), with
    the manager's short deadline (0.2 s in the hung-chunk tests, which need it to be short):
    on a loaded machine a healthy write can miss it, which is the deadline working, not a
    fault, so a room that failed is cleared, drained and tried again (room ids 1000+)."""
    for n in range(attempts):
        s = NixlKVSender(mgr, 1000 + n, [session], [make_transfer_info(session, [0])])
        s.init(1)
        s.send([3])
        assert _wait(lambda s=s: s.poll() in (KVPoll.Success, KVPoll.Failed), 30)
        ok = s.poll() is KVPoll.Success
        s.clear()
        assert mgr.wait_drained(s.handle, 30)
        if ok:
            return
    raise AssertionError(f"no room to {session!r} succeeded in {attempts} attempts")


def _ended_once(mgr: KVManager) -> None:
    s = mgr.stats()
    ended = s.chunks_done + s.chunks_failed + s.chunks_skipped + s.chunks_drained
    assert ended == s.chunks_submitted, f"chunks not ended exactly once: {s}"


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("workers", "peer_state"), [(0, "stopped"), (3, "stopped"),
                                                     (0, "running"), (3, "running")])
def test_every_chunk_ends_once_on_every_end_path_including_close_abandon(
    sender_pool: SenderPool, peer_factory: Callable[..., Any], workers: int, peer_state: str
) -> None:
    """Rounds of 12 rooms; the rooms are cleared and ``close(timeout_s=0)`` races
    ``wait_drained`` and ``progress`` from other threads (switch interval 1 µs). With the
    peer *stopped* every write stays in progress: each chunk's end is abandoned by close(),
    then the peer resumes and the abandoned writes land. With the peer *running* the writes
    complete, and each chunk's end is claimed by whichever thread polls it first -- a
    worker, a poller, or close() -- while releases take 2 ms (so close() often finds a chunk
    claimed but not yet accounted). Every transfer must have been released exactly once,
    and every chunk counted once."""
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    peer = peer_factory()
    running = peer_state == "running"
    tx = LedgerTransport(sender_pool.transport, release_delay_s=0.002 if running else 0.0)
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
            if not running:
                peer.stop()
            senders = []
            for i in range(12):
                room = 100 * round_no + i
                s = NixlKVSender(mgr, room, ["d"], [make_transfer_info("d", [2 * i, 2 * i + 1])])
                s.init(2)
                s.send([2 * i, 2 * i + 1])
                senders.append(s)
            # Every chunk is posted: a worker does not wait on one chunk before it takes
            # the next unit (inline, each send posts its own).
            posted = 12
            if not running:
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
                if not running:
                    peer.cont()
            for t in pollers:
                t.join(30)
            sys.setswitchinterval(old)
            assert not any(t.is_alive() for t in pollers)
            assert errors == [], errors
            # The peer resumed above: the abandoned writes land now, and the ones NIXL still
            # had in progress at close() (kept, still draining) end once it settles them.
            assert mgr.wait_drained(None, 30), mgr.stats()
            assert _wait(lambda: sender_pool.transport.stats().live_transfers == 0, 30)
            assert tx.ledger.double_released == [], tx.ledger.double_released
            for s in senders:
                assert tx.ledger.live_of(s.bootstrap_room) == 0, "a transfer never released"
            _ended_once(mgr)
            st_ = mgr.stats()
            if not running:
                assert st_.chunks_drained == posted, st_  # posted, then purged: drained once
                assert st_.chunks_skipped == 12 - posted, st_  # queued, never posted
    finally:
        sys.setswitchinterval(old)


@pytest.mark.slow
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
        _warm_up(mgr, "hung")
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


LONG_PAGES = st.lists(st.integers(0, 200), min_size=33, max_size=120)
"""Lists past the 32 pages that :func:`sender.pages.scan_pages` scans in Python: its numpy
path (one comparison for strictly increasing lists, a sort otherwise)."""


@pytest.mark.parametrize("n", [33, 64, 200])
def test_a_long_sorted_list_with_one_adjacent_repeat_is_refused(n: int) -> None:
    """The numpy path's shortcut is for *strictly* increasing lists: a sorted list with two
    equal neighbours must still be found to repeat a page."""
    pages = list(range(n))
    pages[n // 2] = pages[n // 2 - 1]
    with pytest.raises(ValueError, match="repeats page"):
        make_transfer_info("d", pages)
    with pytest.raises(TransportParamError):
        CheckedPages(pages, unique=True)


@settings(max_examples=150, deadline=None)
@given(st.one_of(PAGES, LONG_PAGES))
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
@given(st.one_of(st.lists(st.integers(0, 60), min_size=2, max_size=40), LONG_PAGES))
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
    from stress.harness.peer import DecodePeer
    from tests.fixtures_nixl import make_sender_pool

    sp = make_sender_pool(256)
    peer = DecodePeer("dup-peer", 256, PAGE_BYTES)
    sp.transport.add_peer("d", peer.metadata())
    spy = _Spy(sp.transport._xfer_agent)
    sp.transport._xfer_agent = spy
    try:
        yield sp.transport, spy
    finally:
        sp.transport._xfer_agent = spy.inner
        sp.transport.close()
        peer.close()


# ---------------------------------------------- draining counts the slots a worker holds


class _BlockingGatherPool(StagingBufferPool):
    """A real staging pool whose ``gather`` waits for ``proceed`` (the worker then holds a
    slot for its room, before the post fence)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.gathering = threading.Event()
        self.proceed = threading.Event()

    def gather(self, *args: Any, **kw: Any) -> int:
        self.gathering.set()
        self.proceed.wait(30)
        return super().gather(*args, **kw)


@pytest.mark.timeout(120)
def test_draining_counts_a_slot_a_worker_holds_for_a_purged_room(
    sender_pool: SenderPool, decode_peer: Any
) -> None:
    """``draining(handle)`` is what a purged opening still holds: also a staging slot that a
    worker leased for it before the purge and still holds (here: gathering into it, held
    there by the test) though no chunk of it was posted. Another thread purges the room
    meanwhile; until the worker lets the slot go, ``draining`` must say 1 and
    ``wait_drained(handle, 0)`` ``False``; then both 0/``True``, and the slot is back."""
    tx = sender_pool.transport
    tx.add_peer("d", decode_peer.metadata())
    pool = _BlockingGatherPool(2, 1, PAGE_BYTES)
    tx.register_region("staging", pool.tensor, PAGE_BYTES)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    mgr = KVManager(tx, sender_pool.pool, num_workers=1, staging_pool=pool)
    try:
        s = NixlKVSender(mgr, 3, ["d"], [make_transfer_info("d", [7])])
        s.init(1)
        s.send([2])
        assert pool.gathering.wait(30), "the worker never gathered"
        answers: list[tuple[int, bool, int]] = []

        def purge_and_ask() -> None:  # another thread (a reaper) purges, then asks
            s.clear()
            for _ in range(200):
                answers.append((mgr.draining(s.handle), mgr.wait_drained(s.handle, 0),
                                pool.owner_slots(s.handle)))

        t = threading.Thread(target=purge_and_ask, daemon=True)
        t.start()
        t.join(30)
        assert not t.is_alive()
        wrong = [a for a in answers if a[2] and (a[0] == 0 or a[1])]
        assert not wrong, f"draining/wait_drained said nothing is held while a slot was: {wrong[0]}"
        assert answers and all(a[2] == 1 for a in answers)
        pool.proceed.set()
        assert mgr.wait_drained(s.handle, 30) and pool.owner_slots(s.handle) == 0
        assert mgr.stats().chunks_skipped == 1  # it reached the fence and was skipped
    finally:
        sys.setswitchinterval(old)
        pool.proceed.set()
        mgr.close()
        pool.close()
    _ended_once(mgr)


# --------------------------------------------- a notice waits for the last draining chunk


class _HeldTransfer:
    """A real transfer that answers ``PROC`` until its ``hold`` is released."""

    def __init__(self, inner: Any, hold: threading.Event) -> None:
        self._inner = inner
        self._hold = hold

    def poll(self) -> str:
        state = str(self._inner.poll())
        return state if self._hold.is_set() else "PROC"

    def settled(self) -> bool:
        return self._hold.is_set()

    def release(self) -> None:
        self._inner.release()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _HoldingTransport:
    """The real transport; the n-th write is held until ``holds[n]`` is set."""

    def __init__(self, inner: Any, n: int) -> None:
        self.inner = inner
        self.holds = [threading.Event() for _ in range(n)]
        self._writes = 0
        self._lock = threading.Lock()

    def write_pages(self, *args: Any, **kw: Any) -> Any:
        xfer = self.inner.write_pages(*args, **kw)
        with self._lock:
            n = self._writes
            self._writes += 1
        return _HeldTransfer(xfer, self.holds[n]) if n < len(self.holds) else xfer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 2])
def test_a_room_notice_waits_for_the_last_draining_chunk(
    sender_pool: SenderPool, decode_peer: Any, workers: int
) -> None:
    """A room with two chunks in flight is cleared: its notice must reach the decode side only
    once *both* have ended (PROTOCOL.md §3: once told, no byte of the room lands any more).
    The first write completes, the test sees its chunk end, and for a while the room must stay
    unknown at the peer; then the second completes and the notice comes. The chunks are ended
    by workers, or (inline) by a poller thread of the test's."""
    tx = sender_pool.transport
    tx.add_peer("d", decode_peer.metadata())
    held = _HoldingTransport(tx, 2)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    mgr = KVManager(held, sender_pool.pool, num_workers=workers)  # type: ignore[arg-type]
    stop = threading.Event()
    try:
        s = NixlKVSender(mgr, 9, ["d"], [make_transfer_info("d", [10, 11])])
        s.init(2)
        s.send([1])
        s.send([2])
        assert _wait(lambda: held._writes == 2, 30)
        s.clear()
        handle = s.handle
        assert mgr.draining(handle) == 2

        def poller() -> None:  # inline: someone has to poll the draining chunks
            while not stop.is_set():
                mgr.wait_drained(None, 0)
                time.sleep(0.0005)

        t = threading.Thread(target=poller, daemon=True)
        t.start()
        held.holds[0].set()
        assert _wait(lambda: mgr.draining(handle) == 1, 30), "the first chunk never ended"
        told_early = decode_peer.wait_room_failed(9, handle.generation, 0.3)
        assert told_early is None, "the decode side was told while a chunk still drained"
        held.holds[1].set()
        assert _wait(lambda: mgr.draining(handle) == 0, 30)
        assert decode_peer.wait_room_failed(9, handle.generation, 10) is not None
    finally:
        stop.set()
        for h in held.holds:
            h.set()
        sys.setswitchinterval(old)
        mgr.close()
    t.join(10)
    assert not t.is_alive()


# ------------------------------------------------------- worker-mode sends racing close()


@pytest.mark.timeout(180)
def test_sends_racing_close_every_submitted_chunk_ends() -> None:
    """Worker mode queues a send's unit under the room lock, so that ``close()``'s stop
    sentinels queue behind every unit whose chunks were counted: a scheduler thread sends
    chunks back to back while ``close()`` runs (switch interval 1 µs), 300 times; once both
    returned, every submitted chunk has ended (done, failed, skipped or drained). (In-memory
    transport: 300 managers; the same queueing runs over real NIXL in the stress suite.)"""
    from tests.sender._instant_transport import InstantTransport

    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    kv = torch_zeros(64)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    lost = 0
    try:
        for _ in range(300):
            mgr = KVManager(InstantTransport(), kv, num_workers=1, notify_decode=False)
            senders = []
            for room in range(4):
                s = NixlKVSender(mgr, room, ["d"], [make_transfer_info("d", range(64))])
                s.init(64)
                senders.append(s)
            go = threading.Event()

            def scheduler(senders: list[NixlKVSender] = senders, go: threading.Event = go) -> None:
                go.set()
                for page in range(16):
                    for s in senders:
                        s.send([page])

            t = threading.Thread(target=scheduler, daemon=True)
            t.start()
            go.wait(10)
            for _ in range(rng.randrange(200)):
                pass
            mgr.close(timeout_s=1.0)
            t.join(30)
            assert not t.is_alive()
            st_ = mgr.stats()
            lost += st_.chunks_submitted - (
                st_.chunks_done + st_.chunks_failed + st_.chunks_skipped + st_.chunks_drained
            )
    finally:
        sys.setswitchinterval(old)
    assert lost == 0, f"seed {seed}: {lost} submitted chunks never ended (queued after close())"


def torch_zeros(pages: int) -> Any:
    import torch

    return torch.zeros((pages, PAGE_BYTES), dtype=torch.uint8)


# ------------------------------------------------------------ concurrent hung-chunk sweeps


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_concurrent_sweeps_never_raise_and_workers_survive(
    sender_pool: SenderPool, peer_factory: Callable[..., Any]
) -> None:
    """One thread sweeps hung chunks at a time, and a sweep never raises into its caller: six
    threads call ``progress()`` (which sweeps when one is due) and ``wait_drained`` back to
    back while a chunk to a stopped peer is hung (switch interval 1 µs), for 40 sweep
    periods. Nothing may raise, both workers must still be alive and take new work, and no
    error may be counted."""
    peer = peer_factory()
    tx = sender_pool.transport
    tx.add_peer("hung", peer.metadata)
    mgr = KVManager(tx, sender_pool.pool, num_workers=2, transfer_timeout_s=0.2,
                    fail_session_on_disconnect=False)
    old = sys.getswitchinterval()
    errors: list[BaseException] = []
    stop = threading.Event()
    try:
        _warm_up(mgr, "hung")
        peer.stop()
        doomed = NixlKVSender(mgr, 2, ["hung"], [make_transfer_info("hung", [1])])
        doomed.init(1)
        doomed.send([4])
        assert _wait(lambda: doomed.poll() is KVPoll.Failed, 30)  # hung now
        sys.setswitchinterval(1e-6)

        def sweeper(i: int) -> None:
            try:
                while not stop.is_set():
                    mgr.progress(doomed.handle)
                    if i % 2:
                        mgr.wait_drained(doomed.handle, 0)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=sweeper, args=(i,), daemon=True) for i in range(6)]
        for t in threads:
            t.start()
        time.sleep(40 * SWEEP_S)
        stop.set()
        for t in threads:
            t.join(30)
        sys.setswitchinterval(old)
        assert not any(t.is_alive() for t in threads)
        assert errors == [], errors[:3]
        assert all(w.is_alive() for w in mgr._workers), "a worker died"
        assert mgr.stats().worker_errors == 0
        peer.cont()
        doomed.clear()
        assert mgr.wait_drained(doomed.handle, 30)
    finally:
        stop.set()
        sys.setswitchinterval(old)
        mgr.close()


# ----------------------------------------------------------------- unknown sessions


@pytest.mark.timeout(60)
def test_a_notice_to_a_removed_session_is_failed_not_skipped(
    sender_pool: SenderPool, decode_peer: Any
) -> None:
    """``peer_disconnected`` is ``False`` for a session that is not a peer (PROTOCOL.md §3: a
    notice to a session that is not a peer of the transport any more fails, counted in
    ``notices_failed``; only a peer that reported a disconnect is skipped)."""
    tx = sender_pool.transport
    tx.add_peer("gone", decode_peer.metadata())
    assert tx.peer_disconnected("gone") is False
    assert tx.peer_disconnected("never-added") is False
    with KVManager(tx, sender_pool.pool, num_workers=0) as mgr:
        s = NixlKVSender(mgr, 4, ["gone"], [make_transfer_info("gone", [0])])
        tx.remove_peer("gone")
        assert tx.peer_disconnected("gone") is False
        s.clear()
        assert _wait(lambda: mgr.stats().notices_failed == 1, 10), mgr.stats()
        assert mgr.stats().notices_skipped_dead == 0


# ----------------------------------------------- one sweeper at a time, every preemption point


class _HungTransfer:
    """A transfer stand-in that stays in progress past its deadline (what a stopped peer's
    write does): every poll raises ``TransferTimeoutError``; release idempotent, counted."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.released = 0

    def poll(self) -> str:
        from sender.errors import TransferTimeoutError

        raise TransferTimeoutError("d0", 0.0)

    def settled(self) -> bool:
        return False  # NIXL still has it in progress

    def release(self) -> None:
        with self._lock:
            self.released += 1


class _HungTransport:
    def __init__(self) -> None:
        self.transfers: list[_HungTransfer] = []

    def write_pages(self, session_id: str, src: Any, dst: Any, notif: Any = None,
                    **kw: Any) -> _HungTransfer:  # fmt: skip
        self.transfers.append(_HungTransfer())
        return self.transfers[-1]


class _SweepRig:
    """An inline manager with one hung chunk and a sweep due; two threads call
    ``maybe_sweep`` (what every worker turn, slot wait, ``progress()`` and ``wait_drained``
    do)."""

    def __init__(self) -> None:
        from staging import StagingContext

        self.transport = _HungTransport()
        kv = torch.zeros((8, 16), dtype=torch.uint8)
        self.mgr = KVManager(self.transport, kv, num_workers=0, fail_session_on_disconnect=False,
                             staging=StagingContext(lock="mutex"))  # fmt: skip
        sender = NixlKVSender(self.mgr, 5, ["d0"], [make_transfer_info("d0", range(4))])
        sender.init(4)
        sender.send(np.array([0, 1, 2, 3]))
        self.mgr.progress(sender.handle)  # the poll times out: the chunk is hung now
        assert self.mgr.rooms.hung, "the rig's chunk did not hang"
        self.mgr.pipeline._sweep_due = 0.0  # a sweep is due
        self.errors: list[BaseException] = []

    def sweep(self) -> None:
        try:
            self.mgr.pipeline.maybe_sweep()
        except BaseException as exc:
            self.errors.append(exc)

    def judge(self) -> str | None:
        if self.errors:
            return f"maybe_sweep raised {self.errors!r}"
        if self.mgr.rooms.unaccounted_errors:
            return f"{self.mgr.rooms.unaccounted_errors} errors counted inside a sweep"
        return None


def test_one_sweeper_at_a_time_at_every_preemption_point() -> None:
    """Deterministic, real threads (``tests/interleave.py``): one ``maybe_sweep`` is stopped
    at every line and return of the library's code it passes while a second runs. "One
    thread sweeps at a time; a sweep never raises into its caller" (docs/THREADING.md): a
    second sweeper that ignores the sweep claim releases the first one's, and is caught at
    the point between the claim and the sweep whatever the machine's load."""
    from tests.interleave import explore

    result = explore(_SweepRig, _SweepRig.sweep, _SweepRig.sweep, _SweepRig.judge, block_s=0.5)
    print(f"sweep vs sweep: {result.schedules} schedules, {result.blocked} blocked")
    assert result.schedules >= 3
    assert not result.failures, result.failures[:3]


def _one_slot_manager(
    sender_pool: SenderPool,
    peer_factory: Callable[..., Any],
    num_workers: int,
    transfer_timeout_s: float,
) -> tuple[Any, StagingBufferPool, KVManager]:
    """A peer added as session "hung", a one-slot staging pool and a manager over them
    (``slot_timeout_s`` = 120 s, far past the slot tests' 60 s checks; no session failure,
    so nothing but the rule under test fails a waiting room)."""
    peer = peer_factory()
    sender_pool.transport.add_peer("hung", peer.metadata)
    pool = StagingBufferPool(1, 1, PAGE_BYTES)
    sender_pool.transport.register_region("staging", pool.tensor, PAGE_BYTES)
    mgr = KVManager(
        sender_pool.transport, sender_pool.pool, num_workers=num_workers, staging_pool=pool,
        transfer_timeout_s=transfer_timeout_s, slot_timeout_s=120.0,
        fail_session_on_disconnect=False,
    )
    return peer, pool, mgr


@pytest.mark.timeout(240)
def test_a_worker_waiting_for_a_slot_still_fails_its_hung_chunks_room_by_the_deadline(
    sender_pool: SenderPool, peer_factory: Callable[..., Any]
) -> None:
    """The contract: a posted chunk ends at the latest at its first poll after its deadline,
    and workers poll without pause. A worker that waits for a staging slot is still a worker:
    here the only slot is held by the room's first chunk, posted to a peer that is really
    stopped (SIGSTOP), and the worker waits for a slot for the room's second chunk. Its room
    must read Failed for the first chunk's deadline (``TransferTimeoutError``), long before
    the slot wait's own bound (``slot_timeout_s`` = 120 s; the check allows 60 s, so a loaded
    machine cannot fail it): a worker that polled nothing but known-hung chunks while it
    waits would fail the room only when the wait gave up ("no staging slot"). (The code
    passes it on 3a76f2e too: the worker polls its posted chunk before it takes the next
    unit. It was written while looking into a two-hosts partition phase where in-flight
    rooms failed with PoolExhaustedError at the rig's slot_timeout_s.)
    """
    peer, pool, mgr = _one_slot_manager(sender_pool, peer_factory, 1, 0.2)
    try:
        _warm_up(mgr, "hung")
        peer.stop()
        doomed = NixlKVSender(mgr, 2, ["hung"], [make_transfer_info("hung", [1, 2])])
        doomed.init(2)
        doomed.send([4])
        doomed.send([5])  # waits on the worker for the slot that the first chunk holds
        assert _wait(lambda: doomed.poll() is KVPoll.Failed, 60), (
            "the room stayed Transferring while its worker waited for a slot: "
            f"{mgr.stats()}"
        )
        exc = mgr.exceptions.get(2)
        assert "TransferTimeoutError" in repr(exc) or "deadline" in repr(exc), repr(exc)
        assert "no staging slot" not in repr(exc), repr(exc)
        # The waiting chunk gives up its wait once its room failed: skipped, not failed at
        # the end of slot_timeout_s.
        assert _wait(lambda: mgr.stats().chunks_skipped >= 1, 60), mgr.stats()
        doomed.clear()
        peer.cont()
        assert mgr.wait_drained(doomed.handle, 60), "the settled hung chunk never ended"
    finally:
        peer.cont()
        mgr.close()
        pool.close()
    _ended_once(mgr)


@pytest.mark.timeout(240)
def test_a_slot_wait_gives_up_at_once_when_only_hung_chunks_hold_the_slots(
    sender_pool: SenderPool, peer_factory: Callable[..., Any], fast_switch: None
) -> None:
    """The contract (THREADING, hung chunks): a slot leased to a hung chunk comes back only
    when NIXL settles its transfer, so a chunk waiting for a slot gives up as soon as every
    slot is held by a hung chunk (``SlotsHeldByHungError``, a ``PoolExhaustedError``),
    instead of waiting out ``slot_timeout_s`` (120 s here; the checks allow 60 s, so a
    loaded machine cannot fail them). The only slot is taken by room 2's chunk, posted to a
    really stopped peer (SIGSTOP). Room 3's chunk starts waiting for the slot *before* that
    chunk hangs (two workers: the wait itself must notice); room 4's chunk is sent once it
    hung (the check before a wait). ``fail_session_on_disconnect=False``: nothing else fails
    rooms 3 and 4. Regression of two-hosts' partition phase (seed 1168136690): rooms opened
    while all 16 slots were hung failed 5, 10, 15 s ... after their opening, one
    ``slot_timeout_s`` after another on each worker (``fail-fast``); on f15a560 rooms 3 and 4
    here wait 120 s.
    """
    from sender.pipeline import SlotsHeldByHungError
    from staging.buffers import PoolExhaustedError

    peer, pool, mgr = _one_slot_manager(sender_pool, peer_factory, 2, 0.5)
    try:
        _warm_up(mgr, "hung")
        peer.stop()
        hung = NixlKVSender(mgr, 2, ["hung"], [make_transfer_info("hung", [1])])
        hung.init(1)
        hung.send([4])
        assert _wait(lambda: mgr.stats().transfers_inflight == 1, 60), mgr.stats()
        waiting = NixlKVSender(mgr, 3, ["hung"], [make_transfer_info("hung", [2])])
        waiting.init(1)
        waiting.send([5])  # the other worker waits for the slot room 2's chunk holds
        assert _wait(lambda: hung.poll() is KVPoll.Failed, 60), mgr.stats()
        assert _wait(lambda: waiting.poll() is KVPoll.Failed, 60), (
            f"room 3 went on waiting for a slot that only a hung chunk holds: {mgr.stats()}"
        )
        late = NixlKVSender(mgr, 4, ["hung"], [make_transfer_info("hung", [3])])
        late.init(1)
        late.send([6])
        assert _wait(lambda: late.poll() is KVPoll.Failed, 60), (
            f"room 4 waited for a slot that only a hung chunk holds: {mgr.stats()}"
        )
        for room in (3, 4):
            exc = mgr.exceptions.get(room)
            assert "held by hung transfers" in repr(exc), (room, repr(exc))
        # Their own session's slots are held by its hung chunk: its peer failed, not us.
        by_code = dict(mgr.stats().rooms_failed_by_code)
        assert by_code == {"timeout": 1, "peer-failed": 2}, by_code
        assert issubclass(SlotsHeldByHungError, PoolExhaustedError)
        assert pool.stats().in_use == 1, "giving up must not free the hung chunk's slot"
        for s in (hung, waiting, late):
            s.clear()
        peer.cont()
        assert mgr.wait_drained(None, 60), "the settled hung chunk never ended"
        assert pool.stats().in_use == 0
    finally:
        peer.cont()
        mgr.close()
        pool.close()
    _ended_once(mgr)
