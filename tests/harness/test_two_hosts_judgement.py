"""Two-hosts judges a fault's rooms by the sender's clock, not by the harness's scheduler.

On a loaded machine a restart of the harness (``rig.peer_lock``, held while the decode peer
process starts again) kept the scheduler thread from noticing rooms for seconds: rooms the
sender had failed 50 ms after a kill were reported 7.7 s late ('kill: room 1363 opened
191 ms after the fault took 7752 ms ... (limit 1000 ms)'). These tests drive the phase
judgement (``_Child._figures``) with outcomes whose two clocks disagree: a scheduler held up
is not the sender's fault (no violation on a fast sender: this failed before the fix). No
latency is judged: the rooms in flight at a fault must fail together (at most one per
worker of its own chunk, the rest ``peer-failed``), whatever either clock says; a slow
sender's latency is a figure.
Sequential: no interleaving is involved.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

import pytest

from sender.poll import KVPoll
from stress.framework import Monitor
from stress.harness.driver import RoomOutcome
from stress.scenarios._conclusions import ConclusionClock
from stress.scenarios._nixl_calls import SlowCalls

pytestmark = pytest.mark.timeout(60)

FAULT_AT = 1000.0
DEAD_AT = FAULT_AT + 0.03
HELD_UNTIL = FAULT_AT + 7.75  # the scheduler notices nothing before this


def _outcome(room: int, started: float, noticed: float) -> RoomOutcome:
    return RoomOutcome(
        room=room,
        session_id="decode-netns",
        status=KVPoll.Failed,
        latency_s=noticed - started,
        error="KVTransferError",
        verified=None,
        footprint=(),
        concluded_at=noticed,
        started_at=started,
        generation=room + 1,
        reason="decode peer 'decode-netns' failed: nixlRemoteDisconnectError",
    )


def _kill_child(
    outcomes: list[RoomOutcome], sender_delay_s: float, own: frozenset[int] = frozenset()
) -> Any:
    """A two-hosts child judging a kill phase of ``outcomes``: the sender concludes each
    ``sender_delay_s`` after the peer died (or after its opening, if later); the rooms in
    ``own`` failed of their own chunk (code ``transport``), the others with their session
    (``peer-failed``)."""
    from stress.scenarios.two_hosts import INVARIANTS, Plan, _Child, _Track

    now = [0.0]
    clock = ConclusionClock(now=lambda: now[0])
    for o in outcomes:
        now[0] = max(o.started_at, DEAD_AT) + sender_delay_s  # the manager tells it then
        code = "transport" if o.room in own else "peer-failed"
        clock.room_concluded(o.room, o.generation, "failed", code, now[0] - o.started_at)

    class _Rig:
        conclusions = clock
        nixl_calls = SlowCalls(object())

    child: Any = _Child.__new__(_Child)
    child.monitor = Monitor("two-hosts", INVARIANTS, duration_s=60.0, watchdog_s=10.0)
    child.plan = Plan(recover_rooms=0)
    child.track = _Track(outcomes=outcomes)
    child._rig = _Rig()
    child.in_flight_at = {}
    return child


def _found(child: Any) -> dict[str, tuple[int, list[str]]]:
    return {
        r.name: (r.violations, list(r.examples)) for r in child.monitor.reports() if r.violations
    }


def _judge(
    sender_delay_s: float,
    own: frozenset[int] = frozenset(),
    in_flight: int = 1,
    kind: str = "kill",
) -> tuple[dict[str, tuple[int, list[str]]], dict[str, Any]]:
    """A kill phase: ``in_flight`` rooms (1, 2, ...) in flight at the fault, eight opened
    0.2 s after it; the sender concludes each ``sender_delay_s`` after the peer died (or
    after its opening, if later), ``own`` of their own chunk; the scheduler notices all of
    them only at ``HELD_UNTIL``."""
    outcomes = [_outcome(1 + i, FAULT_AT - 0.1, HELD_UNTIL) for i in range(in_flight)]
    outcomes += [_outcome(10 + i, FAULT_AT + 0.2 + i * 1e-3, HELD_UNTIL) for i in range(8)]
    child = _kill_child(outcomes, sender_delay_s, own)
    dead_at = DEAD_AT if kind == "kill" else None
    figures = child._figures(kind, FAULT_AT, FAULT_AT + 0.9, FAULT_AT + 1.0, None, [], dead_at)
    return _found(child), figures


def test_a_fault_kind_that_never_found_a_room_in_flight_is_a_vacuous_check() -> None:
    """A fault with no room in flight judges nothing and is not a violation by itself; a
    kind none of whose faults found one is (``fault-to-failed`` would have checked
    nothing of it), and one that found one in another phase is not."""
    after = [_outcome(10 + i, FAULT_AT + 0.2 + i * 1e-3, HELD_UNTIL) for i in range(4)]
    child = _kill_child(after, 0.05)
    child._figures("kill", FAULT_AT, FAULT_AT + 0.9, FAULT_AT + 1.0, None, [], DEAD_AT)
    assert _found(child) == {}
    child._judge_in_flight_coverage()
    assert _found(child) == {
        "fault-to-failed": (1, ["kill: no room was in flight at any of its 1 faults"])
    }
    both = _kill_child([_outcome(1, FAULT_AT - 0.1, HELD_UNTIL), *after], 0.05)
    both.track.outcomes = after  # the first phase: nothing in flight
    both._figures("kill", FAULT_AT, FAULT_AT + 0.9, FAULT_AT + 1.0, None, [], DEAD_AT)
    both.track.outcomes = [_outcome(1, FAULT_AT - 0.1, HELD_UNTIL), *after]
    both._figures("kill", FAULT_AT, FAULT_AT + 0.9, FAULT_AT + 1.0, None, [], DEAD_AT)
    both._judge_in_flight_coverage()
    assert both.in_flight_at == {"kill": [2, 1]} and _found(both) == {}


def test_a_scheduler_held_up_by_the_harness_is_not_the_senders_delay() -> None:
    found, figures = _judge(sender_delay_s=0.05)
    assert found == {}, found
    assert figures["in_flight"] == 1 and figures["opened_after"] == 8, figures
    assert figures["opened_after_ms_max"] < 100, figures
    assert figures["driver_lag_ms_max"] > 7000, figures  # the hold is reported, not judged
    assert figures["judged_by_the_scheduler"] == 0, figures


def test_rooms_in_flight_at_a_hung_peer_failing_each_of_its_own_chunk_are_caught() -> None:
    """A sender whose deadline is not session-fatal: all 4 rooms in flight at a stop fail of
    their own chunk (code ``transport``), more than one per worker (2): a finding, whatever
    either clock says; 2 of their own and 2 with the session (``peer-failed``) are none.
    After a kill the same is not judged (each chunk reports the disconnect itself)."""
    found, figures = _judge(0.05, own=frozenset({1, 2, 3, 4}), in_flight=4, kind="stop")
    assert set(found) == {"fault-to-failed"}, found
    assert found["fault-to-failed"][0] == 1, found
    assert "4 of the 4 rooms in flight at the fault failed of their own chunk" in (
        found["fault-to-failed"][1][0]
    ), found
    assert figures["own_failures_allowed"] == 2 and figures["in_flight_own_failures"] == 4
    found, figures = _judge(0.05, own=frozenset({1, 2}), in_flight=4, kind="stop")
    assert found == {}, found
    assert figures["in_flight_own_failures"] == 2, figures
    found, figures = _judge(0.05, own=frozenset({1, 2, 3, 4}), in_flight=4, kind="kill")
    assert found == {} and figures["in_flight_own_failures"] == 0, found


def test_a_slow_sender_is_a_figure_not_a_violation() -> None:
    """At load 12 the whole child got no CPU for seconds (rooms opened 0.2 s after a kill
    failed 13.8 s later): the latency is reported against its goal, never judged."""
    found, figures = _judge(sender_delay_s=6.0)
    assert found == {}, found
    assert figures["fault_to_failed_ms_max"] >= 6000.0 and not figures["goal_met"], figures
    assert figures["opened_after_ms_max"] >= 5800.0, figures


def test_the_clock_keeps_the_first_conclusion_of_each_opening() -> None:
    now = [1.0]
    clock = ConclusionClock(now=lambda: now[0])
    clock.room_concluded(5, 6, "failed", "transport", 0.1)
    now[0] = 2.0
    clock.room_concluded(5, 6, "failed", "transport", 0.2)
    assert clock.at(5, 6) == 1.0
    assert clock.at(5, 7) is None and clock.at(4, 6) is None
    assert clock.code(5, 6) == "transport" and clock.code(5, 7) is None


def test_slow_nixl_calls_are_noted_and_named_in_their_window() -> None:
    """The diagnostic a finding quotes: a call over 50 ms is noted with its name and thread,
    a quick one is not, what a call raises passes through unchanged."""
    import time

    class _Ops:
        def postXferReq(self, pause: float) -> str:
            time.sleep(pause)
            return "PROC"

        def getXferStatus(self) -> str:
            raise RuntimeError("NIXL_ERR_REMOTE_DISCONNECT")

    calls = SlowCalls(_Ops())
    before = time.monotonic()
    assert calls.postXferReq(0.0) == "PROC"
    assert calls.postXferReq(0.08) == "PROC"
    with pytest.raises(RuntimeError, match="REMOTE_DISCONNECT"):
        calls.getXferStatus()
    after = time.monotonic()
    slow = calls.during(before, after)
    assert [c[2] for c in slow] == ["postXferReq"] and slow[0][1] - slow[0][0] >= 0.08
    assert "postXferReq" in calls.describe(before, after)
    assert calls.during(after + 1, after + 2) == []


class _SlowFault:
    """A link and a peer whose fault calls take ``took_s`` (a loaded machine: the ``ip``
    process and the carrier wait, the SIGSTOP and the wait for the stopped state)."""

    took_s = 0.05

    def __init__(self) -> None:
        self.began: list[float] = []

    def _slowly(self) -> None:
        self.began.append(time.monotonic())
        time.sleep(self.took_s)

    partition = stop = _slowly


@pytest.mark.parametrize("kind", ["stop", "partition", "evict"])
def test_a_fault_is_timed_when_it_began_not_when_its_call_returned(kind: str) -> None:
    """A partition that took over 0.5 s to make under load caught chunks that hung and failed
    their session before a fault time taken after the call, and the rooms parked behind
    their slots (``SlotsHeldByHungError``) were judged in flight at the fault and failing of
    their own chunk (``fault-to-failed``; 'evict: 12 of the 12 rooms ... codes
    ['internal'] ... the last 9 ms after the fault')."""
    from stress.scenarios.two_hosts import SESSION, _Child

    fault = _SlowFault()

    class _Rig:
        peers: ClassVar[dict[str, _SlowFault]] = {SESSION: fault}

    child: Any = _Child.__new__(_Child)
    child.link = fault
    began, on = child._inject(_Rig(), kind)
    assert len(fault.began) == 1
    assert began <= fault.began[0], (
        f"the fault was timed {(began - fault.began[0]) * 1e3:.0f} ms after it began"
    )
    assert on >= fault.began[0] + fault.took_s, "the fault was 'surely on' before its call returned"
