"""One sender, two threads (issue 34, item 9; docs/THREADING.md, "Two threads on one
sender"): in debug mode a ``NixlKVSender`` notices a second thread entering its
scheduler-thread methods while a first one is inside, and says which two threads they are.

The first thread is held inside ``send()`` by a manager whose ``submit_chunk`` waits on an
event, so the overlap is certain, not a matter of timing. The transport is the in-memory
stand-in of ``tests/sender/_instant_transport.py``; inline mode (``num_workers=0``) starts no
thread.
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from sender.errors import ConcurrentSenderUseError, KVTransferError
from sender.manager import KVManager, make_transfer_info
from sender.nixl_sender import NixlKVSender
from sender.poll import KVPoll
from staging import StagingContext
from tests.sender._instant_transport import PAGE_BYTES, InstantTransport

pytestmark = pytest.mark.timeout(60)

JOIN_S = 10.0
"""Bound for a thread that only waits on an event this test sets: past it, it is stuck."""

SESSION = "d0"
PAGES = 4


class HoldingManager(KVManager):
    """``submit_chunk`` signals ``entered`` and then waits for ``release`` (bounded), so a
    thread calling ``send()`` stays inside it until the test lets it go."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.entered = threading.Event()
        self.release = threading.Event()
        self.hold = True

    def submit_chunk(self, *args: Any, **kw: Any) -> Any:
        if self.hold:
            self.entered.set()
            assert self.release.wait(JOIN_S), "the test never released the held send()"
        return super().submit_chunk(*args, **kw)


def _manager(debug: bool) -> HoldingManager:
    return HoldingManager(
        InstantTransport(),
        torch.zeros((PAGES, PAGE_BYTES), dtype=torch.uint8),
        num_workers=0,
        staging=StagingContext(lock="mutex"),
        debug=debug,
    )


@pytest.fixture
def debug_mgr() -> Iterator[HoldingManager]:
    mgr = _manager(debug=True)
    try:
        yield mgr
    finally:
        mgr.release.set()
        mgr.close()


def _sender(mgr: KVManager, room: int = 7) -> NixlKVSender:
    sender = NixlKVSender(mgr, room, [SESSION], [make_transfer_info(SESSION, range(PAGES))])
    sender.init(PAGES)
    return sender


def _send_in(sender: NixlKVSender, name: str, errors: list[BaseException]) -> threading.Thread:
    def run() -> None:
        try:
            sender.send(np.arange(2))
        except BaseException as exc:  # reported by the test's assertion on `errors`
            errors.append(exc)

    thread = threading.Thread(target=run, name=name)
    thread.start()
    return thread


def _joined(thread: threading.Thread) -> None:
    thread.join(JOIN_S)
    assert not thread.is_alive(), f"{thread.name} still running after {JOIN_S:g} s"


def test_a_second_thread_entering_send_is_told_both_threads(debug_mgr: HoldingManager) -> None:
    assert debug_mgr.debug is True
    sender = _sender(debug_mgr)
    errors: list[BaseException] = []
    first = _send_in(sender, "scheduler-A", errors)
    assert debug_mgr.entered.wait(JOIN_S), "scheduler-A never reached submit_chunk"

    raised: list[BaseException] = []

    def second() -> None:
        try:
            sender.send(np.arange(2, 4))
        except BaseException as exc:
            raised.append(exc)

    other = threading.Thread(target=second, name="scheduler-B")
    other.start()
    _joined(other)
    debug_mgr.release.set()
    _joined(first)

    assert errors == []
    assert len(raised) == 1 and isinstance(raised[0], ConcurrentSenderUseError), raised
    err = raised[0]
    assert isinstance(err, KVTransferError)
    text = str(err)
    assert "'scheduler-A'" in text and "'scheduler-B'" in text, text
    assert "called send()" in text and "inside send()" in text, text
    assert (err.method, err.other_method) == ("send", "send")
    assert err.thread.startswith("'scheduler-B'") and err.other_thread.startswith("'scheduler-A'")
    assert err.room == 7 and err.generation == sender.handle.generation
    copy = pickle.loads(pickle.dumps(err))
    assert type(copy) is ConcurrentSenderUseError and str(copy) == text
    assert copy.other_thread == err.other_thread
    # The refused call changed nothing: A's chunk counts, B's does not.
    assert sender._pages_sent == 2 and sender._chunk_idx == 1
    sender.send(np.arange(2, 4))  # the test thread now: a hand-over, no overlap
    assert sender.poll() is KVPoll.Success


