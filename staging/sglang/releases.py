"""The SGLang releases the plugin supports (:data:`RELEASES`): per release, every upstream
object relied on, its hook (or ``None``: checked only) and its source fingerprint.

A newer release gets an entry here (``python -m staging.sglang --fingerprint``) and its
``make sglang`` lock file (``tools/sglang/requirements-<release>.lock``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

__all__ = ["RELEASES", "Target"]

_SH = "sglang.srt.disaggregation.common.staging_handler"
_COMMON = "sglang.srt.disaggregation.common.conn"
_NIXL = "sglang.srt.disaggregation.nixl.conn"


def _decode() -> tuple[Target, ...]:
    """The decode side's targets (the same in 0.5.21 and 0.5.23)."""
    return (
        Target(
            f"{_SH}.DecodeStagingContext",
            "decode_staging_class",
            "REPLACE",
            "3f3ec82d41bd97ab",
            "the decode staging dataclass -> a DecodeCompatContext (room_bootstrap and "
            "room_receivers: locked views on one lock)",
        ),
        Target(
            f"{_NIXL}.NixlKVManager.register_staging_room_bootstrap",
            None,
            None,
            "855821cdb4fe4cb6",
            "relied on: one item assignment per dict (decode scheduler)",
        ),
        Target(
            f"{_SH}.DecodeStagingHandler.unregister_decode_req",
            None,
            None,
            "0a731d40068007d6",
            "relied on: one pop(room, None) per dict (decode scheduler)",
        ),
        Target(
            f"{_SH}.StagingManagerMixin._handle_staging_req",
            None,
            None,
            "8805d70754002f87",
            "relied on: get(room) only, and passes the two dicts on (decode listener)",
        ),
        Target(
            f"{_SH}.handle_staging_req",
            None,
            None,
            "eea646b45a871132",
            "relied on: get(room) only on each dict (decode listener)",
        ),
    )


@dataclass(frozen=True)
class Target:
    """One upstream object the plugin relies on."""

    path: str  # dotted, as HookRegistry.register takes it
    hook: str | None  # a factory of staging.sglang.hooks, or None: checked only
    hook_type: str | None  # "REPLACE", "AROUND", "AFTER" (a HookType name), or None
    fingerprint: str  # of the released source
    does: str  # what the plugin changes there (or relies on), in a few words


# The same released source in both releases (one fingerprint).
_PREFILL_CLASS: Final = Target(
    f"{_SH}.PrefillStagingContext",
    "staging_class",
    "REPLACE",
    "79b39c1eb4e765e6",
    "the prefill staging dataclass -> a CompatStagingContext (locked views)",
)


RELEASES: Final[dict[str, tuple[Target, ...]]] = {
    "0.5.21": (
        _PREFILL_CLASS,
        Target(
            f"{_NIXL}.NixlKVSender.clear",
            "purge_then_clear",
            "AROUND",
            "113022b20bcd716b",
            "one purge_room, then the released clear() without its staging drop "
            "(a rebind of prefetch_requested)",
        ),
        Target(
            f"{_COMMON}.CommonKVSender.__init__",
            "lift_on_new_sender",
            "AFTER",
            "e1f830f678e62de5",
            "a new sender lifts its id's tombstone (reused ids)",
        ),
        Target(
            f"{_NIXL}.NixlKVSender.failure_exception",
            None,
            None,
            "e7caf9fc3226cdbb",
            "relied on: calls self.clear() (so the failure path purges)",
        ),
        *_decode(),
    ),
    "0.5.23": (
        _PREFILL_CLASS,
        Target(
            f"{_COMMON}.CommonKVSender.clear",
            "purge_then_clear",
            "AROUND",
            "868b15393aa9f65b",
            "one purge_room, then the released clear() without its staging drop (a walk "
            "over every key); NIXL's and Mooncake's senders inherit it",
        ),
        Target(
            f"{_NIXL}.NixlKVSender.clear",
            None,
            None,
            "868b15393aa9f65b",
            "relied on: NIXL's sender inherits CommonKVSender.clear (hooked above)",
        ),
        Target(
            f"{_COMMON}.CommonKVSender.__init__",
            "lift_on_new_sender",
            "AFTER",
            "d6b7b1d5dccf0f45",
            "a new sender that owns its room lifts its id's tombstone (reused ids)",
        ),
        Target(
            f"{_COMMON}.CommonKVSender.failure_exception",
            None,
            None,
            "61b5de09eea29ed2",
            "relied on: calls self.clear() (so the failure path purges)",
        ),
        *_decode(),
    ),
}
"""Release -> the targets of that release. The one place a newer release is added."""
