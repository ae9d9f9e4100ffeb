"""Benchmark ``isolation``: healthy decode peers' room latency while another peer is hung.

Issue 33 (peer isolation): a decode peer that stops answering (here a real
:class:`stress.harness.peer.PeerProcess` stopped with ``SIGSTOP``: NIXL keeps its writes in progress
for as long as it stays stopped) must cost only its own rooms. This benchmark measures what
it costs the *healthy* peers' rooms.

Set-up: one :class:`sender.transport.NixlTransport` with ``N`` healthy decode peers (2 under
``--quick``, 3 in full) and one more peer, ``hung``. A single scheduler loop (this thread,
as an engine's) keeps :data:`IN_FLIGHT` rooms in flight to each healthy peer, each room one
chunk of 1-:data:`MAX_ROOM_PAGES` pages (seeded), until each healthy peer had ``rooms``
rooms. Each time the first healthy peer gets a room, the hung peer gets one too (the same
rate as one healthy peer), and those never conclude while it is stopped. The transfer
deadline (:data:`TRANSFER_TIMEOUT_S`) is far past a run, so the hung rooms stay in flight
for all of it; ``slot_timeout_s`` is the manager's default.

Cells: without and with a staging pool (:data:`POOL_SLOTS` slots of
:data:`MAX_ROOM_PAGES` pages, region ``"staging"``; each session may lease half of it, the
manager's default ``session_slots``), with 1 and 4 transfer workers. Each cell (one
:class:`sender.manager.KVManager`) runs two kinds of run side by side (the harness's
:func:`~bench._harness.interleave`, ``rounds`` of each): ``hung`` (the hung peer is
stopped) and ``none`` (the same peer is not stopped): the same rooms to every peer in
both, so the only difference is the hang.

Latency is the sender's own: ``time.monotonic()`` from right before the
:class:`sender.nixl_sender.NixlKVSender` is made to the ``poll()`` that returns
``Success``, on the scheduler loop (it polls every active room each pass). p50/p99 are
taken over every healthy room of a kind in the cell (all rounds pooled: a p99 of one round
of a few dozen rooms would be its worst room). After a ``hung`` run the peer is continued
(``SIGCONT``) and every hung room is concluded, cleared and drained before the next run.
Each run also checks the bytes of its last room per healthy peer at the peer.
"""

from __future__ import annotations

import contextlib
import random
import statistics
import subprocess
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from bench._harness import (
    BenchResult,
    Cell,
    Goal,
    JSONValue,
    Ratio,
    interleave,
    pending_result,
)
from sender import _nixl
from sender.poll import KVPoll

if TYPE_CHECKING:
    import torch

    from sender.manager import KVManager
    from sender.nixl_sender import NixlKVSender
    from sender.transport import NixlTransport
    from staging.buffers import StagingBufferPool
    from stress.harness.peer import PeerProcess

NAME = "isolation"
TITLE = "Healthy peers' room latency with one decode peer hung (SIGSTOP) vs none"

SEED = 33
"""The seed of the rooms' page choices and of the run order (printed in the notes)."""
PAGE_BYTES = 4096
KV_PAGES = 1024
PEER_PAGES = 1024
MAX_ROOM_PAGES = 4
POOL_SLOTS = 8
IN_FLIGHT = 2
"""Rooms in flight to each healthy peer at once."""
TRANSFER_TIMEOUT_S = 30.0
"""The manager's transfer deadline: far past a run, so no hung room times out in one."""
RUN_BOUND_S = 20.0
"""A run gives up (its unconcluded healthy rooms count as failed) after this long: below
:data:`TRANSFER_TIMEOUT_S`, so a hung room cannot reach its deadline inside a run."""
CONCLUDE_BOUND_S = 60.0
"""After ``SIGCONT``: how long the hung rooms may take to conclude and drain."""
PEER_START_TIMEOUT_S = 60.0
GOAL_RATIO = 1.5
HUNG = "hung"
KINDS = ("hung", "none")
CELLS: tuple[tuple[str, int, bool], ...] = (
    ("direct, 1 worker", 1, False),
    ("direct, 4 workers", 4, False),
    ("pool, 1 worker", 1, True),
    ("pool, 4 workers", 4, True),
)
"""(label, transfer workers, staging pool)."""


