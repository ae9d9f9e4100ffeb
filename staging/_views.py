"""The one rule the compat contexts share about their live views: each view attribute is
assigned once (in ``__init__``) and never rebound or deleted.

Engine code that used plain collections rebinds them (``ctx.s = {k for k in ctx.s if ...}``),
which would replace the locked view with an unlocked copy that the other threads never see.
:class:`FixedViews` refuses that with a ``TypeError`` naming the context's own way to do it,
and lets ``view |= {...}`` (which stores the same view back) through.
"""

from __future__ import annotations

from typing import ClassVar

__all__ = ["FixedViews"]


class FixedViews:
    """Base of a context whose attributes named in ``VIEW_NAMES`` are live views.

    Subclasses set ``VIEW_NAMES`` and ``REBIND_HINT`` (appended to the rebind error: what to
    call instead). Not thread-safe by itself; an attribute assignment touches no lock.
    """

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
