"""The hook functions the SGLang plugin installs, and the staging class it puts in place.

Every function here is ours, written against what the released code *does* (read from the
installed wheels; no upstream body is copied). Each is made by a factory that receives the
upstream objects it needs, resolved and checked by :mod:`staging.sglang.plugin` before any
hook is registered. The signatures are those of SGLang's ``HookRegistry``:

* ``AROUND``: ``hook(original, *args, **kwargs)``;
* ``AFTER``: ``hook(result, *args, **kwargs)`` (its return value ``None`` keeps the result);
* ``REPLACE`` of a class: the class itself.

Thread-safety: the hooks keep SGLang's threading as it is (``clear()`` and the sender's
constructor run on the scheduler thread); what they add is one call into a
:class:`~staging.compat.CompatStagingContext`, whose methods are thread-safe.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from staging.compat import CompatStagingContext
from staging.decode_compat import DecodeCompatContext

VIEWS = ("prefetched_rooms", "prefetch_requested")
"""The two set fields of SGLang's ``PrefillStagingContext`` that become our views."""

DECODE_VIEWS = ("room_bootstrap", "room_receivers")
"""The two dict fields of SGLang's ``DecodeStagingContext`` that become our views."""


def staging_class(upstream: type) -> type:
    """Our ``PrefillStagingContext``: a dataclass of the same name and module with
    ``upstream``'s fields except the two sets, on top of :class:`CompatStagingContext`
    (``ctx.prefetched_rooms`` / ``ctx.prefetch_requested`` are its live views, and
    ``purge_room`` / ``lift_tombstone`` exist). The kept fields (buffers, watermarks, the
    watermark condition, the prefetch sockets) are built by their own default factories,
    as upstream's are.

    Raises:
        ValueError: ``upstream`` is not a dataclass holding both set fields.
    """
    return _on_base(upstream, VIEWS, CompatStagingContext, "its two staging sets")


def decode_staging_class(upstream: type) -> type:
    """Our ``DecodeStagingContext``: a dataclass of the same name and module with
    ``upstream``'s fields except the two dicts (``allocator`` is kept), on top of
    :class:`~staging.decode_compat.DecodeCompatContext` (``ctx.room_bootstrap`` /
    ``ctx.room_receivers`` are its live views on one lock, and ``purge_room`` /
    ``register_room`` / ``room_entry`` exist).

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
    """``upstream`` remade as a dataclass on ``base`` without the ``views`` fields (the
    base's ``__init__`` makes them, from the generated ``__post_init__``).

    Raises:
        ValueError: ``upstream`` is not a dataclass holding every field of ``views``.
    """
    if not dataclasses.is_dataclass(upstream):
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


def _field_copy(f: dataclasses.Field[Any]) -> tuple[str, Any, dataclasses.Field[Any]]:
    kwargs: dict[str, Any] = {
        "init": f.init,
        "repr": f.repr,
        "hash": f.hash,
        "compare": f.compare,
        "metadata": f.metadata,
    }
    if f.default is not dataclasses.MISSING:
        kwargs["default"] = f.default
    if f.default_factory is not dataclasses.MISSING:
        kwargs["default_factory"] = f.default_factory
    return f.name, f.type, dataclasses.field(**kwargs)


def _ours(sender: Any) -> CompatStagingContext | None:
    """The sender's manager's staging context if it is ours (a prefill context made by the
    plugin's class), else ``None`` (decode side, staging off, or bare sets)."""
    ctx = getattr(sender.kv_mgr, "_staging_ctx", None)
    return ctx if isinstance(ctx, CompatStagingContext) else None


def _owns_room(sender: Any) -> bool:
    """Whether the sender is the one that owns its bootstrap room: 0.5.23 marks a sender of
    a duplicate or cancelled room (deferred bootstrap) with ``_owns_bootstrap_room = False``,
    and its ``clear()`` then leaves the room alone; 0.5.21 has no such mark (always owns)."""
    if getattr(sender.kv_mgr, "deferred_bootstrap", None) is None:
        return True
    return bool(getattr(sender, "_owns_bootstrap_room", True))


class _StagingHidden:
    """A sender's manager as the released ``clear()`` sees it while the hook runs it: every
    attribute read and write goes to the real manager (its methods come back bound to it),
    except ``_staging_ctx``, which reads ``None``, so the released body skips its own drop
    of the room from the two sets (0.5.21: a rebind the view would refuse; 0.5.23: a walk
    over every key). The hook purges the room itself, once, before."""

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
    """AROUND hook of a sender's ``clear()`` (0.5.21's ``NixlKVSender.clear``; 0.5.23's
    ``CommonKVSender.clear``, which NIXL's and Mooncake's senders inherit).

    On our context, when the sender owns its room (a duplicate's ``clear()`` leaves the room
    alone, as upstream's does): one ``purge_room`` (both views at one instant, tombstoned,
    O(keys of the room)); then the released ``clear()`` (upstream's per-room tables, the
    deferred bootstrap, the ACKs) with the sender's ``kv_mgr`` read through
    :class:`_StagingHidden` for the duration of the call, so that its own staging drop does
    not run. ``clear()`` runs on the scheduler thread, the only thread that reads the
    sender's ``kv_mgr`` (the workers hold the manager itself); the attribute is put back in
    a ``finally``. Any other context (bare sets, decode side): the released ``clear()`` as
    it is.
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
    """AFTER hook of ``CommonKVSender.__init__``: a sender that owns its room and did not
    conclude in its constructor is a new request with that id; lift the id's tombstone so its
    writes are accepted (:meth:`CompatStagingContext.lift_tombstone`; nothing is dropped, so
    a duplicate id arriving while the first request is live leaves the first's keys alone).
    A sender of a duplicate or cancelled room (0.5.23: ``_owns_bootstrap_room`` false, or
    ``conclude_state`` already ``Failed``) lifts nothing."""

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
