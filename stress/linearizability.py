"""A small linearizability checker and a sequential model of ``StagingContext``.

Recording: each thread wraps every call in :meth:`ThreadRecorder.call`, which stores the
operation with its invocation and response instants (``time.perf_counter_ns``, one clock for
all threads) and its result (an exception becomes a :class:`Raised` result). Each thread
writes only its own list, so recording adds no synchronisation between the threads.

Checking (:func:`check`): the Wing & Gong search, with the memoisation of Lowe ("Testing for
linearizability", 2017): repeatedly pick a *minimal* pending operation -- one that no other
pending operation precedes in real time (``a`` precedes ``b`` iff ``a.response <
b.invoke``) -- apply it to the sequential model, and continue if the model's answer equals the
recorded result; backtrack otherwise. A (set of linearized operations, model state) pair seen
before is not searched again. The history is linearizable iff some branch linearizes all.

Staging histories are checked per room (:func:`check_staging`): an operation on room ``r``
only reads and writes ``r``'s state, and ``purge_session`` is projected onto each room ("was
``r`` in the returned set, and drop the session's keys from ``r``"). A linearizable history
has linearizable projections, so a projection that fails proves the whole history is not
linearizable; the projections keep the searches tiny.

Per-room projections cannot see whether ``purge_session`` is atomic across rooms: each room's
keys go at once either way. :func:`check_session_views` checks the other cut: the keys ONE
session has in every room, as a multi-key reader sees them (``snapshot()``,
``prefetch_requested``: a ``view`` operation whose result is the whole key set at once), with
that session's ``requests`` and ``purge_session`` (:class:`SessionKeysModel`). A view that
saw the session half-removed, or half-added, has no linearization point.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, NamedTuple, Protocol, TypeVar

from staging import RoomHandle, RoomPurge
from staging.context import PrefetchKey

S = TypeVar("S", bound=Hashable)
T = TypeVar("T")


@dataclass(frozen=True)
class Raised:
    """The recorded result of a call that raised: the exception class name."""

    exc_type: str


@dataclass(frozen=True)
class Op:
    """One completed operation of a history.

    ``invoke``/``response`` are ``perf_counter_ns`` instants; ``thread`` is a small id used
    only for display; ``name``/``args`` say what was called, ``result`` what it returned.
    """

    thread: int
    invoke: int
    response: int
    name: str
    args: tuple[Hashable, ...]
    result: Hashable

    def precedes(self, other: Op) -> bool:
        """``True`` if this operation returned before ``other`` was invoked."""
        return self.response < other.invoke

    def __str__(self) -> str:
        args = ", ".join(repr(a) for a in self.args)
        return f"t{self.thread} {self.name}({args}) -> {self.result!r}"


class Model(Protocol[S]):
    """A sequential specification: an initial state and a step function."""

    def initial(self) -> S:
        """The state before any operation."""
        ...

    def step(self, state: S, op: Op) -> S | None:
        """The state after ``op`` if its recorded result is what the specification returns
        in ``state``; ``None`` if the result is impossible there."""
        ...


@dataclass(frozen=True)
class CheckResult(Generic[S]):
    """Outcome of one check. ``linearization`` is a witness order when ``ok``."""

    ok: bool
    key: Hashable
    history: tuple[Op, ...]
    linearization: tuple[Op, ...] | None
    states_explored: int

    def describe(self) -> str:
        """The history, one operation per line in invocation order, with relative times."""
        if not self.history:
            return f"{self.key}: empty history"
        base = min(op.invoke for op in self.history)
        lines = [
            f"  [{(op.invoke - base) / 1e3:9.1f} .. {(op.response - base) / 1e3:9.1f} us] {op}"
            for op in sorted(self.history, key=lambda o: (o.invoke, o.response))
        ]
        verdict = "linearizable" if self.ok else "NOT linearizable"
        return f"room {self.key!r}: {verdict} ({self.states_explored} states)\n" + "\n".join(lines)


class SearchBudgetExceeded(RuntimeError):
    """The search visited more than ``max_states`` states (history too large to check)."""


def check(
    history: Sequence[Op], model: Model[S], *, key: Hashable = None, max_states: int = 1_000_000
) -> CheckResult[S]:
    """Is ``history`` linearizable with respect to ``model``? (Wing & Gong + memoisation.)

    Raises:
        SearchBudgetExceeded: more than ``max_states`` (done-set, state) pairs explored.
    """
    ops = tuple(sorted(history, key=lambda o: (o.invoke, o.response)))
    n = len(ops)
    full = (1 << n) - 1
    seen: set[tuple[int, S]] = set()

    def moves(done: int, state: S) -> list[tuple[int, S]] | None:
        """The minimal pending ops the model accepts next, with the states they lead to;
        ``None`` if ``(done, state)`` was searched before."""
        if (done, state) in seen:
            return None
        seen.add((done, state))
        if len(seen) > max_states:
            raise SearchBudgetExceeded(f"more than {max_states} states for {n} operations")
        # The minimal pending ops: those invoked before every pending op has responded.
        # Scan from the lowest pending index; ops are sorted by invoke, so once one is
        # invoked after the earliest response seen so far, no later op can be minimal or
        # respond earlier (response >= invoke): the scan stops there. O(width), not O(n).
        i = (~done & (done + 1)).bit_length() - 1
        earliest_response = ops[i].response
        minimal: list[int] = []
        while i < n and ops[i].invoke <= earliest_response:
            if not done >> i & 1:
                minimal.append(i)
                earliest_response = min(earliest_response, ops[i].response)
            i += 1
        found: list[tuple[int, S]] = []
        for i in minimal:
            if ops[i].invoke > earliest_response:
                break
            nxt = model.step(state, ops[i])
            if nxt is not None:
                found.append((i, nxt))
        return found

    # Depth-first, with an explicit stack (a history may hold thousands of operations, more
    # than Python's recursion limit): each frame is (done, its untried moves); ``order``
    # holds the op that led to each frame but the first.
    ok = n == 0
    order: list[int] = []
    first = moves(0, model.initial()) if n else None
    stack: list[tuple[int, Iterator[tuple[int, S]]]] = [(0, iter(first or ()))]
    while stack and not ok:
        done, untried = stack[-1]
        move = next(untried, None)
        if move is None:
            stack.pop()
            if order:
                order.pop()
            continue
        i, state = move
        now = done | 1 << i
        if now == full:
            order.append(i)
            ok = True
            break
        later = moves(now, state)
        if later is not None:
            order.append(i)
            stack.append((now, iter(later)))
    witness = tuple(ops[i] for i in order) if ok else None
    return CheckResult(ok, key, ops, witness, len(seen))


# ---------------------------------------------------------------------------- recording


class ThreadRecorder:
    """Records the operations of ONE thread (only that thread may call :meth:`call`)."""

    def __init__(self, thread: int) -> None:
        self.thread = thread
        self.ops: list[Op] = []

    def call(self, name: str, args: tuple[Hashable, ...], fn: Callable[[], T]) -> T | Raised:
        """Run ``fn()`` and record it as ``name(*args)``; an exception is recorded and
        returned as :class:`Raised` (not re-raised)."""
        invoke = time.perf_counter_ns()
        result: T | Raised
        try:
            result = fn()
        except Exception as exc:
            result = Raised(type(exc).__name__)
        response = time.perf_counter_ns()
        self.ops.append(Op(self.thread, invoke, response, name, args, _hashable(result)))
        return result


def _hashable(value: object) -> Hashable:
    if isinstance(value, (set, list)):
        return frozenset(value)
    if isinstance(value, Hashable):
        return value
    raise TypeError(f"unhashable result {value!r}")


def merge(recorders: Iterable[ThreadRecorder]) -> list[Op]:
    """All recorded operations of ``recorders`` as one history."""
    return [op for rec in recorders for op in rec.ops]


# ---------------------------------------------------------------------------- staging model


class RoomState(NamedTuple):
    """Sequential state of one room: open generation (``None`` = closed), prefetched flag,
    ``(chunk_idx, session_id)`` keys, and the highest generation seen (generations only grow).
    """

    generation: int | None
    prefetched: bool
    keys: frozenset[tuple[int, str]]
    last_generation: int


CLOSED = RoomState(None, False, frozenset(), 0)

STAGING_OPS = (
    "open", "purge", "request", "requests", "cancel", "mark", "purge_session",
    "is_open", "is_prefetched", "is_requested", "room_requests", "handle",
)  # fmt: skip
"""Operation names of staging histories; ``args`` mirror the ``StagingContext`` method's."""


