"""Worker mode: what ``poll()`` returns agrees with the counters, the log and the listener.

A transfer worker ends a failed chunk in one write section of the room table (status
``Failed``, the chunk and room counted, the session failed) and emits the log lines and the
listener events of that section once the lock is released. A descheduled worker can sit
between the two for as long as the machine likes; the scheduler's ``poll()``, ``stats()``
and a scrape must not see the room ``Failed`` and the rest not yet. The test holds the
worker exactly there (right after the accounting section returned, before anything it
decided is emitted), deterministically, then checks everything the instant ``poll()``
returned ``Failed``. (On 3a76f2e ``sessions_failed`` was still 0 there, and no WARNING or
listener event had been made.)
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.fixtures_nixl import requires_nixl

pytestmark = [pytest.mark.timeout(90)]

HOLD_S = 30.0  # bound of every wait here; each one normally ends in milliseconds


class Recorder:
    """A listener that records every event (list appends: atomic under the GIL)."""

    def __init__(self) -> None:
        self.concluded: list[tuple[int, int, str, str]] = []
        self.ended: list[tuple[str, str]] = []
        self.threads: list[str] = []

    def room_concluded(
        self, room: int, generation: int, outcome: str, code: str, seconds: float
    ) -> None:
        self.concluded.append((room, generation, outcome, code))
        self.threads.append(threading.current_thread().name)

    def chunk_ended(self, session_id: str, outcome: str, seconds: float, nbytes: int) -> None:
        self.ended.append((session_id, outcome))


@pytest.mark.nixl
@requires_nixl
def test_poll_failed_in_worker_mode_agrees_with_counters_log_and_listener(
    peer_factory: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    import torch

    from sender.manager import KVManager, make_transfer_info
    from sender.nixl_sender import NixlKVSender
    from sender.poll import KVPoll
    from sender.transport import NixlTransport

    caplog.set_level(logging.WARNING, logger="sender")
    page_bytes = 4096
    peer = peer_factory(64, page_bytes)
    kv = torch.randint(0, 256, (64, page_bytes), dtype=torch.uint8)
    listener = Recorder()
    held, release = threading.Event(), threading.Event()
    with NixlTransport("publication-prefill") as tx:
        tx.register_region("kv", kv, page_bytes)
        tx.add_peer("dead", peer.metadata)
        with KVManager(tx, kv, num_workers=2, events=listener) as mgr:
            account = mgr.rooms.account_ends

            def held_after_the_section(*args: Any, **kwargs: Any) -> Any:
                after = account(*args, **kwargs)
                if not held.is_set() and any(end[1] is not None for end in args[0]):
                    held.set()  # the room is Failed now; nothing it decided is emitted yet
                    release.wait(HOLD_S)
                return after

            mgr.rooms.account_ends = held_after_the_section  # type: ignore[method-assign]
            peer.kill()
            s = NixlKVSender(mgr, 7, ["dead"], [make_transfer_info("dead", range(4))])
            s.init(4)
            s.send([0, 1, 2, 3])
            try:
                assert held.wait(HOLD_S), "no worker ended a failed chunk"
                assert s.poll() is KVPoll.Failed
                st = mgr.stats()
                warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
                told = list(listener.concluded)
                ended = list(listener.ended)
            finally:
                release.set()
            gen = s.handle.generation
            assert (st.rooms_failed, st.chunks_failed, st.sessions_failed) == (1, 1, 1), st
            assert st.rooms_failed_by_code.get("transport", 0) == 1, st.rooms_failed_by_code
            assert [t[:3] for t in told] == [(7, gen, "failed")], told
            assert ended == [("dead", "failed")], ended
            assert sum(f"room 7 generation {gen} failed" in m for m in warned) == 1, warned
            # The held worker finds its publication done and emits nothing twice.
            end = time.monotonic() + HOLD_S
            while mgr.rooms.pending_locked() and time.monotonic() < end:
                time.sleep(0.001)
            with pytest.raises(Exception):  # noqa: B017 (the transport error, by design)
                s.failure_exception()
            assert mgr.wait_drained(s.handle, timeout_s=10)
    assert [t[:3] for t in listener.concluded] == [(7, gen, "failed")], listener.concluded
    assert listener.ended == [("dead", "failed")], listener.ended
    assert sum(f"room 7 generation {gen} failed" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.nixl
@requires_nixl
def test_a_listener_reading_back_into_the_manager_does_not_wait_for_itself(
    peer_factory: Callable[..., Any],
) -> None:
    """A listener that calls ``stats()``/``status()`` (two threads at once may run one) reads
    while its own publication is in progress: it must not wait for it (nor for another
    thread's, which may be waiting on it)."""
    import torch

    from sender.manager import KVManager, make_transfer_info
    from sender.nixl_sender import NixlKVSender
    from sender.poll import KVPoll
    from sender.transport import NixlTransport

    page_bytes = 4096
    peer = peer_factory(64, page_bytes)
    kv = torch.randint(0, 256, (64, page_bytes), dtype=torch.uint8)
    seen: list[int] = []
    box: list[Any] = []

    class ReadsBack(Recorder):
        def room_concluded(
            self, room: int, generation: int, outcome: str, code: str, seconds: float
        ) -> None:
            super().room_concluded(room, generation, outcome, code, seconds)
            seen.append(box[0].stats().rooms_succeeded + box[0].stats().rooms_failed)
            box[0].status(room)

    with NixlTransport("publication-readback") as tx:
        tx.register_region("kv", kv, page_bytes)
        tx.add_peer("p", peer.metadata)
        with KVManager(tx, kv, num_workers=2, events=ReadsBack()) as mgr:
            box.append(mgr)
            senders = []
            for n in range(8):
                s = NixlKVSender(mgr, n, ["p"], [make_transfer_info("p", range(n * 4, n * 4 + 4))])
                s.init(4)
                s.send([0, 1])
                s.send([2, 3])
                senders.append(s)
            end = time.monotonic() + HOLD_S
            while any(s.poll() not in (KVPoll.Success, KVPoll.Failed) for s in senders):
                assert time.monotonic() < end, "rooms never concluded"
                time.sleep(0.001)
            assert all(s.poll() is KVPoll.Success for s in senders)
            assert len(seen) == 8 and min(seen) >= 1, seen


class _HoldAfterSection:
    """The room table's lock, unchanged, except that ``target`` is held right after one of
    its write sections released the lock (before anything else that thread does)."""

    def __init__(self, lock: Any) -> None:
        self._lock = lock
        self.target: threading.Thread | None = None
        self.held = threading.Event()
        self.go = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lock, name)

    @contextlib.contextmanager
    def _then_hold(self, section: Any) -> Iterator[None]:
        with section:
            yield
        if threading.current_thread() is self.target and not self.held.is_set():
            self.held.set()
            self.go.wait(HOLD_S)

    def write(self) -> Any:
        return self._then_hold(self._lock.write())

    def write_untimed(self) -> Any:
        return self._then_hold(self._lock.write_untimed())


