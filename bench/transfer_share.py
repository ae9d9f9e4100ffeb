"""Benchmark ``transfer-share``: the bookkeeping share of a real NIXL transfer.

One room = 8 chunks of 1 MiB (16 pages of 64 KiB each) sent over NIXL to a decode peer in
its own process (:class:`stress.harness.peer.PeerProcess`). Measured side by side, round by round:

* ``sender`` -- the room through the full sender path: :class:`sender.nixl_sender.NixlKVSender`
  on a :class:`sender.manager.KVManager` (``make_transfer_info``, the sender, ``init``, 8
  ``send``, ``poll`` until ``Success``, ``clear``).
* ``bare`` -- the same NIXL writes and nothing else: per chunk one
  :meth:`~sender.transport.NixlTransport.write_pages` of the same pages with the same
  notification, then ``wait`` and ``release`` of each (the staged variant gathers each chunk
  into a pre-leased staging slot first, with the same :meth:`StagingBufferPool.gather`).

* ``no-op`` -- the sender path again, on a transport that moves nothing (its transfers are
  done at once): the bookkeeping with no NIXL work around it.

Bookkeeping is reported three ways (the goal is judged on the second):

* ``diff``: ``(sender - bare) / sender``, per round;
* ``book`` (direct): the sender's transport is wrapped by a thin timer (``write_pages``,
  ``poll``, ``release``) and so is the staging pool's ``gather`` (a data copy, not
  bookkeeping); the time spent inside every sender API call *minus* the transport and
  gather time inside it is the bookkeeping. The sleeps between polls are outside every API
  call, so they are excluded too;
* ``no-op``: the same subtraction on the ``no-op`` cells.

Shares are taken of the real ``sender`` room time. The manager runs inline
(``num_workers=0``): the whole room runs on the calling thread, so thread hand-offs (which
``stress-rooms`` measures) are not mixed into bookkeeping. Debug locks are off (production
settings). Torch runs on one intra-op thread while measuring: with its default two threads
on this 2-core machine (shared with NIXL's progress threads and the peer process), a 1 MiB
gather took 0.2 ms or 34 ms depending on outside load (measured); one thread kept it at
~0.2 ms.

Page layout: 64 KiB pages, 16 per chunk. One peer (one page size) then serves both layouts:
``contiguous`` chunks (16 consecutive pages on both sides, which the transport coalesces
into ONE 1 MiB descriptor -- the cheapest NIXL transfer of 1 MiB, so the share is at its
largest: the worst case for the goal) and ``scattered`` chunks (16 random pages on each
side: 16 descriptors, as paged KV caches are laid out). Each layout runs the ``direct``
path (pages go straight from the KV pool) and the ``staged`` path (gather into a staging
slot + one write; adds the staging context's prefetch bookkeeping and slot leasing).
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from bench._harness import (
    BenchResult,
    Cell,
    Goal,
    JSONValue,
    Ratio,
    interleave,
    median,
    median_ratio,
    pending_result,
    timer_overhead_ns,
)
from bench._noop import NoopTransport
from sender import _nixl

if TYPE_CHECKING:
    import torch

    from sender.manager import KVManager, PageArray, TransportLike
    from sender.transport import PageIndices
    from staging.buffers import StagingBufferPool, StagingSlot
    from stress.harness.peer import PeerProcess

NAME = "transfer-share"
TITLE = "Bookkeeping share of a real transfer: 8 x 1 MiB room over NIXL to a peer process"

PAGE_BYTES = 64 * 1024
PAGES_PER_CHUNK = 16
CHUNKS = 8
ROOM_PAGES = CHUNKS * PAGES_PER_CHUNK
ROOM_BYTES = ROOM_PAGES * PAGE_BYTES
KV_PAGES = 1024
PEER_PAGES = 512
PLANS = 4
SESSION = "decode-0"
POLL_INTERVAL_S = 0.0002
GOAL_SHARE_PCT = 5.0
"""Goal (issue 19): bookkeeping <= this % of a real 8 x 1 MiB room, every layout and path."""
NEXT_GOAL_SHARE_PCT = 2.0
"""The goal after that one: <= this %."""
TORCH_THREADS = 1
LAYOUTS = ("contiguous", "scattered")
PATHS = ("direct", "staged")
WAYS = ("sender", "bare", "no-op")
NOOP_ROOMS_FACTOR = 4
CALLS = ("open", "init", "send", "poll", "clear")
"""Sender API calls timed for the direct measurement (``open`` = transfer info + sender)."""


@dataclass(frozen=True)
class Preset:
    """Effort of one run: ``rooms`` per cell per round."""

    rounds: int
    rooms: int
    warmup: int = 1


FULL = Preset(rounds=15, rooms=8)
QUICK = Preset(rounds=5, rooms=4)


# ---------------------------------------------------------------------------- timed wrappers


@dataclass
class _Clock:
    """Nanoseconds spent inside the transport and inside gathers (single-threaded use)."""

    excluded_ns: int = 0


class _TimedTransfer:
    """A transport transfer whose ``poll``/``release`` time goes to the clock."""

    __slots__ = ("_clock", "_inner")

    def __init__(self, inner: Any, clock: _Clock) -> None:
        self._inner = inner
        self._clock = clock

    def poll(self) -> str:
        t0 = time.perf_counter_ns()
        try:
            state: str = self._inner.poll()
            return state
        finally:
            self._clock.excluded_ns += time.perf_counter_ns() - t0

    def release(self) -> None:
        t0 = time.perf_counter_ns()
        try:
            self._inner.release()
        finally:
            self._clock.excluded_ns += time.perf_counter_ns() - t0


class _TimedTransport:
    """The manager's view of a :class:`NixlTransport`, with ``write_pages`` timed."""

    def __init__(self, inner: TransportLike, clock: _Clock) -> None:
        self._inner = inner
        self._clock = clock

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
    ) -> _TimedTransfer:
        t0 = time.perf_counter_ns()
        try:
            xfer = self._inner.write_pages(
                session_id,
                src_pages,
                dst_pages,
                notif,
                src_region=src_region,
                dst_region=dst_region,
                timeout_s=timeout_s,
            )
        finally:
            self._clock.excluded_ns += time.perf_counter_ns() - t0
        return _TimedTransfer(xfer, self._clock)


