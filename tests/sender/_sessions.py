"""The two-session rig over real NIXL: a prefill transport and a decode transport whose
agent is added twice, as sessions ``A`` and ``B`` (the ``sessions_rig`` fixture in
tests/sender/conftest.py yields a ``SessionsRig``), and senders of one or two sessions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sender.manager import KVManager, make_transfer_info
from sender.nixl_sender import NixlKVSender
from sender.transport import NixlTransport
from staging.buffers import StagingBufferPool

SESSIONS_PAGES = 64


SESSIONS_PAGE_BYTES = 4096


A, B = "decode-a", "decode-b"


@dataclass
class SessionsRig:
    tx: NixlTransport
    rx: NixlTransport
    kv: torch.Tensor
    dst: torch.Tensor

    def with_pool(
        self,
        num_slots: int,
        slot_pages: int,
        page_bytes: int = SESSIONS_PAGE_BYTES,
        cls: type[StagingBufferPool] = StagingBufferPool,
        **kw: Any,
    ) -> Any:
        pool = cls(num_slots, slot_pages, page_bytes, **kw)
        self.tx.register_region("staging", pool.tensor, page_bytes)
        return pool


def two_session_sender(mgr: KVManager, room: int, n: int, **info_kw: Any) -> NixlKVSender:
    infos = [
        make_transfer_info(A, list(range(0, n)), **info_kw),
        make_transfer_info(B, list(range(n, 2 * n)), **info_kw),
    ]
    s = NixlKVSender(mgr, room, [A, B], infos)
    s.init(n)
    return s


def one_session_sender(mgr: KVManager, room: int, dst: list[int], **info_kw: Any) -> NixlKVSender:
    s = NixlKVSender(mgr, room, [A], [make_transfer_info(A, dst, **info_kw)])
    s.init(len(dst))
    return s
