"""Linearizability of StagingContext, checked on histories recorded from real threads.

Hypothesis generates per-thread programs (2-3 threads x up to 4 operations on 2 rooms, with
handles that go stale); each program runs on real threads behind a Barrier under a 1 us switch
interval, and the recorded history is checked room by room against the sequential model in
:mod:`stress.linearizability`. The search is derandomized (``derandomize=True``): a failure
replays from the printed falsifying example. A planted check-then-act bug must be rejected,
and the checker itself is unit-tested on hand-written histories.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from staging import RoomHandle, RoomPurge, StagingContext
from staging.locks import LOCK_KINDS
from stress.linearizability import (
    CheckResult,
    Op,
    Raised,
    SearchBudgetExceeded,
    ThreadRecorder,
    check,
    check_staging,
    first_violation,
    merge,
)

pytestmark = pytest.mark.timeout(60)

ROOMS = 2
JOIN_S = 10.0
REPEATS = 3  # runs of each generated program (different interleavings, same program)


# ---------------------------------------------------------------------------- checker units

H1 = RoomHandle(0, 1)
H2 = RoomHandle(0, 2)


def op(thread: int, invoke: int, response: int, name: str, *args: object, result: object) -> Op:
    return Op(thread, invoke, response, name, tuple(args), result)  # type: ignore[arg-type]


def opened(room: int = 0, generation: int = 1) -> Op:
    return op(-1, 0, 1, "open", room, result=RoomHandle(room, generation))


def test_overlapping_duplicate_requests_one_true_is_linearizable() -> None:
    history = [
        opened(),
        op(1, 10, 50, "request", H1, 0, "a", result=True),
        op(2, 20, 60, "request", H1, 0, "a", result=False),
        op(1, 70, 80, "is_requested", H1, 0, "a", result=True),
    ]
    (result,) = check_staging(history)
    assert result.ok, result.describe()
    assert result.linearization is not None and len(result.linearization) == 4
    # The witness respects real time: no op is placed before one that preceded it.
    order = result.linearization
    for i, a in enumerate(order):
        assert not any(b.precedes(a) for b in order[i + 1 :])


def test_duplicate_requests_both_true_is_not_linearizable() -> None:
    history = [
        opened(),
        op(1, 10, 50, "request", H1, 0, "a", result=True),
        op(2, 20, 60, "request", H1, 0, "a", result=True),
    ]
    result = first_violation(history)
    assert result is not None and not result.ok
    assert "NOT linearizable" in result.describe()


def test_write_accepted_after_purge_returned_is_not_linearizable() -> None:
    purge = RoomPurge(0, True, False, frozenset(), 1)
    late = [opened(), op(1, 10, 20, "purge", H1, result=purge)]
    # Strictly after the purge returned: a late write must be refused.
    assert first_violation([*late, op(2, 30, 40, "request", H1, 0, "a", result=True)])
    assert first_violation([*late, op(2, 30, 40, "request", H1, 0, "a", result=False)]) is None
    # Overlapping the purge, the write may be refused (after) ...
    overlap = op(2, 15, 40, "request", H1, 0, "a", result=False)
    assert first_violation([*late, overlap]) is None
    # ... or accepted, but then the purge must have returned the key.
    accepted = op(2, 5, 40, "request", H1, 0, "a", result=True)
    assert first_violation([*late, accepted]) is not None
    with_key = RoomPurge(0, True, False, frozenset({(0, "a")}), 1)
    history = [opened(), op(1, 10, 20, "purge", H1, result=with_key), accepted]
    assert first_violation(history) is None


def test_stale_handle_must_not_reach_the_new_generation() -> None:
    base = [
        opened(),
        op(1, 10, 20, "purge", H1, result=RoomPurge(0, True, False, frozenset(), 1)),
        op(1, 30, 40, "open", 0, result=H2),
    ]
    assert first_violation([*base, op(2, 50, 60, "request", H1, 1, "b", result=True)])
    assert first_violation([*base, op(2, 50, 60, "mark", H1, result=True)])
    assert first_violation([*base, op(2, 50, 60, "request", 0, 1, "b", result=True)]) is None
    assert first_violation([*base, op(2, 50, 60, "is_open", H1, result=False)]) is None
    # A generation number may not go backwards on reopen.
    old = op(1, 30, 40, "open", 0, result=RoomHandle(0, 1))
    assert first_violation([*base[:2], old]) is not None


def test_open_of_an_open_room_must_raise() -> None:
    dup = op(1, 10, 20, "open", 0, result=Raised("RoomAlreadyOpenError"))
    assert first_violation([opened(), dup]) is None
    assert first_violation([opened(), op(1, 10, 20, "open", 0, result=H2)]) is not None


def test_purge_session_is_projected_per_room() -> None:
    other = RoomHandle(1, 2)
    history = [
        opened(0, 1),
        opened(1, 2),
        op(1, 10, 20, "request", H1, 0, "s", result=True),
        op(2, 30, 40, "purge_session", "s", result=frozenset({0})),
        op(2, 50, 60, "is_requested", H1, 0, "s", result=False),
        op(2, 50, 60, "room_requests", other, result=frozenset()),
    ]
    assert all(r.ok for r in check_staging(history))
    wrong = [*history[:3], op(2, 30, 40, "purge_session", "s", result=frozenset({0, 1}))]
    assert first_violation(wrong) is not None


def test_checker_is_model_agnostic_and_bounded() -> None:
    @dataclass(frozen=True)
    class Register:
        """A read/write register: the textbook example."""

        def initial(self) -> int:
            return 0

        def step(self, state: int, o: Op) -> int | None:
            if o.name == "write":
                return o.args[0]  # type: ignore[return-value]
            return state if o.result == state else None

    good = [
        op(1, 0, 10, "write", 1, result=None),
        op(2, 5, 15, "read", result=0),  # overlaps the write: may read the old value
        op(2, 20, 30, "read", result=1),
    ]
    bad = [op(1, 0, 10, "write", 1, result=None), op(2, 20, 30, "read", result=0)]
    assert check(good, Register()).ok
    assert not check(bad, Register()).ok
    # Many fully concurrent ops blow the budget instead of hanging.
    wide = [op(i, 0, 100, "write", i, result=None) for i in range(14)]
    wide.append(op(99, 200, 210, "read", result=-1))
    with pytest.raises(SearchBudgetExceeded):
        check(wide, Register(), max_states=1000)


# ---------------------------------------------------------------------------- programs


@dataclass(frozen=True)
class Step:
    """One generated operation: what, on which room, through which reference."""

    name: str
    room: int
    ref: str  # "id" (bare room id), "initial" (handle from setup), "mine" (own latest open)
    chunk: int
    session: str

    def __repr__(self) -> str:
        return f"{self.name}(room={self.room},{self.ref},{self.chunk},{self.session})"


OP_NAMES = (
    "request", "request", "requests", "cancel", "mark", "purge", "open", "purge_session",
    "is_requested", "is_prefetched", "is_open", "room_requests",
)  # fmt: skip

steps = st.builds(
    Step,
    name=st.sampled_from(OP_NAMES),
    room=st.integers(0, ROOMS - 1),
    ref=st.sampled_from(("id", "initial", "mine")),
    chunk=st.integers(0, 1),
    session=st.sampled_from(("a", "b")),
)
programs = st.lists(st.lists(steps, min_size=1, max_size=4), min_size=2, max_size=3)

Program = Sequence[Sequence[Step]]
ContextFactory = Callable[[], StagingContext]


@contextmanager
def switch_interval(seconds: float) -> Iterator[None]:
    old = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def perform(
    ctx: StagingContext, rec: ThreadRecorder, step: Step, handles: dict[int, RoomHandle]
) -> None:
    """Run one step through the recorder; remember handles this thread opens."""
    ref: int | RoomHandle = step.room if step.ref == "id" else handles[step.room]
    c, s = step.chunk, step.session
    name = step.name
    if name == "request":
        rec.call(name, (ref, c, s), lambda: ctx.request_prefetch(ref, c, s))
    elif name == "requests":
        chunks = (c, 1 - c)
        rec.call(name, (ref, chunks, s), lambda: ctx.request_prefetches(ref, chunks, s))
    elif name == "cancel":
        rec.call(name, (ref, c, s), lambda: ctx.cancel_prefetch(ref, c, s))
    elif name == "mark":
        rec.call(name, (ref,), lambda: ctx.mark_prefetched(ref))
    elif name == "purge":
        rec.call(name, (ref,), lambda: ctx.purge_room(ref))
    elif name == "open":
        got = rec.call(name, (step.room,), lambda: ctx.open_room(step.room))
        if isinstance(got, RoomHandle) and step.ref == "mine":
            handles[step.room] = got
    elif name == "purge_session":
        rec.call(name, (s,), lambda: ctx.purge_session(s))
    elif name == "is_requested":
        rec.call(name, (ref, c, s), lambda: ctx.is_requested(ref, c, s))
    elif name == "is_prefetched":
        rec.call(name, (ref,), lambda: ctx.is_prefetched(ref))
    elif name == "is_open":
        rec.call(name, (ref,), lambda: ctx.is_open(ref))
    elif name == "room_requests":
        rec.call(name, (ref,), lambda: ctx.room_requests(ref))
    else:  # pragma: no cover - the strategy only draws the names above
        raise AssertionError(name)


def run_program(factory: ContextFactory, program: Program) -> list[Op]:
    """Run ``program`` (one op list per thread) on real threads; return the history."""
    ctx = factory()
    setup = ThreadRecorder(-1)
    initial: dict[int, RoomHandle] = {}
    for room in range(ROOMS):
        handle = setup.call("open", (room,), lambda room=room: ctx.open_room(room))
        assert isinstance(handle, RoomHandle)
        initial[room] = handle
    recorders = [ThreadRecorder(i) for i in range(len(program))]
    barrier = threading.Barrier(len(program), timeout=JOIN_S)
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            handles = dict(initial)
            barrier.wait()
            for step in program[i]:
                perform(ctx, recorders[i], step, handles)
        except BaseException as exc:  # asserted below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(len(program))]
    with switch_interval(1e-6):
        for t in threads:
            t.start()
        for t in threads:
            t.join(JOIN_S)
    assert not [t for t in threads if t.is_alive()], "a worker thread did not finish"
    assert errors == []
    return merge([setup, *recorders])


def violation_in(
    factory: ContextFactory, program: Program, repeats: int
) -> CheckResult[object] | None:
    """Run ``program`` ``repeats`` times; the first non-linearizable room history, if any."""
    for _ in range(repeats):
        bad = first_violation(run_program(factory, program))
        if bad is not None:
            return bad  # type: ignore[return-value]
    return None


# ---------------------------------------------------------------------------- the proofs

SETTINGS = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.mark.parametrize("lock", LOCK_KINDS)
def test_staging_context_histories_are_linearizable(lock: str) -> None:
    print(f"hypothesis: derandomize=True, max_examples=60, repeats={REPEATS}, lock={lock}")
    checked = [0]

    @SETTINGS
    @given(programs)
    def prop(program: list[list[Step]]) -> None:
        bad = violation_in(lambda: StagingContext(lock=lock), program, REPEATS)
        checked[0] += REPEATS
        assert bad is None, f"program {program}\n{bad.describe() if bad else ''}"

    prop()
    print(f"histories checked: {checked[0]}")


class RacyContext(StagingContext):
    """PLANTED BUG: request_prefetch as a caller-side check-then-act, not under one lock.

    Two threads can both see the key absent, yield, and both report it newly recorded.
    """

    def request_prefetch(self, room: int | RoomHandle, chunk_idx: int, session_id: str) -> bool:
        if not self.is_open(room) or self.is_requested(room, chunk_idx, session_id):
            return False
        time.sleep(0)  # forced yield between the check and the act
        self.request_prefetches(room, (chunk_idx,), session_id)
        return True


class Caught(Exception):
    """Raised (from one place) once the planted bug is caught, to end the search early."""


def test_planted_check_then_act_is_rejected() -> None:
    """The checker must find a non-linearizable history of RacyContext within budget."""
    found: list[tuple[list[list[Step]], CheckResult[object]]] = []
    tried = [0]

    @settings(
        max_examples=200,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(programs)
    def search(program: list[list[Step]]) -> None:
        if not found:
            tried[0] += 1
            bad = violation_in(RacyContext, program, repeats=5)
            if bad is not None:
                found.append((program, bad))
        if found:
            raise Caught  # every later call (and hypothesis' replay) raises here too

    with pytest.raises(Caught):
        search()
    assert found, "the planted check-then-act race was not caught: the harness is too weak"
    program, bad = found[0]
    print(f"caught after {tried[0]} programs: {program}\n{bad.describe()}")
