"""The fast data path (issue: data path at raw-NIXL speed): page lists checked once
(:class:`sender.pages.CheckedPages`), the numpy index checks of larger writes, the binding
calls on plain int handles, prepared and unprepared descriptor lists, and the poll pacing.

Every write here moves real bytes over NIXL (UCX) to a peer and is checked byte-exact."""

from __future__ import annotations

import itertools
import os
import time
from typing import Any

import numpy as np
import pytest

from sender import transport as transport_mod
from sender.errors import TransportParamError
from sender.pages import CheckedPages, as_pages
from sender.transport import NixlTransport, pause_between_polls, poll_pauses
from tests.fixtures_nixl import NUM_PAGES, PAGE_BYTES, SenderPool, make_sender_pool, requires_nixl

# ------------------------------------------------------------------ CheckedPages (no NIXL)


@pytest.mark.timeout(10)
def test_checked_pages_checks_once_and_is_immutable() -> None:
    src = np.array([7, 3, 5], dtype=np.int64)
    pages = CheckedPages(src)
    src[0] = 99  # the caller's array changes later: the checked copy does not
    assert pages.tolist() == [7, 3, 5] and list(pages) == [7, 3, 5]
    assert pages.max_page == 7 and pages.unique and len(pages) == 3
    assert pages.indices.dtype == np.int32 and not pages.indices.flags.writeable
    with pytest.raises(ValueError):
        pages.indices[0] = 1
    assert np.asarray(pages).tolist() == [7, 3, 5]
    assert np.asarray(pages, dtype=np.int64).dtype == np.int64
    part = pages[1:]
    assert part.tolist() == [3, 5] and part.max_page == 7 and part.unique  # bound inherited
    assert pages[::2].tolist() == [7, 5]
    with pytest.raises(TypeError):
        pages[[0, 0]]  # type: ignore[index]  # an index array could repeat pages
    with pytest.raises(ValueError):
        pages[3:]
    span = CheckedPages.span(10, 4)
    assert span.tolist() == [10, 11, 12, 13] and span.max_page == 13 and span.unique
    assert CheckedPages([2, 2], unique=False).tolist() == [2, 2]


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("pages", "match"),
    [
        ([], "no pages"),
        ([1, -1, 3], "page -1 out of range"),
        ([0, 2**31], "page 2147483648 out of range"),
        # NIXL converts indices to 32-bit ints unchecked: 2**32 + 1 would become page 1.
        (np.array([0, 2**32 + 1], dtype=np.int64), "page 4294967297 out of range"),
        ([4, 1, 4], "duplicates"),
        ([True, False], "ints only"),
        (np.array([1.0, 2.0]), "integers"),
        (np.zeros((2, 2), dtype=np.int64), "1-D"),
    ],
)
def test_checked_pages_refuses_bad_lists(pages: Any, match: str) -> None:
    with pytest.raises(TransportParamError, match=match):
        CheckedPages(pages)


@pytest.mark.timeout(10)
def test_span_refuses_bad_spans() -> None:
    for first, count in ((0, 0), (-1, 2), (2**31 - 1, 2)):
        with pytest.raises(TransportParamError):
            CheckedPages.span(first, count)


@pytest.mark.timeout(10)
def test_as_pages_passes_int64_arrays_through_and_converts_the_rest() -> None:
    arr = np.arange(5, dtype=np.int64)
    assert as_pages(arr, "x") is arr
    assert as_pages([1, 2], "x").dtype == np.int64
    assert as_pages(np.arange(3, dtype=np.int32), "x").dtype == np.int64
    assert as_pages(CheckedPages([4, 2]), "x").tolist() == [4, 2]


# ------------------------------------------------------------------ poll pacing (no NIXL)


class _Module:
    """Stands in for a module inside ``sender.transport`` only: the given attributes
    replaced, everything else the real module's (nothing outside the transport changes)."""

    def __init__(self, real: Any, **replaced: Any) -> None:
        self._real = real
        self.__dict__.update(replaced)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