def _read_failed(reader: str, mgr: Any, handle: Any) -> None:
    """One of the readers that run or await a publication, seeing room 7 failed."""
    from sender.poll import KVPoll

    if reader == "stats":
        assert mgr.stats().rooms_failed == 1
    elif reader == "handle_status":
        assert mgr.handle_status(handle) is KVPoll.Failed
    elif reader == "status":
        assert mgr.status(7) is KVPoll.Failed
    else:
        assert mgr.wait_drained(handle, timeout_s=HOLD_S)


@pytest.mark.parametrize("reader", ["stats", "handle_status", "status", "wait_drained"])
def test_a_reader_right_after_a_deciding_section_agrees_with_listener_and_log(
    reader: str, caplog: pytest.LogCaptureFixture
) -> None:
    """'What a locked section decides (listener events, log lines ...) runs after the lock
    is released, by the deciding thread or the first reader to see it (``handle_status``,
    ``status``, ``stats``, ``wait_drained`` run or await it before returning)': a thread
    failing a room is held the instant its write section released ROOM; a reader that sees
    the room ``Failed`` returns only once the listener was told and the WARNING logged."""
    from sender.errors import KVTransferError
    from tests.sender._listeners import Recorder as Counting
    from tests.sender._stub_transport import StubTransport, _sender, _stub_manager

    caplog.set_level(logging.WARNING, logger="sender")
    listener = Counting()
    mgr = _stub_manager(StubTransport(), events=listener)
    s = _sender(mgr, 7)
    hold = _HoldAfterSection(mgr.rooms.lock)
    mgr.rooms.lock = hold  # type: ignore[assignment]
    failer = threading.Thread(
        target=mgr.record_failure, args=(s.handle, KVTransferError(7, "boom"), "boom"),
        name="failer", daemon=True,
    )
    hold.target = failer
    failer.start()
    try:
        assert hold.held.wait(HOLD_S), "the failing thread never left its section"
        _read_failed(reader, mgr, s.handle)
        told = dict(listener.rooms)
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    finally:
        hold.go.set()
        failer.join(HOLD_S)
    assert not failer.is_alive()
    gen = s.handle.generation
    assert told == {"failed": 1}, told
    assert sum(f"room 7 generation {gen} failed" in m for m in warned) == 1, warned
    assert dict(listener.rooms) == {"failed": 1}, listener.rooms  # and told once only


