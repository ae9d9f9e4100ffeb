"""The checks the sender stress scenarios rest on, each shown to catch a planted bug.

* the decode page audit (``stress.scenarios._page_audit``) judges page histories: a planted
  cross-room overwrite (the bytes of an earlier room on a page a later room was verified on)
  is reported, legitimate states are not;
* the reference driver's drain rule: a failed room's destination pages are handed out again
  only once ``mgr.draining(handle) == 0``; the old fixed quarantine (planted, 0 s) hands them
  out while a delayed write of the failed room is still in flight;
* the driver judges what ``failure_exception()`` raises: a planted sender that lets a
  ``KeyError`` escape is recorded as a broken contract;
* the fault injector's delay mode: a write released before its post still lands, as with NIXL.

The driver tests run real NIXL agents (a sender transport and an in-process decode peer).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

import numpy as np
import pytest

from sender.errors import TRANSPORT_ERRORS, KVTransferError
from sender.manager import KVManager
from sender.nixl_sender import NixlKVSender
from sender.poll import KVPoll
from staging.context import RoomHandle
from stress.harness.driver import (
    CONTRACT_PREFIX,
    DriverConfig,
    RoomOutcome,
    SchedulerDriver,
    judge_failure,
)
from stress.harness.faults import FaultInjectingTransport, nixl_error
from stress.scenarios._page_audit import PageAudit
from tests.fixtures_nixl import NUM_PAGES, SenderPool, requires_nixl

SESSION = "decode-inproc"

# ---------------------------------------------------------------------- the page audit


def _outcome(
    room: int,
    started: float,
    dst: Sequence[int],
    src: Sequence[int],
    status: KVPoll,
    verified: bool | None,
) -> RoomOutcome:
    return RoomOutcome(
        room, "s", status, 0.01, None, verified, (), started + 0.01, started,
        tuple(dst), tuple(src),
    )  # fmt: skip


class _Peer:
    """Page digests "at the peer", as a test sets them."""

    def __init__(self, pages: dict[int, str]) -> None:
        self.pages = pages

    def digest(self, session_id: str, pages: Sequence[int]) -> list[str]:
        return [self.pages.get(p, "zero") for p in pages]


SRC = [f"src{i}" for i in range(16)]  # digest of prefill page i


def test_page_audit_reports_a_cross_room_overwrite() -> None:
    audit = PageAudit(SRC)
    # Room 1 fails on pages 0, 1; room 2 is given them next and verified.
    audit.record(_outcome(1, 1.0, [0, 1], [3, 4], KVPoll.Failed, None))
    audit.record(_outcome(2, 2.0, [0, 1], [5, 6], KVPoll.Success, True))
    # Planted: room 1's write to page 0 lands after room 2 was verified.
    peer = _Peer({0: "src3", 1: "src6"})
    report = audit.check(peer.digest)
    assert report.judged == 2 and report.unjudged == 0
    (text,) = report.violations
    assert "cross-room overwrite" in text and "room 1 (Failed)" in text and "room 2" in text
    assert audit.check(peer.digest).violations == ()  # reported once per run
    # The same state, seen by the check made before the page is reused, is not repeated.
    assert audit.check_pages(peer.digest, "s", [0, 1]) == []


def test_page_audit_before_reuse_sees_an_overwrite_later_hidden() -> None:
    audit = PageAudit(SRC)
    audit.record(_outcome(1, 1.0, [7], [3], KVPoll.Failed, None))
    audit.record(_outcome(2, 2.0, [7], [5], KVPoll.Success, True))
    (text,) = audit.check_pages(_Peer({7: "src3"}).digest, "s", [7])
    assert "room 1" in text and "before the page was reused" in text


@pytest.mark.parametrize(
    ("history", "actual"),
    [
        # The last verified room's bytes.
        ([(1, KVPoll.Success, True, 3)], "src3"),
        # A later room failed part-way: its bytes or the verified room's.
        ([(1, KVPoll.Success, True, 3), (2, KVPoll.Failed, None, 9)], "src9"),
        ([(1, KVPoll.Success, True, 3), (2, KVPoll.Failed, None, 9)], "src3"),
        # A later room succeeded but could not be verified.
        ([(1, KVPoll.Success, True, 3), (2, KVPoll.Success, None, 9)], "src9"),
    ],
)
def test_page_audit_accepts_what_a_correct_sender_leaves(
    history: list[tuple[int, KVPoll, bool | None, int]], actual: str
) -> None:
    audit = PageAudit(SRC)
    for i, (room, status, verified, src) in enumerate(history):
        audit.record(_outcome(room, float(i), [0], [src], status, verified))
    report = audit.check(_Peer({0: actual}).digest)
    assert report.violations == () and report.judged == 1


def test_page_audit_does_not_judge_unverified_or_reset_pages() -> None:
    audit = PageAudit(SRC)
    audit.record(_outcome(1, 1.0, [0], [3], KVPoll.Failed, None))  # never verified
    audit.record(_outcome(2, 1.0, [1], [4], KVPoll.Success, True))
    audit.peer_reset("s", 5.0)  # the peer lost its pages after room 2
    report = audit.check(_Peer({0: "junk", 1: "zero"}).digest)
    assert report.violations == () and report.judged == 0 and report.unjudged == 2


def test_page_audit_reports_bytes_of_no_room() -> None:
    audit = PageAudit(SRC)
    audit.record(_outcome(1, 1.0, [0], [3], KVPoll.Success, True))
    (text,) = audit.check(_Peer({0: "torn"}).digest).violations
    assert "bytes of no room" in text


# ---------------------------------------------------------------------- judging failures


def test_judge_failure_allows_only_the_contract() -> None:
    stored = RuntimeError("the room's own")
    assert judge_failure(stored, stored, None) is None
    assert judge_failure(KVTransferError(1, "x"), None, None) is None
    if TRANSPORT_ERRORS:
        assert judge_failure(nixl_error("nixlBackendError"), None, None) is None
    assert judge_failure(KeyError(1), stored, None) is not None
    assert judge_failure(AttributeError("x"), None, None) is not None
    # An equal-looking but different object (another opening's exception) is not allowed.
    assert judge_failure(RuntimeError("the room's own"), stored, None) is not None


# ---------------------------------------------------------------------- real NIXL


@pytest.fixture
def rig(
    sender_pool: SenderPool, decode_peer: Any
) -> Iterator[tuple[FaultInjectingTransport, SenderPool, Any]]:
    sender_pool.transport.add_peer(SESSION, decode_peer.metadata())
    injector = FaultInjectingTransport(sender_pool.transport, seed=5)
    try:
        yield injector, sender_pool, decode_peer
    finally:
        injector.close()


def _driver(mgr: KVManager, peer: Any) -> SchedulerDriver:
    return SchedulerDriver(mgr, {SESSION: NUM_PAGES}, lambda s, p: peer.page_digest(p))


class _Tracker:
    """Which room last used each page, and whether pages are handed out while draining."""

    def __init__(self, mgr: KVManager) -> None:
        self.mgr = mgr
        self.last: dict[int, RoomHandle] = {}
        self.handles: dict[int, RoomHandle] = {}
        self.reused_while_draining: list[tuple[int, int]] = []

    def on_conclude(self, o: RoomOutcome) -> None:
        for page in o.dst_pages:
            self.last[page] = self.handles[o.room]

    def before_reuse(self, session_id: str, pages: Sequence[int]) -> None:
        for page in pages:
            handle = self.last.get(page)
            if handle is not None and self.mgr.draining(handle):
                self.reused_while_draining.append((page, handle.room))


def _tracked_factory(tracker: _Tracker) -> Any:
    def make(mgr: KVManager, room: int, sessions: Sequence[str], infos: Sequence[Any]) -> Any:
        sender = NixlKVSender(mgr, room, sessions, infos)
        tracker.handles[room] = sender.handle
        return sender

    return make


@requires_nixl
@pytest.mark.nixl
@pytest.mark.timeout(60)
@pytest.mark.parametrize("rule", ["drain", "quarantine"])
def test_driver_reuses_a_failed_rooms_pages_only_once_drained(
    rig: tuple[FaultInjectingTransport, SenderPool, Any], rule: str, fast_switch: None
) -> None:
    """Every room is aborted after a chunk while its delayed writes are still in flight.
    The drain rule holds its pages back until they drained; the old quarantine (planted,
    0 s) hands them to the next room at once."""
    injector, sp, peer = rig
    injector.set_delay(1.0, 0.2)
    with KVManager(injector, sp.pool, num_workers=8, transfer_timeout_s=5.0) as mgr:
        tracker = _Tracker(mgr)
        driver = SchedulerDriver(
            mgr, {SESSION: 32}, lambda s, p: peer.page_digest(p),
            sender_factory=_tracked_factory(tracker),
        )  # fmt: skip
        driver.on_conclude = tracker.on_conclude
        driver.before_reuse = tracker.before_reuse
        cfg = DriverConfig(
            rooms=24, chunks=2, max_active=4, seed=9, abort_rate=1.0, reuse="lifo",
            abort_lag_s=0.02, release_rule=rule, quarantine_s=0.0, deadline_s=30,
        )  # fmt: skip
        result = driver.run(cfg)
        assert result.failed == 24 and result.unconcluded == 0 and not result.escaped
        drained = sum(o.draining > 0 for o in result.outcomes)
        print(f"{drained} of 24 rooms had writes in flight at their purge; rule={rule}")
        assert drained  # writes were in flight at the purge
        assert driver.wait_pages(5.0)
        assert mgr.wait_drained(None, 5.0)
    assert injector.quiesce(5.0)
    if rule == "drain":
        assert tracker.reused_while_draining == []
    else:
        assert tracker.reused_while_draining, "the planted quarantine was not caught"


class _KeyErrorSender(NixlKVSender):
    """Planted: failure_exception lets a KeyError escape (a check-then-pop without its lock
    would)."""

    def failure_exception(self) -> NoReturn:
        self.clear()
        raise KeyError(self.bootstrap_room)


@requires_nixl
@pytest.mark.nixl
@pytest.mark.timeout(60)
@pytest.mark.parametrize("planted", [False, True])
def test_driver_records_a_failure_exception_of_a_foreign_type(
    rig: tuple[FaultInjectingTransport, SenderPool, Any], planted: bool
) -> None:
    injector, sp, peer = rig
    with KVManager(injector, sp.pool, num_workers=2) as mgr:
        driver = _driver(mgr, peer)
        if planted:
            driver.sender_factory = _KeyErrorSender
        result = driver.run(DriverConfig(rooms=6, chunks=2, seed=3, abort_rate=1.0))
    assert result.failed == 6
    contract = [e for e in result.escaped if e.startswith(CONTRACT_PREFIX)]
    if planted:
        assert len(contract) == 6 and all("KeyError" in e for e in contract), result.escaped
    else:
        assert result.escaped == ()
        assert {o.error for o in result.outcomes} == {"KVTransferError"}


@requires_nixl
@pytest.mark.nixl
@pytest.mark.timeout(60)
def test_delayed_write_released_before_its_post_still_lands(
    rig: tuple[FaultInjectingTransport, SenderPool, Any],
) -> None:
    injector, sp, peer = rig
    injector.set_delay(1.0, 0.1)
    xfer = injector.write_pages(SESSION, [5, 6], [40, 41], b"late", timeout_s=5)
    assert xfer.poll() == "PROC"
    xfer.release()  # before its post: NIXL could not cancel it either
    assert injector.quiesce(5.0)
    assert peer.page_digest([40, 41]) == sp.digests([5, 6])
    st = injector.stats()
    assert st.delayed == 1 and st.posted_after_release == 1
    assert sp.transport.stats().live_transfers == 0
    # A delayed write polled to the end is the real transfer.
    injector.set_delay(1.0, 0.05)
    xfer = injector.write_pages(SESSION, [7], [42], timeout_s=5)
    end = time.monotonic() + 5
    while xfer.poll() != "DONE":
        assert time.monotonic() < end
        time.sleep(0.001)
    xfer.release()
    assert peer.page_digest([42]) == sp.digests([7])
    assert np.array_equal(peer.pool[42].numpy(), sp.pool[7].numpy())


@requires_nixl
@pytest.mark.nixl
@pytest.mark.timeout(60)
def test_driver_retries_a_refused_footprint_while_the_lock_is_busy_not_a_fixed_count(
    rig: tuple[FaultInjectingTransport, SenderPool, Any],
) -> None:
    """Under ``lock_timeout=10 ms`` a busy staging lock refuses ``footprint()``; the driver
    must try again as long as its run may take (it once gave up after 5 refusals, and a
    loaded machine's reader held the lock longer). Deterministic: the holder gives the lock
    back only once the lock counted more refusals than the old limit (lock stats), and once
    the run's deadline has passed a lock still held is reported."""
    import threading

    from staging.context import StagingContext

    injector, sp, peer = rig
    staging = StagingContext(lock_timeout=0.01, debug=True)
    with KVManager(injector, sp.pool, num_workers=2, staging=staging) as mgr:
        driver = _driver(mgr, peer)
        lock = staging.lock
        done = threading.Event()
        refusals = 8  # more than the old fixed 5

        def hold() -> None:
            lock.acquire_write_untimed()
            try:
                end = time.monotonic() + 30.0  # bounded; normally milliseconds
                while lock.stats().timeouts < refusals and not done.is_set():
                    assert time.monotonic() < end, "the driver stopped asking"
                    time.sleep(0.001)
            finally:
                lock.release_write()

        holder = threading.Thread(target=hold, name="holder", daemon=True)
        holder.start()
        while not lock.stats().write_acquisitions:  # the holder has it
            time.sleep(0.001)
        escaped: list[str] = []
        try:
            assert driver._footprint(12345, 0, escaped) == ()
        finally:
            done.set()
            holder.join(10.0)
        assert not holder.is_alive()
        assert escaped == [], escaped
        assert driver.footprint_retries >= refusals
        # Past the run's deadline a lock still held is reported, not waited for.
        done.clear()
        refusals = 1 << 30  # the holder keeps it until told
        holder = threading.Thread(target=hold, name="holder-2", daemon=True)
        before = lock.stats().write_acquisitions
        holder.start()
        while lock.stats().write_acquisitions == before:
            time.sleep(0.001)
        try:
            driver._deadline = time.monotonic()
            assert driver._footprint(12345, 0, escaped) == ()
        finally:
            done.set()
            holder.join(10.0)
        assert not holder.is_alive()
        assert len(escaped) == 1 and "LockTimeoutError" in escaped[0], escaped