@pytest.mark.timeout(10)
def test_poll_pauses_spin_then_grow_with_elapsed_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pinned on an injected clock, not on how long the machine took: 0 while spinning,
    then POLL_PAUSE_FRACTION of the time polled so far, clamped to MIN..MAX."""
    now = [1000.0]
    monkeypatch.setattr(transport_mod, "time", _Module(time, monotonic=lambda: now[0]))
    pauses = poll_pauses(spin_s=0.002)
    assert [next(pauses) for _ in range(3)] == [0.0, 0.0, 0.0]  # spinning: poll at once
    now[0] += 0.0019
    assert next(pauses) == 0.0  # still inside the spin
    now[0] += 0.0017  # 3.6 ms polled: a pause of 3.6 / 16 = 0.225 ms
    assert next(pauses) == pytest.approx(0.0036 * transport_mod.POLL_PAUSE_FRACTION)
    fresh = poll_pauses(spin_s=0.0)
    assert next(fresh) == transport_mod.POLL_PAUSE_MIN_S  # never below the floor
    now[0] += 0.05  # 50 ms more: capped, a long write costs one poll per ms
    assert next(pauses) == transport_mod.POLL_PAUSE_MAX_S
    assert next(fresh) == transport_mod.POLL_PAUSE_MAX_S


@pytest.mark.timeout(10)
def test_pause_between_polls_never_sleeps_for_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    """A zero pause only yields (``time.sleep(0)`` costs 30-90 us on these VMs, longer than a
    1 MiB write); a positive one sleeps exactly that long. Counted, not timed."""
    sleeps: list[float] = []
    yields = [0]

    def count_yield() -> None:
        yields[0] += 1

    monkeypatch.setattr(transport_mod, "time", _Module(time, sleep=sleeps.append))
    monkeypatch.setattr(transport_mod, "os", _Module(os, sched_yield=count_yield))
    for _ in range(2000):
        pause_between_polls(0.0)
    assert yields[0] == 2000 and sleeps == []
    pause_between_polls(2.5e-4)
    assert sleeps == [2.5e-4] and yields[0] == 2000


# ------------------------------------------------------------------ writes with real NIXL

def _connect(sp: SenderPool, peer: Any, session: str = "peer") -> None:
    md = peer.metadata() if callable(peer.metadata) else peer.metadata
    sp.transport.add_peer(session, md)


def _write_and_check(
    sp: SenderPool, peer: Any, src: Any, dst: Any, **kw: Any
) -> None:
    peer.zero_pages()  # a write that moved nothing must not pass on an earlier one's bytes
    x = sp.transport.write_pages("peer", src, dst, **kw)
    x.wait(10)
    x.release()
    assert peer.read_pages(list(np.asarray(dst))) == sp.page_bytes_of(np.asarray(src))


@pytest.mark.nixl
@requires_nixl
@pytest.mark.timeout(60)
@pytest.mark.parametrize("prepared", [True, False], ids=["prepared", "unprepared"])
def test_checked_and_plain_writes_land_byte_exact(
    decode_peer: Any, monkeypatch: pytest.MonkeyPatch, prepared: bool
) -> None:
    """Small and large writes, plain and checked, sliced, on
    prepared descriptor lists (``makeXferReq``) and on per-write lists (``createXferReq``)."""
    if not prepared:  # regions above this many pages are not prepared
        monkeypatch.setattr(transport_mod, "_MAX_PREPPED_PAGES", 0)
    sp = make_sender_pool()
    try:
        _connect(sp, decode_peer)
        assert (sp.transport._regions["kv"].prepped is not None) is prepared
        rng = np.random.default_rng(5)
        for n in (1, 4, 16, 17, 64, 200):
            src = rng.choice(NUM_PAGES, n, replace=False).astype(np.int64)
            dst = rng.choice(NUM_PAGES, n, replace=False).astype(np.int64)
            _write_and_check(sp, decode_peer, src, dst)
            _write_and_check(sp, decode_peer, np.sort(src), np.sort(dst))  # runs coalesce
            _write_and_check(sp, decode_peer, CheckedPages(src, unique=False), CheckedPages(dst))
            if n > 2:
                cs, cd = CheckedPages(src, unique=False), CheckedPages(dst)
                _write_and_check(sp, decode_peer, cs[1:-1], cd[1:-1])
            # Mixed: one checked, one plain (checked per write as usual).
            _write_and_check(sp, decode_peer, CheckedPages(src, unique=False), dst)
        assert sp.transport.stats().live_transfers == 0
    finally:
        sp.transport.close()


@pytest.mark.nixl
@requires_nixl
@pytest.mark.timeout(30)
def test_large_bad_writes_never_reach_nixl(sender_pool: SenderPool, decode_peer: Any) -> None:
    """The numpy checks of writes of more than 16 pages, and checked lists past a region,
    refuse before any NIXL call (NIXL itself would wrap 2**32 + 1 to page 1 unchecked)."""
    tr = sender_pool.transport
    _connect(sender_pool, decode_peer)
    ok = np.arange(20, dtype=np.int64)
    wrap = ok.copy()
    wrap[7] = 2**32 + 1
    neg = ok.copy()
    neg[3] = -1
    dup = ok[::-1].copy()
    dup[10] = dup[2]  # not adjacent, not sorted
    far = np.arange(NUM_PAGES - 5, NUM_PAGES + 15, dtype=np.int64)
    cases = [
        ("src wraps in int32", wrap, ok, "src_pages: page 4294967297 out of range"),
        ("dst wraps in int32", ok, wrap, "dst_pages: page 4294967297 out of range"),
        ("negative src", neg, ok, "src_pages: page -1 out of range"),
        ("duplicate dst, unsorted", ok, dup, "dst_pages contains duplicates"),
        ("dst past the pool", ok, far, "dst_pages: page"),
        ("checked dst past the peer's pool", CheckedPages(ok), CheckedPages(far), "dst_pages"),
        ("checked src past the pool", CheckedPages(far), CheckedPages(ok), "src_pages"),
        ("checked slice past the pool", CheckedPages(ok)[:15], CheckedPages(far)[5:], "dst"),
        ("checked dst not distinct", CheckedPages(ok), CheckedPages(dup, unique=False),
         "duplicates"),
    ]

    class _NoNixl:
        def __init__(self) -> None:
            self.calls: list[str] = []

        def __getattr__(self, name: str) -> Any:
            self.calls.append(name)
            raise AssertionError(f"NIXL touched: {name}")

    real = tr._xfer_agent
    spy = _NoNixl()
    tr._xfer_agent = spy
    try:
        for what, src, dst, match in cases:
            with pytest.raises(TransportParamError, match=match):
                tr.write_pages("peer", src, dst)
                pytest.fail(f"no error for {what}")
    finally:
        tr._xfer_agent = real
    assert spy.calls == []
    assert tr.stats().transfers_started == 0
    # A slice whose parent's bound is past the pool, but which is itself in range, is fine.
    wide = CheckedPages(np.concatenate([ok, far]))
    x = tr.write_pages("peer", CheckedPages(ok), wide[:20])
    x.wait(10)
    x.release()
    assert decode_peer.read_pages(ok.tolist()) == sender_pool.page_bytes_of(ok)


@pytest.mark.nixl
@requires_nixl
@pytest.mark.timeout(30)
def test_close_drops_the_binding_agent(decode_peer: Any) -> None:
    """Transfers hold the binding agent directly; close() must still drop it (else NIXL's
    progress thread would outlive the transport) and refuse later writes."""
    sp = make_sender_pool()
    _connect(sp, decode_peer)
    x = sp.transport.write_pages("peer", [1, 2], [3, 4])
    x.wait(10)
    sp.transport.close()
    assert x.released and sp.transport._xfer_agent is None and sp.transport._agent is None
    with pytest.raises(Exception, match="closed"):
        sp.transport.write_pages("peer", [1], [1])


@pytest.mark.nixl
@requires_nixl
@pytest.mark.timeout(30)
def test_wait_after_release_still_raises(sender_pool: SenderPool, decode_peer: Any) -> None:
    """``wait()``'s shortcut for a write done at the post never hides a release."""
    from sender.errors import TransferReleasedError

    _connect(sender_pool, decode_peer)
    x = sender_pool.transport.write_pages("peer", [1], [2])
    x.wait(10)
    x.release()
    with pytest.raises(TransferReleasedError):
        x.wait(1)
    with pytest.raises(TransferReleasedError):
        x.poll()


