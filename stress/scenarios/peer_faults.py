"""``peer-faults``: ``sender-lifecycle`` with two decode peer processes, one of which is
really SIGKILLed (then restarted and re-added) and/or SIGSTOPped (then continued) over and
over during the run, while the other keeps serving.

``decode-told`` judges the rooms of a session only away from its faults (a room opened before
a fault ended and purged less than ``TOLD_GRACE_S`` before it began is not judged); what a
peer learnt is fetched right before it is killed.

``--peer-kill`` / ``--peer-stop`` choose the faults (neither given: both, alternating). A
killed peer surfaces as ``nixlRemoteDisconnectError`` and fails every room of its session at
once; a stopped peer is never detected by NIXL, so its rooms fail at our transfer deadline
(``TransferTimeoutError``). Reported besides the invariants: the worst time from a kill to
the last of that session's rooms concluding, per kill.

``rooms-concluded`` judges a killed peer's rooms by order, not by the clock: every room of
the killed session still open at the kill concludes (by the sender's clock: the manager's
``room_concluded`` event, :class:`~stress.scenarios._conclusions.ConclusionClock`) before the
kill's phase ends -- the next fault, or the end of admission for the last one. A phase lasts
at least the restart of the killed peer (a new process) plus a pause, while NIXL reports a
disconnect on the next post or poll and a chunk it says nothing about ends at our transfer
deadline. A sender that leaves a dead peer's rooms to a later deadline or hanging fails the
check on any machine; a loaded machine only makes the phase longer. The time from the kill
to each room's conclusion is a reported figure (``kill_to_failed_ms_max``); its goal (two
transfer deadlines) is the ``fail-fast`` benchmark's (``python -m bench fail-fast``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from stress.framework import Monitor, ScenarioMetrics, StressConfig, register
from stress.harness.driver import RoomOutcome
from stress.scenarios._sender_rig import (
    ROOMS_CONCLUDED,
    SENDER_INVARIANTS,
    TRANSFER_TIMEOUT_S,
    SenderRig,
    peer_start_bound,
    sender_rig,
)

PEER_PAGES = 512
SESSIONS = ("decode-a", "decode-b")
FAULT_EVERY_S = 1.5


@dataclass(frozen=True)
class KillPhase:
    """A kill of ``session`` at ``at``; its phase ends at ``ends`` (the next fault, or the
    end of admission)."""

    session: str
    at: float
    ends: float


def judge_kills(
    phases: Sequence[KillPhase],
    outcomes: Sequence[RoomOutcome],
    concluded_at: Callable[[RoomOutcome], float],
) -> tuple[list[str], list[float]]:
    """``rooms-concluded`` for killed peers: the findings (a room of the killed session open
    at the kill that the sender concluded only after the kill's phase ended) and the time
    from the kill to each such room's conclusion (a figure, never judged).
    ``concluded_at``: when the sender concluded a room. Pure; raises nothing."""
    findings: list[str] = []
    took: list[float] = []
    for ph in phases:
        for o in outcomes:
            ended = concluded_at(o)
            if o.session_id != ph.session or not o.started_at < ph.at < ended:
                continue
            took.append(ended - ph.at)
            if ended > ph.ends:
                findings.append(
                    f"room {o.room} of {ph.session} (open at its kill) concluded "
                    f"{o.status!r} only after the kill's phase ended (the next fault or the "
                    f"end of admission), {(ended - ph.at) * 1e3:.0f} ms after the kill and "
                    f"{(ended - ph.ends) * 1e3:.0f} ms after the phase's end"
                )
    return findings, took


class PeerFaults:
    name = "peer-faults"
    description = "sender-lifecycle with decode peers SIGKILLed/restarted and SIGSTOPped"
    default_duration = 20.0
    invariants = SENDER_INVARIANTS

    def run(self, config: StressConfig, monitor: Monitor) -> ScenarioMetrics:
        kinds = [k for k, on in (("kill", config.peer_kill), ("stop", config.peer_stop)) if on]
        kinds = kinds or ["kill", "stop"]
        # (time, kind, session) of every fault, in order (the faulter's thread appends).
        faults_at: list[tuple[float, str, str]] = []
        outcomes: list[RoomOutcome] = []  # the scheduler thread appends

        with sender_rig(config, SESSIONS, PEER_PAGES, monitor=monitor) as rig:
            monitor.restart_clock()  # the duration counts from here, not from peer start-up
            faults = {"kill": 0, "stop": 0, "restart_failures": 0}
            monitor.spawn(rig.scheduler(monitor, outcomes.append), "scheduler")
            monitor.spawn(rig.reaper(monitor, 1000), "reaper")
            injector = monitor.spawn(
                self._faulter(rig, monitor, config, kinds, faults_at, faults), "peer-faulter"
            )
            injector.join(monitor.time_left() + 2 * monitor.watchdog_s)
            admission_end = time.monotonic()
            monitor.stop.set()
            monitor.join_all(timeout=monitor.watchdog_s)
            rig.check_end(monitor)
            ends = [at for at, _, _ in faults_at[1:]] + [admission_end]
            phases = [
                KillPhase(sid, at, end)
                for (at, kind, sid), end in zip(faults_at, ends, strict=True)
                if kind == "kill"
            ]

            def concluded_at(o: RoomOutcome) -> float:
                at = rig.conclusions.at(o.room, o.generation)
                return o.concluded_at if at is None else min(at, o.concluded_at)

            findings, took = judge_kills(phases, list(outcomes), concluded_at)
            for text in findings:
                monitor.violation(ROOMS_CONCLUDED, text)
            return ScenarioMetrics(
                extra={
                    **rig.stats.to_json(),
                    "peer_kills": faults["kill"],
                    "peer_stops": faults["stop"],
                    "restart_failures": faults["restart_failures"],
                    "kill_rooms_judged": len(took),
                    "kill_to_failed_ms_max": round(max(took, default=0.0) * 1e3, 1),
                    "faults_injected": rig.injector.stats().faults,
                }
            )

    @staticmethod
    def _faulter(
        rig: SenderRig,
        monitor: Monitor,
        config: StressConfig,
        kinds: list[str],
        faults_at: list[tuple[float, str, str]],
        faults: dict[str, int],
    ) -> Callable[[], None]:
        # A fault every ~1.5 s; short (--quick) runs still get at least two.
        every = min(FAULT_EVERY_S, monitor.duration_s / 3)

        def run() -> None:
            rng = config.rng(2000)
            counters = monitor.counters()
            n = 0
            while monitor.running() and monitor.time_left() > every:
                time.sleep(every * (0.5 + rng.random()))
                if not monitor.running():
                    break
                kind = kinds[n % len(kinds)]
                n += 1
                sid = SESSIONS[rng.randrange(len(SESSIONS))]
                peer = rig.peers[sid]
                # decode-told: rooms living around a fault of their session are not judged;
                # what the peer learnt so far is fetched before a kill (the new process
                # knows nothing).
                window = rig.notices.fault(sid, time.monotonic())
                if kind == "kill":
                    rig.harvest_notices(sid)
                    # The fault is the signal, not the end of kill()'s reap: rooms the
                    # sender fails meanwhile were open at the kill (timed after the reap,
                    # none was).
                    faults_at.append((time.monotonic(), kind, sid))
                    peer.kill()
                    rig.audit.peer_reset(sid, time.monotonic())  # its pages are gone with it
                    faults["kill"] += 1
                    time.sleep(0.2)
                    # The scheduler waits on peer_lock for its page reads meanwhile: a long
                    # step, bounded by the peer's own start timeout.
                    bound = peer_start_bound(monitor)
                    with monitor.long_step(f"restart {sid}", bound), rig.peer_lock:
                        rig.tx.remove_peer(sid)
                        try:
                            peer.restart()
                            rig.tx.add_peer(sid, peer.metadata)
                        except Exception:  # counted; the session then stays down
                            faults["restart_failures"] += 1
                else:
                    peer.stop()
                    faults_at.append((time.monotonic(), kind, sid))
                    faults["stop"] += 1
                    time.sleep(TRANSFER_TIMEOUT_S + 0.3)
                    peer.cont()
                rig.notices.fault_end(window, time.monotonic())
                counters.faults += 1
                counters.ops += 1

        return run


register(PeerFaults())
