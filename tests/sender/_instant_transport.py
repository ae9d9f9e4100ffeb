"""The in-memory transport of the explorer-driven tests (``InstantTransport``: a write
is a ``GuardedTransfer``, DONE at once unless scripted, whose release is guarded like
``sender.transport.Transfer``'s), inline managers over it (``_mem_manager``) and the
frontrun settings of the DPOR explorations (``EXPLORE``).

An explorer needs every step to be Python it can schedule; real NIXL calls release the GIL
into C++ (tests/sender/test_dpor_clear.py)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from sender.errors import TransferReleasedError
from sender.manager import KVManager
from staging.context import StagingContext

EXPLORE: dict[str, Any] = {
    "preemption_bound": None,
    "stop_on_first": True,
    "detect_io": False,
    "reproduce_on_failure": 3,
    "deadlock_timeout": 10.0,
    "timeout_per_run": 10.0,
}


PAGE_BYTES = 16


class GuardedTransfer:
    """A transfer stand-in: ``poll`` answers ``state`` (``"DONE"`` unless scripted
    otherwise; a test may set it later); release idempotent under a lock, counted;
    a poll after release refused (like ``sender.transport.Transfer``)."""

    def __init__(self, state: str = "DONE") -> None:
        self._lock = threading.Lock()
        self._released = False
        self.state = state
        self.raw_releases = 0

    def poll(self) -> str:
        with self._lock:
            if self._released:
                raise TransferReleasedError("transfer already released")
            return self.state

    def release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
            self.raw_releases += 1


class InstantTransport:
    """``write_pages`` stand-in: the n-th posted transfer starts in ``states[n]`` (``"DONE"``
    past the script)."""

    def __init__(self, states: Sequence[str] = ()) -> None:
        self.transfers: list[GuardedTransfer] = []
        self._states = list(states)

    def write_pages(
        self,
        session_id: str,
        src_pages: Sequence[int] | Any,
        dst_pages: Sequence[int] | Any,
        notif: bytes | None = None,
        **kwargs: Any,
    ) -> GuardedTransfer:
        n = len(self.transfers)
        xfer = GuardedTransfer(self._states[n] if n < len(self._states) else "DONE")
        self.transfers.append(xfer)
        return xfer


def _mem_manager(transport: Any, **kw: Any) -> KVManager:
    return KVManager(
        transport,
        torch.zeros((8, PAGE_BYTES), dtype=torch.uint8),
        num_workers=0,
        staging=StagingContext(lock="mutex"),
        **kw,
    )