@pytest.mark.timeout(10)
def test_module_constants_are_consistent() -> None:
    assert transport_mod.POLL_PAUSE_MIN_S < transport_mod.POLL_PAUSE_MAX_S
    assert 0 < transport_mod.POLL_PAUSE_FRACTION < 1
    assert PAGE_BYTES > 0 and isinstance(NixlTransport, type)
    assert list(itertools.islice(poll_pauses(1.0), 2)) == [0.0, 0.0]


@pytest.mark.nixl
@requires_nixl
@pytest.mark.timeout(30)
def test_adopting_guide_checked_pages_example_runs(
    sender_pool: SenderPool, decode_peer: Any
) -> None:
    """docs/ADOPTING.md's CheckedPages example runs as written and moves the right bytes."""
    import re
    from pathlib import Path

    guide = Path(__file__).resolve().parents[2] / "docs" / "ADOPTING.md"
    text = guide.read_text(encoding="utf-8")
    section = text[text.index("## Handing pages to the sender") :]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "no python example under '## Handing pages to the sender'"
    sender_pool.transport.add_peer("decode-0", decode_peer.metadata())
    kv_pages = np.arange(40, 72, dtype=np.int64)
    decode_pages = np.arange(100, 132, dtype=np.int64)
    scope: dict[str, Any] = {
        "transport": sender_pool.transport,
        "kv_pages": kv_pages,
        "decode_pages": decode_pages,
    }
    exec(compile(match.group(1), "docs/ADOPTING.md:checked", "exec"), scope)
    xfer = scope["xfer"]
    xfer.wait(10)
    xfer.release()
    assert decode_peer.read_pages(decode_pages[:16].tolist()) == sender_pool.page_bytes_of(
        kv_pages[:16]
    )
