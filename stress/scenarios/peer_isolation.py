"""``peer-isolation``: one decode peer hung (SIGSTOP, its deadline far away) while rooms to
the healthy peers go on; the invariant ``healthy-isolated`` (issue 33: no healthy room
fails or exceeds its bound because another peer hung).

One phase per worker count (1, then ``--threads``), each with a fresh manager whose transfer
deadline is :data:`HUNG_DEADLINE_S`, over two healthy decode peer processes and one more,
``decode-hung``. A phase: warm every connection, stop ``decode-hung``, open ``workers + 2``
one-page rooms to it and wait until at least ``workers`` of their chunks are in flight (as
many as there are workers), then drive :data:`HEALTHY_ROOMS` rooms to the healthy peers
(verified at the peer), continue ``decode-hung`` and conclude its rooms.

``healthy-isolated`` is judged by order, not by the clock. While ``decode-hung`` is stopped
its rooms can end only at their deadline (NIXL keeps the writes in progress), so each of
them still ``Transferring`` right after a healthy room concluded proves that room concluded
before the hung rooms could have timed out. A violation: a healthy room that failed, that
did not conclude, or that concluded only after one of the hung rooms had already ended
(before the peer was continued) -- it waited for the hung peer's deadline. The phase
reports ``healthy_while_hung``, the healthy Successes seen while every hung room was still
in flight (all of them on a sender whose workers never wait on one chunk; 0 on one whose
``workers`` workers each wait on their own hung chunk).

Test-only ``--plant-bug worker-waits-on-its-chunk``: the manager's transport is wrapped so
that ``write_pages`` polls the write it posted until it ends (or fails) before returning --
the posting worker waits on its own chunk, as workers did before issue 33. Nothing of the
library is changed: the wrapper sits at the manager's transport seam. The first
``workers`` hung chunks then hold every worker until their deadline, and every healthy
room concludes only after it: ``healthy-isolated`` fires.

The rig's other sender invariants hold as in every sender scenario (no injected NIXL
faults here: a healthy room must not fail).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from sender.manager import KVManager, make_transfer_info
from sender.nixl_sender import NixlKVSender
from sender.poll import KVPoll
from stress.framework import JSONValue, Monitor, ScenarioMetrics, StressConfig, register
from stress.harness.driver import DriverConfig, RoomOutcome, SchedulerDriver
from stress.invariants import describe
from stress.scenarios._sender_rig import SENDER_INVARIANTS, SenderRig, sender_rig

HEALTHY_ISOLATED = describe(
    "healthy-isolated",
    "while a decode peer is hung (SIGSTOP, deadline far away) every room to a healthy peer "
    "concludes Success while the hung peer's rooms are all still in flight",
)

PLANT_WAITS = "worker-waits-on-its-chunk"
"""Test-only planted bug: ``write_pages`` returns only once its write ended (see the module
docstring)."""

HEALTHY = ("decode-a", "decode-b")
HUNG = "decode-hung"
SESSIONS = (*HEALTHY, HUNG)
PEER_PAGES = 512
HUNG_DEADLINE_S = 8.0
"""The phase's transfer deadline: the hung rooms end by it at the earliest (not a bound on
the healthy rooms: they are judged by order). Kept under the watchdog period's reach of a
planted run: under the plant every healthy room waits this long."""
HEALTHY_ROOMS = {True: 24, False: 160}
"""Healthy rooms per phase: ``--quick`` / full."""
CHUNKS = 2
EXTRA_HUNG = 2
"""Hung rooms per phase: the phase's workers plus this many."""
SETTLE_S = 30.0
"""After ``SIGCONT``: the bound for the hung rooms to conclude (a progress bound: their
writes complete in milliseconds once the peer runs)."""
POSTED_S = 30.0
"""The bound for ``workers`` hung chunks to be in flight after their rooms were opened."""
HUNG_PAGE_BASE = 400
"""The hung peer's destination pages come from here on (the driver never sends to it)."""


class _WaitsOnItsChunk:
    """The planted bug: the transport the manager sees, with ``write_pages`` waiting for its
    own write to end before it returns (the posting worker is held, as before issue 33).
    Everything else is forwarded as is."""

    POLL_PAUSE_S = 0.001

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def write_pages(self, *args: Any, **kwargs: Any) -> Any:
        """The inner ``write_pages``, then poll the write until it ends; a failure stays
        the transfer's (its next ``poll`` raises it again).

        Raises:
            Exception: what the inner ``write_pages`` raises.
        """
        transfer = self._inner.write_pages(*args, **kwargs)
        while True:
            try:
                if transfer.poll() == "DONE":
                    break
            except Exception:  # the transfer keeps its failure: the pipeline sees it
                break
            time.sleep(self.POLL_PAUSE_S)
        return transfer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@dataclasses.dataclass
