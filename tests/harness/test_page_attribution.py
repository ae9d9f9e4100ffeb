"""Who wrote what a decode page holds: the page audit's attribution, stamped source pages
and the decode peer's log of landed writes (issue 23, section 1).

* The old audit named "the bytes of room X" by digest, i.e. by *prefill page*: rooms that
  send the same prefill page send the same bytes, so it named the last room in the page's
  history with those bytes even when another room (given another page) had sent them too.
  :func:`test_shared_prefill_bytes_are_not_pinned_on_a_room` feeds it such a history.
* Stamped sources (:mod:`stress.harness.stamps`) make every write's bytes unique: the audit then
  names the one write, and tells a stale write (a room given the page before the verified
  one) from a misdirected one (bytes meant for another page).
* A planted real overwrite (a stale stamped write landing after the page was handed on and
  verified) is still reported, by the digest and by the page's own stamp.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

from sender.manager import KVManager
from sender.poll import KVPoll
from stress.harness.driver import DriverConfig, RoomOutcome, SchedulerDriver
from stress.harness.landings import LandingLog
from stress.harness.stamps import STAMP_BYTES, Stamp, StampedSources, make_stamp, read_stamp
from stress.scenarios._page_audit import PageAudit
from tests.fixtures_nixl import NUM_PAGES, SenderPool, requires_nixl

SRC = [f"src{i}" for i in range(16)]  # digest of prefill page i (unstamped histories)


def _outcome(
    room: int,
    started: float,
    dst: Sequence[int],
    src: Sequence[int],
    status: KVPoll,
    verified: bool | None,
    sent: Sequence[str] = (),
    gen: int = -1,
) -> RoomOutcome:
    return RoomOutcome(
        room, "s", status, 0.01, None, verified, (), started + 0.01, started,
        tuple(dst), tuple(src), 0, False, gen, tuple(sent),
    )  # fmt: skip


class _Peer:
    def __init__(self, pages: dict[int, str], raw: dict[int, bytes] | None = None) -> None:
        self.pages = pages
        self.raw = raw or {}

    def digest(self, session_id: str, pages: Sequence[int]) -> list[str]:
        return [self.pages.get(p, "zero") for p in pages]

    def read(self, session_id: str, pages: Sequence[int]) -> bytes:
        return b"".join(self.raw.get(p, bytes(64)) for p in pages)


# ---------------------------------------------------------------------- unstamped histories


def test_shared_prefill_bytes_are_not_pinned_on_a_room() -> None:
    """Room 1 (Failed) sent prefill page 3 to decode page 7; room 2 was verified on page 7;
    room 3, given page 9, sent prefill page 3 as well. Page 7 now holds prefill page 3's
    bytes: room 1's stale write *or* room 3's misdirected one; the digest cannot tell. The
    old audit said "cross-room overwrite ... the bytes of room 1 (Failed)"."""
    audit = PageAudit(SRC)
    audit.record(_outcome(1, 1.0, [7], [3], KVPoll.Failed, None))
    audit.record(_outcome(2, 2.0, [7], [5], KVPoll.Success, True))
    audit.record(_outcome(3, 3.0, [9], [3], KVPoll.Success, True))
    (text,) = audit.check(_Peer({7: "src3", 9: "src3"}).digest).violations
    assert "holds the bytes of room 1" not in text, text
    assert "ambiguous" in text and "2 rooms" in text, text
    assert "room 1 (Failed) -> page 7" in text and "room 3 (Success) -> page 9" in text, text


def test_bytes_only_one_room_ever_sent_still_name_it() -> None:
    audit = PageAudit(SRC)
    audit.record(_outcome(1, 1.0, [7], [3], KVPoll.Failed, None))
    audit.record(_outcome(2, 2.0, [7], [5], KVPoll.Success, True))
    (text,) = audit.check(_Peer({7: "src3"}).digest).violations
    assert "cross-room overwrite" in text and "bytes of room 1 (Failed)" in text, text


# ---------------------------------------------------------------------- stamps


def test_stamp_round_trip_and_rejects() -> None:
    st = Stamp(room=976, generation=12345, chunk=3, dst_page=503)
    raw = make_stamp(st) + bytes(100)
    assert len(make_stamp(st)) == STAMP_BYTES == 32
    assert read_stamp(raw) == st and str(st).startswith("room 976 gen 12345 chunk 3")
    assert read_stamp(bytes(64)) is None and read_stamp(b"short") is None


def test_stamped_sources_are_exclusive_and_name_their_room() -> None:
    kv = torch.randint(
        0, 256, (8, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)
    )
    before = kv.clone()
    sources = StampedSources(kv, range(2, 8))
    a = sources.take(3)
    b = sources.take(3)
    assert sources.available() == 0 and not set(a.tolist()) & set(b.tolist())
    with pytest.raises(ValueError):
        sources.take(1)
    dig = sources.stamp(4, 9, a.tolist(), [10, 11, 12])
    for i, p in enumerate(a.tolist()):
        assert read_stamp(kv[p].numpy().tobytes()) == Stamp(4, 9, i, 10 + i)
        assert dig[i] == hashlib.blake2b(kv[p].numpy().tobytes(), digest_size=16).hexdigest()
        assert torch.equal(kv[p, STAMP_BYTES:], before[p, STAMP_BYTES:])  # the rest kept
    assert torch.equal(kv[:2], before[:2])  # pages left out are never stamped
    sources.give_back(a.tolist())
    assert sources.available() == 3
    with pytest.raises(ValueError):
        StampedSources(kv, [1, 1])


def _stamped(room: int, gen: int, chunk: int, dst: int) -> tuple[str, bytes]:
    raw = make_stamp(Stamp(room, gen, chunk, dst)) + bytes(32)
    return hashlib.blake2b(raw, digest_size=16).hexdigest(), raw


def test_planted_stale_stamped_write_is_reported_with_its_writer() -> None:
    """Planted real overwrite: room 1's write to page 7 lands after room 2 was given the
    page and verified. The finding names room 1's opening and chunk, from the digest and
    from the page's own stamp."""
    d1, raw1 = _stamped(1, 11, 0, 7)
    d2, _ = _stamped(2, 12, 0, 7)
    peer = _Peer({7: d1}, {7: raw1})
    audit = PageAudit(SRC, read=peer.read)
    audit.record(_outcome(1, 1.0, [7], [3], KVPoll.Failed, None, [d1], 11))
    audit.record(_outcome(2, 2.0, [7], [5], KVPoll.Success, True, [d2], 12))
    (text,) = audit.check(peer.digest).violations
    assert "cross-room overwrite" in text and "room 1 gen 11 (Failed) sent it (chunk 0)" in text
    assert "its stamp names room 1 gen 11 chunk 0 (sent to decode page 7)" in text, text


