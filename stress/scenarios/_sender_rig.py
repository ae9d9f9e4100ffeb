"""What the two sender scenarios share: a real decode peer process (or several), a real
NIXL transport wrapped by the fault injector, a KVManager with debug locks, a reaper thread
that purges random rooms from outside the scheduler, and the end-of-run leak checks.
"""

from __future__ import annotations

import contextlib
import random
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from sender.driver import DriverConfig, DriverResult, RoomOutcome, SchedulerDriver
from sender.faults import FaultInjectingTransport
from sender.manager import KVManager
from sender.peer import PeerProcess
from sender.poll import KVPoll
from sender.transport import NixlTransport
from staging.buffers import StagingBufferPool
from staging.context import StagingContext
from stress.framework import JSONValue, Monitor, StressConfig, WorkerCounters
from stress.invariants import (
    LOCK_ORDER,
    NO_DEADLOCK,
    NO_ESCAPED_EXCEPTION,
    NO_LEAK,
    NO_RESURRECTION,
    NO_THREAD_LEFT,
    describe,
)

ROOMS_CONCLUDED = describe(
    "rooms-concluded", "every room concluded Success or Failed (a dead peer's within 1 s)"
)
BYTES_VERIFIED = describe("bytes-verified", "every verifiable Success room's bytes match")

SENDER_INVARIANTS = (
    NO_ESCAPED_EXCEPTION,
    ROOMS_CONCLUDED,
    BYTES_VERIFIED,
    NO_LEAK,
    NO_RESURRECTION,
    LOCK_ORDER,
    NO_DEADLOCK,
    NO_THREAD_LEFT,
)
"""What both sender scenarios check."""

PAGE_BYTES = 4096
KV_PAGES = 1024
STAGING_SLOTS = 16
TRANSFER_TIMEOUT_S = 0.5
REAP_EVERY_S = 0.05
REAP_PROBABILITY = 0.2


@dataclass
class RigStats:
    """What the scenario reports besides the monitor's counters."""

    succeeded: int = 0
    failed: int = 0
    verified: int = 0
    unverified: int = 0
    reaped: int = 0
    errors: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, JSONValue]:
        return {
            "succeeded": self.succeeded,
            "failed": self.failed,
            "verified": self.verified,
            "unverified_peer_gone": self.unverified,
            "reaped_by_other_thread": self.reaped,
            "errors": dict(sorted(self.errors.items())),
        }


