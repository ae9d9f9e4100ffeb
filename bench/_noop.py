"""A transport that moves nothing: the sender's bookkeeping with no NIXL work around it.

:class:`NoopTransport` has the one method :class:`sender.manager.KVManager` needs of a
transport (``write_pages``); every transfer it returns is done at once and holds nothing. It
has no ``send_notif``, so a manager on it starts no notifier thread. Used by
``transfer-share`` and ``curves`` (timed) and by ``instructions`` (counted under callgrind),
so the three measure the same bookkeeping. It imports neither torch nor NIXL.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sender.transport import PageIndices


class NoopTransfer:
    """A transfer that is already done and holds nothing (done inside its post, as a small
    write over UCX on one host: the manager ends it at its post, as it ends a real one)."""

    __slots__ = ()
    REPORTS_DONE_AT_POST = True
    done = True

    def poll(self) -> str:
        """Always ``"DONE"``."""
        return "DONE"

    def release(self) -> None:
        """Nothing to release."""
        return None


class NoopTransport:
    """A transport that moves nothing (see the module docstring)."""

    def write_pages(
        self,
        session_id: str,
        src_pages: PageIndices,
        dst_pages: PageIndices,
        notif: bytes | None = None,
        *,
        src_region: str = "kv",
        dst_region: str = "kv",
        timeout_s: float | None = None,
    ) -> NoopTransfer:
        """A transfer that is done at once; the arguments are not looked at."""
        return NoopTransfer()
