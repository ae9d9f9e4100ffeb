"""A :class:`Chunk`: one chunk of one room bound for one decode session, from ``send`` until
it *ends* -- the unit the chunk pipeline stages, posts, polls and ends.

A chunk is registered in its room entry's ``inflight`` while the room is open and it is being
posted or in flight, in the room table's ``draining`` after the room's purge, and in neither
once it ended. It ends exactly once: the thread that wins its claim (a non-blocking acquire,
an atomic test-and-set that is never released) alone releases its transfer and slot and does
its accounting, whichever thread saw the terminal state first.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from sender.pages import CheckedPages
from staging.buffers import StagingSlot
from staging.context import RoomHandle

__all__ = ["Chunk", "TransferLike"]

PageArray = npt.NDArray[np.int64]


class TransferLike(Protocol):
    """What the pipeline needs of a transport transfer (``settled()``, when a transfer has
    it, tells whether a write that timed out can still move bytes; without it a timed-out
    transfer counts as settled; ``done``, when it has it, says the write completed inside
    its post)."""

    def poll(self) -> str: ...

    def release(self) -> None: ...


class Chunk:
    """One chunk of one room for one session, and what became of it.

    The job fields (``handle`` .. ``dst_checked``) are set when the chunk is made (under the
    room lock, by ``send``) and never change. ``transfer`` and ``slot`` are set by the thread
    that stages and posts the chunk before any other thread can see them (``transfer`` is
    ``None`` while the chunk is registered but not yet posted: pollers skip it). ``hung`` is
    set once, under the room lock. The claim decides who ends it.
    """

    __slots__ = (
        "_claim",
        "byte_range",
        "chunk_id",
        "chunk_idx",
        "dst_checked",
        "dst_pages",
        "dst_region",
        "handle",
        "hung",
        "is_last",
        "made_at",
        "session_id",
        "slot",
        "src_checked",
        "src_pages",
        "transfer",
    )

    def __init__(
        self,
        handle: RoomHandle,
        chunk_idx: int,
        session_id: str,
        src_pages: PageArray,
        dst_pages: PageArray | None,
        byte_range: tuple[int, int] | None,
        dst_region: str,
        is_last: bool,
        chunk_id: int,
        src_checked: CheckedPages | None,
        dst_checked: CheckedPages | None,
        made_at: float,
    ) -> None:
        self.handle = handle
        self.chunk_idx = chunk_idx
        self.session_id = session_id
        self.src_pages = src_pages
        # The destination pages as an array only when they are not checked (``dst_checked``
        # is ``None``); a checked chunk needs no second copy of them.
        self.dst_pages = dst_pages
        self.byte_range = byte_range
        self.dst_region = dst_region
        self.is_last = is_last
        self.chunk_id = chunk_id
        # The same pages checked once (sender/pages.py), for the transport; None: the arrays.
        self.src_checked = src_checked
        self.dst_checked = dst_checked
        self.made_at = made_at
        # The deadline error of a chunk that timed out while NIXL still had it in progress:
        # its room is failed, but the chunk has not ended (it may still write) until the
        # transfer settles. Set once, under the room lock.
        self.hung: BaseException | None = None
        self.transfer: Any = None  # TransferLike once posted
        self.slot: StagingSlot | None = None
        self._claim = threading.Lock()  # looked up at call time: DPOR explorers see it

    def claim(self) -> bool:
        """``True`` for the one caller that gets to end this chunk; ``False`` for all later."""
        # mutant-site: claim
        return self._claim.acquire(False)

    @property
    def ended(self) -> bool:
        """``True`` once some thread claimed the chunk's end."""
        return self._claim.locked()

    @property
    def num_pages(self) -> int:
        """Pages this chunk sends to its session (0: all in the decode prefix)."""
        return int(self.src_pages.shape[0])

    def __repr__(self) -> str:
        return (
            f"<Chunk room={self.handle.room} gen={self.handle.generation} "
            f"chunk={self.chunk_idx} session={self.session_id!r} id={self.chunk_id}>"
        )
