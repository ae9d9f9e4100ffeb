"""Sentences of the sender's contract that an outside set of planted bugs got past (issue 23,
section 3), each checked against the sentence; each planted violation is a ``make mutants``
id (``tools/mutants_sender.py``, ``tools/mutants_staging.py``):

* **Notifier.** A queued notice and its counters change together under the notifier's lock
  (``enqueue`` against ``stop`` at every preemption point: the notifier thread never sends
  a message not yet counted queued, and once ``stop`` returned ``True`` nothing is pending);
  the pending count includes notices skipped to dead peers; ``stop()``'s join is bounded
  (``close()`` returns while a notice send hangs in NIXL).
* **Staging pool.** A release names its lease: a stale (repeated) release never frees a slot
  another owner now holds (a holder's repeated release at every preemption point against a
  second acquirer).
* **Failure records.** A record is popped for its opening: ``pop_failure_record`` of a stale
  handle, at every preemption point against purge + reopen + a new failure, never takes the
  new opening's record.
* **Inline progress.** ``progress()`` polls the draining chunks: a purged room's in-flight
  chunk ends when another room's scheduler progresses (sequential).
* **Listeners.** ``FanOut`` survives a listener whose exception and whose own object have a
  raising ``__repr__``/``__str__`` (sequential, also through a manager).

The transport is the in-memory stand-in of ``tests/sender/test_dpor_clear.py`` (every step is
Python the explorer can stop); the same paths run over real NIXL in the other suites.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

from sender.events import FanOut
from sender.manager import KVManager, make_transfer_info
from sender.nixl_sender import NixlKVSender
from sender.notices import RoomNotice
from sender.notifier import Notifier
from staging import StagingContext
from staging.buffers import StagingBufferPool
from tests.interleave import explore
from tests.sender.test_dpor_clear import PAGE_BYTES, InstantTransport

pytestmark = pytest.mark.timeout(120)

JOIN_S = 30.0
"""A bound for a thread doing a handful of O(1) steps: past it, it is stuck (a deadlock or
an unbounded wait), on any machine."""
BLOCK_S = 0.05
"""See tests/staging/test_compat_views.py: only how long the second thread may wait for a lock
the stopped first one holds."""

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


# ------------------------------------------------------------------ notifier


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


def test_a_queued_notice_and_its_counters_change_together() -> None:
    try:
        result = explore(EnqueueVsStop, EnqueueVsStop.enqueue, EnqueueVsStop.stop,
                         EnqueueVsStop.check, block_s=BLOCK_S)  # fmt: skip
    finally:
        for notifier in EnqueueVsStop.made:
            assert notifier.stop(JOIN_S)
        EnqueueVsStop.made.clear()
    _ran(result, "notifier enqueue vs stop")


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


def _manager(transport: Any, **kw: Any) -> KVManager:
    return KVManager(
        transport,
        torch.zeros((8, PAGE_BYTES), dtype=torch.uint8),
        num_workers=0,
        staging=StagingContext(lock="mutex"),
        **kw,
    )


def test_pending_notices_include_those_skipped_to_dead_peers() -> None:
    tx = NotifyingTransport(dead=frozenset({"dead"}))
    mgr = _manager(tx)
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


def test_close_returns_while_a_notice_send_hangs() -> None:
    """``stop()``'s join is bounded: ``close()`` leaves a notifier blocked in a send behind
    (a daemon) instead of waiting for it."""
    tx = NotifyingTransport()
    tx.hang.set()
    mgr = _manager(tx)
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


# ------------------------------------------------------------------ staging pool


class StaleReleaseVsAcquire:
    """One slot. Holder A leases it and releases it twice (the second release is stale);
    B acquires meanwhile and keeps what it got."""

    def __init__(self) -> None:
        self.pool = StagingBufferPool(1, 1, PAGE_BYTES)
        self.b: Any = None

    def holder(self) -> None:
        slot = self.pool.try_acquire("A")
        if slot is None:
            return
        self.pool.release(slot)
        self.pool.release(slot)  # stale: the lease was returned already

    def acquirer(self) -> None:
        self.b = self.pool.try_acquire("B")

    def check(self) -> str | None:
        if self.b is None:
            return None
        held = self.pool.owner_slots("B")
        st = self.pool.stats()
        if held != 1 or st.in_use != 1 or st.free != 0:
            return f"B's slot was freed by A's stale release: owner_slots(B)={held}, {st}"
        return None


def test_a_stale_release_never_frees_a_slot_someone_else_holds() -> None:
    result = explore(StaleReleaseVsAcquire, StaleReleaseVsAcquire.holder,
                     StaleReleaseVsAcquire.acquirer, StaleReleaseVsAcquire.check,
                     block_s=BLOCK_S)  # fmt: skip
    _ran(result, "pool stale release vs acquire")


# ------------------------------------------------------------------ failure records


class StalePopVsReopen:
    """Room 5's first opening failed ("first"); thread 1 pops its record through the old
    handle while thread 2 purges it, reopens the id and fails the new opening ("second")."""

    def __init__(self) -> None:
        self.mgr = _manager(InstantTransport())
        self.old = self.mgr.open_room(5, ["d0"])
        assert self.mgr.record_failure(self.old, None, "first")
        self.popped: str | None = "not run"

    def pop(self) -> None:
        self.popped = self.mgr.pop_failure_record(self.old)

    def reopen(self) -> None:
        self.mgr.purge_room(self.old)
        new = self.mgr.open_room(5, ["d0"])
        assert self.mgr.record_failure(new, None, "second")

    def check(self) -> str | None:
        left = dict(self.mgr.failure_records)
        if self.popped not in ("first", None) or left != {5: "second"}:
            return (
                f"the stale handle popped {self.popped!r}; records left {left}: a record "
                "was popped by room id, not for its opening"
            )
        return None


def test_a_failure_record_is_popped_for_its_opening() -> None:
    result = explore(StalePopVsReopen, StalePopVsReopen.pop, StalePopVsReopen.reopen,
                     StalePopVsReopen.check, block_s=BLOCK_S)  # fmt: skip
    _ran(result, "pop_failure_record(stale) vs purge+reopen+fail")


# ------------------------------------------------------------------ inline progress


def test_progress_ends_a_purged_rooms_draining_chunk() -> None:
    tx = InstantTransport(states=["PROC"])
    mgr = _manager(tx)
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


# ------------------------------------------------------------------ listeners


class Unprintable(Exception):
    def __repr__(self) -> str:
        raise RuntimeError("repr of the listener's exception")

    def __str__(self) -> str:
        raise RuntimeError("str of the listener's exception")


class BrokenListener:
    def room_concluded(self, *args: Any) -> None:
        raise Unprintable()

    def chunk_ended(self, *args: Any) -> None:
        raise Unprintable()

    def __repr__(self) -> str:
        raise RuntimeError("repr of the listener")

    def __str__(self) -> str:
        raise RuntimeError("str of the listener")


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def room_concluded(self, *args: Any) -> None:
        self.events.append(("room", *args))

    def chunk_ended(self, *args: Any) -> None:
        self.events.append(("chunk", *args))


def test_fanout_survives_a_listener_that_cannot_be_printed() -> None:
    good = Recorder()
    fan = FanOut(BrokenListener(), good)
    fan.room_concluded(5, 1, "failed", "aborted", 0.1)
    fan.chunk_ended("d0", "done", 0.1, 16)
    st = fan.stats()
    assert (st.events, st.errors) == (2, 2) and st.last_error, st
    assert [e[0] for e in good.events] == ["room", "chunk"]
    # Through a manager: its caller sees nothing of it.
    good2 = Recorder()
    mgr = _manager(InstantTransport(), events=FanOut(BrokenListener(), good2))
    try:
        sender = NixlKVSender(mgr, 7, ["d0"], [make_transfer_info("d0", range(2))])
        sender.init(2)
        sender.send(np.array([0, 1]))
        mgr.progress(sender.handle)
        sender.poll()
        assert any(e[0] == "chunk" for e in good2.events), good2.events
    finally:
        mgr.close(0)