def room_of(op: Op) -> int | None:
    """The room an operation touches; ``None`` for ``purge_session`` (every room)."""
    if op.name == "purge_session":
        return None
    ref = op.args[0]
    if isinstance(ref, RoomHandle):
        return ref.room
    if isinstance(ref, int):
        return ref
    raise ValueError(f"operation without a room: {op}")


class StagingRoomModel:
    """Sequential specification of ``StagingContext`` restricted to one room."""

    def __init__(self, room: int) -> None:
        self.room = room

    def initial(self) -> RoomState:
        """A closed room that was never opened."""
        return CLOSED

    @staticmethod
    def _live(state: RoomState, ref: Hashable) -> bool:
        if state.generation is None:
            return False
        return not isinstance(ref, RoomHandle) or ref.generation == state.generation

    def step(self, state: RoomState, op: Op) -> RoomState | None:
        """Apply ``op``; ``None`` if its recorded result is impossible in ``state``."""
        name, args, result = op.name, op.args, op.result
        if name == "open":
            if state.generation is not None:
                return state if result == Raised("RoomAlreadyOpenError") else None
            if (
                isinstance(result, RoomHandle)
                and result.room == self.room
                and result.generation > state.last_generation
            ):
                return RoomState(result.generation, False, frozenset(), result.generation)
            return None
        if name == "purge_session":
            return self._purge_session(state, args, result)
        live = self._live(state, args[0])
        if name == "purge":
            if not live:
                expect = RoomPurge(self.room, False, False, frozenset())
                return state if result == expect else None
            expect = RoomPurge(self.room, True, state.prefetched, state.keys, state.generation)
            if result != expect:
                return None
            return RoomState(None, False, frozenset(), state.last_generation)
        if name in ("request", "cancel", "is_requested"):
            return self._keyed(state, live, name, args, result)
        if name == "requests":
            chunks, session = args[1], args[2]
            if not isinstance(chunks, tuple) or not isinstance(session, str):
                raise ValueError(f"bad args {op}")
            added = (
                frozenset(c for c in chunks if (c, session) not in state.keys)
                if live
                else frozenset()
            )
            if result != added:
                return None
            return state._replace(keys=state.keys | {(c, session) for c in added})
        if name == "mark":
            newly = live and not state.prefetched
            if result != newly:
                return None
            return state._replace(prefetched=True) if newly else state
        if name == "is_open":
            return state if result == live else None
        if name == "is_prefetched":
            return state if result == (live and state.prefetched) else None
        if name == "room_requests":
            return state if result == (state.keys if live else frozenset()) else None
        if name == "handle":
            gen = state.generation
            return (
                state if result == (None if gen is None else RoomHandle(self.room, gen)) else None
            )
        raise ValueError(f"unknown staging operation {op}")

    @staticmethod
    def _keyed(
        state: RoomState, live: bool, name: str, args: tuple[Hashable, ...], result: Hashable
    ) -> RoomState | None:
        chunk, session = args[1], args[2]
        if not isinstance(chunk, int) or not isinstance(session, str):
            raise ValueError(f"bad args {name}{args}")
        key = (chunk, session)
        present = live and key in state.keys
        if name == "is_requested":
            return state if result == present else None
        if name == "request":
            newly = live and not present
            if result != newly:
                return None
            return state._replace(keys=state.keys | {key}) if newly else state
        # cancel
        if result != present:
            return None
        return state._replace(keys=state.keys - {key}) if present else state

    def _purge_session(
        self, state: RoomState, args: tuple[Hashable, ...], result: Hashable
    ) -> RoomState | None:
        session = args[0]
        if not isinstance(result, frozenset):
            return None
        doomed = frozenset(k for k in state.keys if k[1] == session)
        if (self.room in result) != bool(doomed):
            return None
        return state._replace(keys=state.keys - doomed) if doomed else state