@dataclass(frozen=True)
class Preset:
    """Effort: ``healthy`` peers, ``rooms`` per healthy peer per run, ``rounds`` runs of each
    kind per cell."""

    healthy: int
    rooms: int
    rounds: int


FULL = Preset(healthy=3, rooms=200, rounds=4)
QUICK = Preset(healthy=2, rooms=200, rounds=1)


@dataclass
class _Run:
    """What one run measured."""

    latencies_s: list[float] = field(default_factory=list)
    failed: int = 0
    hung_rooms: int = 0
    hung_in_flight: int = 0
    """Hung rooms still ``Transferring`` when the last healthy room concluded."""
    hung_outcomes: dict[str, int] = field(default_factory=dict)
    wrong_bytes: int = 0


@dataclass
class _CellData:
    label: str
    workers: int
    pool: bool
    runs: dict[str, list[_Run]] = field(default_factory=lambda: {k: [] for k in KINDS})


@dataclass
class _Room:
    sender: NixlKVSender
    session: str
    src: list[int]
    dst: list[int]
    started: float


def quantiles_ms(latencies_s: Sequence[float]) -> tuple[float | None, float | None]:
    """(p50, p99) in ms of ``latencies_s`` (``None`` when empty; with one value, it)."""
    lat = sorted(latencies_s)
    if not lat:
        return None, None
    if len(lat) == 1:
        return lat[0] * 1e3, lat[0] * 1e3
    q = statistics.quantiles(lat, n=100, method="inclusive")
    return statistics.median(lat) * 1e3, q[98] * 1e3


