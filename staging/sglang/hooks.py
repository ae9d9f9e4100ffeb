"""The hooks the SGLang plugin installs (factories; signatures of SGLang's ``HookRegistry``:
``AROUND`` ``hook(original, *args, **kwargs)``, ``AFTER`` ``hook(result, *args, **kwargs)``,
``REPLACE`` the class itself). No upstream body is copied.

Thread-safety: SGLang's threading is unchanged (``clear()`` and the sender's constructor
run on the scheduler thread); each hook adds one call into a thread-safe compat context.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Final

from staging.compat import CompatStagingContext
from staging.decode_compat import DecodeCompatContext

VIEWS = ("prefetched_rooms", "prefetch_requested")
"""The two set fields of SGLang's ``PrefillStagingContext`` that become our views."""

DECODE_VIEWS = ("room_bootstrap", "room_receivers")
"""The two dict fields of SGLang's ``DecodeStagingContext`` that become our views."""


def staging_class(upstream: type) -> type:
    """Our ``PrefillStagingContext``: ``upstream``'s dataclass without the two sets, on
    :class:`CompatStagingContext`.

    Raises:
        ValueError: ``upstream`` is not a dataclass holding both set fields.
    """
    return _on_base(upstream, VIEWS, CompatStagingContext, "its two staging sets")


def decode_staging_class(upstream: type) -> type:
    """Our ``DecodeStagingContext``: ``upstream``'s dataclass without the two dicts, on
    :class:`~staging.decode_compat.DecodeCompatContext`.

    Raises:
        ValueError: ``upstream`` is not a dataclass holding both dict fields.
    """
    return _on_base(upstream, DECODE_VIEWS, DecodeCompatContext, "its two staging dicts")


def _on_base(
    upstream: type,
    views: tuple[str, ...],
    base: type[CompatStagingContext] | type[DecodeCompatContext],
    what: str,
) -> type:
    """``upstream`` remade on ``base`` without the ``views`` fields. Raises: ValueError."""
    if not isinstance(upstream, type) or not dataclasses.is_dataclass(upstream):
        raise ValueError(f"{upstream!r} is not a dataclass")
    fields = dataclasses.fields(upstream)
    missing = [v for v in views if v not in {f.name for f in fields}]
    if missing:
        raise ValueError(f"{upstream.__qualname__} has no field {missing}")
    kept = [_field_copy(f) for f in fields if f.name not in views]

    init = base.__init__

    def __post_init__(self: Any) -> None:
        init(self)

    made = dataclasses.make_dataclass(
        upstream.__name__,
        kept,
        bases=(base,),
        namespace={
            "__post_init__": __post_init__,
            "__doc__": (
                f"{upstream.__name__} with {what} on a {base.__name__} "
                "(installed by the nixl-staging SGLang plugin)."
            ),
            "NIXL_STAGING_PLUGIN": True,
        },
    )
    made.__module__ = upstream.__module__
    made.__qualname__ = upstream.__qualname__
    return made


_FIELD_ARGS = ("init", "repr", "hash", "compare", "metadata", "default", "default_factory")


def _field_copy(f: dataclasses.Field[Any]) -> tuple[str, Any, dataclasses.Field[Any]]:
    kwargs = {a: getattr(f, a) for a in _FIELD_ARGS if getattr(f, a) is not dataclasses.MISSING}
    return f.name, f.type, dataclasses.field(**kwargs)


def _ours(sender: Any) -> CompatStagingContext | None:
    """The sender's manager's staging context if it is our prefill one, else ``None``."""
    ctx = getattr(sender.kv_mgr, "_staging_ctx", None)
    return ctx if isinstance(ctx, CompatStagingContext) else None


def _owns_room(sender: Any) -> bool:
    """Whether the sender owns its room (0.5.23: ``_owns_bootstrap_room``; 0.5.21: always)."""
    if getattr(sender.kv_mgr, "deferred_bootstrap", None) is None:
        return True
    return bool(getattr(sender, "_owns_bootstrap_room", True))


class _StagingHidden:
    """A manager proxy whose ``_staging_ctx`` reads ``None``, so the released ``clear()``
    skips its own staging drop (the hook purged the room already)."""

    __slots__ = ("_mgr",)

    def __init__(self, mgr: Any) -> None:
        object.__setattr__(self, "_mgr", mgr)

    def __getattr__(self, name: str) -> Any:
        if name == "_staging_ctx":
            return None
        return getattr(self._mgr, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._mgr, name, value)


def purge_then_clear() -> Callable[..., Any]:
    """AROUND hook of a sender's ``clear()``: on our context, one ``purge_room`` (if the
    sender owns its room), then the released ``clear()`` with ``kv_mgr`` swapped for
    :class:`_StagingHidden`. Safe: only the scheduler thread reads the sender's ``kv_mgr``.
    """

    def clear(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
        ctx = _ours(self)
        if ctx is None:
            return original(self, *args, **kwargs)
        mgr = self.kv_mgr
        if getattr(mgr, "enable_staging", True) and _owns_room(self):
            ctx.purge_room(self.bootstrap_room)
        self.kv_mgr = _StagingHidden(mgr)
        try:
            return original(self, *args, **kwargs)
        finally:
            self.kv_mgr = mgr

    clear.__qualname__ = "nixl_staging.purge_then_clear"
    return clear


def lift_on_new_sender() -> Callable[..., Any]:
    """AFTER hook of ``CommonKVSender.__init__``: a new sender that owns its room and did
    not conclude lifts the id's tombstone (:meth:`CompatStagingContext.lift_tombstone`)."""

    def after_init(result: Any, self: Any, *args: Any, **kwargs: Any) -> None:
        ctx = _ours(self)
        if ctx is None or getattr(self, "conclude_state", None) is not None:
            return
        if not getattr(self, "_owns_bootstrap_room", True):
            return
        try:
            ctx.lift_tombstone(self.bootstrap_room)
        except (TypeError, ValueError):
            return  # not a room id (None): nothing can be tombstoned under it

    after_init.__qualname__ = "nixl_staging.lift_on_new_sender"
    return after_init


HOOKS: Final[dict[str, tuple[str, Callable[[Any], Callable[..., Any] | type]]]] = {
    "staging_class": ("REPLACE", staging_class),
    "decode_staging_class": ("REPLACE", decode_staging_class),
    "purge_then_clear": ("AROUND", lambda _: purge_then_clear()),
    "lift_on_new_sender": ("AFTER", lambda _: lift_on_new_sender()),
}
"""Each hook by name: its ``HookType`` (fixed by what it is: a class, a wrapper, an
epilogue) and how it is made from the resolved upstream object."""
