"""A reference scheduler loop: drives many :class:`NixlKVSender` rooms the way an engine does.

Per step the loop admits new rooms (up to ``max_active``), sends each active room its next
chunk, polls every room, and concludes it: on ``Success`` it verifies the bytes at the decode
peer (optional) and calls ``clear()``; on ``Failed`` it calls ``failure_exception()`` and
records what was raised. Used by the end-to-end tests, the stress suite and the benchmarks;
it is also the usage example of the sender API.
"""

from __future__ import annotations

import hashlib
import random
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from sender.manager import KVManager, make_transfer_info
from sender.nixl_sender import NixlKVSender
from sender.poll import KVPoll

DigestFn = Callable[[str, Sequence[int]], list[str]]
"""``digest(session_id, dst_pages) -> hex digest per page`` at the decode peer."""


def page_digests(pages: torch.Tensor) -> list[str]:
    """blake2b-128 hex digest of each row of a 2-D uint8 tensor (the peer's digest)."""
    data = pages.contiguous().numpy()
    return [hashlib.blake2b(row.tobytes(), digest_size=16).hexdigest() for row in data]


@dataclass(frozen=True, slots=True)
class DriverConfig:
    """What to run.

    Attributes:
        rooms: how many rooms to run in total.
        chunks: chunks per room (``send`` calls).
        pages_per_chunk: KV pages per chunk.
        max_active: rooms in flight at once.
        room_base: id of the first room (ids are consecutive).
        seed: seed of the room plans (source pages, session choice).
        deadline_s: the run gives up (aborting what is left) after this long.
        quarantine_s: destination pages of a failed room are not reused for this long
            (a released in-flight transfer may still land there).
        verify: check every ``Success`` room's bytes at the peer (needs ``digest``).
    """

    rooms: int
    chunks: int = 8
    pages_per_chunk: int = 1
    max_active: int = 16
    room_base: int = 0
    seed: int = 0
    deadline_s: float = 120.0
    quarantine_s: float = 1.0
    verify: bool = True


@dataclass(frozen=True, slots=True)
class RoomOutcome:
    """How one room ended."""

    room: int
    session_id: str
    status: KVPoll | None
    latency_s: float
    error: str | None
    verified: bool | None
    footprint: tuple[str, ...]
    concluded_at: float


@dataclass(frozen=True, slots=True)
class DriverResult:
    """The outcome of :meth:`SchedulerDriver.run`."""

    outcomes: tuple[RoomOutcome, ...]
    wall_s: float
    unconcluded: int
    escaped: tuple[str, ...]

    @property
    def succeeded(self) -> int:
        return sum(o.status is KVPoll.Success for o in self.outcomes)

    @property
    def failed(self) -> int:
        return sum(o.status is KVPoll.Failed for o in self.outcomes)

    @property
    def verify_failures(self) -> int:
        return sum(o.verified is False for o in self.outcomes)

    @property
    def leaked_rooms(self) -> int:
        return sum(bool(o.footprint) for o in self.outcomes)

    @property
    def rooms_per_s(self) -> float:
        return len(self.outcomes) / self.wall_s if self.wall_s > 0 else 0.0

    def latency_quantiles(self) -> tuple[float, float]:
        """(p50, p99) room latency in seconds (0 when no room finished)."""
        lat = sorted(o.latency_s for o in self.outcomes)
        if not lat:
            return 0.0, 0.0
        if len(lat) == 1:
            return lat[0], lat[0]
        q = statistics.quantiles(lat, n=100, method="inclusive")
        return statistics.median(lat), q[98]


@dataclass(slots=True)
class _Active:
    sender: NixlKVSender
    session_id: str
    src: np.ndarray
    dst: np.ndarray
    started: float
    chunks_sent: int = 0


@dataclass(slots=True)
class _DstPool:
    free: deque[int]
    quarantined: deque[tuple[float, np.ndarray]] = field(default_factory=deque)


