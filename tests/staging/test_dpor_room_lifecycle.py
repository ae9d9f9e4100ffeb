"""Exhaustive interleaving exploration (DPOR, ``frontrun``) of the staging room lifecycle.

``frontrun.explore`` runs the workers as real threads under its own scheduler, patching
``threading.Lock`` and friends with cooperative versions for the setup, the run and the
invariant of every execution (our locks are built through a late-binding factory, so the
patched class is what they get). It explores one execution per Mazurkiewicz trace of the
shared-memory and lock events it sees (``preemption_bound=None``: no bound, so a pass covers
every distinct interleaving at that granularity). Each test prints the number of
interleavings explored.

Wiring under plain ``pytest``: frontrun refuses to run (it skips) unless it believes it runs
under its CLI (``FRONTRUN_ACTIVE=1``) or locks are patched for the whole session
(``--frontrun-patch-locks``). ``explore()`` patches and unpatches the locks itself, so the
``frontrun_enabled`` fixture (tests/conftest.py) only sets ``FRONTRUN_ACTIVE=1`` for these
tests (with ``monkeypatch``, undone after each), and each test asserts that something was
explored so that a skip or an empty exploration cannot pass silently.

Contexts are built with ``debug=False``: debug mode adds bookkeeping to every acquisition
(the per-thread held-lock list, the try-acquire that counts contention) that the explorer
must interleave too -- measured 323 instead of 3 interleavings (rw) and 226 instead of 5
(mutex) for the first proof -- without testing anything more of the room lifecycle. The
lock-order checks run in the stress suite (``debug=True``) instead.

Every proof is paired with a planted bug the explorer must catch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import frontrun
import pytest

from staging import RoomHandle, RoomPurge, StagingContext
from staging.locks import LOCK_KINDS

pytestmark = pytest.mark.timeout(120)

EXPLORE: dict[str, Any] = {
    "preemption_bound": None,  # full DPOR: every distinct interleaving
    "stop_on_first": True,
    "detect_io": False,  # no sockets or files here
    "reproduce_on_failure": 3,
    "deadlock_timeout": 10.0,
    "timeout_per_run": 10.0,
}



def explore(
    setup: Callable[[], Any],
    workers: list[Callable[[Any], None]],
    invariant: Callable[[Any], bool],
    label: str,
) -> Any:
    result = frontrun.explore(setup=setup, workers=workers, invariant=invariant, **EXPLORE)
    print(f"{label}: {result.num_explored} interleavings explored, holds={result.property_holds}")
    assert result.num_explored > 0, "frontrun explored nothing (skipped or misconfigured)"
    return result


def assert_holds(result: Any) -> None:
    assert result.property_holds is True, result.explanation


def no_leak(ctx: StagingContext) -> bool:
    """Purge every room; then nothing may be left anywhere."""
    for room in ctx.open_rooms:
        ctx.purge_room(room)
    st = ctx.stats()
    snap = ctx.snapshot()
    return (st.open_rooms, st.prefetched_rooms, st.requested_keys) == (0, 0, 0) and not (
        snap.open_rooms or snap.prefetched_rooms or snap.prefetch_requested
    )


# ------------------------------------------------------------------ 1: purge vs late writer


class PurgeVsLateWriter:
    """Room 1 is open with one key; a purger races a late writer holding the handle."""

    lock = "mutex"

    def __init__(self) -> None:
        self.ctx = StagingContext(lock=self.lock, debug=False)
        self.handle = self.ctx.open_room(1)
        self.ctx.request_prefetch(self.handle, 0, "a")
        self.purge: RoomPurge | None = None
        self.late_added: frozenset[int] = frozenset()
        self.late_marked: bool | None = None
        self.reads: tuple[bool, bool] | None = None

    # workers
    def purger(self) -> None:
        self.purge = self.ctx.purge_room(self.handle)

    def late_writer(self) -> None:
        self.late_added = self.ctx.request_prefetches(self.handle, (1, 2), "late")
        self.late_marked = self.ctx.mark_prefetched(self.handle)

    def late_single_writer(self) -> None:
        self.late_added = frozenset(
            {1} if self.ctx.request_prefetch(self.handle, 1, "late") else ()
        )

    def reader(self) -> None:
        """Two point reads through the (soon stale) handle."""
        self.reads = (
            self.ctx.is_requested(self.handle, 0, "a"),
            self.ctx.is_requested(self.handle, 1, "late"),
        )

    def reader_invariant(self) -> bool:
        """What the reader saw is consistent: the late key is seen only if it was accepted,
        and once the reader saw the room purged (key 0 gone) nothing of it comes back."""
        if self.reads is None:
            return False
        saw_key0, saw_late = self.reads
        if saw_late and not self.late_added:
            return False
        if not saw_key0 and saw_late:
            return False
        return self.invariant()

    def invariant(self) -> bool:
        """After the purge the room is closed, nothing of it is recorded anywhere, and the
        purge returned exactly what was accepted before it (and nothing after)."""
        ctx, purge = self.ctx, self.purge
        if purge is None or not purge.was_open or purge.generation != self.handle.generation:
            return False
        expected = {(0, "a")} | {(c, "late") for c in self.late_added}
        return (
            purge.requests == expected
            and purge.was_prefetched == bool(self.late_marked)
            and not ctx.is_open(self.handle)
            and not ctx.is_prefetched(1)
            and ctx.room_requests(1) == frozenset()
            and no_leak(ctx)
        )


@pytest.mark.usefixtures("frontrun_enabled")
@pytest.mark.parametrize("lock", LOCK_KINDS)
def test_purge_vs_late_request_and_mark(lock: str) -> None:
    state = type("State", (PurgeVsLateWriter,), {"lock": lock})
    result = explore(
        state,
        [state.purger, state.late_writer],
        state.invariant,
        f"purge vs late request_prefetches+mark [{lock}]",
    )
    assert_holds(result)


@pytest.mark.usefixtures("frontrun_enabled")
@pytest.mark.parametrize("lock", LOCK_KINDS)
def test_purge_vs_late_writer_vs_reader_three_threads(lock: str) -> None:
    state = type("State", (PurgeVsLateWriter,), {"lock": lock})
    result = explore(
        state,
        [state.purger, state.late_single_writer, state.reader],
        state.reader_invariant,
        f"purge vs late request_prefetch vs stale reader [{lock}, 3 threads]",
    )
    assert_holds(result)


# ------------------------------------------------------------------ 2: purge+reopen


class ReopenVsStaleWriter:
    """A purger closes generation 1 and reopens the room; a writer keeps the old handle."""

    lock = "mutex"

    def __init__(self) -> None:
        self.ctx = StagingContext(lock=self.lock, debug=False)
        self.stale = self.ctx.open_room(1)
        self.purge: RoomPurge | None = None
        self.fresh: RoomHandle | None = None
        self.accepted: bool | None = None

    def purge_and_reopen(self) -> None:
        self.purge = self.ctx.purge_room(self.stale)
        self.fresh = self.ctx.open_room(1)

    def stale_writer(self) -> None:
        self.accepted = self.ctx.request_prefetch(self.stale, 7, "late")

    def invariant(self) -> bool:
        """The new generation never holds the stale writer's key; the old one kept it only
        if the write was accepted (i.e. happened before the purge)."""
        ctx, purge, fresh = self.ctx, self.purge, self.fresh
        if purge is None or fresh is None or fresh.generation == self.stale.generation:
            return False
        late = frozenset({(7, "late")}) if self.accepted else frozenset()
        return (
            purge.requests == late
            and ctx.room_requests(fresh) == frozenset()
            and not ctx.is_requested(1, 7, "late")
            and ctx.stats().requested_keys == 0
            and ctx.open_rooms == {1}
            and no_leak(ctx)
        )


@pytest.mark.usefixtures("frontrun_enabled")
@pytest.mark.parametrize("lock", LOCK_KINDS)
def test_purge_reopen_vs_stale_writer(lock: str) -> None:
    state = type("State", (ReopenVsStaleWriter,), {"lock": lock})
    result = explore(
        state,
        [state.purge_and_reopen, state.stale_writer],
        state.invariant,
        f"purge+reopen vs stale writer [{lock}]",
    )
    assert_holds(result)


# ------------------------------------------------------------------ planted bugs


class UpstreamPattern:
    """PLANTED BUG: the unlocked upstream pattern -- two bare sets, purge by rebuild.

    The late writer checks that the room is still live (``in prefetched_rooms``) and then
    adds; the purge discards the room and rebuilds ``prefetch_requested`` with a set
    comprehension. Either order alone is fine; interleaved, the writer's add lands after the
    rebuild (the room is resurrected) or into the discarded old set.
    """

    def __init__(self) -> None:
        self.prefetched_rooms: set[int] = {1, 2}
        self.prefetch_requested: set[tuple[int, int, str]] = {(1, 0, "a"), (2, 0, "a")}

    def purge(self) -> None:
        self.prefetched_rooms.discard(1)
        self.prefetch_requested = {k for k in self.prefetch_requested if k[0] != 1}

    def late_writer(self) -> None:
        if 1 in self.prefetched_rooms:
            self.prefetch_requested.add((1, 5, "late"))

    def invariant(self) -> bool:
        """After the purge nothing of room 1 is left; room 2 is untouched."""
        return (
            1 not in self.prefetched_rooms
            and all(k[0] != 1 for k in self.prefetch_requested)
            and (2, 0, "a") in self.prefetch_requested
        )


@pytest.mark.usefixtures("frontrun_enabled")
def test_planted_upstream_purge_resurrects() -> None:
    """The explorer must find the interleaving where the late writer resurrects room 1."""
    # Each order alone is correct, so the bug is only in an interleaving.
    for order in (
        (UpstreamPattern.purge, UpstreamPattern.late_writer),
        (UpstreamPattern.late_writer, UpstreamPattern.purge),
    ):
        state = UpstreamPattern()
        for step in order:
            step(state)
        assert state.invariant()
    result = explore(
        UpstreamPattern,
        [UpstreamPattern.purge, UpstreamPattern.late_writer],
        UpstreamPattern.invariant,
        "planted upstream purge vs late writer",
    )
    assert result.property_holds is False, "DPOR missed the planted resurrection"
    print(result.explanation)


class _NoLock:
    """Stand-in for the context's lock that excludes nothing (for the planted bug below)."""

    kind = "none"

    def read(self) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    def write(self) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    def write_untimed(self) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    def acquire_write(self) -> None:
        return None

    def acquire_write_untimed(self) -> None:
        return None

    def release_write(self) -> None:
        return None

    def stats(self) -> None:
        return None


