"""peer-faults' ``rooms-concluded`` for a killed peer's rooms is judged by order, not by the
clock (``stress/scenarios/peer_faults.py``, :func:`judge_kills`): a room of the killed session
open at the kill must be concluded by the sender before the kill's phase ended (the next
fault, or the end of admission). How long it took is a figure. Pure function; sequential."""

from __future__ import annotations

import pytest

from sender.poll import KVPoll
from stress.harness.driver import RoomOutcome
from stress.scenarios.peer_faults import KillPhase, judge_kills

pytestmark = pytest.mark.timeout(60)

KILL_AT = 100.0
PHASE = KillPhase("decode-a", KILL_AT, KILL_AT + 4.0)


def _room(room: int, session: str, started: float, concluded: float) -> RoomOutcome:
    return RoomOutcome(
        room=room,
        session_id=session,
        status=KVPoll.Failed,
        latency_s=concluded - started,
        error="KVTransferError",
        verified=None,
        footprint=(),
        concluded_at=concluded,
        started_at=started,
        generation=1,
        reason="",
    )


def _sender_time(o: RoomOutcome) -> float:
    return o.concluded_at


def test_a_room_concluded_within_its_kills_phase_is_no_finding_however_long_it_took() -> None:
    rooms = [
        _room(1, "decode-a", KILL_AT - 0.1, KILL_AT + 0.05),
        _room(2, "decode-a", KILL_AT - 0.1, KILL_AT + 3.9),  # slow (a loaded machine): a figure
    ]
    findings, took = judge_kills([PHASE], rooms, _sender_time)
    assert findings == []
    assert sorted(round(t, 2) for t in took) == [0.05, 3.9]


def test_a_room_still_open_when_the_phase_ended_is_a_finding() -> None:
    """The planted violation: the sender left a dead peer's room open past the next fault
    (a later deadline, or a hang ended only by the driver's give-up)."""
    late = _room(3, "decode-a", KILL_AT - 0.1, KILL_AT + 5.0)
    findings, took = judge_kills([PHASE], [late], _sender_time)
    assert len(findings) == 1 and "room 3 of decode-a" in findings[0], findings
    assert "1000 ms after the phase's end" in findings[0], findings
    assert took == [pytest.approx(5.0)]


def test_only_the_killed_sessions_rooms_open_at_the_kill_are_judged() -> None:
    rooms = [
        _room(4, "decode-b", KILL_AT - 0.1, KILL_AT + 9.0),  # the other peer's room
        _room(5, "decode-a", KILL_AT + 0.1, KILL_AT + 9.0),  # opened after the kill
        _room(6, "decode-a", KILL_AT - 0.2, KILL_AT - 0.1),  # concluded before it
    ]
    assert judge_kills([PHASE], rooms, _sender_time) == ([], [])