@pytest.mark.parametrize("reader", ["stats", "handle_status", "status", "wait_drained"])
def test_a_reader_awaits_a_publication_another_thread_is_making(reader: str) -> None:
    """'... by the deciding thread or the first reader to see it (``handle_status``,
    ``status``, ``stats``, ``wait_drained`` run or *await* it before returning)': the
    failing thread is inside the listener, telling the room's failure, when a reader sees
    the room ``Failed``; the reader returns only after that listener call returned."""
    from sender.errors import KVTransferError
    from tests.sender._stub_transport import StubTransport, _sender, _stub_manager

    order: list[str] = []
    inside, go = threading.Event(), threading.Event()

    class Slow(Recorder):
        def room_concluded(
            self, room: int, generation: int, outcome: str, code: str, seconds: float
        ) -> None:
            inside.set()
            go.wait(HOLD_S)
            super().room_concluded(room, generation, outcome, code, seconds)
            order.append("told")

    mgr = _stub_manager(StubTransport(), events=Slow())
    s = _sender(mgr, 7)

    def read() -> None:
        _read_failed(reader, mgr, s.handle)
        order.append("read")

    failer = threading.Thread(
        target=mgr.record_failure, args=(s.handle, KVTransferError(7, "boom"), "boom"),
        name="failer", daemon=True,
    )
    failer.start()
    reading = threading.Thread(target=read, name="reader", daemon=True)
    try:
        assert inside.wait(HOLD_S), "the listener was never told"
        reading.start()
        reading.join(0.5)  # a reader that does not wait returns meanwhile
    finally:
        go.set()
        failer.join(HOLD_S)
        if reading.ident is not None:
            reading.join(HOLD_S)
    assert not failer.is_alive() and not reading.is_alive()
    assert order == ["told", "read"], order


@pytest.mark.parametrize("mode", ["workers", "workers-pool", "inline", "inline-pool"])
def test_a_listener_is_called_holding_no_lock_of_the_model_nor_a_gate(mode: str) -> None:
    """*Listeners*: 'A listener ... is called holding no lock of the model or gate'. Debug
    mode tracks every lock of the model and each room's post gate (a checked ``MutexLock``),
    so ``held_locks()`` inside the listener must be empty, on every path a chunk can end on:
    here writes that report done inside their post (ended by the posting thread, right after
    its gate), by a worker or inline, with and without a staging pool."""
    import numpy as np
    import torch

    from sender.manager import KVManager, make_transfer_info
    from sender.nixl_sender import NixlKVSender
    from sender.poll import KVPoll
    from staging.buffers import StagingBufferPool
    from staging.context import StagingContext
    from staging.locks import held_locks
    from tests.sender._instant_transport import PAGE_BYTES, GuardedTransfer, InstantTransport

    class DoneAtPost(GuardedTransfer):
        REPORTS_DONE_AT_POST = True
        done = True

    class DoneAtPostTransport(InstantTransport):
        def write_pages(self, *args: Any, **kwargs: Any) -> GuardedTransfer:
            xfer = DoneAtPost()
            self.transfers.append(xfer)
            return xfer

    held: list[tuple[str, tuple[Any, ...]]] = []

    class LockChecking(Recorder):
        def room_concluded(
            self, room: int, generation: int, outcome: str, code: str, seconds: float
        ) -> None:
            held.append(("room_concluded", held_locks()))
            super().room_concluded(room, generation, outcome, code, seconds)

        def chunk_ended(self, session_id: str, outcome: str, seconds: float, nbytes: int) -> None:
            held.append(("chunk_ended", held_locks()))
            super().chunk_ended(session_id, outcome, seconds, nbytes)

    listener = LockChecking()
    pool = StagingBufferPool(4, 4, PAGE_BYTES) if mode.endswith("pool") else None
    with KVManager(
        DoneAtPostTransport(), torch.zeros((8, PAGE_BYTES), dtype=torch.uint8),
        num_workers=1 if mode.startswith("workers") else 0, staging=StagingContext(lock="mutex"),
        staging_pool=pool, events=listener, debug=True,
    ) as mgr:
        s = NixlKVSender(mgr, 3, ["d0"], [make_transfer_info("d0", range(4))])
        s.init(4)
        s.send(np.array([0, 1]))
        s.send(np.array([2, 3]))
        end = time.monotonic() + HOLD_S
        while s.poll() is not KVPoll.Success:
            assert time.monotonic() < end, f"the room never succeeded: {s.poll()!r}"
            time.sleep(0.001)
        assert mgr.stats().chunks_done == 2
    assert listener.ended == [("d0", "done"), ("d0", "done")], listener.ended
    assert sorted(name for name, _ in held) == ["chunk_ended", "chunk_ended", "room_concluded"]
    assert all(locks == () for _, locks in held), held