def _timed_pool(num_slots: int, clock: _Clock) -> StagingBufferPool:
    """A staging pool whose ``gather`` (a data copy, not bookkeeping) goes to the clock."""
    from staging.buffers import StagingBufferPool

    class TimedPool(StagingBufferPool):
        def gather(
            self,
            slot: StagingSlot,
            source: torch.Tensor,
            pages: Any,
            byte_range: tuple[int, int] | None = None,
        ) -> int:
            t0 = time.perf_counter_ns()
            try:
                return super().gather(slot, source, pages, byte_range)
            finally:
                clock.excluded_ns += time.perf_counter_ns() - t0

    return TimedPool(num_slots, PAGES_PER_CHUNK, PAGE_BYTES, lock="mutex", debug=False)


# ---------------------------------------------------------------------------- the rig


@dataclass(frozen=True)
class _Plan:
    """Source and destination pages of one room (``ROOM_PAGES`` each, chunk after chunk)."""

    src: PageArray
    dst: PageArray

    def chunk(self, c: int) -> tuple[PageArray, PageArray]:
        lo, hi = c * PAGES_PER_CHUNK, (c + 1) * PAGES_PER_CHUNK
        return self.src[lo:hi], self.dst[lo:hi]


def make_plans(layout: str, seed: int = 3) -> list[_Plan]:
    """``PLANS`` room plans of a layout (the same plans serve the sender and the bare path)."""
    rng = np.random.default_rng(seed)
    plans = []
    for k in range(PLANS):
        if layout == "contiguous":
            src = np.arange(ROOM_PAGES, dtype=np.int64) + k * ROOM_PAGES
            dst = np.arange(ROOM_PAGES, dtype=np.int64) + (k % (PEER_PAGES // ROOM_PAGES)) * (
                ROOM_PAGES
            )
        elif layout == "scattered":
            src = rng.choice(KV_PAGES, ROOM_PAGES, replace=False).astype(np.int64)
            dst = rng.choice(PEER_PAGES, ROOM_PAGES, replace=False).astype(np.int64)
        else:
            raise ValueError(f"unknown layout {layout!r}")
        plans.append(_Plan(src, dst))
    return plans


@dataclass
class _RowStats:
    """Direct-measurement data of one sender cell, one entry per round."""

    book_us: list[float] = field(default_factory=list)
    by_call_us: dict[str, list[float]] = field(default_factory=dict)


class _Rig:
    """Prefill transport, staging pool and four inline managers (real NIXL or no-op
    transport, direct or staged path) in front of one decode peer process."""

    def __init__(self, peer: PeerProcess) -> None:
        import torch

        from sender.manager import KVManager
        from sender.transport import NixlTransport
        from staging.context import StagingContext

        self.peer = peer
        self.clock = _Clock()
        gen = torch.Generator().manual_seed(11)
        self.kv = torch.randint(0, 256, (KV_PAGES, PAGE_BYTES), dtype=torch.uint8, generator=gen)
        # 2 * CHUNKS slots: a sender holds one per chunk until it polls, the bare path
        # keeps CHUNKS pre-leased for the whole run.
        self.pool = _timed_pool(2 * CHUNKS, self.clock)
        self.tx = NixlTransport("bench-share-prefill")
        try:
            self.tx.register_region("kv", self.kv, PAGE_BYTES)
            self.tx.register_region("staging", self.pool.tensor, PAGE_BYTES)
            self.tx.add_peer(SESSION, peer.metadata)
            transports = {
                "sender": _TimedTransport(self.tx, self.clock),
                "no-op": _TimedTransport(NoopTransport(), self.clock),
            }
            self.managers: dict[tuple[str, str], KVManager] = {
                (way, path): KVManager(
                    transport,
                    self.kv,
                    num_workers=0,
                    staging=StagingContext(lock="rw", debug=False),
                    staging_pool=self.pool if path == "staged" else None,
                    lock="mutex",
                    debug=False,
                    poll_interval_s=POLL_INTERVAL_S,
                )
                for way, transport in transports.items()
                for path in PATHS
            }
            self.bare_slots = [self.pool.acquire("bare") for _ in range(CHUNKS)]
        except BaseException:
            self.tx.close()
            raise
        self.next_room = 0
        self.stats: dict[str, _RowStats] = {}

    def close(self) -> None:
        try:
            for mgr in self.managers.values():
                mgr.close()
        finally:
            self.pool.close()
            self.tx.close()

    # -------------------------------------------------------------- one room, each way

    def sender_room(self, way: str, path: str, plan: _Plan, book: dict[str, int]) -> int:
        """One room through the sender (``way`` = ``"sender"`` or ``"no-op"``); returns its
        wall ns and adds each call's bookkeeping ns to ``book``."""
        from sender.manager import make_transfer_info
        from sender.nixl_sender import NixlKVSender
        from sender.poll import KVPoll

        mgr = self.managers[way, path]
        room = self.next_room
        self.next_room += 1
        clock = self.clock
        clk = time.perf_counter_ns

        def call(kind: str, fn: Callable[[], Any]) -> Any:
            c0 = clock.excluded_ns
            t0 = clk()
            out = fn()
            book[kind] += clk() - t0 - (clock.excluded_ns - c0)
            return out

        start = clk()
        sender: NixlKVSender = call(
            "open",
            lambda: NixlKVSender(mgr, room, [SESSION], [make_transfer_info(SESSION, plan.dst)]),
        )
        call("init", lambda: sender.init(ROOM_PAGES))
        for c in range(CHUNKS):
            src = plan.src[c * PAGES_PER_CHUNK : (c + 1) * PAGES_PER_CHUNK]
            call("send", partial(sender.send, src))
        while True:
            status = call("poll", sender.poll)
            if status is KVPoll.Success:
                break
            if status is KVPoll.Failed:
                raise RuntimeError(f"benchmark room {room} failed: {sender.failure_exception()}")
            time.sleep(POLL_INTERVAL_S)
        call("clear", sender.clear)
        return clk() - start

    def bare_room(self, path: str, plan: _Plan) -> int:
        """The same writes without the sender; returns the room's wall ns."""
        room = self.next_room
        self.next_room += 1
        clk = time.perf_counter_ns
        start = clk()
        xfers = []
        for c in range(CHUNKS):
            src, dst = plan.chunk(c)
            region = "kv"
            if path == "staged":
                slot = self.bare_slots[c]
                n = self.pool.gather(slot, self.kv, src)
                src = np.arange(slot.first_page, slot.first_page + n, dtype=np.int64)
                region = "staging"
            notif = f"room={room};chunk={c};last={int(c == CHUNKS - 1)}".encode()
            xfers.append(
                self.tx.write_pages(SESSION, src, dst, notif, src_region=region, timeout_s=30.0)
            )
        for x in xfers:
            x.wait(interval_s=POLL_INTERVAL_S)
        for x in xfers:
            x.release()
        return clk() - start

    def verify(self, path: str, plan: _Plan) -> None:
        """Send one room through the sender and check its bytes at the peer (untimed).

        Raises:
            RuntimeError: the bytes at the peer differ from the source pages.
        """
        from stress.harness.driver import page_digests

        self.peer.zero_pages(plan.dst.tolist())
        self.sender_room("sender", path, plan, dict.fromkeys(CALLS, 0))
        want = page_digests(self.kv[plan.src.tolist()])
        if self.peer.page_digest(plan.dst.tolist()) != want:
            raise RuntimeError(f"benchmark bug: {path} room bytes differ at the peer")

    # -------------------------------------------------------------- cells

    def cells(self, preset: Preset) -> list[tuple[str, Callable[[], float]]]:
        cells: list[tuple[str, Callable[[], float]]] = []
        for layout in LAYOUTS:
            plans = make_plans(layout)
            for path in PATHS:
                for way in WAYS:
                    cells.append(
                        (_label(layout, path, way), self._cell(layout, path, way, plans, preset))
                    )
        return cells

    def _cell(
        self, layout: str, path: str, way: str, plans: list[_Plan], preset: Preset
    ) -> Callable[[], float]:
        """ms per room (``sender``, ``bare``) or bookkeeping µs per room (``no-op``)."""
        stats = self.stats.setdefault(_label(layout, path, way), _RowStats())
        rooms = preset.rooms if way != "no-op" else preset.rooms * NOOP_ROOMS_FACTOR

        def cell() -> float:
            total = 0
            if way == "bare":
                for i in range(rooms):
                    total += self.bare_room(path, plans[i % len(plans)])
                return total / rooms / 1e6
            book = dict.fromkeys(CALLS, 0)
            for i in range(rooms):
                total += self.sender_room(way, path, plans[i % len(plans)], book)
            stats.book_us.append(sum(book.values()) / rooms / 1e3)
            for kind, ns in book.items():
                stats.by_call_us.setdefault(kind, []).append(ns / rooms / 1e3)
            return stats.book_us[-1] if way == "no-op" else total / rooms / 1e6

        return cell


def _label(layout: str, path: str, way: str) -> str:
    unit = "µs bookkeeping/room" if way == "no-op" else "ms/room"
    return f"{layout}/{path}/{way} {unit}"


# ---------------------------------------------------------------------------- run


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run torch's CPU ops on ``n`` intra-op threads; restore the previous count after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def measure(preset: Preset) -> BenchResult:
    """Run the benchmark with an explicit preset (tests use tiny ones)."""
    if not _nixl.AVAILABLE:
        return pending_result(NAME, TITLE, f"NIXL not importable: {_nixl.IMPORT_ERROR!r}")
    from stress.harness.peer import PeerProcess

    overhead_ns = timer_overhead_ns()
    started = time.perf_counter()
    with (
        torch_threads(TORCH_THREADS),
        PeerProcess(PEER_PAGES, PAGE_BYTES, name="bench-share", stderr=subprocess.DEVNULL) as peer,
    ):
        peer_start_s = time.perf_counter() - started
        rig = _Rig(peer)
        try:
            for layout in LAYOUTS:
                for path in PATHS:
                    rig.verify(path, make_plans(layout)[0])
            samples = interleave(rig.cells(preset), preset.rounds, warmup=preset.warmup)
            stats = rig.stats
        finally:
            rig.close()
    return _report(preset, samples, stats, overhead_ns, peer_start_s)


def _report(
    preset: Preset,
    samples: dict[str, list[float]],
    stats: dict[str, _RowStats],
    overhead_ns: float,
    peer_start_s: float,
) -> BenchResult:
    warm = preset.warmup
    columns = [
        "layout",
        "path",
        "sender ms",
        "bare ms",
        "sender/bare",
        "diff %",
        "book µs",
        "book %",
        "no-op µs",
        "no-op %",
        "sender GB/s",
    ]
    rows: list[dict[str, Cell]] = []
    ratios: list[Ratio] = []
    shares: dict[str, tuple[float, float, float]] = {}
    by_call: dict[str, dict[str, float]] = {}
    for layout in LAYOUTS:
        for path in PATHS:
            key = f"{layout}/{path}"
            snd = samples[_label(layout, path, "sender")]
            bare = samples[_label(layout, path, "bare")]
            noop = samples[_label(layout, path, "no-op")]
            st = stats[_label(layout, path, "sender")]
            book = st.book_us[warm:]  # the warm-up round's entries come first
            direct_pct = median([100 * b / (s * 1e3) for b, s in zip(book, snd, strict=True)])
            noop_pct = median([100 * b / (s * 1e3) for b, s in zip(noop, snd, strict=True)])
            diff_pct = median([100 * (s - b) / s for s, b in zip(snd, bare, strict=True)])
            ratio = median_ratio(snd, bare)
            shares[key] = (direct_pct, noop_pct, diff_pct)
            rows.append(
                {
                    "layout": layout,
                    "path": path,
                    "sender ms": median(snd),
                    "bare ms": median(bare),
                    "sender/bare": ratio,
                    "diff %": diff_pct,
                    "book µs": median(book),
                    "book %": direct_pct,
                    "no-op µs": median(noop),
                    "no-op %": noop_pct,
                    "sender GB/s": ROOM_BYTES / (median(snd) * 1e6),
                }
            )
            ratios.append(Ratio(f"sender/bare {key}", ratio, "> 1: the sender path costs more"))
            by_call[key] = {k: median(v[warm:]) for k, v in st.by_call_us.items()}
            noop_st = stats[_label(layout, path, "no-op")]
            by_call[f"{key}/no-op"] = {k: median(v[warm:]) for k, v in noop_st.by_call_us.items()}

    detail = ", ".join(
        f"{k} {d:.1f}% (no-op {n:.1f}%, diff {f:.1f}%)" for k, (d, n, f) in shares.items()
    )
    worst = max(direct for direct, _, _ in shares.values())
    goals = [
        Goal(
            f"bookkeeping <= {pct:g} % of a real 8 x 1 MiB room (book %, every layout and "
            f"path){' (the next step)' if pct == NEXT_GOAL_SHARE_PCT else ''}",
            worst <= pct,
            f"worst {worst:.1f} %: {detail}",
            "the sender's Python calls per chunk; what was tried is in PERFORMANCE.md's "
            '"Decisions"',
        )
        for pct in (GOAL_SHARE_PCT, NEXT_GOAL_SHARE_PCT)
    ]
    primary = "contiguous/direct"

    def calls(key: str) -> str:
        return ", ".join(f"{k} {v:.0f}" for k, v in by_call[key].items())

    notes = [
        f"medians of {preset.rounds} rounds, all {len(samples)} cells interleaved; "
        f"{preset.rooms} rooms per sender/bare cell, {preset.rooms * NOOP_ROOMS_FACTOR} per "
        "no-op cell; room = 8 chunks x 16 pages x 64 KiB, sent to a PeerProcess over NIXL "
        "(UCX, CMA)",
        "sender/bare ms: wall time per room; diff % = (sender - bare) / sender; book µs: time "
        "inside the sender's API calls minus the transport and gather time inside them; "
        "book % = book µs / sender room time; no-op µs: the same calls with a transport that "
        "moves nothing (bookkeeping with no NIXL work around it); no-op % = no-op µs / "
        "sender room time",
        f"book µs per room by call, {primary}: {calls(primary)}; the same with the no-op "
        f"transport: {calls(primary + '/no-op')}",
        "inline manager (num_workers=0), debug locks off, StagingContext lock rw, manager "
        f"lock mutex, torch on {TORCH_THREADS} intra-op thread; timer pairs "
        f"({overhead_ns:.0f} ns each) are not subtracted, so book is a slight overestimate",
        "the per-chunk goal on the no-op transport (<= 1.0x NIXL's own per-call cost) is "
        "judged by `python -m bench curves`, which has that anchor",
        f"one room per layout/path verified byte-exact at the peer before timing; peer "
        f"process start {peer_start_s:.1f} s (untimed)",
    ]
    params: dict[str, JSONValue] = {
        "rounds": preset.rounds,
        "warmup_rounds": preset.warmup,
        "rooms_per_cell": preset.rooms,
        "noop_rooms_per_cell": preset.rooms * NOOP_ROOMS_FACTOR,
        "page_bytes": PAGE_BYTES,
        "pages_per_chunk": PAGES_PER_CHUNK,
        "chunks": CHUNKS,
        "room_bytes": ROOM_BYTES,
        "timer_overhead_ns": overhead_ns,
    }
    book_json: dict[str, JSONValue] = {k: dict(v) for k, v in by_call.items()}
    return BenchResult(
        name=NAME,
        title=TITLE,
        columns=columns,
        rows=rows,
        ratios=ratios,
        goals=goals,
        notes=notes,
        params=params,
        samples=samples,
        extra={"bookkeeping_us_by_call": book_json},
    )


def run(quick: bool) -> BenchResult:
    """The ``--quick`` preset (5 rounds x 4 rooms) or the full one (15 rounds x 8 rooms)."""
    return measure(QUICK if quick else FULL)
