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

    # Prints its name, still compares, hashes and all-reduces as the int.
    def __str__(self) -> str:
        return f"KVPoll.{self.name}"

    def __format__(self, spec: str) -> str:
        """``f"{status}"`` names it; a numeric spec (``f"{status:d}"``) formats the int."""
        return str(self) if not spec else format(self.value, spec)


def merge_status(current: KVPoll | None, update: KVPoll) -> KVPoll:
    """The status after ``update`` is applied to ``current`` (``None``: no status yet).
    Progress only moves forward; ``Failed`` wins and is sticky."""
    if current is None:
        return update
    if current is KVPoll.Failed or update is KVPoll.Failed:
        return KVPoll.Failed
    return update if update > current else current


def is_concluded(status: KVPoll | None) -> bool:
    """``True`` for the two final states, ``Success`` and ``Failed``."""
    return status is KVPoll.Success or status is KVPoll.Failed
