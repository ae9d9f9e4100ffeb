"""``clear()`` (docs/THREADING.md, "Why clear() is safe from any thread, idempotent and
all-or-nothing"): it never raises, purges everything, and an observer sees a purge, its counters
and its reported status as one section."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from sender.manager import KVManager
from sender.poll import KVPoll
from staging.buffers import StagingBufferPool
from staging.context import StagingContext
from tests.fixtures_nixl import PAGE_BYTES, requires_nixl
from tests.interleave import Exploration, explore
from tests.polling import wait_until
from tests.sender._crowded_staging import long_reader
from tests.sender._scripted import Rig, ScriptedTransport, sender
from tests.sender._stub_transport import BOUND_S, StubTransport, _sender, _stub_manager, _stub_wait


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
        self.mgr = _stub_manager(self.transport, notify_decode=False)
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


class PurgeVsConclusion:
    """Room 3 is transferring (its one write done but not yet polled). Thread 1 purges it;
    thread 2 concludes it another way (``mode``): ``fail`` records a failure, ``succeed``
    polls the write (inline ``progress``), which ends the room ``Success``."""

    mode = "fail"

    def __init__(self) -> None:
        self.transport = StubTransport()
        self.listener = Conclusions()
        self.mgr = _stub_manager(self.transport, events=self.listener)
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
        if want_outcome != "success" and not _stub_wait(lambda: mgr.stats().notices_sent >= 1):
            problems.append("no room notice was sent")
        sent = [o for r, g, o in self.transport.sent() if (r, g) == (3, gen)]
        want_sent = [] if want_outcome == "success" else [want_outcome]
        if sent != want_sent:
            problems.append(f"the decode side was told {sent}, expected {want_sent}")
        return "; ".join(problems) or None


class PurgeVsSuccess(PurgeVsConclusion):
    mode = "succeed"


@pytest.mark.nixl
@requires_nixl
@pytest.mark.timeout(40)
@pytest.mark.usefixtures("fast_switch")
def test_clear_never_raises_and_purges_all_under_lock_timeout(
    rig: Rig, crowded_staging: StagingContext
) -> None:
    """Twelve rooms (inline mode), each with staging keys, a leased slot and a transfer in
    flight, are cleared while a long reader holds the staging context
    (``lock_timeout=0.005``). ``clear()`` must never raise and must purge everything: once
    drained nothing is left, and every room id can be opened again. At 8343a9b ``clear()``
    raised LockTimeoutError half-way: the staging room, slot and transfer leaked, and
    reopening the id failed.

    Found by the audit of issue 9 (defect d5, at 8343a9b).
    """
    n = 12
    pool = StagingBufferPool(n, 1, PAGE_BYTES)
    rig.tx.register_region("staging", pool.tensor, PAGE_BYTES)
    script = ScriptedTransport(rig.tx, hold=range(1, n + 1))
    raised: list[BaseException] = []
    with (
        KVManager(
            script,
            rig.kv,
            num_workers=0,
            staging=crowded_staging,
            staging_pool=pool,
            transfer_timeout_s=20,
            session_slots=n,
        ) as mgr,
        script,
    ):
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


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("stopped", ["purge", "scrape"])
def test_no_scrape_between_a_purge_and_its_count(stopped: str) -> None:
    """docs/METRICS.md (room_purges_total, rooms_concluded_total{cleared}, rooms_open) and
    ``clear()``'s "changes everything or nothing": the purge stopped at every line and
    return while a scrape runs, and the scrape stopped likewise while the purge runs; every
    ``stats()`` must add up.

    Found by issue 33, item 0 (sentence (c): planted bugs an outside set got past).
    """
    purge, scrape = PurgeVsScrape.purge, PurgeVsScrape.scrape
    first, second = (purge, scrape) if stopped == "purge" else (scrape, purge)
    result = explore(PurgeVsScrape, first, second, PurgeVsScrape.check, block_s=0.02)
    _explored(result, f"purge vs stats(), {stopped} stopped")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_concurrent_purges_lose_no_count() -> None:
    """One purge stopped at every line and return while another room's purge runs: both are
    counted.

    Found by issue 33, item 0 (sentence (c): planted bugs an outside set got past).
    """
    result = explore(PurgeVsPurge, PurgeVsPurge.purge, PurgeVsPurge.purge_other,
                     PurgeVsPurge.check, block_s=0.02)  # fmt: skip
    _explored(result, "purge vs purge")


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("rig", [PurgeVsConclusion, PurgeVsSuccess], ids=["fail", "succeed"])
def test_a_purge_reports_counts_and_tells_the_status_of_its_own_section(
    rig: type[PurgeVsConclusion],
) -> None:
    """PROTOCOL.md 3 (``outcome``), METRICS.md (``rooms_concluded_total{cleared}``): the
    purge stopped at every line and return while a failure (or the room's success) races
    it. Whichever came first, the purge's ``status``, the counters, the listener's one
    conclusion and the decode side's notice must all say the same thing: a status read
    before the purge took the room's gate would clear a room that had already concluded.

    Found by issue 33, item 0 (sentence (e): planted bugs an outside set got past).
    """
    result = explore(rig, rig.purge_it, rig.conclude, rig.check, block_s=0.02)
    _explored(result, f"purge vs {rig.mode}")