class _Phase:
    """What one phase saw."""

    workers: int
    healthy_while_hung: int = 0
    healthy_after_hung_ended: int = 0
    healthy_failed: int = 0
    healthy_unconcluded: int = 0
    hung_in_flight_at_start: int = 0
    hung_outcomes: dict[str, int] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, JSONValue]:
        outcomes: dict[str, JSONValue] = dict(self.hung_outcomes)
        return {
            "workers": self.workers,
            "healthy_while_hung": self.healthy_while_hung,
            "healthy_after_hung_ended": self.healthy_after_hung_ended,
            "healthy_failed": self.healthy_failed,
            "healthy_unconcluded": self.healthy_unconcluded,
            "hung_in_flight_at_start": self.hung_in_flight_at_start,
            "hung_outcomes": outcomes,
        }


def _poll_until_concluded(senders: Sequence[NixlKVSender], bound_s: float) -> list[KVPoll]:
    """Poll every sender until each concluded or ``bound_s`` passed; the last statuses."""
    end = time.monotonic() + bound_s
    while True:
        statuses = [s.poll() for s in senders]
        if all(st in (KVPoll.Success, KVPoll.Failed) for st in statuses):
            return statuses
        if time.monotonic() >= end:
            return statuses
        time.sleep(0.001)


def _conclude_and_purge(sender: NixlKVSender, status: KVPoll) -> None:
    if status is KVPoll.Failed:
        try:
            sender.failure_exception()
        except Exception:  # raises by design: the outcome was counted by the caller
            return
    sender.clear()