class SenderRig:
    """One prefill sender talking to ``len(sessions)`` decode peer processes."""

    def __init__(self, config: StressConfig, sessions: tuple[str, ...], peer_pages: int) -> None:
        self.config = config
        self.sessions = sessions
        self.peer_pages = peer_pages
        self.stats = RigStats()
        self.peers: dict[str, PeerProcess] = {}
        self._stack = contextlib.ExitStack()
        try:
            self._setup(config, sessions, peer_pages)
        except BaseException:
            self._stack.close()
            raise
        self.peer_lock = threading.Lock()  # serialises peer restarts against digests
        self.rooms_used: list[int] = []

    def _setup(self, config: StressConfig, sessions: tuple[str, ...], peer_pages: int) -> None:
        gen = torch.Generator().manual_seed(config.seed)
        self.kv = torch.randint(0, 256, (KV_PAGES, PAGE_BYTES), dtype=torch.uint8, generator=gen)
        self.pool = StagingBufferPool(STAGING_SLOTS, 1, PAGE_BYTES, debug=True)
        self.tx = NixlTransport(f"stress-prefill-{config.seed}")
        self._stack.callback(self.tx.close)
        self._stack.callback(self.pool.close)
        self.tx.register_region("kv", self.kv, PAGE_BYTES)
        self.tx.register_region("staging", self.pool.tensor, PAGE_BYTES)
        for sid in sessions:
            peer = PeerProcess(
                peer_pages, PAGE_BYTES, name=sid, rpc_timeout_s=2.0, stderr=subprocess.DEVNULL
            )
            self._stack.callback(peer.close)
            self.peers[sid] = peer
            self.tx.add_peer(sid, peer.metadata)
        self.injector = FaultInjectingTransport(
            self.tx, rate=config.fault_rate, seed=config.seed, points=("write", "poll")
        )
        self.mgr = KVManager(
            self.injector,
            self.kv,
            num_workers=max(1, config.threads),
            staging=StagingContext(lock=config.lock, debug=True),
            staging_pool=self.pool,
            transfer_timeout_s=TRANSFER_TIMEOUT_S,
            lock="mutex",
            debug=True,
        )

    def close(self) -> None:
        try:
            self.mgr.close()
        finally:
            self._stack.close()

    # ------------------------------------------------------------------ the scheduler

    def digest(self, session_id: str, pages: Sequence[int]) -> list[str]:
        with self.peer_lock:
            peer = self.peers[session_id]
        return peer.page_digest(pages)

    def scheduler(
        self, monitor: Monitor, on_outcome: Callable[[RoomOutcome], None] | None = None
    ) -> Callable[[], None]:
        """The scheduler thread's body: batches of rooms until the deadline."""

        def run() -> None:
            counters = monitor.counters()
            driver = SchedulerDriver(self.mgr, dict.fromkeys(self.sessions, self.peer_pages),
                                     self.digest)
            base = 0
            cfg = self.config
            while monitor.running():
                result = driver.run(
                    DriverConfig(
                        rooms=cfg.rooms,
                        chunks=cfg.chunks,
                        pages_per_chunk=1,
                        max_active=max(4, cfg.rooms // 2),
                        room_base=base,
                        seed=cfg.seed + base,
                        deadline_s=max(5.0, monitor.watchdog_s / 2),
                        quarantine_s=1.0,
                    )
                )
                base += cfg.rooms
                self._account(monitor, counters, result, on_outcome)

        return run

    def _account(
        self,
        monitor: Monitor,
        counters: WorkerCounters,
        result: DriverResult,
        on_outcome: Callable[[RoomOutcome], None] | None,
    ) -> None:
        for text in result.escaped:
            monitor.violation(NO_ESCAPED_EXCEPTION, text)
        if result.unconcluded:
            monitor.violation(
                ROOMS_CONCLUDED, f"{result.unconcluded} rooms not concluded before the deadline"
            )
        for o in result.outcomes:
            self.rooms_used.append(o.room)
            counters.rooms += 1
            counters.ops += self.config.chunks
            monitor.latency(o.latency_s)
            if o.status is KVPoll.Success:
                self.stats.succeeded += 1
                if o.verified is False:
                    monitor.violation(BYTES_VERIFIED, f"room {o.room}: bytes differ at the peer")
                elif o.verified:
                    self.stats.verified += 1
                else:
                    self.stats.unverified += 1
            elif o.status is KVPoll.Failed:
                self.stats.failed += 1
                key = o.error or "none"
                self.stats.errors[key] = self.stats.errors.get(key, 0) + 1
            else:
                monitor.violation(ROOMS_CONCLUDED, f"room {o.room} ended as {o.status!r}")
            if o.footprint:
                monitor.violation(NO_LEAK, f"room {o.room} left in {o.footprint} at conclusion")
            if on_outcome is not None:
                on_outcome(o)
        counters.faults = self.injector.stats().faults

    # ------------------------------------------------------------------ chaos

    def reaper(self, monitor: Monitor, index: int) -> Callable[[], None]:
        """Another thread purging random open rooms (an engine aborting requests)."""

        def run() -> None:
            rng: random.Random = self.config.rng(index)
            while monitor.running():
                time.sleep(REAP_EVERY_S)
                rooms = list(self.mgr.request_status)
                if (
                    rooms
                    and rng.random() < REAP_PROBABILITY
                    and self.mgr.purge_room(rng.choice(rooms)).was_open
                ):
                    self.stats.reaped += 1

        return run

    # ------------------------------------------------------------------ end checks

    def check_end(self, monitor: Monitor) -> None:
        """After the scheduler stopped: quiesce, then nothing may be left anywhere."""
        self.mgr.close()
        for room in self.rooms_used:
            left = self.mgr.footprint(room)
            if left:
                monitor.violation(NO_RESURRECTION, f"room {room} reappeared in {left}")
        st = self.mgr.stats()
        if st.open_rooms or st.transfers_inflight:
            monitor.violation(NO_LEAK, f"manager: {st}")
        snap = self.mgr.staging.snapshot()
        if snap.open_rooms or snap.prefetched_rooms or snap.prefetch_requested:
            monitor.violation(NO_LEAK, f"staging: {len(snap.prefetch_requested)} keys left")
        ps = self.pool.stats()
        if ps.in_use or ps.owners:
            monitor.violation(NO_LEAK, f"staging pool: {ps.in_use} slots still leased")
        live = self.tx.stats().live_transfers
        if live:
            monitor.violation(NO_LEAK, f"transport: {live} transfer handles never released")


@contextlib.contextmanager
def sender_rig(
    config: StressConfig, sessions: tuple[str, ...], peer_pages: int
) -> Iterator[SenderRig]:
    """A started :class:`SenderRig`, always closed (peers reaped) on exit."""
    rig = SenderRig(config, sessions, peer_pages)
    try:
        yield rig
    finally:
        rig.close()
