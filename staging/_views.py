"""``FixedViews``: a compat context's view attributes are assigned once, in ``__init__``.

Rebinding one (``ctx.s = {k for k in ctx.s if ...}``) would swap the locked view for an
unlocked copy, so it raises ``TypeError``; ``view |= {...}`` (same view stored back) passes.
"""

from __future__ import annotations

from typing import ClassVar

__all__ = ["FixedViews"]


class FixedViews:
    """Base of a context whose ``VIEW_NAMES`` attributes are live views; ``REBIND_HINT``
    ends the rebind error. An attribute assignment touches no lock."""

    __slots__ = ()  # a subclass with __slots__ keeps instances without a __dict__

    VIEW_NAMES: ClassVar[frozenset[str]] = frozenset()
    REBIND_HINT: ClassVar[str] = ""

    def __setattr__(self, name: str, value: object) -> None:
        if name in self.VIEW_NAMES:
            current = getattr(self, name, None)
            if current is None:  # the one assignment, in __init__
                object.__setattr__(self, name, value)
                return
            if value is current:
                return  # `ctx.view |= {...}` mutated the view in place and stores it back
            raise TypeError(
                f"{name} is a live thread-safe view and cannot be rebound: {self.REBIND_HINT}"
            )
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if name in self.VIEW_NAMES:
            raise TypeError(f"{name} cannot be deleted; call ctx.purge_room(room)")
        object.__delattr__(self, name)