def test_misdirected_stamped_write_is_told_apart() -> None:
    d1, _ = _stamped(1, 11, 0, 7)
    d3, raw3 = _stamped(3, 13, 2, 9)
    peer = _Peer({7: d3, 4: "x", 5: "y", 9: d3}, {7: raw3})
    audit = PageAudit(SRC, read=peer.read, explain=lambda s, p: f"log of page {p}")
    audit.record(_outcome(1, 1.0, [7], [3], KVPoll.Success, True, [d1], 11))
    audit.record(_outcome(3, 3.0, [4, 5, 9], [0, 1, 3], KVPoll.Success, True, ["x", "y", d3], 13))
    (text,) = audit.check(peer.digest).violations
    assert "misdirected write" in text and "room 3 gen 13 (Success) sent to decode page 9" in text
    assert "log of page 7" in text, text


def test_late_landing_is_found_in_the_order_of_the_landing_log() -> None:
    """Planted real overwrite, covered again: room 1's write to page 7 lands after room 2's
    (given the page after it), then room 3's bytes cover it. The final bytes (room 3's,
    verified) look right; the landing log's order does not. Orders that the contract allows
    are not reported: each opening after the one before, a write landing twice in a row, an
    unstamped change (zeroed), a write of an opening not in the page's history (misdirected:
    the final-bytes audit's business), other pages."""
    from stress.harness.landings import Landing

    audit = PageAudit(SRC)
    for room, t, status in ((1, 1.0, KVPoll.Failed), (2, 2.0, KVPoll.Success),
                            (3, 3.0, KVPoll.Success)):  # fmt: skip
        audit.record(_outcome(room, t, [7, 8], [3, 4], status, status is KVPoll.Success,
                              gen=10 + room))  # fmt: skip

    def log(*rows: tuple[int, int, int]) -> list[Landing]:
        return [Landing(i + 1, 100.0 + i, page, room, gen, 0, page)
                for i, (page, room, gen) in enumerate(rows)]  # fmt: skip

    fine = log((7, 1, 11), (7, 1, 11), (7, 2, 12), (7, -1, -1), (8, 1, 11), (7, 3, 13),
               (8, 3, 13), (7, 9, 19))  # fmt: skip
    assert audit.late_landings("s", fine) == []
    late = log((7, 1, 11), (7, 2, 12), (7, 1, 11), (7, 3, 13), (8, 2, 12))
    (text,) = audit.late_landings("s", late)
    assert text.startswith("late landing: decode page 7 of 's'"), text
    assert "room 1 gen 11 (Failed) (chunk 0) landed at 102.000" in text, text
    assert "after the write of room 2 gen 12 (Success)" in text, text
    assert audit.late_landings("s", late) == [], "a finding is reported once per run"


