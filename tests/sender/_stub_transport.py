"""In-memory stub transport whose writes the test settles by hand (``StubTransfer``:
in flight, DONE, hung, kept at a peer's removal), the inline managers made over it
(``_stub_manager``; tests/sender/conftest.py closes them after each test) and one-session
senders of them (``_sender``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from sender.errors import PeerNotFoundError, TransferTimeoutError
from sender.manager import KVManager, make_transfer_info
from sender.nixl_sender import NixlKVSender
from sender.notices import RoomNotice, decode_notice
from staging.context import StagingContext

STUB_PAGE_BYTES = 16


BOUND_S = 10.0


def _stub_wait(cond: Callable[[], bool], timeout_s: float = BOUND_S) -> bool:
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() >= end:
            return cond()
        time.sleep(0.002)
    return True


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


_MADE: list[KVManager] = []


def _stub_manager(transport: StubTransport, **kw: Any) -> KVManager:
    kw.setdefault("num_workers", 0)
    kw.setdefault("staging", StagingContext(lock="mutex"))
    mgr = KVManager(transport, torch.zeros((16, STUB_PAGE_BYTES), dtype=torch.uint8), **kw)
    _MADE.append(mgr)
    return mgr


def _sender(mgr: KVManager, room: int, session: str = "d0", pages: int = 1) -> NixlKVSender:
    s = NixlKVSender(mgr, room, [session], [make_transfer_info(session, range(pages))])
    s.init(pages)
    return s