class PeerIsolation:
    name = "peer-isolation"
    description = "a decode peer hung (SIGSTOP) while rooms to healthy peers go on"
    default_duration = 20.0
    invariants = (HEALTHY_ISOLATED, *SENDER_INVARIANTS)

    def run(self, config: StressConfig, monitor: Monitor) -> ScenarioMetrics:
        planted = config.plant_bug == PLANT_WAITS
        # No injected NIXL faults: every healthy room must succeed.
        quiet = dataclasses.replace(config, fault_rate=0.0)
        phases: list[_Phase] = []
        with sender_rig(quiet, SESSIONS, PEER_PAGES, monitor=monitor) as rig:
            monitor.restart_clock()  # rooms are bounded by count; the clock is for rates
            rig.finish_manager(monitor)  # the rig's default manager (0.5 s deadline): unused
            for workers in dict.fromkeys((1, max(1, config.threads))):
                if monitor.stop.is_set():
                    break
                mgr = rig.make_manager(
                    num_workers=workers,
                    transfer_timeout_s=HUNG_DEADLINE_S,
                    wrap=_WaitsOnItsChunk if planted else None,
                )
                phases.append(self._phase(rig, mgr, monitor, config, workers))
                rig.finish_manager(monitor)
            rig.audit_pages(monitor)
            # rig.close (the context exit) closes the last manager again: a no-op.
        return ScenarioMetrics(
            extra={
                **rig.stats.to_json(),
                "planted": planted,
                "hung_deadline_s": HUNG_DEADLINE_S,
                "phases": [p.to_json() for p in phases],
            }
        )

    def _phase(
        self,
        rig: SenderRig,
        mgr: KVManager,
        monitor: Monitor,
        config: StressConfig,
        workers: int,
    ) -> _Phase:
        phase = _Phase(workers)
        counters = monitor.counters()
        room = rig.next_room
        # Warm every connection (the first write to a peer sets it up) while all answer.
        warm = []
        for i, sid in enumerate(SESSIONS):
            s = NixlKVSender(mgr, room + i, [sid], [make_transfer_info(sid, [i])])
            s.init(1)
            s.send([i])
            warm.append(s)
        rig.rooms_used.extend(range(room, room + len(SESSIONS)))
        room += len(SESSIONS)
        for s, status in zip(warm, _poll_until_concluded(warm, SETTLE_S), strict=True):
            if status is not KVPoll.Success:
                monitor.violation(HEALTHY_ISOLATED, f"warm-up room {s.bootstrap_room}: {status}")
            _conclude_and_purge(s, status)
        hung_peer = rig.peers[HUNG]
        hung_peer.stop()
        window = rig.notices.fault(HUNG, time.monotonic())  # decode-told: not judged there
        hung: list[NixlKVSender] = []
        try:
            for i in range(workers + EXTRA_HUNG):
                dst = HUNG_PAGE_BASE + i
                s = NixlKVSender(mgr, room, [HUNG], [make_transfer_info(HUNG, [dst])])
                rig.rooms_used.append(room)
                room += 1
                s.init(1)
                s.send([dst])
                hung.append(s)
            rig.next_room = room
            # As many hung chunks in flight as there are workers (posted, or being posted).
            end = time.monotonic() + POSTED_S
            while mgr.stats().transfers_inflight < workers and time.monotonic() < end:
                time.sleep(0.001)
            phase.hung_in_flight_at_start = mgr.stats().transfers_inflight
            counters.beats += 1
            self._healthy(rig, mgr, monitor, config, phase, hung, counters)
        finally:
            hung_peer.cont()
        statuses = _poll_until_concluded(hung, SETTLE_S)
        for s, status in zip(hung, statuses, strict=True):
            key = status.name
            phase.hung_outcomes[key] = phase.hung_outcomes.get(key, 0) + 1
            _conclude_and_purge(s, status)
        rig.notices.fault_end(window, time.monotonic())
        counters.beats += 1
        return phase

    def _healthy(
        self,
        rig: SenderRig,
        mgr: KVManager,
        monitor: Monitor,
        config: StressConfig,
        phase: _Phase,
        hung: list[NixlKVSender],
        counters: Any,
    ) -> None:
        """Drive the healthy rooms while the hung peer is stopped; judge each conclusion."""
        driver = SchedulerDriver(mgr, dict.fromkeys(HEALTHY, PEER_PAGES), rig.digest)
        ended_at: list[int] = []  # how many healthy rooms had concluded when a hung one ended

        def on_conclude(o: RoomOutcome) -> None:
            rig.audit.record(o)
            if not ended_at and any(s.poll() is not KVPoll.Transferring for s in hung):
                ended_at.append(phase.healthy_while_hung + phase.healthy_after_hung_ended)
            if o.status is not KVPoll.Success:
                phase.healthy_failed += 1
                monitor.violation(
                    HEALTHY_ISOLATED,
                    f"{phase.workers} worker(s): room {o.room} to healthy {o.session_id} "
                    f"ended {o.status!r} while {HUNG} was hung: {o.error}",
                )
            elif ended_at:
                phase.healthy_after_hung_ended += 1
                if phase.healthy_after_hung_ended <= 3:
                    monitor.violation(
                        HEALTHY_ISOLATED,
                        f"{phase.workers} worker(s): room {o.room} to healthy {o.session_id} "
                        f"concluded only after a room of the hung peer had ended (its "
                        f"{HUNG_DEADLINE_S:g} s deadline), {o.latency_s:.2f} s after its "
                        f"opening; {ended_at[0]} healthy rooms concluded before",
                    )
            else:
                phase.healthy_while_hung += 1

        def beat(done: int, total: int) -> None:
            counters.beats += 1

        driver.on_conclude = on_conclude
        driver.progress = beat
        rooms = HEALTHY_ROOMS[config.quick]
        base = rig.next_room
        rig.next_room += rooms
        cfg = DriverConfig(
            rooms=rooms,
            chunks=CHUNKS,
            pages_per_chunk=1,
            max_active=4,
            room_base=base,
            seed=config.seed + base,
            # The driver's own give-up: well past the hung rooms' deadline, so a planted
            # run shows its rooms concluding after it (the order is what is judged).
            deadline_s=HUNG_DEADLINE_S + 2 * monitor.watchdog_s,
        )
        # Under the planted bug nothing concludes until the hung rooms' deadline: a long
        # step for the watchdog (the invariant above reports it, not no-deadlock).
        with monitor.long_step("healthy rooms while a peer is hung", cfg.deadline_s):
            result = driver.run(cfg)
        if result.unconcluded:
            phase.healthy_unconcluded += result.unconcluded
            monitor.violation(
                HEALTHY_ISOLATED,
                f"{phase.workers} worker(s): {result.unconcluded} healthy rooms not concluded "
                f"within {cfg.deadline_s:g} s while {HUNG} was hung",
            )
        rig.account(monitor, counters, result)
        if phase.healthy_after_hung_ended > 3:
            monitor.violation(
                HEALTHY_ISOLATED,
                f"{phase.workers} worker(s): {phase.healthy_after_hung_ended} healthy rooms in "
                "all concluded only after a hung room had ended",
            )


register(PeerIsolation())
