"""Benchmark ``curves``: per-room sender cost as a room's work grows, against bare NIXL.

A *room* is what :class:`sender.nixl_sender.NixlKVSender` sends for one request: ``chunks``
chunks of :data:`CHUNK_PAGES` contiguous 16 KiB pages (64 KiB a chunk), each to every one
of the room's ``sessions`` decode sessions, with ``rooms`` rooms in flight at once. Three
curves vary one of these from the base room (8 chunks, 1 session, 1 room in flight):

* (a) ``chunks`` per room: 1, 8, 32, 128 (inline manager);
* (b) ``sessions`` per room: 1, 2, 4, 8 -- tensor-parallel fan-out: each session its own
  session id on the transport and its own disjoint pages of the peer's registered pool, so
  every session is a real destination region (one decode peer process serves them all: the
  transport lets several sessions name one remote agent; eight peer processes would not fit
  on a 2-core machine beside the sender);
* (c) ``rooms`` in flight: 1, 16, 256, inline and with 1, 2 and 4 transfer workers.

Each point is measured three ways, all cells of all curves interleaved in shuffled rounds
(:func:`bench._harness.interleave`):

* ``sender`` -- the rooms through the public API: per room ``make_transfer_info`` per
  session, :class:`~sender.nixl_sender.NixlKVSender`, ``init``; then chunk by chunk, each
  room's next ``send`` (a scheduler step sends every room its next chunk); then ``poll``
  sweeps over the unconcluded rooms until every one is ``Success`` (``clear`` as each
  concludes). Inline (``num_workers=0``) a sweep is the progress, so sweeps run back to back
  (busy); with workers the scheduler pauses :data:`WORKER_POLL_S` between sweeps (a
  scheduler step: a sweep that never let go of the GIL would starve the workers).
* ``no-op`` -- the same on :class:`bench._noop.NoopTransport` (moves nothing): bookkeeping
  with no NIXL work around it.
* ``bare`` -- the same writes with NIXL's own prepped calls and no sender around them, built
  as ``throughput``'s ``raw prepped`` anchor (:class:`bench.throughput._RawNixl`: an agent
  configured as our transport's, ``prep_xfer_dlist`` once per side): per write
  ``make_prepped_xfer`` by page index with the same notification bytes the sender sends, and
  ``transfer``, in the sender's order; then each handle busy-polled to DONE and released.
  One thread (workers are the sender's business).

Per room: wall time (the cell's span / rooms) and process CPU time (``time.process_time``:
every thread of this process, transfer workers and NIXL's progress threads included; not
the peer's). Each curve's growth is stated as the exponent of a log-log least-squares fit
of per-room cost on the size (1 = linear, 0 = flat) and as the slope of its last step (the
growth where the room is largest). A per-room figure that grows faster than the work it
does is flagged: an exponent or last step noticeably above 1 in chunks or sessions (the
work, ``chunks x sessions`` writes, is linear), or above 0 in rooms in flight (the work per
room is constant). Speed is reported, never asserted.
"""

from __future__ import annotations

import math
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from bench._harness import (
    BenchResult,
    Cell,
    Goal,
    JSONValue,
    Ratio,
    Table,
    gc_paused,
    interleave,
    loglog_exponent,
    median,
    median_ratio,
    pending_result,
)
from bench._noop import NoopTransport
from bench.throughput import PAGE_BYTES, RAW_TIMEOUT_S
from sender import _nixl

if TYPE_CHECKING:
    import torch

    from bench.throughput import _RawNixl
    from sender.manager import KVManager
    from sender.nixl_sender import NixlKVSender
    from sender.transport import NixlTransport
    from stress.harness.peer import PeerProcess

NAME = "curves"
TITLE = "Per-room sender cost as chunks, sessions and rooms in flight grow, vs bare NIXL"

