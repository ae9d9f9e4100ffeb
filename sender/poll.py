"""``KVPoll``: the per-room transfer status, and the rule for merging status updates.

Ranks all-reduce their statuses with MIN, so ``Failed`` must stay the lowest value.
"""

from __future__ import annotations

from enum import IntEnum


class KVPoll(IntEnum):
    """Status of one room's KV transfer, in order of progress (``Failed`` lowest)."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4

    # An IntEnum prints as its int (``print(poll())`` said ``4``); it names itself here and
    # still compares, hashes and all-reduces as the int (``KVPoll.Success == 4``).
    def __str__(self) -> str:
        return f"KVPoll.{self.name}"

    def __format__(self, spec: str) -> str:
        """``f"{status}"`` names it; a numeric spec (``f"{status:d}"``) formats the int."""
        return str(self) if not spec else format(self.value, spec)


def merge_status(current: KVPoll | None, update: KVPoll) -> KVPoll:
    """The status after ``update`` is applied to ``current``.

    Progress only moves forward; ``Failed`` wins over anything and is sticky (only purging
    the room forgets it). ``current=None`` means the room had no status yet.
    """
    if current is None:
        return update
    if current is KVPoll.Failed or update is KVPoll.Failed:
        return KVPoll.Failed
    return update if update > current else current


def is_concluded(status: KVPoll | None) -> bool:
    """``True`` for the two final states, ``Success`` and ``Failed``."""
    return status is KVPoll.Success or status is KVPoll.Failed