def check_staging(
    history: Sequence[Op], *, max_states: int = 1_000_000
) -> list[CheckResult[RoomState]]:
    """Check a ``StagingContext`` history room by room; one result per room, by room id."""
    rooms = sorted({r for op in history if (r := room_of(op)) is not None})
    return [
        check(
            [op for op in history if room_of(op) in (room, None)],
            StagingRoomModel(room),
            key=room,
            max_states=max_states,
        )
        for room in rooms
    ]


def first_violation(history: Sequence[Op]) -> CheckResult[RoomState] | None:
    """The first room whose projection is not linearizable, or ``None`` if all are."""
    for result in check_staging(history):
        if not result.ok:
            return result
    return None


# ---------------------------------------------------------------------------- whole-session views

SESSION_VIEW_OPS = ("requests", "purge_session", "view")
"""Operation names of a session-view history: ``requests(ref, chunks, session)`` (one room's
batch; its rooms stay open throughout), ``purge_session(session)``, and ``view(source)``,
whose result is every key ``(room, chunk, session)`` one locked read returned (all sessions:
:func:`check_session_views` projects it)."""


class SessionKeysModel:
    """Sequential specification of the set of keys ``(room, chunk, session)`` that ONE
    session has across every room, under ``requests``, ``purge_session`` and ``view``.

    The rooms a history's ``requests`` name must stay open for the whole history (no
    ``purge_room`` in it): then this set is all that these operations read or write of the
    session, and every locked multi-key read must return it exactly, as of one instant.
    """

    def __init__(self, session: str) -> None:
        self.session = session

    def initial(self) -> frozenset[PrefetchKey]:
        """No key of the session anywhere."""
        return frozenset()

    def step(self, state: frozenset[PrefetchKey], op: Op) -> frozenset[PrefetchKey] | None:
        """Apply ``op``; ``None`` if its recorded result is impossible in ``state``."""
        session, result = self.session, op.result
        if op.name == "view":
            return state if result == state else None
        if op.name == "purge_session":
            rooms = frozenset(room for room, _, _ in state)
            return frozenset() if result == rooms else None
        if op.name == "requests":
            room = room_of(op)
            chunks = op.args[1]
            if room is None or not isinstance(chunks, tuple):
                raise ValueError(f"bad args {op}")
            added = frozenset(c for c in chunks if (room, c, session) not in state)
            if result != added:
                return None
            return state | {(room, c, session) for c in added}
        raise ValueError(f"not a session-view operation: {op}")


