"""Sender sentences of docs/THREADING.md that an outside set of planted bugs got past (issue
33, item 0), each checked against the SENTENCE through the manager's public API, with a stand-in
transport (no NIXL: the checks are fast and judge what the sentence promises, not how the chunk
pipeline is built). Each has a planted violation in ``make mutants`` (``tools/mutants_contract.py``)
put elsewhere than the line the check was first expected to watch.

a. Inline mode with a staging pool: a chunk that finds no free slot checks *before it waits*
   whether every slot is leased to a hung chunk, and fails its room at once
   (``SlotsHeldByHungError``) rather than after ``slot_timeout_s`` -- also with
   ``slot_timeout_s=0``, where there is no wait to check in.
b. A write that ``remove_peer`` kept fails its room at once but not its session: the session
   id may already name a new peer, whose rooms go on (workers poll both rooms' writes).
c. A purge's counters change in the same critical section as the room's status: no
   ``stats()`` between a purge and its count, and two concurrent purges count two.
d. A room notice is held and released per *opening*: an id purged, reopened and purged again
   while its first opening still drains gets two notices, each once its own opening drained.
e. The status a purge reports, counts and sends in its notice is the one it read in its own
   critical section: a failure or a success racing it is either before the purge (and then
   reported, counted and told as such) or after it (refused).

The interleavings of c and e are explored with ``tests/interleave.py`` (real threads, the
first stopped at every line and return of the library's code it passes while the second runs
to its end: deterministic, independent of the machine's load).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from sender.errors import PeerNotFoundError, TransferTimeoutError
from sender.manager import KVManager, make_transfer_info
from sender.nixl_sender import NixlKVSender
from sender.notices import RoomNotice, decode_notice
from sender.poll import KVPoll
from staging import StagingContext
from staging.buffers import PoolExhaustedError, StagingBufferPool
from tests.interleave import Exploration, explore

pytestmark = pytest.mark.timeout(120)

PAGE_BYTES = 16
BOUND_S = 10.0
"""What "at once" is allowed on a loaded machine: far below the 60 s ``slot_timeout_s``
of the waits that must not happen, far above any scheduling delay."""


def _wait(cond: Callable[[], bool], timeout_s: float = BOUND_S) -> bool:
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() >= end:
            return cond()
        time.sleep(0.002)
    return True


# ------------------------------------------------------------------ the stand-in transport


class StubTransfer:
    """A posted write. ``state``: ``"PROC"`` (in flight), ``"DONE"``; ``error``: what a poll
    raises instead (a deadline, a removed peer); ``settled``: whether NIXL is done with it
    (a hung or kept write is not)."""

    def __init__(self, session_id: str, notif: bytes | None) -> None:
        self.session_id = session_id
        self.notif = notif
        self.state = "PROC"
        self.error: BaseException | None = None
        self.is_settled = True
        self.releases = 0
        self._lock = threading.Lock()

    def poll(self) -> str:
        if self.error is not None:
            raise self.error
        return self.state

    def settled(self) -> bool:
        return self.is_settled

    def release(self) -> None:
        with self._lock:
            self.releases += 1

    def hang(self) -> None:
        """Past its deadline while NIXL still has it (a hung peer)."""
        self.is_settled = False
        self.error = TransferTimeoutError(self.session_id, 0.0)

    def keep_at_removal(self) -> None:
        """``remove_peer`` kept it: NIXL still has it, its polls raise PeerNotFoundError."""
        self.is_settled = False
        self.error = PeerNotFoundError(self.session_id)

    def land(self) -> None:
        """NIXL completes it (a resumed peer, a healed link)."""
        self.error = None
        self.state = "DONE"
        self.is_settled = True


class StubTransport:
    """``write_pages`` makes a :class:`StubTransfer` (in flight until the test says
    otherwise); ``send_notif`` records each room notice with the moment it was sent."""

    def __init__(self) -> None:
        self.transfers: list[StubTransfer] = []
        self.notices: list[tuple[str, RoomNotice]] = []
        self._lock = threading.Lock()

    def write_pages(
        self,
        session_id: str,
        src_pages: Any,
        dst_pages: Any,
        notif: bytes | None = None,
        *,
        src_region: str = "kv",
        dst_region: str = "kv",
        timeout_s: float | None = None,
    ) -> StubTransfer:
        xfer = StubTransfer(session_id, notif)
        with self._lock:
            self.transfers.append(xfer)
        return xfer

    def send_notif(self, session_id: str, message: bytes) -> None:
        with self._lock:
            self.notices.append((session_id, decode_notice(message)))

    def sent(self) -> list[tuple[int, int, str]]:
        with self._lock:
            return [(n.room, n.gen, n.outcome) for _, n in self.notices]


class Conclusions:
    """A listener: every ``room_concluded`` event, per opening."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.events: list[tuple[int, int, str]] = []

    def room_concluded(self, room: int, generation: int, outcome: str, code: str,
                       seconds: float) -> None:  # fmt: skip
        with self._lock:
            self.events.append((room, generation, outcome))

    def chunk_ended(self, session_id: str, outcome: str, seconds: float, nbytes: int) -> None:
        pass

    def of(self, room: int, generation: int) -> list[str]:
        with self._lock:
            return [o for r, g, o in self.events if (r, g) == (room, generation)]