CHUNK_PAGES = 4
"""Pages per chunk (contiguous on both sides: one 64 KiB descriptor a write)."""
KV_PAGES = 1024
BASE_CHUNKS = 8
SESSIONS_PREFIX = "decode-"
WORKER_POLL_S = 0.0002
"""Pause between poll sweeps with transfer workers (transfer-share's scheduler step)."""
TRANSFER_TIMEOUT_S = 30.0
WAYS = ("sender", "no-op", "bare")
SILENT = "bare no-notif"
"""The base room's bare writes without notifications: NIXL's own per-call cost, the anchor of
the no-op goal (a write with a notification stays in progress until its control message is
through, many times the cost of the call itself here)."""
AXES = ("chunks", "sessions", "rooms")
LINEAR_TOL = 0.1
"""Flag a fitted exponent above (1 or 0) + this; the last step gets twice this."""
NOOP_PER_CALL_GOAL = 1.0
"""Goal: no-op bookkeeping per chunk <= this x bare NIXL's per-chunk cost (base room)."""


@dataclass(frozen=True)
class Preset:
    """Effort: the sizes of each curve, the workers of curve (c), ``rounds``, and ``writes``:
    about how many chunk writes each cell makes per round (it runs whole batches of
    ``rooms`` rooms, at least one)."""

    chunks: tuple[int, ...]
    sessions: tuple[int, ...]
    rooms: tuple[int, ...]
    workers: tuple[int, ...]
    rounds: int
    writes: int
    warmup: int = 1

    def __post_init__(self) -> None:
        """Check the sizes.

        Raises:
            ValueError: a curve's sizes are not increasing ints >= 1, the sessions or rooms
                curve lacks 1 (the base room is on both), or a count is out of range.
        """
        for what, sizes in (("chunks", self.chunks), ("sessions", self.sessions)):
            if not sizes or min(sizes) < 1 or list(sizes) != sorted(set(sizes)):
                raise ValueError(f"{what} must be increasing ints >= 1, got {sizes}")
        if not self.rooms or min(self.rooms) < 1 or list(self.rooms) != sorted(set(self.rooms)):
            raise ValueError(f"rooms must be increasing ints >= 1, got {self.rooms}")
        if 1 not in self.sessions or 1 not in self.rooms:
            raise ValueError("the sessions and rooms curves must include 1 (the base room)")
        if not self.workers or min(self.workers) < 0:
            raise ValueError(f"workers must be ints >= 0, got {self.workers}")
        if self.rounds < 1 or self.writes < 1 or self.warmup < 0:
            raise ValueError("need rounds >= 1, writes >= 1 and warmup >= 0")


FULL = Preset(
    chunks=(1, 8, 32, 128),
    sessions=(1, 2, 4, 8),
    rooms=(1, 16, 256),
    workers=(0, 1, 2, 4),
    rounds=9,
    writes=512,
)
QUICK = Preset(
    chunks=(1, 8, 32),
    sessions=(1, 4),
    rooms=(1, 16),
    workers=(0, 2),
    rounds=3,
    writes=64,
)


@dataclass(frozen=True, order=True)
class Shape:
    """One point: ``rooms`` rooms in flight of ``chunks`` chunks to ``sessions`` sessions,
    on a manager with ``workers`` transfer workers (0 = inline)."""

    chunks: int
    sessions: int
    rooms: int
    workers: int

    @property
    def writes(self) -> int:
        """Chunk writes of one batch (every room, chunk and session)."""
        return self.rooms * self.chunks * self.sessions

    def key(self, way: str) -> tuple[str, Shape]:
        """The cell measuring this shape that way (the bare ways have no workers)."""
        if way in ("bare", SILENT):
            return way, Shape(self.chunks, self.sessions, self.rooms, 0)
        return way, self

    def label(self, way: str) -> str:
        w, s = self.key(way)
        return f"c={s.chunks} s={s.sessions} r={s.rooms} w={s.workers} | {w} µs/room"