def test_landing_log_records_each_stamped_write() -> None:
    pool = np.zeros((4, 64), dtype=np.uint8)
    log = LandingLog(pool, 0.001)
    try:
        pool[2, :STAMP_BYTES] = np.frombuffer(make_stamp(Stamp(5, 6, 1, 2)), np.uint8)
        end = time.monotonic() + 10
        while not log.records() and time.monotonic() < end:
            time.sleep(0.002)
        pool[2] = 0
        while len(log.records()) < 2 and time.monotonic() < end:
            time.sleep(0.002)
    finally:
        log.close()
    first, second = log.records()
    assert (first.page, first.room, first.generation, first.chunk, first.dst_page) == (
        2,
        5,
        6,
        1,
        2,
    )
    assert second.room == -1 and second.seq > first.seq and second.at >= first.at


# ---------------------------------------------------------------------- real NIXL


@requires_nixl
@pytest.mark.nixl
@pytest.mark.timeout(60)
def test_driver_with_stamped_sources_verifies_each_room_against_its_stamps(
    sender_pool: SenderPool, decode_peer: Any
) -> None:
    """Rooms over real NIXL with stamped sources: each succeeds, verified against its own
    stamped digests; every decode page's stamp names the room (opening) that used it last,
    and the page audit finds nothing."""
    sender_pool.transport.add_peer("s", decode_peer.metadata())
    sources = StampedSources(sender_pool.pool)
    with KVManager(sender_pool.transport, sender_pool.pool, num_workers=2) as mgr:
        audit = PageAudit(
            [""] * NUM_PAGES,
            read=lambda s, p: decode_peer.read_pages(list(p)),
        )
        driver = SchedulerDriver(
            mgr, {"s": 32}, lambda s, p: decode_peer.page_digest(list(p)), sources=sources
        )
        driver.on_conclude = audit.record
        result = driver.run(DriverConfig(rooms=12, chunks=4, max_active=4, seed=2, reuse="lifo"))
    assert result.succeeded == 12 and result.verify_failures == 0 and not result.escaped
    last: dict[int, RoomOutcome] = {}
    for o in result.outcomes:
        assert o.verified and len(o.sent_digests) == 4 and o.generation >= 0
        for p in o.dst_pages:
            last[p] = o
    for page, o in last.items():
        st = read_stamp(decode_peer.read_pages([page]))
        assert st is not None and (st.room, st.generation) == (o.room, o.generation)
        assert st.dst_page == page
    report = audit.check(lambda s, p: decode_peer.page_digest(list(p)))
    assert report.violations == () and report.judged == len(last)
    assert sources.available() == NUM_PAGES  # every source page came back


