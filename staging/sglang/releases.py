"""The SGLang releases the plugin supports (:data:`RELEASES`): per release, every upstream
object relied on, its hook (or ``None``: checked only) and its source fingerprint.

A newer release gets an entry here (``python -m staging.sglang --fingerprint``) and its
``make sglang`` lock file (``tools/sglang/requirements-<release>.lock``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from staging.sglang.hooks import HOOKS

__all__ = ["RELEASES", "Target"]

_SH = "sglang.srt.disaggregation.common.staging_handler"
_COMMON = "sglang.srt.disaggregation.common.conn"
_NIXL = "sglang.srt.disaggregation.nixl.conn"


@dataclass(frozen=True)
class Target:
    """One upstream object the plugin relies on."""

    path: str  # dotted, as HookRegistry.register takes it
    hook: str | None  # a name in staging.sglang.hooks.HOOKS, or None: checked only
    hook_type: str | None  # "REPLACE", "AROUND", "AFTER" (a HookType name), or None
    fingerprint: str  # of the released source
    does: str  # what the plugin changes there (or relies on), in a few words


Row = tuple[str, str | None, str, str]
"""``(path, hook, fingerprint, does)`` of one target; its hook type follows from the hook."""


def _targets(*rows: Row) -> tuple[Target, ...]:
    return tuple(Target(path, hook, HOOKS[hook][0] if hook else None, fp, does)
                 for path, hook, fp, does in rows)  # fmt: skip


# The same released source in both releases (one fingerprint each).
_PREFILL_CLASS: Final[Row] = (
    f"{_SH}.PrefillStagingContext", "staging_class", "79b39c1eb4e765e6",
    "the prefill staging dataclass -> a CompatStagingContext (locked views)",
)  # fmt: skip
_DECODE: Final[tuple[Row, ...]] = (
    (f"{_SH}.DecodeStagingContext", "decode_staging_class", "3f3ec82d41bd97ab",
     "the decode staging dataclass -> a DecodeCompatContext (room_bootstrap and "
     "room_receivers: locked views on one lock)"),
    (f"{_NIXL}.NixlKVManager.register_staging_room_bootstrap", None, "855821cdb4fe4cb6",
     "relied on: one item assignment per dict (decode scheduler)"),
    (f"{_SH}.DecodeStagingHandler.unregister_decode_req", None, "0a731d40068007d6",
     "relied on: one pop(room, None) per dict (decode scheduler)"),
    (f"{_SH}.StagingManagerMixin._handle_staging_req", None, "8805d70754002f87",
     "relied on: get(room) only, and passes the two dicts on (decode listener)"),
    (f"{_SH}.handle_staging_req", None, "eea646b45a871132",
     "relied on: get(room) only on each dict (decode listener)"),
)  # fmt: skip


RELEASES: Final[dict[str, tuple[Target, ...]]] = {
    "0.5.21": _targets(
        _PREFILL_CLASS,
        (f"{_NIXL}.NixlKVSender.clear", "purge_then_clear", "113022b20bcd716b",
         "one purge_room, then the released clear() without its staging drop "
         "(a rebind of prefetch_requested)"),
        (f"{_COMMON}.CommonKVSender.__init__", "lift_on_new_sender", "e1f830f678e62de5",
         "a new sender lifts its id's tombstone (reused ids)"),
        (f"{_NIXL}.NixlKVSender.failure_exception", None, "e7caf9fc3226cdbb",
         "relied on: calls self.clear() (so the failure path purges)"),
        *_DECODE,
    ),
    "0.5.23": _targets(
        _PREFILL_CLASS,
        (f"{_COMMON}.CommonKVSender.clear", "purge_then_clear", "868b15393aa9f65b",
         "one purge_room, then the released clear() without its staging drop (a walk "
         "over every key); NIXL's and Mooncake's senders inherit it"),
        (f"{_NIXL}.NixlKVSender.clear", None, "868b15393aa9f65b",
         "relied on: NIXL's sender inherits CommonKVSender.clear (hooked above)"),
        (f"{_COMMON}.CommonKVSender.__init__", "lift_on_new_sender", "d6b7b1d5dccf0f45",
         "a new sender that owns its room lifts its id's tombstone (reused ids)"),
        (f"{_COMMON}.CommonKVSender.failure_exception", None, "61b5de09eea29ed2",
         "relied on: calls self.clear() (so the failure path purges)"),
        *_DECODE,
    ),
}  # fmt: skip
"""Release -> the targets of that release. The one place a newer release is added."""
