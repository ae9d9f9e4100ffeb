"""Fixtures shared by several sender test files (their helpers are in the ``_*.py`` modules
here).

``rig`` is the scripted rig of tests/sender/_scripted.py; test_sender.py and
test_fail_session.py define rigs of their own under the same name, which override it there.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from sender.transport import NixlTransport
from staging.context import StagingContext
from tests.fixtures_nixl import SenderPool
from tests.sender import _stub_transport
from tests.sender._crowded_staging import FILLER_KEYS
from tests.sender._scripted import SCRIPTED_SESSION, Rig
from tests.sender._sessions import SESSIONS_PAGE_BYTES, SESSIONS_PAGES, A, B, SessionsRig


@pytest.fixture
def rig(sender_pool: SenderPool, decode_peer: Any) -> Rig:
    sender_pool.transport.add_peer(SCRIPTED_SESSION, decode_peer.metadata())
    return Rig(sender_pool, decode_peer)


@pytest.fixture
def sessions_rig() -> Iterator[SessionsRig]:
    """A prefill transport (KV pool ``kv``) and a decode transport (``kv``), with the decode
    agent added twice, as sessions A and B (two decode sessions, one agent)."""
    gen = torch.Generator().manual_seed(25)
    kv = torch.randint(
        0, 256, (SESSIONS_PAGES, SESSIONS_PAGE_BYTES), dtype=torch.uint8, generator=gen
    )
    dst = torch.zeros((SESSIONS_PAGES, SESSIONS_PAGE_BYTES), dtype=torch.uint8)
    with NixlTransport("prefill-edge") as tx, NixlTransport("decode-edge") as rx:
        tx.register_region("kv", kv, SESSIONS_PAGE_BYTES)
        rx.register_region("kv", dst, SESSIONS_PAGE_BYTES)
        md = rx.metadata()
        tx.add_peer(A, md)
        tx.add_peer(B, md)
        yield SessionsRig(tx, rx, kv, dst)


@pytest.fixture(scope="module")
def crowded_staging() -> StagingContext:
    """A staging context with a small lock timeout and 200k keys of filler rooms (ids >=
    1_000_000): its ``snapshot()`` holds the read lock ~0.1 s, 20x the lock timeout."""
    ctx = StagingContext(lock_timeout=0.005)
    per_room = 64
    for i in range(FILLER_KEYS // per_room):
        ctx.request_prefetches(ctx.open_room(1_000_000 + i), range(per_room), "filler")
    return ctx


@pytest.fixture(autouse=True)
def _close_stub_managers() -> Iterator[None]:
    """Close the stub managers a test made (``_stub_transport._stub_manager``)."""
    yield
    while _stub_transport._MADE:
        _stub_transport._MADE.pop().close(1.0)
