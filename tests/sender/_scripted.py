"""The scripted real-NIXL rig of the sender tests.

``ScriptedTransport`` wraps the real transport: its writes are held (``"PROC"`` until the
transport's block ends or their deadline passes) or met (two threads must poll them DONE
together) by write number. ``Rig`` is what the ``rig`` fixture (tests/sender/conftest.py)
yields: the sender transport and KV pool of ``sender_pool`` and an in-process decode peer
added as ``SCRIPTED_SESSION``. ``sender()`` opens and inits a one-session room to it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from sender.errors import TransferTimeoutError
from sender.manager import KVManager, make_transfer_info
from sender.nixl_sender import NixlKVSender
from tests.fixtures_nixl import SenderPool

SCRIPTED_SESSION = "decode-0"


class ScriptedTransfer:
    """A real transfer whose answers follow the script of its :class:`ScriptedTransport`."""

    def __init__(self, inner: Any, owner: ScriptedTransport, write_no: int) -> None:
        self.inner = inner
        self.write_no = write_no
        self._owner = owner

    @property
    def held(self) -> bool:
        return self.write_no in self._owner.hold and not self._owner.unheld.is_set()

    @property
    def done(self) -> bool:
        return bool(self.inner.done) and not self.held

    def poll(self) -> str:
        state: str = self.inner.poll()  # raises TransferReleasedError once released
        if self.held:
            if time.monotonic() >= self.inner.started_at + self.inner.timeout_s:
                raise TransferTimeoutError(self.inner.session_id, self.inner.timeout_s)
            return "PROC"
        if state == "DONE" and self.write_no in self._owner.meet:
            # Only one thread came (the barrier breaks): that is what a fixed sender does.
            with contextlib.suppress(threading.BrokenBarrierError):
                self._owner.barrier.wait()
        return state

    def wait(self, timeout_s: float | None = None, interval_s: float = 0.0002) -> None:
        end = None if timeout_s is None else time.monotonic() + timeout_s
        while self.poll() != "DONE":
            if end is not None and time.monotonic() >= end:
                raise TimeoutError(f"wait({timeout_s}) elapsed")
            time.sleep(interval_s)

    def release(self) -> None:
        self.inner.release()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class ScriptedTransport:
    """A real transport whose transfers are held or met by write number (1-based).

    Thread-safe: the write counter is under ``_lock`` (never held while calling NIXL).
    """

    def __init__(self, inner: Any, *, hold: Sequence[int] = (), meet: Sequence[int] = ()) -> None:
        self.inner = inner
        self.hold = frozenset(hold)
        self.meet = frozenset(meet)
        self.unheld = threading.Event()
        self.barrier = threading.Barrier(2, timeout=0.5)
        self._lock = threading.Lock()
        self._writes = 0
        self.transfers: list[ScriptedTransfer] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __enter__(self) -> ScriptedTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        """End every hold, so that workers polling a held transfer can stop."""
        self.unheld.set()

    def write_pages(
        self,
        session_id: str,
        src_pages: Any,
        dst_pages: Any,
        notif: bytes | None = None,
        **kw: Any,
    ) -> ScriptedTransfer:
        with self._lock:
            self._writes += 1
            write_no = self._writes
        xfer = ScriptedTransfer(
            self.inner.write_pages(session_id, src_pages, dst_pages, notif, **kw), self, write_no
        )
        with self._lock:
            self.transfers.append(xfer)
        return xfer


@dataclass
class Rig:
    """The sender transport + pool (``sp``) and an in-process decode peer added as
    SCRIPTED_SESSION."""

    sp: SenderPool
    peer: Any  # stress.harness.peer.DecodePeer

    @property
    def tx(self) -> Any:
        return self.sp.transport

    @property
    def kv(self) -> torch.Tensor:
        return self.sp.pool


def sender(
    mgr: KVManager, room: int, dst: Sequence[int], session: str = SCRIPTED_SESSION
) -> NixlKVSender:
    s = NixlKVSender(mgr, room, [session], [make_transfer_info(session, dst)])
    s.init(len(dst))
    return s