_MADE: list[KVManager] = []
"""Every manager a test made (the explorer's dry run makes one it never checks): closed
after each test, so that no notifier or worker thread outlives it."""


@pytest.fixture(autouse=True)
def _close_managers() -> Iterator[None]:
    yield
    while _MADE:
        _MADE.pop().close(1.0)


def _told_at_least(transport: StubTransport, n: int) -> bool:
    return len(transport.sent()) >= n


def _manager(transport: StubTransport, **kw: Any) -> KVManager:
    kw.setdefault("num_workers", 0)
    kw.setdefault("staging", StagingContext(lock="mutex"))
    mgr = KVManager(transport, torch.zeros((16, PAGE_BYTES), dtype=torch.uint8), **kw)
    _MADE.append(mgr)
    return mgr


def _sender(mgr: KVManager, room: int, session: str = "d0", pages: int = 1) -> NixlKVSender:
    s = NixlKVSender(mgr, room, [session], [make_transfer_info(session, range(pages))])
    s.init(pages)
    return s


# ------------------------------------------------------------------ a: inline pre-wait check


@pytest.mark.parametrize("slot_timeout_s", [0.0, 60.0])
def test_a_inline_slot_wait_checks_for_hung_holders_before_it_waits(
    slot_timeout_s: float,
) -> None:
    """THREADING.md, Draining (and the ``send`` row): "a chunk waiting for a staging slot
    gives up as soon as every slot is leased to a hung chunk (checked between the wait's
    50 ms pieces, and inline also before it)". Inline, the only slot is held by room 1's
    chunk, hung (past its deadline, NIXL still has it). Room 2's ``send`` must fail its room
    with ``SlotsHeldByHungError`` (a ``PoolExhaustedError``), at once: with
    ``slot_timeout_s=0`` there is no wait to check in, so only the check before it can name
    the cause; with 60 s the send must not wait it out. The hung chunk keeps its slot."""
    from sender.pipeline import SlotsHeldByHungError

    transport = StubTransport()
    pool = StagingBufferPool(1, 4, PAGE_BYTES)
    mgr = _manager(transport, staging_pool=pool, slot_timeout_s=slot_timeout_s,
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


# ------------------------------------------------------------------ b: kept write vs session


@pytest.mark.parametrize("workers", [0, 2])
def test_b_a_write_kept_at_remove_peer_fails_its_room_not_its_session(workers: int) -> None:
    """THREADING.md, Removed peers: a write ``remove_peer`` kept (its polls raise
    ``PeerNotFoundError`` while NIXL still has it) fails its room at once, "its session is
    not failed: the id may already name a new peer". ``fail_session_on_disconnect=True``
    (the default): a deadline would fail the session, a removal must not. Room 1's write is
    kept; room 2 already writes to the same session id (the new peer), and room 3 opens on it
    after room 1 failed. With workers, both writes are polled by worker threads at once."""
    transport = StubTransport()
    mgr = _manager(transport, num_workers=workers, notify_decode=False)
    try:
        old = _sender(mgr, 1)
        old.send(np.array([3]))
        new = _sender(mgr, 2)
        new.send(np.array([4]))
        assert _wait(lambda: len(transport.transfers) == 2)
        kept = next(t for t in transport.transfers if t.notif and t.notif.startswith(b"room=1;"))
        fresh = next(t for t in transport.transfers if t is not kept)
        kept.keep_at_removal()
        if workers:
            assert _wait(lambda: old.poll() is KVPoll.Failed), "the kept write's room never failed"
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
        assert _wait(lambda: len(transport.transfers) == 3), "room 3's write was not posted"
        fresh.land()
        transport.transfers[2].land()
        assert _wait(lambda: new.poll() is KVPoll.Success), f"room 2: {new.poll()!r}"
        assert _wait(lambda: later.poll() is KVPoll.Success), f"room 3: {later.poll()!r}"
        old.clear()
        assert mgr.draining(old.handle) == 1, "the kept write stopped draining before it settled"
        kept.land()
        assert mgr.wait_drained(old.handle, BOUND_S)
    finally:
        mgr.close(1.0)


# ------------------------------------------------------------------ c: purge counters


def _counts_agree(mgr: KVManager) -> str | None:
    """Every room here is opened once and purged at most once, unconcluded: in any one
    ``stats()`` the open rooms and the purges add up to the rooms opened, and every purge
    counted a cleared room."""
    st = mgr.stats()
    if st.open_rooms + st.purges != st.rooms_opened:
        return (f"stats() between a purge and its count: open_rooms={st.open_rooms} "
                f"purges={st.purges} rooms_opened={st.rooms_opened}")  # fmt: skip
    if st.rooms_cleared != st.purges:
        return f"rooms_cleared={st.rooms_cleared} but purges={st.purges}"
    return None


class PurgeVsScrape:
    """Thread 1 clears room 1 (unconcluded); thread 2 scrapes ``stats()`` and checks it."""

    def __init__(self) -> None:
        self.transport = StubTransport()
        self.mgr = _manager(self.transport, notify_decode=False)
        self.a = _sender(self.mgr, 1)
        self.seen: list[str] = []

    def purge(self) -> None:
        self.a.clear()

    def scrape(self) -> None:
        why = _counts_agree(self.mgr)
        if why:
            self.seen.append(why)

    def check(self) -> str | None:
        self.mgr.close(1.0)
        return "; ".join(self.seen) or _counts_agree(self.mgr)


class PurgeVsPurge(PurgeVsScrape):
    """Two threads clear two rooms: neither count is lost."""

    def __init__(self) -> None:
        super().__init__()
        self.b = _sender(self.mgr, 2)

    def purge_other(self) -> None:
        self.b.clear()

    def check(self) -> str | None:
        self.mgr.close(1.0)
        st = self.mgr.stats()
        if (st.purges, st.rooms_cleared) != (2, 2):
            return f"two purges counted purges={st.purges} rooms_cleared={st.rooms_cleared}"
        return None


def _explored(result: Exploration, label: str) -> None:
    print(f"{label}: {result.schedules} schedules, {result.blocked} blocked")
    assert result.schedules > 1, "the explorer ran no preempted schedule"
    assert not result.failures, result.failures[:3]


@pytest.mark.parametrize("stopped", ["purge", "scrape"])
def test_c_no_scrape_between_a_purge_and_its_count(stopped: str) -> None:
    """docs/METRICS.md (room_purges_total, rooms_concluded_total{cleared}, rooms_open) and
    ``clear()``'s "changes everything or nothing": the purge stopped at every line and
    return while a scrape runs, and the scrape stopped likewise while the purge runs; every
    ``stats()`` must add up."""
    purge, scrape = PurgeVsScrape.purge, PurgeVsScrape.scrape
    first, second = (purge, scrape) if stopped == "purge" else (scrape, purge)
    result = explore(PurgeVsScrape, first, second, PurgeVsScrape.check, block_s=0.02)
    _explored(result, f"purge vs stats(), {stopped} stopped")


def test_c_two_concurrent_purges_lose_no_count() -> None:
    """One purge stopped at every line and return while another room's purge runs: both are
    counted."""
    result = explore(PurgeVsPurge, PurgeVsPurge.purge, PurgeVsPurge.purge_other,
                     PurgeVsPurge.check, block_s=0.02)  # fmt: skip
    _explored(result, "purge vs purge")


# ------------------------------------------------------------------ d: notices per opening


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("first_drains", ["first", "second"])
def test_d_a_notice_is_held_and_released_per_opening(workers: int, first_drains: str) -> None:
    """THREADING.md, Room notices; PROTOCOL.md 3: room 7 is cleared while its write is in
    flight (its notice is held), reopened, written to and cleared again while the first
    write still drains. Each opening gets its own notice, sent only once *its* write ended:
    while one opening drains, no notice of it may go out, and the other's notice is not
    lost. Drained in both orders; with workers the ends are seen on worker threads."""
    transport = StubTransport()
    mgr = _manager(transport, num_workers=workers)
    try:
        first = _sender(mgr, 7)
        first.send(np.array([3]))
        assert _wait(lambda: len(transport.transfers) == 1)
        first.clear()
        second = _sender(mgr, 7)
        second.send(np.array([4]))
        assert _wait(lambda: len(transport.transfers) == 2)
        second.clear()
        g1, g2 = first.handle.generation, second.handle.generation
        assert g1 != g2
        order = [(0, g1), (1, g2)] if first_drains == "first" else [(1, g2), (0, g1)]
        time.sleep(0.05)  # give a wrong early notice time to go out
        assert transport.sent() == [], (
            f"a notice went out before anything drained: {transport.sent()}"
        )
        told: list[tuple[int, int, str]] = []
        for n, (index, gen) in enumerate(order):
            transport.transfers[index].land()
            handle = first.handle if gen == g1 else second.handle
            assert mgr.wait_drained(handle, BOUND_S), f"opening gen {gen} never drained"
            told.append((7, gen, "cleared"))
            assert _wait(functools.partial(_told_at_least, transport, n + 1)), (
                f"no notice for gen {gen} once it drained: {transport.sent()} {mgr.stats()}"
            )
            time.sleep(0.02)  # a second, wrong notice would follow at once
            assert transport.sent() == told, (
                f"after gen {gen} drained the decode side was told {transport.sent()}, "
                f"expected {told}"
            )
    finally:
        mgr.close(1.0)


# ------------------------------------------------------------------ e: the purge's own status


class PurgeVsConclusion:
    """Room 3 is transferring (its one write done but not yet polled). Thread 1 purges it;
    thread 2 concludes it another way (``mode``): ``fail`` records a failure, ``succeed``
    polls the write (inline ``progress``), which ends the room ``Success``."""

    mode = "fail"

    def __init__(self) -> None:
        self.transport = StubTransport()
        self.listener = Conclusions()
        self.mgr = _manager(self.transport, events=self.listener)
        self.s = _sender(self.mgr, 3)
        self.s.send(np.array([3]))
        self.transport.transfers[0].land()
        self.handle = self.s.handle
        self.purge: Any = None
        self.concluded_first = False

    def purge_it(self) -> None:
        self.purge = self.mgr.purge_room(self.handle)

    def conclude(self) -> None:
        if self.mode == "fail":
            self.concluded_first = self.mgr.record_failure(
                self.handle, RuntimeError("racing failure"), "racing failure"
            )
        else:
            self.mgr.progress(self.handle)

    def check(self) -> str | None:
        try:
            return self._check()
        finally:
            self.mgr.close(1.0)

    def _check(self) -> str | None:
        p, mgr, gen = self.purge, self.mgr, self.handle.generation
        if not mgr.wait_drained(self.handle, BOUND_S):  # inline: this polls the write
            return f"the purged opening never drained: {mgr.stats()}"
        st = mgr.stats()
        told = self.listener.of(3, gen)
        if self.mode == "succeed":
            # The write ended Success before the purge's section (the room concluded) or its
            # end came after (the chunk drained and the purge cleared the room).
            self.concluded_first = st.rooms_succeeded == 1
        want_status = (
            (KVPoll.Failed if self.mode == "fail" else KVPoll.Success)
            if self.concluded_first
            else KVPoll.Transferring
        )
        want_outcome = (
            ("failed" if self.mode == "fail" else "success") if self.concluded_first else "cleared"
        )
        problems = []
        if p.status is not want_status:
            problems.append(f"the purge reported {p.status!r}, expected {want_status!r}")
        if told != [want_outcome]:
            problems.append(f"the listener was told {told}, expected [{want_outcome!r}]")
        counted = (st.rooms_succeeded, st.rooms_failed, st.rooms_cleared)
        want_counted = {"success": (1, 0, 0), "failed": (0, 1, 0), "cleared": (0, 0, 1)}
        if counted != want_counted[want_outcome]:
            problems.append(f"counted (succeeded, failed, cleared) = {counted}")
        if want_outcome != "success" and not _wait(lambda: mgr.stats().notices_sent >= 1):
            problems.append("no room notice was sent")
        sent = [o for r, g, o in self.transport.sent() if (r, g) == (3, gen)]
        want_sent = [] if want_outcome == "success" else [want_outcome]
        if sent != want_sent:
            problems.append(f"the decode side was told {sent}, expected {want_sent}")
        return "; ".join(problems) or None


class PurgeVsSuccess(PurgeVsConclusion):
    mode = "succeed"


@pytest.mark.parametrize("rig", [PurgeVsConclusion, PurgeVsSuccess], ids=["fail", "succeed"])
def test_e_a_purge_reports_counts_and_tells_the_status_of_its_own_section(
    rig: type[PurgeVsConclusion],
) -> None:
    """PROTOCOL.md 3 (``outcome``), METRICS.md (``rooms_concluded_total{cleared}``): the
    purge stopped at every line and return while a failure (or the room's success) races
    it. Whichever came first, the purge's ``status``, the counters, the listener's one
    conclusion and the decode side's notice must all say the same thing: a status read
    before the purge took the room's gate would clear a room that had already concluded."""
    result = explore(rig, rig.purge_it, rig.conclude, rig.check, block_s=0.02)
    _explored(result, f"purge vs {rig.mode}")