def session_of(op: Op) -> str | None:
    """The session a session-view operation writes; ``None`` for a ``view`` (all of them)."""
    if op.name == "view":
        return None
    session = op.args[-1] if op.name == "requests" else op.args[0]
    if not isinstance(session, str):
        raise ValueError(f"operation without a session: {op}")
    return session


def check_session_views(
    history: Sequence[Op], session: str, *, max_states: int = 1_000_000
) -> CheckResult[frozenset[PrefetchKey]]:
    """Is the history of ``session``'s writes, with every ``view`` projected onto that
    session's keys, linearizable (:class:`SessionKeysModel`)?

    Every op whose session is another one is left out. When the session's writes do not
    overlap in time (one writer, as in the tests), the answer comes from
    :func:`check_one_writer` (exact for that shape, and linear-time: histories hold
    thousands of views); otherwise from the general search.

    Raises:
        SearchBudgetExceeded: as :func:`check` (general search only).
    """
    writes: list[Op] = []
    views: list[Op] = []
    for op in history:
        if op.name == "view":
            keys = op.result
            if not isinstance(keys, frozenset):
                raise ValueError(f"a view must return a frozenset: {op}")
            mine = frozenset(k for k in keys if k[2] == session)
            views.append(Op(op.thread, op.invoke, op.response, op.name, op.args, mine))
        elif session_of(op) == session:
            writes.append(op)
    model = SessionKeysModel(session)
    writes.sort(key=lambda o: o.invoke)
    if all(a.response < b.invoke for a, b in itertools.pairwise(writes)):
        return check_one_writer(writes, views, model, key=session)
    return check([*writes, *views], model, key=session, max_states=max_states)


def check_one_writer(
    writes: Sequence[Op], reads: Sequence[Op], model: Model[S], *, key: Hashable = None
) -> CheckResult[S]:
    """:func:`check` for histories of one shape: ``writes`` that do not overlap in time
    (one thread's, in order) and ``reads`` that never change the model's state.

    The writes' order is then fixed, so their states ``S_0..S_n`` are too (``S_j`` after the
    first ``j``), and a read can take effect at ``S_j`` only for ``j`` from the number of
    writes that returned before it was invoked to the number not invoked after it returned
    (``a`` precedes ``b`` iff ``a.response < b.invoke``, as in :func:`check`). A
    read that precedes another must take effect at the same or an earlier ``j``. Reads taken
    by their responses, each at the earliest ``j`` that its result and the reads before it
    allow, satisfy every constraint if any assignment does (each constraint is a lower
    bound). O((n + reads) log n), plus each read's scan over the states it may take effect at.
    """
    ops = tuple(sorted([*writes, *reads], key=lambda o: (o.invoke, o.response)))
    ordered = sorted(writes, key=lambda o: o.invoke)
    states = [model.initial()]
    for w in ordered:
        nxt = model.step(states[-1], w)
        if nxt is None:
            return CheckResult(False, key, ops, None, len(states))
        states.append(nxt)
    invokes = [w.invoke for w in ordered]
    responses = [w.response for w in ordered]
    placed: list[tuple[int, Op]] = []  # (j, read), by the reads' responses
    done_at: list[int] = []  # the responses of the reads placed so far
    highest: list[int] = []  # highest[k] = max j of the first k + 1 reads placed
    for read in sorted(reads, key=lambda o: o.response):
        low = bisect.bisect_left(responses, read.invoke)  # writes that returned before it
        high = bisect.bisect_right(invokes, read.response)  # writes not invoked after it
        before = bisect.bisect_left(done_at, read.invoke)  # reads that returned before it
        if before:
            low = max(low, highest[before - 1])
        j = next((j for j in range(low, high + 1) if model.step(states[j], read) is not None), None)
        if j is None:
            return CheckResult(False, key, ops, None, len(states) + len(placed))
        placed.append((j, read))
        done_at.append(read.response)
        highest.append(max(j, highest[-1]) if highest else j)
    by_state: list[list[Op]] = [[] for _ in states]
    for j, read in placed:
        by_state[j].append(read)
    witness: list[Op] = [*by_state[0]]
    for j, w in enumerate(ordered, start=1):
        witness.append(w)
        witness.extend(by_state[j])
    return CheckResult(True, key, ops, tuple(witness), len(states) + len(placed))
