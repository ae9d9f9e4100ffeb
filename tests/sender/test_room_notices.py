"""Room notices: the prefill side tells each decode session when a room fails or is cleared
before ``Success`` (wire format and decode-side contract: docs/PROTOCOL.md section 3).

* the wire format (``sender.notices``): round trip, and refusal of malformed messages and of
  other versions (unit, no NIXL);
* the decode side (``stress.harness.peer.DecodePeer``, in process over real NIXL): notices are kept
  apart from per-transfer notifications, malformed ones are counted and dropped without
  stopping the pump, the history is capped, assigned pages are freed by a notice;
* the control channel (``PeerProcess``): paged ``room_notices`` and the page ledger;
* end to end over real NIXL with a peer process: a room aborted with chunks in flight is
  told only after those chunks drained (its pages already hold their bytes when the notice is
  learnt; a sender that tells at the purge is caught), a room cleared before ``Success`` is
  told ``cleared``, a ``Success`` room is told nothing, and toward a dead peer the notices
  are counted as failed while ``clear()``/``failure_exception()`` stay fast and never raise
  anything but the room's error;
* the stress suite's ``decode-told`` check catches a missing notice, a wrong outcome and a
  ``Success`` room told failed (planted by sending notices by hand).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import numpy as np
import pytest

from sender.notices import (
    CODES,
    MAX_NOTICE_BYTES,
    OUTCOMES,
    PREFIX,
    NoticeError,
    RoomNotice,
    decode_notice,
    is_notice,
)
from sender.notifier import Notifier
from sender.poll import KVPoll
from tests.fixtures_nixl import PAGE_BYTES, SenderPool, make_sender_pool, requires_nixl
from tests.interleave import explore
from tests.sender._instant_transport import InstantTransport, _mem_manager
from tests.sender._stub_transport import BOUND_S, StubTransport, _sender, _stub_manager, _stub_wait

# --------------------------------------------------------------------------- wire format


@pytest.mark.timeout(10)
def test_round_trip_of_every_outcome_and_code() -> None:
    for outcome in OUTCOMES:
        for code in CODES:
            notice = RoomNotice(2**40 + 3, 17, outcome, code)
            wire = notice.encode()
            assert wire.startswith(PREFIX) and is_notice(wire) and len(wire) <= MAX_NOTICE_BYTES
            assert decode_notice(wire) == notice
            assert decode_notice(bytes(bytearray(wire))) == notice
    assert decode_notice(b'NXSTG-ROOM/1 {"gen":0,"room":5,"code":"timeout","outcome":"failed",'
                         b'"extra":1}') == RoomNotice(5, 0, "failed", "timeout")  # fmt: skip


BAD_MESSAGES: list[tuple[str, Any]] = [
    ("other version", b'NXSTG-ROOM/2 {"room":1,"gen":1,"outcome":"failed","code":"aborted"}'),
    ("version 10", b'NXSTG-ROOM/10 {"room":1,"gen":1,"outcome":"failed","code":"aborted"}'),
    ("no space after the version",
     b'NXSTG-ROOM/1{"room":1,"gen":1,"outcome":"failed","code":"aborted"}'),
    ("per-transfer notification", b"room=1;chunk=0;last=1"),
    ("bad json", PREFIX + b"{not json"),
    ("not utf-8", PREFIX + b'{"room":1,"gen":1,"outcome":"\xff","code":"aborted"}'),
    ("deep nesting", PREFIX + b"[" * 240 + b"]" * 240),
    ("too long", PREFIX + b'{"room":1,"gen":1,"outcome":"failed","code":"aborted","pad":"'
     + b"x" * MAX_NOTICE_BYTES + b'"}'),
    ("not an object", PREFIX + b"[1, 1, \"failed\", \"aborted\"]"),
    ("missing gen", PREFIX + b'{"room":1,"outcome":"failed","code":"aborted"}'),
    ("bool room", PREFIX + b'{"room":true,"gen":1,"outcome":"failed","code":"aborted"}'),
    ("negative gen", PREFIX + b'{"room":1,"gen":-1,"outcome":"failed","code":"aborted"}'),
    ("float room", PREFIX + b'{"room":1.0,"gen":1,"outcome":"failed","code":"aborted"}'),
    ("string gen", PREFIX + b'{"room":1,"gen":"1","outcome":"failed","code":"aborted"}'),
    ("unknown outcome", PREFIX + b'{"room":1,"gen":1,"outcome":"done","code":"aborted"}'),
    ("unknown code", PREFIX + b'{"room":1,"gen":1,"outcome":"failed","code":"oops"}'),
    ("a str, not bytes", '{"room":1,"gen":1,"outcome":"failed","code":"aborted"}'),
]  # fmt: skip


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("name", "message"), BAD_MESSAGES, ids=[b[0] for b in BAD_MESSAGES])
def test_malformed_and_other_versions_are_refused(name: str, message: Any) -> None:
    with pytest.raises(NoticeError):
        decode_notice(message)


@pytest.mark.timeout(10)
def test_encode_refuses_fields_out_of_their_domain() -> None:
    for bad in [RoomNotice(-1, 0, "failed", "aborted"), RoomNotice(1, 0, "ok", "aborted"),
                RoomNotice(1, 0, "failed", "nope"), RoomNotice(True, 0, "failed", "aborted")]:
        with pytest.raises(NoticeError):
            bad.encode()  # fmt: skip


# --------------------------------------------------------------------------- decode side


def _notice(room: int, gen: int, outcome: str = "failed", code: str = "aborted") -> bytes:
    return RoomNotice(room, gen, outcome, code).encode()


@pytest.fixture
def linked_peer(nixl_required: None) -> Iterator[tuple[Any, SenderPool]]:
    """An in-process DecodePeer (history capped at 4) and a sender transport linked to it
    as session ``"d"``."""
    from stress.harness.peer import DecodePeer

    peer = DecodePeer("decode-notices", 16, 64, max_failed_rooms=4)
    sp = make_sender_pool(16, 64)
    try:
        sp.transport.add_peer("d", peer.metadata())
        yield peer, sp
    finally:
        sp.transport.close()
        peer.close()


@requires_nixl
@pytest.mark.timeout(30)
def test_decode_peer_learns_notices_apart_from_transfer_notifications(
    linked_peer: tuple[Any, SenderPool], thread_excepthook: list[Any]
) -> None:
    peer, sp = linked_peer
    tx = sp.transport
    # Garbage first: every malformed or other-version notice is counted and dropped.
    bad = [m for _, m in BAD_MESSAGES if isinstance(m, bytes) and m.startswith(b"NXSTG-ROOM/")]
    for message in bad:
        tx.send_notif("d", message)
    tx.send_notif("d", b"room=7;chunk=0;last=1")  # a per-transfer notification
    assert peer.assign_pages(7, 3, [1, 2, 3]) is True
    assert peer.free_pages() == []
    sent_at = time.monotonic()
    tx.send_notif("d", _notice(7, 3, "failed", "timeout"))
    learnt = peer.wait_room_failed(7, 3, 5.0)
    assert learnt is not None and (learnt.outcome, learnt.code) == ("failed", "timeout")
    assert sent_at <= learnt.learnt_at <= time.monotonic()  # order on one clock, no duration
    stats = peer.notice_stats()
    assert stats.refused == len(bad) and stats.learnt == 1, stats
    # The pump kept the two kinds apart; the notice freed the room's pages.
    assert peer.notifs() == {tx.name: [b"room=7;chunk=0;last=1"]}
    assert peer.free_pages() == [1, 2, 3] and stats.pages_freed == 3
    # A per-transfer notification arriving after the notice changes nothing (the notice wins)
    tx.send_notif("d", b"room=7;chunk=1;last=1")
    assert peer.wait_notif(b"room=7;chunk=1;last=1", 5.0)
    assert peer.room_failed(7, 3) == learnt and peer.room_failed(7, 4) is None
    # A duplicate keeps the first; pages assigned to an opening already told are free at once.
    tx.send_notif("d", _notice(7, 3, "cleared", "cleared"))
    tx.send_notif("d", _notice(8, 1))
    assert peer.wait_room_failed(8, 1, 5.0) is not None
    assert peer.room_failed(7, 3) == learnt and peer.notice_stats().duplicates == 1
    assert peer.assign_pages(8, 1, [4, 5]) is False and peer.free_pages() == [1, 2, 3, 4, 5]
    assert peer.assign_pages(9, 1, [1, 2]) is True and peer.free_pages() == [3, 4, 5]
    assert peer.release_pages(9, 1) == (1, 2) and peer.free_pages() == [1, 2, 3, 4, 5]
    # The history is capped (4 here): the oldest are dropped and counted; seq has no gaps.
    for room in range(10, 14):
        tx.send_notif("d", _notice(room, 1, "cleared", "cleared"))
    assert peer.wait_room_failed(13, 1, 5.0) is not None
    assert list(peer.failed_rooms()) == [(10, 1), (11, 1), (12, 1), (13, 1)]
    records, more, first = peer.room_notices(since=0, limit=3)
    assert [r.seq for r in records] == [3, 4, 5] and more and first == 3
    assert peer.room_notices(since=5)[0][0].room == 13
    assert peer.notice_stats().dropped == 2
    from sender.errors import TransportParamError

    with pytest.raises(TransportParamError, match="room and gen"):
        peer.assign_pages(-1, 0, [1])
    assert not thread_excepthook


# --------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def shared_peer() -> Iterator[Any]:
    """One decode peer process for the end-to-end tests below (each uses its own rooms and
    pages; each starts its own sender agent)."""
    from sender import _nixl

    if not _nixl.AVAILABLE:
        pytest.skip(f"NIXL not importable: {_nixl.IMPORT_ERROR!r}")
    from stress.harness.peer import PeerProcess

    proc = PeerProcess(64, PAGE_BYTES, name="decode-notices", start_timeout_s=60.0)
    try:
        yield proc
    finally:
        proc.close()


class _Sender:
    """A sender agent linked to a peer process, a fault injector around it (for delayed
    writes) and a manager; everything closed by :meth:`close`."""

    def __init__(self, peer: Any, session: str = "d", **mgr_kw: Any) -> None:
        from sender.manager import KVManager
        from stress.harness.faults import FaultInjectingTransport

        self.session = session
        self.sp = make_sender_pool(64, PAGE_BYTES)
        self.tx = self.sp.transport
        self.tx.add_peer(session, peer.metadata)
        self.injector = FaultInjectingTransport(self.tx, points=())
        mgr_kw.setdefault("num_workers", 4)
        mgr_kw.setdefault("transfer_timeout_s", 5.0)
        self.mgr = KVManager(self.injector, self.sp.pool, **mgr_kw)

    def sender(self, room: int, dst: list[int]) -> Any:
        from sender.manager import make_transfer_info
        from sender.nixl_sender import NixlKVSender

        s = NixlKVSender(self.mgr, room, [self.session], [make_transfer_info(self.session, dst)])
        s.init(len(dst))
        return s

    def close(self) -> None:
        try:
            self.mgr.close()
        finally:
            self.injector.close()
            self.tx.close()


@pytest.fixture
def make_sender() -> Iterator[Callable[..., _Sender]]:
    made: list[_Sender] = []

    def make(peer: Any, **kw: Any) -> _Sender:
        made.append(_Sender(peer, **kw))
        return made[-1]

    yield make
    for s in made:
        s.close()


def _wait(cond: Callable[[], bool], timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() >= end:
            return False
        time.sleep(0.002)
    return True


DELAY_S = 0.3


def _order_problems(
    peer: Any, s: _Sender, room: int, dst: list[int], src: list[int], *, planted: bool
) -> list[str]:
    """Abort a room whose 4 chunks are all posted (each write held ``DELAY_S`` by the
    injector), purge it, then watch the peer: when it learns the notice, the room's pages must
    already hold the bytes the chunks wrote, and the notice must come after the writes. With
    ``planted`` the notice is sent by hand at the purge (a sender that does not wait for the
    drain; the manager's own notices are off). Returns what was wrong."""
    from sender.errors import KVTransferError

    zero = peer.page_digest(dst)
    want = s.sp.digests(src)
    s.injector.set_delay(1.0, DELAY_S, lambda n: n is not None and n.startswith(b"room=%d;" % room))
    snd = s.sender(room, dst)
    assert peer.assign_pages(room, snd.handle.generation, dst)
    posted_at = time.monotonic()
    for i in range(4):
        snd.send(src[2 * i : 2 * i + 2])
    assert _wait(lambda: s.mgr.stats().transfers_inflight == 4, 5.0), s.mgr.stats()
    snd.abort()
    with pytest.raises(KVTransferError, match="aborted"):
        snd.failure_exception()
    purged_at = time.monotonic()
    # Never blocks on the chunks in flight: they are all still draining (asserted below) and
    # their bytes not landed, though failure_exception() returned.
    if planted:
        s.tx.send_notif(s.session, _notice(room, snd.handle.generation))
    assert s.mgr.draining(snd.handle) == 4
    assert peer.page_digest(dst) == zero  # the writes are still held back
    problems: list[str] = []
    learnt = None
    end = time.monotonic() + 5.0
    while learnt is None and time.monotonic() < end:
        learnt = peer.failed_rooms().get((room, snd.handle.generation))
    if learnt is None:
        return ["the notice never arrived"]
    got = peer.page_digest(dst)  # right after learning it
    if got != want:
        late = sum(a != b for a, b in zip(got, want, strict=True))
        problems.append(f"{late} pages not yet written")
    if learnt.learnt_at < posted_at + DELAY_S:
        problems.append(f"learnt {(learnt.learnt_at - purged_at) * 1e3:.0f} ms after the purge, "
                        f"before the held writes were posted")  # fmt: skip
    if (learnt.outcome, learnt.code) != ("failed", "aborted"):
        problems.append(f"told {learnt}")
    if not set(dst) <= set(peer.free_pages()):
        problems.append("the room's pages were not freed")
    assert s.mgr.wait_drained(snd.handle, 5.0)
    return problems


@requires_nixl
@pytest.mark.nixl
@pytest.mark.timeout(60)
@pytest.mark.parametrize("planted", [False, True], ids=["manager", "planted-early-notice"])
def test_a_room_aborted_in_flight_is_told_only_after_its_chunks_drained(
    shared_peer: Any, make_sender: Callable[..., _Sender], planted: bool
) -> None:
    s = make_sender(shared_peer, notify_decode=not planted)
    room = 100 + int(planted)
    dst = list(range(8)) if not planted else list(range(8, 16))
    src = [3, 9, 12, 20, 33, 40, 41, 63]
    problems = _order_problems(shared_peer, s, room, dst, src, planted=planted)
    print(f"planted={planted}: {problems}")
    if planted:  # the check is not vacuous: telling at the purge is caught
        assert problems, "a notice sent at the purge went unnoticed"
    else:
        assert not problems, problems
        st = s.mgr.stats()
        assert (st.notices_sent, st.notices_failed) == (1, 0)


@requires_nixl
@pytest.mark.nixl
@pytest.mark.timeout(60)
def test_cleared_rooms_are_told_cleared_and_success_rooms_nothing(
    shared_peer: Any, make_sender: Callable[..., _Sender]
) -> None:

    s = make_sender(shared_peer)
    peer = shared_peer
    # Cleared before Success: one chunk of four sent and done, then clear().
    cleared = s.sender(200, list(range(16, 24)))
    cleared.send([1, 2])
    assert _wait(lambda: s.mgr.stats().chunks_done == 1, 5.0)
    cleared.clear()
    # Success: every chunk, then clear().
    ok = s.sender(201, list(range(24, 28)))
    ok.send([5, 6])
    ok.send([7, 8])
    assert _wait(lambda: ok.poll() is KVPoll.Success, 5.0)
    ok.clear()
    # Cleared before init: opened and dropped (a cancelled request).
    from sender.nixl_sender import NixlKVSender

    bare = NixlKVSender(s.mgr, 202, [s.session])
    bare.clear()
    gen = {r.bootstrap_room: r.handle.generation for r in (cleared, ok, bare)}
    for room in (200, 202):
        learnt = peer.wait_room_failed(room, gen[room], 5.0)
        assert learnt is not None and (learnt.outcome, learnt.code) == ("cleared", "cleared")
    time.sleep(0.2)  # a notice for the Success room would have come by now
    assert (201, gen[201]) not in peer.failed_rooms()
    assert s.mgr.stats().notices_sent == 2


@requires_nixl
@pytest.mark.nixl
@pytest.mark.timeout(60)
def test_notices_to_a_dead_peer_are_counted_and_never_block_or_raise(
    peer_factory: Callable[..., Any], make_sender: Callable[..., _Sender]
) -> None:
    """A peer that died: once a transfer to it reported the disconnect, notices to it are not
    sent at all (counted as skipped: no NIXL error line for them); nothing is sent on the
    caller's thread, nothing raises, nothing hangs ``close()``. (A notice sent before anyone
    noticed the death may even "succeed": NIXL reports that send's failure asynchronously.)"""
    from sender.errors import TRANSPORT_ERRORS, KVTransferError

    peer = peer_factory(64, PAGE_BYTES)
    s = make_sender(peer)
    peer.kill()
    senders: list[str] = []
    agent = s.tx._agent  # the real NIXL agent, wrapped: who calls it is recorded
    real_send = agent.send_notif

    def send_notif(*args: Any, **kw: Any) -> Any:
        senders.append(threading.current_thread().name)
        return real_send(*args, **kw)

    agent.send_notif = send_notif
    failed = s.sender(300, list(range(4)))
    failed.send([1, 2])
    failed.send([3, 4])
    assert _wait(lambda: failed.poll() is KVPoll.Failed, 5.0)
    assert s.tx.peer_disconnected(s.session)  # the transfer reported it
    with pytest.raises((KVTransferError, *TRANSPORT_ERRORS)):
        failed.failure_exception()
    cleared = s.sender(301, list(range(4, 8)))
    cleared.clear()
    cleared.clear()  # idempotent
    assert _wait(lambda: s.mgr.stats().notices_skipped_dead >= 2, 5.0), s.mgr.stats()
    st = s.mgr.stats()
    assert (st.notices_sent, st.notices_failed, st.notices_pending) == (0, 0, 0), st
    assert set(senders) <= {"kv-notifier"}, senders  # never the caller's thread
    mine = [t for t in threading.enumerate() if t.name.startswith("kv-")]
    s.mgr.close()
    assert not [t.name for t in mine if t.is_alive()]  # close() ended them: nothing hangs


@requires_nixl
@pytest.mark.nixl
@pytest.mark.timeout(60)
def test_control_channel_pages_the_notice_history(
    shared_peer: Any, make_sender: Callable[..., _Sender]
) -> None:
    from stress.harness.peer import PeerError

    peer = shared_peer
    s = make_sender(peer, notify_decode=False)
    base = peer.notice_stats().learnt
    for room in range(400, 405):
        s.tx.send_notif(s.session, _notice(room, 9, "cleared", "cleared"))
    assert peer.wait_room_failed(404, 9, 5.0) is not None
    seen, since, pages = [], 0, 0
    while True:
        page = peer.room_notices(since, limit=2)
        pages += 1
        seen += [(r.room, r.gen) for r in page.records]
        since = page.next
        if not page.more:
            break
    assert seen[-5:] == [(r, 9) for r in range(400, 405)] and pages >= 3
    assert page.stats.learnt == base + 5
    assert peer.assign_pages(404, 9, np.array([60, 61])) is False
    assert {60, 61} <= set(peer.free_pages())
    assert peer.release_pages(999, 1) == ()
    bad_args: list[dict[str, Any]] = [
        {"since": -1}, {"limit": 0}, {"limit": 10_000}, {"since": "x"}
    ]  # fmt: skip
    for bad in bad_args:
        with pytest.raises(PeerError):
            peer._call({"cmd": "room_notices", **bad})
    with pytest.raises(PeerError, match="room and gen"):
        peer._call({"cmd": "assign_pages", "room": "1", "gen": 0, "pages": [1]})


@requires_nixl
@pytest.mark.nixl
@pytest.mark.timeout(60)
def test_decode_told_check_catches_missing_wrong_and_unwanted_notices(
    shared_peer: Any, make_sender: Callable[..., _Sender]
) -> None:
    """The stress suite's ``decode-told`` check on a manager that sends no notice, with
    notices planted by hand: one room never told, one told the wrong outcome, one ``Success``
    room told failed: three violations; the rooms told correctly pass."""
    from stress.framework import Monitor
    from stress.invariants import DECODE_TOLD
    from stress.scenarios._sender_rig import NoticeTracker, TrackedManager

    peer = shared_peer
    s = make_sender(peer)
    s.mgr.close()
    tracker = NoticeTracker()
    s.mgr = TrackedManager(
        s.injector, s.sp.pool, num_workers=2, notify_decode=False, tracker=tracker
    )
    senders = {room: s.sender(room, [40 + room - 500]) for room in range(500, 505)}
    for room in (500, 501, 502):  # failed: told right, told "cleared", never told
        senders[room].abort()
        with pytest.raises(Exception, match="aborted"):
            senders[room].failure_exception()
    senders[503].clear()  # cleared before Success: told right
    senders[504].send([1])
    assert _wait(lambda: senders[504].poll() is KVPoll.Success, 5.0)
    senders[504].clear()
    gen = {room: snd.handle.generation for room, snd in senders.items()}
    for room, outcome in [(500, "failed"), (501, "cleared"), (503, "cleared"), (504, "failed")]:
        s.tx.send_notif(s.session, _notice(room, gen[room], outcome, "aborted"))
    s.mgr.close()
    monitor = Monitor("t", [DECODE_TOLD], duration_s=1.0, watchdog_s=10.0)
    counts = tracker.check(monitor, {s.session: peer}, s.mgr)
    report = {r.name: r for r in monitor.reports()}[DECODE_TOLD]
    assert report.violations == 3, report.examples
    assert (counts["judged"], counts["learnt"], counts["missing"]) == (4, 3, 1), counts
    assert (counts["outcome_mismatch"], counts["success_told"]) == (1, 1), counts
    assert any("502" in e and "not known" in e for e in report.examples)


@requires_nixl
@pytest.mark.nixl
@pytest.mark.timeout(60)
def test_decode_told_judges_a_room_aborted_after_success_as_a_success(
    shared_peer: Any, make_sender: Callable[..., _Sender]
) -> None:
    """A room that concluded ``Success`` inside the manager before the scheduler's ``abort()``
    (its last chunk ended between two scheduler steps) is purged ``Failed`` but is never
    notified (docs/PROTOCOL.md): ``decode-told`` must not call it missing, and must still
    call a "failed" notice of it a violation. (The check once judged it by the purge's
    status alone: two-hosts' notice rounds failed with "never sent" beside CPU hogs.)"""
    from stress.framework import Monitor
    from stress.invariants import DECODE_TOLD
    from stress.scenarios._sender_rig import NoticeTracker, TrackedManager

    peer = shared_peer
    s = make_sender(peer)
    s.mgr.close()
    tracker = NoticeTracker()
    s.mgr = TrackedManager(s.injector, s.sp.pool, num_workers=2, tracker=tracker)
    senders = {room: s.sender(room, [50 + room - 700]) for room in (700, 701)}
    for snd in senders.values():
        snd.send([1])
    # Success inside the manager, not yet seen by a poll; then the scheduler gives it up.
    assert _wait(lambda: all(s.mgr.status(r) is KVPoll.Success for r in senders), 5.0)
    for snd in senders.values():
        snd.abort()
        assert snd.poll() is KVPoll.Failed
        with pytest.raises(Exception, match="aborted"):
            snd.failure_exception()
    gen = senders[701].handle.generation
    s.tx.send_notif(s.session, _notice(701, gen, "failed", "aborted"))  # told, wrongly
    assert peer.wait_room_failed(701, gen, 10.0) is not None  # learnt before the check
    s.mgr.close()
    assert s.mgr.stats().notices_queued == 0  # neither is notified by the manager
    monitor = Monitor("t", [DECODE_TOLD], duration_s=1.0, watchdog_s=10.0)
    counts = tracker.check(monitor, {s.session: peer}, s.mgr)
    report = {r.name: r for r in monitor.reports()}[DECODE_TOLD]
    assert (counts["judged"], counts["missing"], counts["success_told"]) == (0, 0, 1), counts
    assert report.violations == 1 and "701" in report.examples[0], report.examples


# --------------------------------------------------------------------------- stress check


def _run_lifecycle(tmp_path: Any, *extra: str) -> tuple[int, dict[str, Any]]:
    """``python -m stress sender-lifecycle --duration 1 ... --json``: (status, scenario)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / f"stress{len(extra)}.json"
    proc = subprocess.run(
        [sys.executable, "-m", "stress", "sender-lifecycle", "--duration", "1", "--seed", "5",
         "--fault-rate", "0.05", "--progress", "off", "--json", str(out), *extra],
        cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )  # fmt: skip
    print(proc.stdout[-3000:])
    scenario: dict[str, Any] = json.loads(out.read_text())["scenarios"][0]
    return proc.returncode, scenario


@pytest.mark.slow
@requires_nixl
@pytest.mark.nixl
@pytest.mark.timeout(120)
def test_stress_decode_told_holds_and_catches_a_sender_that_tells_nobody(tmp_path: Any) -> None:
    """``decode-told`` in a real stress run: every failed room is learnt by the peer (and the
    latency is reported); with ``--plant-bug no-notices`` (managers made with
    ``notify_decode=False``) it reports every one of them, and nothing else fires."""
    metrics = tmp_path / "metrics.prom"
    rc, clean = _run_lifecycle(tmp_path, "--metrics", str(metrics))
    told = clean["extra"]["decode_told"]
    assert rc == 0 and clean["invariants"]["decode-told"]["violations"] == 0, told
    try:
        import prometheus_client  # noqa: F401
    except ModuleNotFoundError:
        pass
    else:  # the scrape after a run with faults: failures by reason, latency histograms
        text = metrics.read_text()
        assert 'nixl_staging_room_duration_seconds_count{outcome="success"}' in text, text[:500]
        assert "nixl_staging_room_outcomes_total{" in text and 'outcome="failed"' in text
        assert "nixl_staging_rooms_failed_total{" in text
    assert told["judged"] > 0 and told["learnt"] == told["judged"], told
    assert told["idle_latency_ms"]["p50"] is not None
    rc, planted = _run_lifecycle(tmp_path, "--plant-bug", "no-notices")
    told = planted["extra"]["decode_told"]
    fired = {k: v["violations"] for k, v in planted["invariants"].items() if v["violations"]}
    assert rc == 1 and told["judged"] > 0 and told["notices_sent"] == 0, told
    assert fired == {"decode-told": told["judged"]}, fired


@pytest.mark.nixl
@requires_nixl
@pytest.mark.timeout(60)
def test_close_withholds_the_notice_of_a_room_whose_writes_it_abandoned() -> None:
    """``close()`` gives up on writes still in flight after its timeout (NIXL cannot cancel
    them: they may still land). Their room must get no notice, since a notice tells the
    decode side it may reuse the pages. The first version sent it: the peer learnt
    ``cleared`` with the pages still zero, and the bytes landed 0.7 s later."""
    import torch

    from sender.manager import KVManager, make_transfer_info
    from sender.nixl_sender import NixlKVSender
    from stress.harness.faults import FaultInjectingTransport
    from stress.harness.peer import DecodePeer

    sp = make_sender_pool(64, PAGE_BYTES)
    peer = DecodePeer("d-abandon", 64, PAGE_BYTES)
    inj = FaultInjectingTransport(sp.transport, points=())
    try:
        sp.transport.add_peer("d", peer.metadata())
        inj.set_delay(1.0, 1.0)  # every write is posted 1 s late
        mgr = KVManager(inj, sp.pool, num_workers=2, transfer_timeout_s=5.0)  # type: ignore[arg-type]
        s = NixlKVSender(mgr, 1, ["d"], [make_transfer_info("d", [0, 1])])
        s.init(2)
        s.send([5, 6])
        deadline = time.monotonic() + 5
        while mgr.stats().transfers_inflight < 1:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        mine = [t for t in threading.enumerate() if t.name.startswith("kv-")]
        mgr.close(timeout_s=0.3)  # the workers still stop: no RuntimeError
        assert not [t.name for t in mine if t.is_alive()]
        st = mgr.stats()
        assert st.transfers_abandoned == 1 and st.notices_withheld == 1 and st.notices_sent == 0
        assert peer.wait_room_failed(1, s.handle.generation, 1.5) is None
        # The abandoned write does land later: exactly why no notice may be sent.
        end = time.monotonic() + 3
        while time.monotonic() < end and not torch.equal(peer.pool[0:2], sp.pool[5:7]):
            time.sleep(0.005)
        assert torch.equal(peer.pool[0:2], sp.pool[5:7])
    finally:
        inj.quiesce(3)
        inj.close()
        sp.transport.close()
        peer.close()


class _SlowNotices:
    """A real transport whose ``send_notif`` takes ``delay_s`` (a notifier on a loaded
    machine) and silently drops the notices of the rooms in ``drop`` (a lost notice: the
    call returns as if sent). Everything else is the real transport's."""

    def __init__(self, inner: Any, delay_s: float, drop: set[int]) -> None:
        self.inner = inner
        self.delay_s = delay_s
        self.drop = drop

    def send_notif(self, session_id: str, message: bytes) -> None:
        from sender.notices import decode_notice

        time.sleep(self.delay_s)
        if decode_notice(message).room in self.drop:
            return
        self.inner.send_notif(session_id, message)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.slow
@requires_nixl
@pytest.mark.nixl
@pytest.mark.timeout(120)
def test_decode_told_waits_for_the_notifier_backlog_and_still_finds_a_lost_notice(
    shared_peer: Any, make_sender: Callable[..., _Sender]
) -> None:
    """Issue 16's question, as a deterministic experiment: 30 rooms cleared, each notice
    taking 0.15 s to send, so the notifier's backlog outlasts ``close()`` and the old fixed
    2 s wait -- those notices are *late*, not lost, and the check must wait for them (it
    follows the backlog, ``stats().notices_pending``). One notice is really lost (dropped by
    the transport while the send returned): the check must still report it, as missing after
    it was sent."""
    from stress.framework import Monitor
    from stress.invariants import DECODE_TOLD
    from stress.scenarios._sender_rig import (
        TOLD_WAIT_S,
        NoticeTracker,
        TrackedManager,
        _NoticeClock,
    )

    peer = shared_peer
    s = make_sender(peer)
    s.mgr.close()
    tracker = NoticeTracker()
    lost_room = 604
    slow = _SlowNotices(s.injector, 0.15, {lost_room})
    s.mgr = TrackedManager(
        _NoticeClock(slow, tracker), s.sp.pool, num_workers=1, tracker=tracker  # type: ignore[arg-type]
    )
    senders = [s.sender(room, [room - 600]) for room in range(600, 630)]
    for snd in senders:
        snd.clear()  # cleared before Success: each is told "cleared"
    s.mgr.close(timeout_s=0.1)
    assert s.mgr.stats().notices_pending > 20, "the backlog did not outlast close()"
    monitor = Monitor("t", [DECODE_TOLD], duration_s=1.0, watchdog_s=10.0)
    counts = tracker.check(monitor, {s.session: peer}, s.mgr)
    report = {r.name: r for r in monitor.reports()}[DECODE_TOLD]
    assert (counts["judged"], counts["learnt"], counts["missing"]) == (30, 29, 1), counts
    assert report.violations == 1, report.examples
    assert str(lost_room) in report.examples[0] and "sent " in report.examples[0]
    assert counts["late"] > 0, f"no notice came later than {TOLD_WAIT_S} s: not a backlog"
    assert counts["notifier_stuck"] == 0


def _told_at_least(transport: StubTransport, n: int) -> bool:
    return len(transport.sent()) >= n


JOIN_S = 30.0


BLOCK_S = 0.05


NOTICE = RoomNotice(5, 1, "failed", "aborted")


def _ran(result: Any, label: str) -> None:
    print(f"{label}: {result.schedules} schedules, {result.blocked} blocked")
    assert result.schedules > 1, "the explorer ran no preempted schedule"
    assert not result.failures, result.failures[:3]


def _until(cond: Callable[[], bool], what: str, bound_s: float = JOIN_S) -> None:
    deadline = time.monotonic() + bound_s
    while not cond():
        assert time.monotonic() < deadline, f"{what} not within {bound_s:g} s"
        time.sleep(0.001)


class EnqueueVsStop:
    """A notice for two sessions is queued while ``stop`` runs on another thread. The send
    function checks, on the notifier thread, that the message it sends was counted queued."""

    made: ClassVar[list[Notifier]] = []  # every notifier, stopped at the end of the test

    def __init__(self) -> None:
        self.violations: list[str] = []
        self.notifier = Notifier(self._send)
        self.made.append(self.notifier)
        self.stopped: bool | None = None

    def _send(self, session_id: str, payload: bytes) -> None:
        c = self.notifier.counts()
        if c.pending < 1:
            self.violations.append(f"sending to {session_id} while counts say {c}")

    def enqueue(self) -> None:
        self.notifier.enqueue(NOTICE, ("d0", "d1"))

    def stop(self) -> None:
        self.stopped = self.notifier.stop(JOIN_S)

    def check(self) -> str | None:
        if self.violations:
            return "; ".join(self.violations)
        if not self.stopped:
            return "stop() did not see the notifier thread end"
        c = self.notifier.counts()
        told = (c.queued, c.sent, c.withheld) in ((2, 2, 0), (0, 0, 1))
        if c.pending != 0 or not told:
            return f"after stop() returned True: {c} (the notice neither sent nor withheld)"
        return None


class NotifyingTransport(InstantTransport):
    """The in-memory transport with ``send_notif`` (``block`` set: every send hangs until
    it is cleared, as a send to a partitioned peer can in NIXL) and ``peer_disconnected``
    (the sessions in ``dead``)."""

    def __init__(self, dead: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.dead = dead
        self.sent: list[tuple[str, bytes]] = []
        self.hang = threading.Event()
        self.release = threading.Event()
        self.entered = threading.Event()

    def send_notif(self, session_id: str, message: bytes) -> None:
        self.entered.set()
        if self.hang.is_set():  # longer than the test's closer waits (3 x JOIN_S)
            self.release.wait(3 * JOIN_S)
        self.sent.append((session_id, message))

    def peer_disconnected(self, session_id: str) -> bool:
        return session_id in self.dead


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("first_drains", ["first", "second"])
def test_a_notice_is_held_and_released_per_opening(workers: int, first_drains: str) -> None:
    """THREADING.md, Room notices; PROTOCOL.md 3: room 7 is cleared while its write is in
    flight (its notice is held), reopened, written to and cleared again while the first
    write still drains. Each opening gets its own notice, sent only once *its* write ended:
    while one opening drains, no notice of it may go out, and the other's notice is not
    lost. Drained in both orders; with workers the ends are seen on worker threads.

    Found by issue 33, item 0 (sentence (d): planted bugs an outside set got past).
    """
    transport = StubTransport()
    mgr = _stub_manager(transport, num_workers=workers)
    try:
        first = _sender(mgr, 7)
        first.send(np.array([3]))
        assert _stub_wait(lambda: len(transport.transfers) == 1)
        first.clear()
        second = _sender(mgr, 7)
        second.send(np.array([4]))
        assert _stub_wait(lambda: len(transport.transfers) == 2)
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
            assert _stub_wait(functools.partial(_told_at_least, transport, n + 1)), (
                f"no notice for gen {gen} once it drained: {transport.sent()} {mgr.stats()}"
            )
            time.sleep(0.02)  # a second, wrong notice would follow at once
            assert transport.sent() == told, (
                f"after gen {gen} drained the decode side was told {transport.sent()}, "
                f"expected {told}"
            )
    finally:
        mgr.close(1.0)


@pytest.mark.timeout(120)
def test_a_queued_notice_and_its_counters_change_together() -> None:
    """Found by issue 23, section 3 (planted bugs an outside set got past)."""
    try:
        result = explore(EnqueueVsStop, EnqueueVsStop.enqueue, EnqueueVsStop.stop,
                         EnqueueVsStop.check, block_s=BLOCK_S)  # fmt: skip
    finally:
        for notifier in EnqueueVsStop.made:
            assert notifier.stop(JOIN_S)
        EnqueueVsStop.made.clear()
    _ran(result, "notifier enqueue vs stop")


@pytest.mark.timeout(120)
def test_pending_notices_include_those_skipped_to_dead_peers() -> None:
    """Found by issue 23, section 3 (planted bugs an outside set got past)."""
    tx = NotifyingTransport(dead=frozenset({"dead"}))
    mgr = _mem_manager(tx)
    try:
        handle = mgr.open_room(5, ["dead", "live"])
        mgr.purge_room(handle)  # cleared before Success, nothing in flight: told at once
        _until(lambda: len(tx.sent) == 1 and mgr.stats().notices_skipped_dead == 1,
               "the notifier handling both sessions")  # fmt: skip
        st = mgr.stats()
        assert st.notices_pending == 0, f"a notice skipped to a dead peer still pending: {st}"
        assert mgr.notifier.counts().pending == 0
    finally:
        mgr.close(0)


@pytest.mark.timeout(120)
def test_close_returns_while_a_notice_send_hangs() -> None:
    """``stop()``'s join is bounded: ``close()`` leaves a notifier blocked in a send behind
    (a daemon) instead of waiting for it.

    Found by issue 23, section 3 (planted bugs an outside set got past).
    """
    tx = NotifyingTransport()
    tx.hang.set()
    mgr = _mem_manager(tx)
    returned: list[bool] = []
    try:
        mgr.purge_room(mgr.open_room(5, ["d0"]))
        assert tx.entered.wait(JOIN_S), "the notifier never sent"
        def close() -> None:
            mgr.close(0.1)
            returned.append(True)

        closer = threading.Thread(target=close, daemon=True)
        closer.start()
        closer.join(JOIN_S)  # close() waits its 0.5 s grace, then leaves the notifier
        assert not closer.is_alive() and returned == [True], "close() waited for a hung send"
        notifier = mgr.notifier
        assert notifier.stop(0.05) is False, "stop() says the hung notifier thread ended"
    finally:
        tx.release.set()
        thread = mgr.notifier.thread
        assert thread is not None
        thread.join(JOIN_S)
        assert not thread.is_alive()
