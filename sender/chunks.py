"""A :class:`Chunk`: one chunk of one room bound for one decode session, from ``send`` until
it ends.

While in flight it is in its room entry's ``inflight`` (open room) or the room table's
``draining`` (purged room). It ends exactly once: the thread that wins its claim (a
non-blocking acquire, never released) alone releases its transfer and slot and accounts it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Protocol

from sender.pages import CheckedPages
from staging.buffers import StagingSlot
from staging.context import RoomHandle

__all__ = ["Chunk", "TransferLike"]


class TransferLike(Protocol):
    """What the pipeline needs of a transfer. Optional: ``settled()`` (may a timed-out write
    still move bytes; absent: settled) and ``done`` (completed inside its post)."""

    def poll(self) -> str: ...

    def release(self) -> None: ...


@dataclass(slots=True, eq=False, repr=False)
class Chunk:
    """One chunk of one room for one session, and what became of it.

    The job fields (``handle`` .. ``made_at``) never change. ``transfer`` and ``slot`` are set
    by the posting thread before others see them (``transfer`` is ``None`` until posted:
    pollers skip it). ``hung`` is set once, under the room lock. The claim decides who ends it.
    """

    handle: RoomHandle
    chunk_idx: int
    session_id: str
    # Its pages, checked once (sender/pages.py) for the transport; None: it sends none.
    src_checked: CheckedPages | None
    dst_checked: CheckedPages | None
    byte_range: tuple[int, int] | None
    dst_region: str
    is_last: bool
    chunk_id: int
    made_at: float
    # Set (once, under the room lock) when it failed by us while NIXL still has it.
    hung: BaseException | None = field(default=None, init=False)
    transfer: Any = field(default=None, init=False)  # TransferLike once posted
    slot: StagingSlot | None = field(default=None, init=False)
    # threading.Lock looked up at call time: DPOR explorers see it.
    _claim: threading.Lock = field(default_factory=lambda: threading.Lock(), init=False)

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
        return 0 if self.src_checked is None else len(self.src_checked)

    def __repr__(self) -> str:
        return (
            f"<Chunk room={self.handle.room} gen={self.handle.generation} "
            f"chunk={self.chunk_idx} session={self.session_id!r} id={self.chunk_id}>"
        )
