"""A :class:`Chunk`: one chunk of one room bound for one decode session, from ``send`` until
it ends.

While in flight it is in its room entry's ``inflight`` (open room) or the room table's
``draining`` (purged room). It ends exactly once: the thread that wins its claim (a
non-blocking acquire, never released) alone releases its transfer and slot and accounts it.
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
    """What the pipeline needs of a transfer. Optional: ``settled()`` (may a timed-out write
    still move bytes; absent: settled) and ``done`` (completed inside its post)."""

    def poll(self) -> str: ...

    def release(self) -> None: ...


class Chunk:
    """One chunk of one room for one session, and what became of it.

    The job fields (``handle`` .. ``made_at``) never change. ``transfer`` and ``slot`` are set
    by the posting thread before others see them (``transfer`` is ``None`` until posted:
    pollers skip it). ``hung`` is set once, under the room lock. The claim decides who ends it.
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
        self.dst_pages = dst_pages  # None when dst_checked is set
        self.byte_range = byte_range
        self.dst_region = dst_region
        self.is_last = is_last
        self.chunk_id = chunk_id
        # The pages checked once (sender/pages.py) for the transport; None: use the arrays.
        self.src_checked = src_checked
        self.dst_checked = dst_checked
        self.made_at = made_at
        # Set (once, under the room lock) when it failed by us while NIXL still has it.
        self.hung: BaseException | None = None
        self.transfer: Any = None  # TransferLike once posted
        self.slot: StagingSlot | None = None
        self._claim = threading.Lock()  # looked up at call time: DPOR explorers see it

    def claim(self) -> bool:
        """``True`` for the one caller that gets to end this chunk."""
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