class SchedulerDriver:
    """Runs rooms through a manager like an engine's scheduler thread.

    Args:
        mgr: the manager (its transport has the sessions as peers).
        sessions: session id -> number of destination pages its peer has.
        digest: how to read page digests at a peer (``None`` disables verification).

    Thread-safety: one ``run`` at a time, on the calling (scheduler) thread. ``stop()`` may
    be called from any thread.
    """

    def __init__(
        self,
        mgr: KVManager,
        sessions: Mapping[str, int],
        digest: DigestFn | None = None,
    ) -> None:
        if not sessions:
            raise ValueError("at least one session is needed")
        self.mgr = mgr
        self.sessions = dict(sessions)
        self.digest = digest
        self._stop = threading.Event()
        self._src_digests = page_digests(mgr.kv_pool) if digest is not None else []
        self.progress: Callable[[int, int], None] | None = None

    def stop(self) -> None:
        """Ask a running ``run`` to abort what is left and return. Thread-safe."""
        self._stop.set()

    def run(self, cfg: DriverConfig) -> DriverResult:
        """Run ``cfg.rooms`` rooms; never raises for a failed room (it is an outcome).

        Raises:
            ValueError: a room needs more destination pages than a session has, or a bad
                config.
        """
        need = cfg.chunks * cfg.pages_per_chunk
        if cfg.rooms < 0 or cfg.chunks < 1 or cfg.pages_per_chunk < 1 or cfg.max_active < 1:
            raise ValueError(f"bad driver config: {cfg}")
        for sid, n in self.sessions.items():
            if need > n:
                raise ValueError(f"a room needs {need} pages; session {sid!r} has {n}")
        rng = random.Random(cfg.seed)
        pools = {sid: _DstPool(deque(range(n))) for sid, n in self.sessions.items()}
        session_ids = sorted(self.sessions)
        kv_pages = self.mgr.kv_pool.shape[0]
        outcomes: list[RoomOutcome] = []
        escaped: list[str] = []
        active: list[_Active] = []
        next_room = 0
        t0 = time.monotonic()
        deadline = t0 + cfg.deadline_s
        while (next_room < cfg.rooms or active) and not self._stop.is_set():
            if time.monotonic() > deadline:
                break
            moved = False
            now = time.monotonic()
            for pool in pools.values():
                while pool.quarantined and pool.quarantined[0][0] <= now:
                    pool.free.extend(int(p) for p in pool.quarantined.popleft()[1])
            while next_room < cfg.rooms and len(active) < cfg.max_active:
                sid = session_ids[rng.randrange(len(session_ids))]
                pool = pools[sid]
                if len(pool.free) < need:
                    break
                dst = np.array([pool.free.popleft() for _ in range(need)], dtype=np.int64)
                src = np.array(rng.sample(range(kv_pages), need), dtype=np.int64)
                room = cfg.room_base + next_room
                next_room += 1
                try:
                    sender = NixlKVSender(self.mgr, room, [sid], [make_transfer_info(sid, dst)])
                    sender.init(need)
                except Exception as exc:  # bad config or a programming error: recorded
                    escaped.append(f"room {room} setup: {exc!r}")
                    pool.free.extend(int(p) for p in dst)
                    continue
                active.append(_Active(sender, sid, src, dst, time.monotonic()))
                moved = True
            still: list[_Active] = []
            for a in active:
                try:
                    if a.chunks_sent < cfg.chunks:
                        lo = a.chunks_sent * cfg.pages_per_chunk
                        a.sender.send(a.src[lo : lo + cfg.pages_per_chunk])
                        a.chunks_sent += 1
                        moved = True
                    status = a.sender.poll()
                except Exception as exc:  # the contract says this never happens
                    escaped.append(f"room {a.sender.bootstrap_room}: {exc!r}")
                    status = KVPoll.Failed
                if status in (KVPoll.Success, KVPoll.Failed):
                    outcomes.append(self._conclude(a, status, pools[a.session_id], cfg))
                    moved = True
                    if self.progress is not None:
                        self.progress(len(outcomes), cfg.rooms)
                else:
                    still.append(a)
            active = still
            if not moved:
                time.sleep(0.0005)
        unconcluded = len(active) + (cfg.rooms - next_room)
        for a in active:  # deadline or stop: give the rest up, still without leaking
            a.sender.abort()
            outcomes.append(self._conclude(a, KVPoll.Failed, pools[a.session_id], cfg))
        return DriverResult(tuple(outcomes), time.monotonic() - t0, unconcluded, tuple(escaped))

    def _conclude(
        self, a: _Active, status: KVPoll, pool: _DstPool, cfg: DriverConfig
    ) -> RoomOutcome:
        room = a.sender.bootstrap_room
        verified: bool | None = None
        error: str | None = None
        if status is KVPoll.Success:
            if cfg.verify and self.digest is not None:
                try:
                    got = self.digest(a.session_id, a.dst.tolist())
                    verified = got == [self._src_digests[p] for p in a.src.tolist()]
                except Exception as exc:  # the peer may be gone by now
                    error = f"verify: {exc!r}"
                    verified = None
            a.sender.clear()
            pool.free.extend(int(p) for p in a.dst)
        else:
            try:
                a.sender.failure_exception()
            except Exception as exc:  # by design: this is how the failure is reported
                error = type(exc).__name__
            pool.quarantined.append((time.monotonic() + cfg.quarantine_s, a.dst))
        return RoomOutcome(
            room,
            a.session_id,
            status,
            time.monotonic() - a.started,
            error,
            verified,
            self.mgr.footprint(room),
            time.monotonic(),
        )
