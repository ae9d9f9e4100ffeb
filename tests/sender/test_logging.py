"""What an operator sees of a failed room: one WARNING naming room, generation and session;
an exception that names them; a session failed as a whole logged once; INFO for a room
cleared before it concluded; DEBUG for chunk posts and ends; nothing logged under a lock.

Real parts: a decode peer process that is SIGKILLed, real NIXL agents over UCX.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from sender.errors import TRANSPORT_ERRORS, KVTransferError
from sender.manager import KVManager, make_transfer_info
from sender.nixl_sender import NixlKVSender
from sender.poll import KVPoll
from tests.fixtures_nixl import SenderPool, requires_nixl

pytestmark = [pytest.mark.nixl, requires_nixl]


def _conclude(s: NixlKVSender, timeout_s: float = 30.0) -> KVPoll:
    end = time.monotonic() + timeout_s
    while (st := s.poll()) not in (KVPoll.Success, KVPoll.Failed):
        if time.monotonic() >= end:
            return st
        time.sleep(0.001)
    return st


def _sender(mgr: KVManager, room: int, session: str, dst: list[int]) -> NixlKVSender:
    s = NixlKVSender(mgr, room, [session], [make_transfer_info(session, dst)])
    s.init(len(dst))
    return s


@pytest.mark.timeout(120)
def test_a_room_failed_by_a_dead_peer_is_one_warning_and_a_named_exception(
    sender_pool: SenderPool, peer_factory: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    peer = peer_factory()
    tx = sender_pool.transport
    tx.add_peer("d1", peer.metadata)
    caplog.set_level(logging.DEBUG, logger="sender")
    with KVManager(tx, sender_pool.pool, num_workers=0) as mgr:
        warm = _sender(mgr, 1, "d1", [0])
        warm.send([3])
        assert _conclude(warm) is KVPoll.Success
        warm.clear()
        peer.kill()
        s = _sender(mgr, 7, "d1", [1, 2])
        gen = s.handle.generation
        s.send([4, 5])
        assert _conclude(s) is KVPoll.Failed
        with pytest.raises((KVTransferError, *TRANSPORT_ERRORS)) as info:
            s.failure_exception()
    named = [
        r for r in caplog.records
        if r.levelno >= logging.WARNING and f"room 7 generation {gen}" in r.getMessage()
    ]
    assert len(named) == 1, [r.getMessage() for r in named]
    assert "d1" in named[0].getMessage() and named[0].name == "sender.manager"
    exc = info.value
    text = " ".join([str(exc), *getattr(exc, "__notes__", ())])
    assert f"room 7 generation {gen}" in text and "'d1'" in text and "chunk 0" in text, text
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert any(m.startswith("room 1 ") and "posted 1 pages" in m for m in debug), debug
    assert any(m.startswith(f"room 7 gen {gen} chunk 0") and "ended" in m for m in debug), debug


@pytest.mark.timeout(120)
def test_a_session_failed_as_a_whole_is_logged_once(
    sender_pool: SenderPool, peer_factory: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Four rooms to one peer that dies: the first room that sees the disconnect logs its
    WARNING, the session's failure one WARNING naming the other three; no room twice."""
    peer = peer_factory()
    tx = sender_pool.transport
    tx.add_peer("d2", peer.metadata)
    with KVManager(tx, sender_pool.pool, num_workers=0) as mgr:
        warm = _sender(mgr, 1, "d2", [0])
        warm.send([3])
        assert _conclude(warm) is KVPoll.Success
        warm.clear()
        rooms = [_sender(mgr, 10 + i, "d2", [10 + 2 * i, 11 + 2 * i]) for i in range(4)]
        peer.kill()
        caplog.set_level(logging.INFO, logger="sender")
        for s in rooms:
            s.send([20, 21])
        for s in rooms:
            assert _conclude(s) is KVPoll.Failed
        for s in rooms:
            with pytest.raises((KVTransferError, *TRANSPORT_ERRORS)):
                s.failure_exception()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    sessions = [m for m in warnings if m.startswith("decode session 'd2' failed")]
    assert len(sessions) >= 1, warnings
    for s in rooms:
        key = f"{s.bootstrap_room} (gen {s.handle.generation})"
        own = f"room {s.bootstrap_room} generation {s.handle.generation}"
        assert sum(key in m for m in sessions) + sum(own in m for m in warnings) == 1, (
            s.bootstrap_room, warnings,
        )


@pytest.mark.timeout(60)
def test_a_room_cleared_before_it_concluded_is_info(
    sender_pool: SenderPool, decode_peer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    tx = sender_pool.transport
    tx.add_peer("d3", decode_peer.metadata())
    caplog.set_level(logging.INFO, logger="sender")
    with KVManager(tx, sender_pool.pool, num_workers=0) as mgr:
        s = _sender(mgr, 5, "d3", [0, 1])
        s.clear()
        done = _sender(mgr, 6, "d3", [2])
        done.send([1])
        assert _conclude(done) is KVPoll.Success
        done.clear()
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any(f"room 5 generation {s.handle.generation} cleared" in m for m in info), info
    assert not any("room 6 " in m for m in info), "a Success room was logged as cleared"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


class _LockCheckingHandler(logging.Handler):
    """Fails a record emitted while the emitting thread holds a lock of the model (debug
    locks track every thread's held locks)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.under_lock: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        from staging.locks import held_locks

        held = held_locks()
        if held:
            self.under_lock.append(f"{record.getMessage()} (holding {held})")


@pytest.mark.timeout(120)
def test_nothing_is_logged_under_a_lock(
    sender_pool: SenderPool, peer_factory: Callable[..., Any]
) -> None:
    """Debug locks know what each thread holds; a handler on the ``sender`` loggers checks it
    at every record, for rooms that succeed, are cleared, and fail by a killed peer."""
    peer = peer_factory()
    tx = sender_pool.transport
    tx.add_peer("d4", peer.metadata)
    handler = _LockCheckingHandler()
    root = logging.getLogger("sender")
    old = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        with KVManager(tx, sender_pool.pool, num_workers=2, debug=True) as mgr:
            ok = _sender(mgr, 1, "d4", [0])
            ok.send([3])
            assert _conclude(ok) is KVPoll.Success
            ok.clear()
            _sender(mgr, 2, "d4", [1]).clear()
            peer.kill()
            bad = [_sender(mgr, 3 + i, "d4", [2 + i]) for i in range(3)]
            for s in bad:
                s.send([5])
            for s in bad:
                assert _conclude(s) is KVPoll.Failed
                with pytest.raises((KVTransferError, *TRANSPORT_ERRORS)):
                    s.failure_exception()
        assert threading.active_count() >= 1
    finally:
        root.removeHandler(handler)
        root.setLevel(old)
    assert handler.under_lock == [], handler.under_lock[:5]