def curve_points(preset: Preset) -> dict[tuple[str, int], list[Shape]]:
    """(axis, workers) -> the shapes of that curve, in size order."""
    base_s, base_r = 1, 1
    out: dict[tuple[str, int], list[Shape]] = {
        ("chunks", 0): [Shape(c, base_s, base_r, 0) for c in preset.chunks],
        ("sessions", 0): [Shape(BASE_CHUNKS, s, base_r, 0) for s in preset.sessions],
    }
    for w in preset.workers:
        out["rooms", w] = [Shape(BASE_CHUNKS, base_s, r, w) for r in preset.rooms]
    return out


def cells(preset: Preset) -> list[tuple[str, Shape]]:
    """Every measured cell once, as (way, shape): each way at each point of each curve (a
    point on several curves, and a bare cell that workers do not change, once), and the
    base room's bare writes without notifications."""
    out: list[tuple[str, Shape]] = []
    for shapes in curve_points(preset).values():
        for shape in shapes:
            for way in WAYS:
                key = shape.key(way)
                if key not in out:
                    out.append(key)
    out.append(Shape(BASE_CHUNKS, 1, 1, 0).key(SILENT))
    return out


def _size(axis: str, shape: Shape) -> int:
    return {"chunks": shape.chunks, "sessions": shape.sessions, "rooms": shape.rooms}[axis]


def verify_shape(preset: Preset) -> Shape:
    """The batch checked byte-exact before timing: two base rooms at the widest fan-out."""
    return Shape(BASE_CHUNKS, max(preset.sessions), 2, max(preset.workers))


def peer_pages(preset: Preset) -> int:
    """Destination pages the largest batch needs (every room, session and chunk its own)."""
    shapes = [s for pts in curve_points(preset).values() for s in pts]
    return max(s.writes for s in (*shapes, verify_shape(preset))) * CHUNK_PAGES


IntArray = npt.NDArray[np.int64]


@dataclass
class _Samples:
    """CPU µs per room of each cell, one entry per call (warm-up rounds first)."""

    cpu_us: dict[str, list[float]] = field(default_factory=dict)