def _room_of(notif: bytes | None) -> int | None:
    if not notif or not notif.startswith(b"room="):
        return None
    return int(notif[5 : notif.index(b";")])


@requires_nixl
@pytest.mark.nixl
@pytest.mark.timeout(90)
@pytest.mark.parametrize("rule", ["drain", "quarantine"])
def test_planted_stale_write_over_real_nixl_is_caught_and_named(
    sender_pool: SenderPool, decode_peer: Any, rule: str, fast_switch: None
) -> None:
    """Planted real overwrite (``quarantine``, 0 s): the writes of rooms the scheduler aborts
    are delayed (posted 0.3 s late, as a TCP-queued write lands late), and their pages are
    handed to the next room at once. The next room succeeds and is verified; then the stale
    write lands. The audit must report it, naming the aborted opening by its stamp. With the
    drain rule nothing is reported (the same delays, the same rooms)."""
    from stress.harness.faults import FaultInjectingTransport

    sender_pool.transport.add_peer("s", decode_peer.metadata())
    injector = FaultInjectingTransport(sender_pool.transport, seed=5)
    aborted: set[int] = set()
    injector.set_delay(1.0, 0.3, select=lambda n: _room_of(n) in aborted)
    # Few source pages, so each is stamped again soon after its room released it: a stamp
    # handed out again too early would be caught (a late write then carries a new stamp).
    sources = StampedSources(sender_pool.pool, range(12))
    digest = lambda s, p: decode_peer.page_digest(list(p))  # noqa: E731
    try:
        with KVManager(injector, sender_pool.pool, num_workers=4, transfer_timeout_s=5.0) as mgr:
            audit = PageAudit([""] * NUM_PAGES, read=lambda s, p: decode_peer.read_pages(list(p)))
            driver = SchedulerDriver(mgr, {"s": 16}, digest, sources=sources)
            driver.on_conclude = audit.record
            found: list[str] = []  # judged right before each reuse, as the stress rigs do

            def before_reuse(session_id: str, pages: Sequence[int]) -> None:
                found.extend(audit.check_pages(digest, session_id, pages))

            driver.before_reuse = before_reuse

            def admitted(handle: Any, will_abort: bool) -> None:
                if will_abort:
                    aborted.add(handle.room)

            driver.on_admit = admitted
            cfg = DriverConfig(
                rooms=64, chunks=2, max_active=2, seed=11, abort_rate=0.5, abort_lag_s=0.01,
                reuse="lifo", release_rule=rule, quarantine_s=0.0, deadline_s=60,
            )  # fmt: skip
            result = driver.run(cfg)
            assert not result.escaped and result.unconcluded == 0
            assert driver.wait_pages(10.0) and mgr.wait_drained(None, 10.0)
        assert injector.quiesce(10.0)
        report = audit.check(digest)
        found.extend(report.violations)
    finally:
        injector.close()
    print(f"rule={rule}: {len(found)} findings, {result.verify_failures} verify failures")
    for text in found[:1]:
        print(text)
    if rule == "drain":
        assert found == [] and result.verify_failures == 0
        return
    assert found, "the planted stale writes were not caught"
    # A stale write carries what its source page holds when it is posted: the aborted
    # room's own stamp (a stale write to its old page), or, once the quarantine also gave
    # its source page to a later room, that room's stamp (bytes meant for another page; a
    # room still in flight is not recorded yet: "bytes of no room", named by the stamp).
    for text in found:
        assert "its stamp names room" in text, text
    stale = [t for t in found if "cross-room overwrite" in t and "(Failed) sent it" in t]
    named = {int(t.split("its stamp names room ")[1].split()[0]) for t in stale}
    assert named <= aborted, found