def _unlocked(base: type) -> type:
    """PLANTED BUG: the real StagingContext with its lock replaced by one that excludes
    nothing (reaches into the private ``_lock``; fails loudly if that is renamed)."""

    def __init__(self: Any) -> None:
        base.__init__(self)
        assert hasattr(self.ctx, "_lock"), "StagingContext no longer has _lock: update this test"
        self.ctx._lock = _NoLock()

    return type(f"Unlocked{base.__name__}", (base,), {"__init__": __init__})


@pytest.mark.usefixtures("frontrun_enabled")
@pytest.mark.parametrize(
    ("base", "workers"),
    [
        (PurgeVsLateWriter, ("purger", "late_writer")),
        (ReopenVsStaleWriter, ("purge_and_reopen", "stale_writer")),
    ],
    ids=["purge-vs-late-writer", "reopen-vs-stale-writer"],
)
def test_planted_unlocked_context_is_caught(base: type, workers: tuple[str, str]) -> None:
    """The same proofs, run on a StagingContext without mutual exclusion, must fail."""
    state = _unlocked(base)
    result = explore(
        state,
        [getattr(state, name) for name in workers],
        state.invariant,
        f"planted unlocked context: {base.__name__}",
    )
    assert result.property_holds is False, "DPOR missed the race of the unlocked context"