class _Rig:
    """The transport, the healthy peers and the hung one; one manager per cell."""

    def __init__(self, healthy: int, seed: int) -> None:
        import torch

        from sender.transport import NixlTransport
        from staging.buffers import StagingBufferPool
        from stress.harness.peer import PeerProcess

        gen = torch.Generator().manual_seed(seed)
        self.kv: torch.Tensor = torch.randint(
            0, 256, (KV_PAGES, PAGE_BYTES), dtype=torch.uint8, generator=gen
        )
        self.rng = random.Random(seed)
        self.peers: dict[str, PeerProcess] = {}
        self.healthy = [f"decode-{i}" for i in range(healthy)]
        self.tx: NixlTransport = NixlTransport("bench-isolation")
        self.pool: StagingBufferPool | None = None
        self.next_room = 0
        try:
            self.tx.register_region("kv", self.kv, PAGE_BYTES)
            self.pool = StagingBufferPool(POOL_SLOTS, MAX_ROOM_PAGES, PAGE_BYTES)
            self.tx.register_region("staging", self.pool.tensor, PAGE_BYTES)
            for sid in [*self.healthy, HUNG]:
                peer = PeerProcess(
                    PEER_PAGES,
                    PAGE_BYTES,
                    name=f"bench-{sid}",
                    start_timeout_s=PEER_START_TIMEOUT_S,
                    stderr=subprocess.DEVNULL,
                )
                self.peers[sid] = peer
                self.tx.add_peer(sid, peer.metadata)
            self.free = {sid: deque(range(PEER_PAGES)) for sid in self.peers}
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Continue the hung peer, close the transport, the pool and every peer."""
        try:
            hung = self.peers.get(HUNG)
            if hung is not None:
                hung.cont()
        finally:
            try:
                self.tx.close()
            finally:
                if self.pool is not None:
                    self.pool.close()
                for peer in self.peers.values():
                    peer.close()

    def manager(self, workers: int, pool: bool) -> KVManager:
        from sender.manager import KVManager

        return KVManager(
            self.tx,
            self.kv,
            num_workers=workers,
            staging_pool=self.pool if pool else None,
            transfer_timeout_s=TRANSFER_TIMEOUT_S,
        )

    def _open(self, mgr: KVManager, session: str) -> _Room:
        from sender.manager import make_transfer_info
        from sender.nixl_sender import NixlKVSender

        n = self.rng.randint(1, MAX_ROOM_PAGES)
        free = self.free[session]
        dst = [free.popleft() for _ in range(n)]
        src = self.rng.sample(range(KV_PAGES), n)
        room = self.next_room
        self.next_room += 1
        started = time.monotonic()
        sender = NixlKVSender(mgr, room, [session], [make_transfer_info(session, dst)])
        sender.init(n)
        sender.send(np.asarray(src, dtype=np.int64))
        return _Room(sender, session, src, dst, started)

    def _finish(self, room: _Room, ok: bool) -> None:
        """Purge a concluded room; a succeeded room's pages are free again (a failed room's
        may still be written: they are dropped)."""
        if ok:
            room.sender.clear()
            self.free[room.session].extend(room.dst)
            return
        with contextlib.suppress(Exception):  # raises by design; counted by the caller
            room.sender.failure_exception()

    def warm_up(self, mgr: KVManager) -> None:
        """One room to every peer (the first write to a peer sets up its connection).

        Raises:
            RuntimeError: a warm-up room did not succeed.
        """
        for sid in self.peers:
            room = self._open(mgr, sid)
            if _conclude(room, CONCLUDE_BOUND_S) is not True:
                raise RuntimeError(f"warm-up room to {sid} did not succeed")
            self._finish(room, True)

    def run(self, mgr: KVManager, rooms: int, hung: bool) -> _Run:
        """One run: ``rooms`` rooms to each healthy peer and as many to the ``hung`` peer,
        stopped with ``hung``; see the module docstring.

        Raises:
            RuntimeError: the hung rooms did not conclude, or the manager did not drain,
                within :data:`CONCLUDE_BOUND_S` after ``SIGCONT``.
        """
        out = _Run()
        active: list[_Room] = []
        hung_rooms: list[_Room] = []
        admitted = dict.fromkeys(self.healthy, 0)
        inflight = dict.fromkeys(self.healthy, 0)
        last: dict[str, _Room] = {}
        peer = self.peers[HUNG]
        if hung:
            peer.stop()
        try:
            deadline = time.monotonic() + RUN_BOUND_S
            while active or any(n < rooms for n in admitted.values()):
                if time.monotonic() > deadline:
                    for room in active:  # unconcluded: counted as failed
                        room.sender.abort()
                        out.failed += 1
                        self._finish(room, False)
                    break
                moved = False
                for sid in self.healthy:
                    while admitted[sid] < rooms and inflight[sid] < IN_FLIGHT:
                        if sid == self.healthy[0]:  # first: not in a healthy window
                            hung_rooms.append(self._open(mgr, HUNG))
                        active.append(self._open(mgr, sid))
                        admitted[sid] += 1
                        inflight[sid] += 1
                        moved = True
                still: list[_Room] = []
                for room in active:
                    status = room.sender.poll()
                    if status is KVPoll.Success:
                        out.latencies_s.append(time.monotonic() - room.started)
                        inflight[room.session] -= 1
                        last[room.session] = room
                        self._finish(room, True)
                        moved = True
                    elif status is KVPoll.Failed:
                        out.failed += 1
                        inflight[room.session] -= 1
                        self._finish(room, False)
                        moved = True
                    else:
                        still.append(room)
                active = still
                if not moved:
                    time.sleep(0.0002)
            out.hung_rooms = len(hung_rooms)
            out.hung_in_flight = sum(r.sender.poll() is KVPoll.Transferring for r in hung_rooms)
        finally:
            if hung:
                peer.cont()
        for room in hung_rooms:
            ok = _conclude(room, CONCLUDE_BOUND_S)
            key = "Success" if ok else "Failed" if ok is False else "unconcluded"
            out.hung_outcomes[key] = out.hung_outcomes.get(key, 0) + 1
            self._finish(room, bool(ok))
        if not mgr.wait_drained(None, CONCLUDE_BOUND_S):
            raise RuntimeError(f"the manager did not drain within {CONCLUDE_BOUND_S:g} s")
        for sid, room in last.items():
            want = [_digest_of(self.kv, p) for p in room.src]
            if self.peers[sid].page_digest(room.dst) != want:
                out.wrong_bytes += 1
        return out


def _digest_of(kv: torch.Tensor, page: int) -> str:
    from stress.harness.peer import page_digest_bytes

    return page_digest_bytes(kv[page].numpy().tobytes())


def _conclude(room: _Room, bound_s: float) -> bool | None:
    """Poll until the room concludes: ``True`` Success, ``False`` Failed, ``None`` not
    within ``bound_s``."""
    end = time.monotonic() + bound_s
    while time.monotonic() < end:
        status = room.sender.poll()
        if status is KVPoll.Success:
            return True
        if status is KVPoll.Failed:
            return False
        time.sleep(0.0005)
    return None


def _cell_runs(rig: _Rig, cell: _CellData, preset: Preset, seed: int) -> None:
    mgr = rig.manager(cell.workers, cell.pool)
    try:
        rig.warm_up(mgr)

        def measure(kind: str) -> Callable[[], float]:
            def go() -> float:
                run = rig.run(mgr, preset.rooms, hung=kind == "hung")
                cell.runs[kind].append(run)
                return quantiles_ms(run.latencies_s)[1] or 0.0

            return go

        interleave([(k, measure(k)) for k in KINDS], preset.rounds, warmup=0, seed=seed)
    finally:
        mgr.close()


def measure(preset: Preset, seed: int = SEED) -> BenchResult:
    """Run the benchmark with an explicit preset (tests use tiny ones)."""
    if not _nixl.AVAILABLE:
        return pending_result(NAME, TITLE, f"NIXL not importable: {_nixl.IMPORT_ERROR!r}")
    started = time.perf_counter()
    rig = _Rig(preset.healthy, seed)
    set_up_s = time.perf_counter() - started
    cells = [_CellData(label, workers, pool) for label, workers, pool in CELLS]
    try:
        for i, cell in enumerate(cells):
            _cell_runs(rig, cell, preset, seed + i)
    finally:
        rig.close()
    return _result(cells, preset, seed, set_up_s)


def _result(cells: list[_CellData], preset: Preset, seed: int, set_up_s: float) -> BenchResult:
    columns = [
        "cell", "healthy rooms", "hung p50 ms", "hung p99 ms", "none p50 ms", "none p99 ms",
        "p99 hung/none", "failed hung/none", "hung rooms stuck",
    ]  # fmt: skip
    rows: list[dict[str, Cell]] = []
    ratios: list[Ratio] = []
    samples: dict[str, list[float]] = {}
    extra: dict[str, JSONValue] = {}
    worst: tuple[float, str] | None = None
    all_met = True
    failed_total = 0
    wrong_total = 0
    for cell in cells:
        lat = {k: [x for r in cell.runs[k] for x in r.latencies_s] for k in KINDS}
        q = {k: quantiles_ms(lat[k]) for k in KINDS}
        failed = {k: sum(r.failed for r in cell.runs[k]) for k in KINDS}
        wrong_total += sum(r.wrong_bytes for k in KINDS for r in cell.runs[k])
        failed_total += failed["hung"] + failed["none"]
        p99_hung, p99_none = q["hung"][1], q["none"][1]
        ratio = p99_hung / p99_none if p99_hung is not None and p99_none else None
        met = ratio is not None and ratio <= GOAL_RATIO and failed["hung"] == 0
        all_met = all_met and met
        if ratio is not None and (worst is None or ratio > worst[0]):
            worst = (ratio, cell.label)
        stuck = sum(r.hung_in_flight for r in cell.runs["hung"])
        sent = sum(r.hung_rooms for r in cell.runs["hung"])
        rows.append(
            {
                "cell": cell.label,
                "healthy rooms": len(lat["hung"]) + failed["hung"],
                "hung p50 ms": q["hung"][0],
                "hung p99 ms": p99_hung,
                "none p50 ms": q["none"][0],
                "none p99 ms": p99_none,
                "p99 hung/none": ratio,
                "failed hung/none": f"{failed['hung']}/{failed['none']}",
                "hung rooms stuck": f"{stuck}/{sent}",
            }
        )
        ratios.append(Ratio(f"{cell.label}: p99 hung/none", ratio, "> 1: slower with a hung peer"))
        for k in KINDS:
            samples[f"{cell.label}: {k} p99 ms"] = [
                quantiles_ms(r.latencies_s)[1] or 0.0 for r in cell.runs[k]
            ]
        outcomes: dict[str, JSONValue] = {}
        for r in cell.runs["hung"]:
            for key, n in r.hung_outcomes.items():
                prev = outcomes.get(key, 0)
                outcomes[key] = (prev if isinstance(prev, int) else 0) + n
        extra[cell.label] = {
            "latencies_ms": {k: [round(x * 1e3, 4) for x in lat[k]] for k in KINDS},
            "hung_rooms_after_sigcont": outcomes,
        }
    detail = (
        f"worst p99 ratio {worst[0]:.2f}x ({worst[1]})" if worst is not None else "no ratio"
    ) + f"; healthy rooms failed: {failed_total} (with and without the hung peer)"
    goals = [
        Goal(
            f"healthy p99 with a hung peer <= {GOAL_RATIO:g}x the run without, and 0 healthy "
            "rooms failed, in every cell",
            all_met,
            detail,
        )
    ]
    notes = [
        f"seed {seed}; {preset.healthy} healthy decode peers + 1 hung (SIGSTOP), "
        f"{preset.rooms} rooms per healthy peer per run, {IN_FLIGHT} in flight per peer, "
        f"1-{MAX_ROOM_PAGES} pages x {PAGE_BYTES} B per room (one chunk); the hung peer gets "
        "a room with each room of the first healthy peer, in both kinds of run (stopped or not)",
        f"{preset.rounds} run(s) of each kind per cell, interleaved; p50/p99 over every "
        "healthy room of a kind in the cell (rounds pooled), open -> Success by the sender's "
        "clock (time.monotonic on the scheduler loop)",
        f"transfer_timeout_s {TRANSFER_TIMEOUT_S:g} (no hung room reaches it in a run); "
        f"pool: {POOL_SLOTS} slots x {MAX_ROOM_PAGES} pages, session_slots default (half), "
        "slot_timeout_s default; 'hung rooms stuck': hung rooms still Transferring when the "
        "last healthy room of the run concluded / hung rooms sent",
        f"wrong bytes at a healthy peer (last room per peer per run): {wrong_total}; set-up "
        f"(peer processes) {set_up_s:.1f} s, untimed",
    ]
    params: dict[str, JSONValue] = {
        "seed": seed,
        "healthy_peers": preset.healthy,
        "rooms_per_peer": preset.rooms,
        "rounds": preset.rounds,
        "in_flight_per_peer": IN_FLIGHT,
        "max_room_pages": MAX_ROOM_PAGES,
        "pool_slots": POOL_SLOTS,
        "transfer_timeout_s": TRANSFER_TIMEOUT_S,
    }
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
        extra=extra,
        ratios_title="p99 ratios (hung / none, rounds pooled; the table's column)",
    )


def run(quick: bool) -> BenchResult:
    """The ``--quick`` preset (2 healthy peers, 1 run of each kind per cell) or the full one
    (3 healthy peers, 4 runs of each kind per cell); 200 rooms per healthy peer per run in
    both (so the hung peer's backlog, 200 rooms, is the same)."""
    return measure(QUICK if quick else FULL)
