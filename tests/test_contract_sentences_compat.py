"""Compat-view sentences of docs/THREADING.md that an outside set of planted bugs got past
(issue 33, item 0), each checked against the SENTENCE, each with a planted violation in
``make mutants`` (``tools/mutants_contract.py``) put elsewhere than the line the check was
first expected to watch:

f. A tombstone refusal is logged *after* the lock is released ("While holding a lock: no user
   callbacks, no logging"): a logging handler that reads the context -- on its own thread
   and on another -- never deadlocks or waits for the writer's lock, on every write path that
   can be refused (``add``, ``test_and_add``, ``update``, ``|=``, ``^=``, both views, both
   lock kinds).
g. ``intersection_update`` / ``&=`` decide on the view's state *inside* the lock: the result is
   the operator's at one instant among another thread's writes, also when, during the
   operator, an element outside ``other`` is added while another is discarded and re-added
   (what a discard list computed from a snapshot taken before the lock gets wrong).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from staging.compat import CompatStagingContext
from staging.locks import LOCK_KINDS
from tests.interleave import explore

pytestmark = pytest.mark.timeout(120)

JOIN_S = 10.0
"""A handful of O(1) operations: not done in 10 s is a deadlock on any machine."""
READ_S = 5.0
"""How long the handler's reader on another thread may take: the lock is free when a refusal
is logged, so any wait at all is the writer still holding it."""


# ------------------------------------------------------------------ f: no logging under the lock


class ReadingHandler(logging.Handler):
    """A handler that reads the context for each record: on the logging thread (a second
    acquisition by the writer's thread if it still holds the lock: a deadlock with a
    non-reentrant lock) and on another thread, joined with a bound (the lock still held by
    the writer, whatever its kind)."""

    def __init__(self, ctx: CompatStagingContext) -> None:
        super().__init__(logging.WARNING)
        # No handler lock: a writer deadlocked inside emit() would hold it, and
        # logging.shutdown() at interpreter exit would then wait for it forever.
        self.lock = None
        self.ctx = ctx
        self.records = 0
        self.blocked: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records += 1
        len(self.ctx.prefetch_requested)
        self.ctx.stats()
        done = threading.Event()

        def other() -> None:
            self.ctx.snapshot()
            done.set()

        reader = threading.Thread(target=other, daemon=True, name="handler-reader")
        reader.start()
        if not done.wait(READ_S):
            self.blocked.append(record.getMessage()[:60])
        reader.join(JOIN_S)


@pytest.fixture
def compat_log() -> Iterator[Callable[[CompatStagingContext], ReadingHandler]]:
    logger = logging.getLogger("staging.compat")
    made: list[ReadingHandler] = []
    old_level = logger.level

    def attach(ctx: CompatStagingContext) -> ReadingHandler:
        handler = ReadingHandler(ctx)
        logger.addHandler(handler)
        made.append(handler)
        return handler

    logger.setLevel(logging.WARNING)
    try:
        yield attach
    finally:
        for handler in made:
            logger.removeHandler(handler)
        logger.setLevel(old_level)


REFUSED_WRITES: dict[str, Callable[[CompatStagingContext, int], Any]] = {
    "keys.add": lambda c, r: c.prefetch_requested.add((r, 0, "s")),
    "keys.test_and_add": lambda c, r: c.prefetch_requested.test_and_add((r, 0, "s")),
    "keys.update": lambda c, r: c.prefetch_requested.update([(r, 0, "s"), (r, 1, "s")]),
    "keys.|=": lambda c, r: c.prefetch_requested.__ior__({(r, 0, "s")}),
    "keys.^=": lambda c, r: c.prefetch_requested.__ixor__({(r, 0, "s")}),
    "rooms.add": lambda c, r: c.prefetched_rooms.add(r),
    "rooms.test_and_add": lambda c, r: c.prefetched_rooms.test_and_add(r),
    "rooms.update": lambda c, r: c.prefetched_rooms.update([r]),
    "rooms.|=": lambda c, r: c.prefetched_rooms.__ior__({r}),
    "rooms.symmetric_difference_update": (
        lambda c, r: c.prefetched_rooms.symmetric_difference_update([r])
    ),
}


@pytest.mark.parametrize("lock", LOCK_KINDS)
@pytest.mark.parametrize("path", sorted(REFUSED_WRITES))
def test_f_a_tombstone_refusal_is_logged_after_the_lock_is_released(
    lock: str, path: str, compat_log: Callable[[CompatStagingContext], ReadingHandler]
) -> None:
    """THREADING.md, the compat views: "the first refusal of each tombstoned id is logged ...
    on the writer's thread after the lock is released"; the lock model: "While holding a
    lock: no user callbacks, no logging". A handler is user code: here it reads the context
    on the logging thread and on another one. The refused write runs on a thread joined with
    a bound (a deadlock fails the test instead of hanging it)."""
    ctx = CompatStagingContext(lock=lock)
    ctx.prefetch_requested.add((9, 0, "s"))
    ctx.prefetched_rooms.add(9)
    ctx.purge_room(9)  # room 9 is tombstoned now
    handler = compat_log(ctx)
    errors: list[BaseException] = []

    def write() -> None:
        try:
            REFUSED_WRITES[path](ctx, 9)
        except BaseException as exc:
            errors.append(exc)

    writer = threading.Thread(target=write, daemon=True, name=f"refused-{path}")
    writer.start()
    writer.join(JOIN_S)
    assert not writer.is_alive(), (
        f"{path} deadlocked: its refusal was logged while it held the context's lock"
    )
    assert not errors, errors
    assert handler.records == 1, f"{path}: {handler.records} refusals logged (expected 1)"
    assert not handler.blocked, (
        f"{path}: a reader on another thread waited for the lock while the refusal was "
        f"logged: {handler.blocked}"
    )
    assert ctx.stats().refused_late_writes >= 1
    assert 9 not in ctx.prefetched_rooms and (9, 0, "s") not in ctx.prefetch_requested


# ------------------------------------------------------------------ g: &= decided in the lock

A, C, D, E = (1, 0, "a"), (3, 0, "a"), (4, 0, "a"), (5, 0, "a")
Op = tuple[str, Any]


def _model(initial: tuple[Any, ...], ops: tuple[Op, ...], keep: frozenset[Any],
           at: int) -> set[Any]:  # fmt: skip
    """The view after ``ops`` with ``&= keep`` placed before ``ops[at]``."""
    model = set(initial)
    for name, arg in [*ops[:at], ("&=", None), *ops[at:]]:
        if name == "&=":
            model.intersection_update(keep)
        elif name == "add":
            model.add(arg)
        else:
            model.discard(arg)
    return model


class IntersectVsChurn:
    """The view holds ``initial``; thread 1 applies ``&= other`` (or ``intersection_update``);
    thread 2 writes ``ops``: an element outside ``other`` is added, and another (outside
    ``other`` as well) discarded and re-added. At one instant the operator drops whatever is
    outside ``other`` *then*: never an element re-added after it, never keeping one added
    before it."""

    lock = "mutex"
    method = "&="
    initial: tuple[Any, ...] = (A, C)
    other: frozenset[Any] = frozenset({A})
    ops: tuple[Op, ...] = (("add", D), ("discard", C), ("add", C))

    def __init__(self) -> None:
        self.ctx = CompatStagingContext(lock=self.lock, debug=False)
        self.view = self.ctx.prefetch_requested
        self.view.update(self.initial)

    def intersect(self) -> None:
        if self.method == "&=":
            self.view &= set(self.other)  # type: ignore[misc]  # (the view returns itself)
        else:
            self.view.intersection_update(list(self.other), {*self.other, E})

    def churn(self) -> None:
        for name, arg in self.ops:
            getattr(self.view, name)(arg)

    def check(self) -> str | None:
        final = set(self.view)
        allowed = [
            _model(self.initial, self.ops, self.other, at) for at in range(len(self.ops) + 1)
        ]
        if final not in allowed:
            return (
                f"{self.method} {set(self.other)} against {list(self.ops)} from "
                f"{set(self.initial)} left {final}; at one instant it leaves one of {allowed}"
            )
        return None


G_CASES: list[tuple[str, str, tuple[Op, ...]]] = [
    ("&=", "mutex", (("add", D), ("discard", C), ("add", C))),
    ("&=", "rw", (("add", D), ("discard", C), ("add", C))),
    ("intersection_update", "mutex", (("discard", C), ("add", D), ("add", C))),
]


@pytest.mark.parametrize(("method", "lock", "ops"), G_CASES)
def test_g_intersection_is_decided_on_the_state_inside_the_lock(
    method: str, lock: str, ops: tuple[Op, ...]
) -> None:
    """THREADING.md, the compat views' table (``intersection_update``, ``view &= other``:
    "decided against the set as it is inside that section"). The operator stopped at every
    line and return of the library's code it passes while thread 2 adds an element outside
    ``other`` and discards and re-adds another; the final set must be the operator's at one
    instant among those writes (``tests/interleave.py``: deterministic)."""
    rig: Any = type("Rig", (IntersectVsChurn,), {"lock": lock, "method": method, "ops": ops})
    result = explore(rig, rig.intersect, rig.churn, rig.check, block_s=0.05)
    print(f"{method} vs {ops} [{lock}]: {result.schedules} schedules, {result.blocked} blocked")
    assert result.schedules > 1, "the explorer ran no preempted schedule"
    assert not result.failures, result.failures[:3]