class _Rig:
    """One prefill transport, the raw anchor agent, one decode peer process, and one
    manager per (transport, workers): NIXL or no-op, inline or 1-4 workers."""

    def __init__(self, peer: PeerProcess, preset: Preset) -> None:
        import torch

        from bench.throughput import _RawNixl
        from sender.manager import KVManager
        from sender.transport import NixlTransport

        self.peer = peer
        self.max_sessions = max(preset.sessions)
        self.sessions = [f"{SESSIONS_PREFIX}{i}" for i in range(self.max_sessions)]
        gen = torch.Generator().manual_seed(29)
        self.kv: torch.Tensor = torch.randint(
            0, 256, (KV_PAGES, PAGE_BYTES), dtype=torch.uint8, generator=gen
        )
        self.tx: NixlTransport = NixlTransport("bench-curves-prefill")
        self.raw: _RawNixl | None = None
        self.managers: dict[tuple[str, int], KVManager] = {}
        self.samples = _Samples()
        self.next_room = 0
        try:
            self.tx.register_region("kv", self.kv, PAGE_BYTES)
            for sid in self.sessions:  # one remote agent, a session id (and pages) each
                self.tx.add_peer(sid, peer.metadata)
            self.raw = _RawNixl(self.kv, peer.metadata, like_transport=True)
            workers = sorted({0, *preset.workers})
            for kind in ("sender", "no-op"):
                transport: Any = self.tx if kind == "sender" else NoopTransport()
                for w in workers:
                    self.managers[kind, w] = KVManager(
                        transport,
                        self.kv,
                        num_workers=w,
                        lock="mutex",
                        debug=False,
                        transfer_timeout_s=TRANSFER_TIMEOUT_S,
                    )
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        try:
            for mgr in self.managers.values():
                mgr.close()
        finally:
            try:
                if self.raw is not None:
                    self.raw.close()
            finally:
                self.tx.close()

    # -------------------------------------------------------------- pages of a batch

    @staticmethod
    def src(chunk: int) -> IntArray:
        """Source pages of chunk ``chunk`` (every room sends the same source pages)."""
        first = (chunk * CHUNK_PAGES) % KV_PAGES
        return np.arange(first, first + CHUNK_PAGES, dtype=np.int64)

    @staticmethod
    def dst(shape: Shape, room: int, session: int) -> IntArray:
        """Destination pages of room ``room`` (0-based in its batch) at session ``session``:
        a block of its own in the peer's pool."""
        block = (room * shape.sessions + session) * shape.chunks * CHUNK_PAGES
        return np.arange(block, block + shape.chunks * CHUNK_PAGES, dtype=np.int64)

    # -------------------------------------------------------------- one batch, each way

    def sender_batch(self, way: str, shape: Shape, dsts: Sequence[Sequence[IntArray]]) -> None:
        """``shape.rooms`` rooms through the sender API, concurrently in flight.

        Raises:
            RuntimeError: a room failed.
        """
        from sender.manager import make_transfer_info
        from sender.nixl_sender import NixlKVSender
        from sender.poll import KVPoll

        mgr = self.managers[way, shape.workers]
        sids = self.sessions[: shape.sessions]
        pages = shape.chunks * CHUNK_PAGES
        senders: list[NixlKVSender] = []
        for k in range(shape.rooms):
            infos = [make_transfer_info(sid, dsts[k][s]) for s, sid in enumerate(sids)]
            snd = NixlKVSender(mgr, self.next_room, sids, infos)
            self.next_room += 1
            snd.init(pages)
            senders.append(snd)
        srcs = [self.src(c) for c in range(shape.chunks)]
        for chunk in srcs:
            for snd in senders:
                snd.send(chunk)
        pause = WORKER_POLL_S if shape.workers else 0.0
        pending = senders
        while pending:
            still: list[NixlKVSender] = []
            for snd in pending:
                status = snd.poll()
                if status is KVPoll.Success:
                    snd.clear()
                elif status is KVPoll.Failed:
                    _raise_failed(snd)
                else:
                    still.append(snd)
            pending = still
            if pending and pause:
                time.sleep(pause)

    def bare_batch(
        self, shape: Shape, dsts: Sequence[Sequence[IntArray]], *, notify: bool = True
    ) -> None:
        """The same writes with NIXL's prepped calls and nothing around them (``notify``:
        with the sender's notification bytes, else none).

        Raises:
            RuntimeError: a write ended in anything but DONE.
            TimeoutError: a write still in progress after about ``RAW_TIMEOUT_S``.
        """
        raw = self.raw
        assert raw is not None
        agent = raw.agent
        local, remote = raw.prepped
        rooms = range(self.next_room, self.next_room + shape.rooms)
        self.next_room += shape.rooms
        last = shape.chunks - 1
        handles = []
        for c in range(shape.chunks):
            src = self.src(c).astype(np.int32)
            for k, room in enumerate(rooms):
                notif = f"room={room};chunk={c};last={int(c == last)}".encode() if notify else b""
                for s in range(shape.sessions):
                    dst = dsts[k][s][c * CHUNK_PAGES : (c + 1) * CHUNK_PAGES].astype(np.int32)
                    handle = agent.make_prepped_xfer("WRITE", local, src, remote, dst, notif)
                    handles.append(handle)
                    agent.transfer(handle, notif)
        deadline = time.monotonic() + RAW_TIMEOUT_S
        for handle in handles:
            state = agent.check_xfer_state(handle)
            while state == "PROC":
                state = agent.check_xfer_state(handle)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"bare write still in progress after {RAW_TIMEOUT_S} s")
            if state != "DONE":
                raise RuntimeError(f"bare write ended in {state!r}")
        for handle in handles:
            agent.release_xfer_handle(handle)

    # -------------------------------------------------------------- checks and cells

    def verify(self, preset: Preset) -> None:
        """One batch of the widest fan-out each way lands the right bytes at the peer.

        Raises:
            RuntimeError: bytes differ at the peer.
        """
        from stress.harness.driver import page_digests

        shape = verify_shape(preset)
        dsts = self.dsts(shape)
        want = page_digests(self.kv[np.concatenate([self.src(c) for c in range(shape.chunks)])])
        for way in ("sender", "bare"):
            for batch in dsts:
                for pages in batch:
                    self.peer.zero_pages(pages.tolist())
            if way == "bare":
                self.bare_batch(shape, dsts)
            else:
                self.sender_batch(way, shape, dsts)
            for batch in dsts:
                for pages in batch:
                    if self.peer.page_digest(pages.tolist()) != want:
                        raise RuntimeError(f"benchmark bug: {way} bytes differ at the peer")

    def dsts(self, shape: Shape) -> list[list[IntArray]]:
        """Destination pages per room of a batch and per session (made once per cell)."""
        return [[self.dst(shape, k, s) for s in range(shape.sessions)] for k in range(shape.rooms)]

    def cell(self, way: str, shape: Shape, preset: Preset) -> Callable[[], float]:
        """Wall µs per room over whole batches of ``shape`` (about ``preset.writes`` chunk
        writes); appends the CPU µs per room of the same span to the samples."""
        label = shape.label(way)
        cpu = self.samples.cpu_us.setdefault(label, [])
        batches = max(1, math.ceil(preset.writes / shape.writes))
        rooms = batches * shape.rooms
        dsts = self.dsts(shape)

        def measure() -> float:
            self.peer.clear_notifs()  # untimed: keep the peer's notification log short
            clock, cpu_clock = time.perf_counter_ns, time.process_time_ns
            with gc_paused():
                c0 = cpu_clock()
                t0 = clock()
                try:
                    for _ in range(batches):
                        if way in ("bare", SILENT):
                            self.bare_batch(shape, dsts, notify=way == "bare")
                        else:
                            self.sender_batch(way, shape, dsts)
                except BaseException as exc:
                    if sys.version_info >= (3, 11):
                        exc.add_note(f"in benchmark cell {label!r}")
                    raise
                elapsed = clock() - t0
                used = cpu_clock() - c0
            cpu.append(used / rooms / 1e3)
            return elapsed / rooms / 1e3

        return measure

    def cells(self, preset: Preset) -> list[tuple[str, Callable[[], float]]]:
        return [(shape.label(way), self.cell(way, shape, preset)) for way, shape in cells(preset)]


