"""Real NIXL and staging objects, wrapped so that a test decides when they answer:
``HeldTransport`` (its writes poll ``"PROC"`` until ``go``) and ``SignallingPool`` (a real
staging pool that signals a lease that found no free slot)."""

from __future__ import annotations

import threading
from typing import Any

from sender.transport import NixlTransport
from staging.buffers import StagingBufferPool, StagingSlot


class HeldTransfer:
    """A real transfer that answers ``"PROC"`` while its transport holds it."""

    def __init__(self, inner: Any, owner: HeldTransport) -> None:
        self.inner = inner
        self.owner = owner

    def poll(self) -> str:
        state: str = self.inner.poll()  # raises TransferReleasedError once released
        self.owner.polls += 1
        return "PROC" if not self.owner.go.is_set() else state

    def release(self) -> None:
        self.inner.release()

    def settled(self) -> bool:
        return True


class HeldTransport:
    """The real transport; its writes are :class:`HeldTransfer` (held until ``go``)."""

    def __init__(self, inner: NixlTransport, *, held: bool = True) -> None:
        self.inner = inner
        self.go = threading.Event()
        if not held:
            self.go.set()
        self.polls = 0
        self.transfers: list[HeldTransfer] = []

    def write_pages(self, *args: Any, **kw: Any) -> HeldTransfer:
        t = HeldTransfer(self.inner.write_pages(*args, **kw), self)
        self.transfers.append(t)
        return t

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class SignallingPool(StagingBufferPool):
    """A real staging pool that sets ``waiting`` when a lease finds no free slot (a worker
    then parks its chunk and tries again; an inline send waits in ``acquire``)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.waiting = threading.Event()

    def try_acquire(self, owner: Any, **kw: Any) -> StagingSlot | None:
        slot = super().try_acquire(owner, **kw)
        if slot is None:
            self.waiting.set()
        return slot