def test_poll_and_abort_from_a_second_thread_fail_the_room_instead_of_raising(
    debug_mgr: HoldingManager,
) -> None:
    sender = _sender(debug_mgr)
    errors: list[BaseException] = []
    first = _send_in(sender, "scheduler-A", errors)
    assert debug_mgr.entered.wait(JOIN_S), "scheduler-A never reached submit_chunk"
    seen: list[object] = []

    def second() -> None:
        try:
            seen.append(sender.poll())
            sender.abort()
            seen.append("abort returned")
        except BaseException as exc:
            seen.append(exc)

    other = threading.Thread(target=second, name="monitor")
    other.start()
    _joined(other)
    debug_mgr.release.set()
    _joined(first)

    assert errors == []
    assert seen == [KVPoll.Failed, "abort returned"], seen
    assert sender.poll() is KVPoll.Failed  # the owner's next poll: the room failed
    with pytest.raises(ConcurrentSenderUseError, match=r"'monitor'.*called poll\(\)") as info:
        sender.failure_exception()
    assert "'scheduler-A'" in str(info.value) and "inside send()" in str(info.value)


def test_without_debug_mode_nothing_is_checked() -> None:
    mgr = _manager(debug=False)
    try:
        assert mgr.debug is False
        sender = _sender(mgr)
        assert sender._one_thread is None
        errors: list[BaseException] = []
        first = _send_in(sender, "scheduler-A", errors)
        assert mgr.entered.wait(JOIN_S), "scheduler-A never reached submit_chunk"
        seen: list[object] = []
        other = threading.Thread(target=lambda: seen.append(sender.poll()), name="monitor")
        other.start()
        _joined(other)
        mgr.release.set()
        _joined(first)
        assert errors == []
        assert seen == [KVPoll.WaitingForInput], seen  # not raised, not Failed
        mgr.hold = False
        sender.send(np.arange(2, 4))
        assert sender.poll() is KVPoll.Success
    finally:
        mgr.release.set()
        mgr.close()


def test_handing_a_sender_from_thread_to_thread_is_allowed(debug_mgr: HoldingManager) -> None:
    debug_mgr.hold = False
    sender = NixlKVSender(debug_mgr, 9, [SESSION], [make_transfer_info(SESSION, range(PAGES))])
    results: list[object] = []

    def step(name: str, call: Any) -> None:
        def run() -> None:
            try:
                results.append(call())
            except BaseException as exc:
                results.append(exc)

        thread = threading.Thread(target=run, name=name)
        thread.start()
        _joined(thread)  # one after the other: never two inside at once

    step("t-init", lambda: sender.init(PAGES))
    step("t-send-1", lambda: sender.send(np.arange(2)))
    step("t-send-2", lambda: sender.send(np.arange(2, 4)))
    step("t-poll", sender.poll)
    step("t-abort", sender.abort)  # after Success: fails nothing
    assert results == [None, None, None, KVPoll.Success, None], results
    assert sender.poll() is KVPoll.Success
    sender.clear()


class OverlapCounting(KVManager):
    """``init_room`` counts the threads inside it at once (``most``) and stays a moment, so
    an undetected second thread in ``NixlKVSender.init`` meets the first one there."""

    STAY_S = 0.15

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._count_lock = threading.Lock()
        self.inside = 0
        self.most = 0

    def init_room(self, *args: Any, **kw: Any) -> Any:
        with self._count_lock:
            self.inside += 1
            self.most = max(self.most, self.inside)
        try:
            threading.Event().wait(self.STAY_S)
            return super().init_room(*args, **kw)
        finally:
            with self._count_lock:
                self.inside -= 1


class TwoInits:
    """A debug-mode sender not yet ``init``-ed; two threads call its ``init``."""

    def __init__(self) -> None:
        self.mgr = OverlapCounting(
            InstantTransport(), torch.zeros((PAGES, PAGE_BYTES), dtype=torch.uint8),
            num_workers=0, staging=StagingContext(lock="mutex"), debug=True,
        )
        self.sender = NixlKVSender(
            self.mgr, 7, [SESSION], [make_transfer_info(SESSION, range(PAGES))]
        )
        self.refused: list[BaseException] = []

    def init(self) -> None:
        try:
            self.sender.init(PAGES)
        except (ConcurrentSenderUseError, ValueError) as exc:  # ValueError: init twice
            self.refused.append(exc)

    def check(self) -> str | None:
        try:
            if self.mgr.most > 1:
                return f"two threads inside init() at once, undetected; refused: {self.refused}"
            return None
        finally:
            self.mgr.close()


def test_two_threads_are_never_inside_at_once_at_every_preemption_point() -> None:
    """*Two threads on one sender*: 'a thread entering one of the five while another is
    inside one gets a ``ConcurrentSenderUseError``', so in debug mode two threads are never
    inside one sender's methods at once. The first thread calling ``init`` is stopped at
    every point of the library's code (``tests/interleave.py``), the second calls ``init``
    meanwhile; whatever the schedule, at most one thread reaches the manager."""
    from tests.interleave import explore

    result = explore(TwoInits, TwoInits.init, TwoInits.init, TwoInits.check, block_s=0.05)
    print(f"init vs init: {result.schedules} schedules, {result.blocked} blocked")
    assert result.schedules >= 2
    assert not result.failures, result.failures[:3]