def _raise_failed(snd: NixlKVSender) -> None:
    """A benchmark room failed: say why (``failure_exception`` raises the stored error)."""
    try:
        snd.failure_exception()
    except BaseException as exc:
        raise RuntimeError(f"benchmark room {snd.bootstrap_room} failed: {exc!r}") from exc


# ---------------------------------------------------------------------------- run


def measure(preset: Preset) -> BenchResult:
    """Run the benchmark with an explicit preset (tests use tiny ones)."""
    if not _nixl.AVAILABLE:
        return pending_result(NAME, TITLE, f"NIXL not importable: {_nixl.IMPORT_ERROR!r}")
    from stress.harness.peer import PeerProcess

    started = time.perf_counter()
    pages = peer_pages(preset)
    with PeerProcess(pages, PAGE_BYTES, name="bench-curves", stderr=subprocess.DEVNULL) as peer:
        peer_start_s = time.perf_counter() - started
        rig = _Rig(peer, preset)
        try:
            rig.verify(preset)
            samples = interleave(rig.cells(preset), preset.rounds, warmup=preset.warmup)
            cpu = {k: v[preset.warmup :] for k, v in rig.samples.cpu_us.items()}
        finally:
            rig.close()
    return _report(preset, samples, cpu, peer_start_s, pages)


