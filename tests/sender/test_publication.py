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

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.fixtures_nixl import requires_nixl

pytestmark = [pytest.mark.nixl, requires_nixl, pytest.mark.timeout(90)]

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