@dataclass(frozen=True)
class _Series:
    """Per-round samples of one way at every point of a curve (wall, CPU)."""

    wall: list[list[float]]
    cpu: list[list[float]]


def _series(
    shapes: Sequence[Shape], way: str, samples: dict[str, list[float]], cpu: dict[str, list[float]]
) -> _Series:
    return _Series([samples[s.label(way)] for s in shapes], [cpu[s.label(way)] for s in shapes])


def _growth(
    sizes: Sequence[int], per_point: Sequence[Sequence[float]]
) -> tuple[float | None, float | None]:
    """(fitted exponent, slope of the last step) of per-room cost vs size: each the median
    over rounds of that round's own fit (a round's cells ran close together in time, so
    slow drift of the machine moves a round's points together)."""
    rounds = min(len(v) for v in per_point)
    fits, lasts = [], []
    for r in range(rounds):
        costs = [v[r] for v in per_point]
        fit = loglog_exponent(sizes, costs)
        last = loglog_exponent(sizes[-2:], costs[-2:])
        if fit is not None:
            fits.append(fit)
        if last is not None:
            lasts.append(last)
    return (median(fits) if fits else None, median(lasts) if lasts else None)


def _report(
    preset: Preset,
    samples: dict[str, list[float]],
    cpu: dict[str, list[float]],
    peer_start_s: float,
    pages: int,
) -> BenchResult:
    curves = curve_points(preset)
    columns = [
        "curve",
        "chunks",
        "sessions",
        "rooms",
        "workers",
        "sender µs",
        "sender cpu",
        "no-op µs",
        "no-op cpu",
        "bare µs",
        "bare cpu",
        "sender/bare",
        "no-op/bare",
        "sender µs/write",
        "bare µs/write",
    ]
    rows: list[dict[str, Cell]] = []
    ratios: list[Ratio] = []
    done: set[Shape] = set()
    for (axis, _), shapes in curves.items():
        for shape in shapes:
            if shape in done:  # the base room is a point of several curves: one row
                continue
            done.add(shape)
            snd, noop, bare = (samples[shape.label(w)] for w in WAYS)
            vs_bare = median_ratio(snd, bare)
            noop_bare = median_ratio(noop, bare)
            rows.append(
                {
                    "curve": axis,
                    "chunks": shape.chunks,
                    "sessions": shape.sessions,
                    "rooms": shape.rooms,
                    "workers": shape.workers,
                    "sender µs": median(snd),
                    "sender cpu": median(cpu[shape.label("sender")]),
                    "no-op µs": median(noop),
                    "no-op cpu": median(cpu[shape.label("no-op")]),
                    "bare µs": median(bare),
                    "bare cpu": median(cpu[shape.label("bare")]),
                    "sender/bare": vs_bare,
                    "no-op/bare": noop_bare,
                    "sender µs/write": median(snd) / (shape.chunks * shape.sessions),
                    "bare µs/write": median(bare) / (shape.chunks * shape.sessions),
                }
            )
            tag = f"c={shape.chunks} s={shape.sessions} r={shape.rooms} w={shape.workers}"
            ratios.append(Ratio(f"sender/bare {tag}", vs_bare, "wall per room; > 1: slower"))
            ratios.append(
                Ratio(f"no-op/bare {tag}", noop_bare, "bookkeeping alone vs NIXL's own calls")
            )

    fit_columns = [
        "curve",
        "workers",
        "sizes",
        "sender",
        "sender cpu",
        "no-op",
        "no-op cpu",
        "bare",
        "bare cpu",
        "sender/bare",
        "last step: sender",
        "last: no-op",
        "flag",
    ]
    fit_rows: list[dict[str, Cell]] = []
    flagged: dict[str, list[str]] = {axis: [] for axis in AXES}
    exponents: dict[str, JSONValue] = {}
    for (axis, workers), shapes in curves.items():
        sizes = [_size(axis, s) for s in shapes]
        limit = 0.0 if axis == "rooms" else 1.0
        by_way = {w: _series(shapes, w, samples, cpu) for w in WAYS}
        row: dict[str, Cell] = {
            "curve": axis,
            "workers": workers,
            "sizes": ",".join(str(x) for x in sizes),
        }
        flags: list[str] = []
        curve_json: dict[str, JSONValue] = {}
        for way in WAYS:
            series = by_way[way]
            for what, per_point in (("", series.wall), (" cpu", series.cpu)):
                fit, last = _growth(sizes, per_point)
                name = f"{way}{what}"
                row[name] = fit
                curve_json[name] = {"fit": fit, "last_step": last}
                if way != "bare" and (
                    (fit is not None and fit > limit + LINEAR_TOL)
                    or (last is not None and last > limit + 2 * LINEAR_TOL)
                ):
                    fit_text = "-" if fit is None else f"{fit:.2f}"
                    last_text = "-" if last is None else f"{last:.2f}"
                    flags.append(f"{name} {fit_text} (last step {last_text})")
                if what == "":
                    if way == "sender":
                        row["last step: sender"] = last
                    elif way == "no-op":
                        row["last: no-op"] = last
        ratio_per_point = [
            median_ratio(a, b) or 0.0
            for a, b in zip(by_way["sender"].wall, by_way["bare"].wall, strict=True)
        ]
        row["sender/bare"] = loglog_exponent(sizes, ratio_per_point)
        row["flag"] = "; ".join(flags) if flags else "-"
        flagged[axis].extend(f"w={workers}: {f}" if axis == "rooms" else f for f in flags)
        fit_rows.append(row)
        exponents[f"{axis} w={workers}"] = curve_json

    base = Shape(BASE_CHUNKS, 1, 1, 0)
    noop_base, silent = samples[base.label("no-op")], samples[base.label(SILENT)]
    noop_vs_call = median_ratio(noop_base, silent)
    noop_vs_bare = median_ratio(noop_base, samples[base.label("bare")])
    snd_vs_bare = median_ratio(samples[base.label("sender")], samples[base.label("bare")])

    def growth_goal(axis: str, text: str) -> Goal:
        measured = len(next(v for (a, _), v in curves.items() if a == axis)) >= 2
        detail = "; ".join(flagged[axis]) if flagged[axis] else "nothing flagged"
        fits = ", ".join(
            f"{r['curve']} w={r['workers']}: sender {_fmt(r['sender'])}, "
            f"no-op {_fmt(r['no-op'])}, bare {_fmt(r['bare'])}"
            for r in fit_rows
            if r["curve"] == axis
        )
        return Goal(text, (not flagged[axis]) if measured else None, f"{detail} ({fits})")

    goals = [
        growth_goal(
            "chunks",
            f"per-room cost at most linear in chunks (exponent <= {1 + LINEAR_TOL:g}, last "
            f"step <= {1 + 2 * LINEAR_TOL:g}; sender and no-op, wall and CPU)",
        ),
        growth_goal(
            "sessions",
            f"per-room cost at most linear in sessions (exponent <= {1 + LINEAR_TOL:g}, last "
            f"step <= {1 + 2 * LINEAR_TOL:g}; sender and no-op, wall and CPU)",
        ),
        growth_goal(
            "rooms",
            f"per-room cost flat in rooms in flight (exponent <= {LINEAR_TOL:g}, last step "
            f"<= {2 * LINEAR_TOL:g}; every workers setting, sender and no-op, wall and CPU)",
        ),
        Goal(
            f"no-op bookkeeping per chunk <= {NOOP_PER_CALL_GOAL:g}x NIXL's own per-call cost "
            f"per chunk ({BASE_CHUNKS}-chunk room, 1 session, inline; the call: a prepped "
            "write with no notification, posted and polled to DONE)",
            None if noop_vs_call is None else noop_vs_call <= NOOP_PER_CALL_GOAL,
            f"no-op/call {_fmt(noop_vs_call, 'x')}: {median(noop_base) / BASE_CHUNKS:.1f} vs "
            f"{median(silent) / BASE_CHUNKS:.1f} µs per chunk (with the sender's "
            f"notifications NIXL's write costs "
            f"{median(samples[base.label('bare')]) / BASE_CHUNKS:.1f} µs: no-op/bare "
            f"{_fmt(noop_vs_bare, 'x')}); sender/bare {_fmt(snd_vs_bare, 'x')}",
            "a chunk's bookkeeping is about one NIXL call's cost, 1.10x in the documented run",
        ),
    ]
    notes = [
        f"medians of {preset.rounds} shuffled rounds, all {len(samples)} cells interleaved; "
        f"a cell runs whole batches, about {preset.writes} chunk writes per round; chunk = "
        f"{CHUNK_PAGES} contiguous pages x {PAGE_BYTES // 1024} KiB to a PeerProcess over NIXL "
        "(UCX, CMA)",
        "µs = wall time per room (span / rooms), cpu = process CPU µs per room (every thread "
        "of this process: workers and NIXL progress threads; not the peer's); ratios are "
        "medians of per-round ratios",
        "bare = the same writes with NIXL's prepped calls (make_prepped_xfer with the "
        "sender's notification bytes + transfer, in the sender's order; then busy polls and "
        "releases) on an agent configured as our transport's, one thread; no-op = the sender "
        "on a transport that moves nothing",
        f"{SILENT}: the base room's bare writes without notifications (NIXL's own "
        f"per-call cost, the per-chunk goal's anchor): {median(silent) / BASE_CHUNKS:.1f} µs "
        f"per write vs {median(samples[base.label('bare')]) / BASE_CHUNKS:.1f} with them (a "
        "write with a notification stays in progress until its control message is through)",
        f"inline rooms poll back to back; with workers the scheduler pauses "
        f"{WORKER_POLL_S * 1e6:.0f} µs between poll sweeps (so a 1-room batch measures that "
        "step too: read the rooms curve with workers for its growth, not its level)",
        "exponents: log-log least-squares slope of per-room cost on the size (1 = linear, "
        "0 = flat), fitted per round, median over rounds; last step: the slope between the "
        "two largest sizes, likewise; "
        "sender/bare column: the same fit of the per-point sender/bare ratio (> 0: the "
        "sender grows faster than NIXL's work)",
        f"sessions: one peer process, each session its own session id and its own pages of "
        f"the peer's pool ({pages} pages); idle workers of the other managers wake every "
        "50 ms (a small CPU background common to all cells)",
        f"every way verified byte-exact at the peer before timing; peer start "
        f"{peer_start_s:.1f} s (untimed)",
    ]
    params: dict[str, JSONValue] = {
        "rounds": preset.rounds,
        "warmup_rounds": preset.warmup,
        "writes_per_cell": preset.writes,
        "chunks": list(preset.chunks),
        "sessions": list(preset.sessions),
        "rooms": list(preset.rooms),
        "workers": list(preset.workers),
        "chunk_pages": CHUNK_PAGES,
        "page_bytes": PAGE_BYTES,
        "peer_pages": pages,
    }
    cpu_json: dict[str, JSONValue] = {k: list(v) for k, v in cpu.items()}
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
        extra={"cpu_us_per_room": cpu_json, "exponents": exponents},
        ratios_in_table=True,
        tables=[Table("growth exponents of per-room cost (fit; last step)", fit_columns, fit_rows)],
    )


def _fmt(value: Cell, suffix: str = "") -> str:
    if isinstance(value, float):
        return f"{value:.2f}{suffix}"
    return "-"


def run(quick: bool) -> BenchResult:
    """The ``--quick`` preset (3 rounds, 3 + 2 + 2 sizes) or the full one (9 rounds)."""
    return measure(QUICK if quick else FULL)
