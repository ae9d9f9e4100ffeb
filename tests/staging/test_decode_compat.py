"""``staging.decode_compat``: the decode side's two dicts under one lock.

The contract (module docstring of :mod:`staging.decode_compat`):

* each dict operation of a view is one critical section, iteration works on a snapshot;
* ``purge_room`` removes a room from both dicts at one instant, ``room_entry`` reads both
  at one instant, ``register_room`` sets both at one instant: a reader sees a room's pair
  whole or not at all (checked in every single-preemption schedule, ``tests/interleave.py``;
  the planted split purge of ``tools/mutants_decode.py`` is killed here);
* rebinding a view is refused; bad keys are refused before the lock is taken.
"""

from __future__ import annotations

import gc
import random
import threading
from collections.abc import Callable
from typing import Any

import pytest

from staging.decode_compat import DecodeCompatContext, LockedDictView
from tests.interleave import explore

JOIN_S = 30.0


@pytest.fixture
def ctx() -> DecodeCompatContext:
    return DecodeCompatContext()


# ---------------------------------------------------------------------- as a dict


def test_views_behave_as_dicts(ctx: DecodeCompatContext) -> None:
    b, r = ctx.room_bootstrap, ctx.room_receivers
    b[7] = ["peer"]
    r[7] = "receiver"
    assert b[7] == ["peer"] and r.get(7) == "receiver" and 7 in b and 8 not in r
    assert r.get(8) is None and r.get(8, "x") == "x"
    assert len(b) == 1 and list(b) == [7] and b.keys() == [7] and b.items() == [(7, ["peer"])]
    assert r.setdefault(7, "other") == "receiver" and r.setdefault(9, "nine") == "nine"
    assert r.pop(9) == "nine" and r.pop(9, None) is None
    with pytest.raises(KeyError):
        r.pop(9)
    with pytest.raises(KeyError):
        _ = b[8]
    with pytest.raises(KeyError):
        del b[8]
    b.update({1: "a"}, c=3)
    assert b == {7: ["peer"], 1: "a", "c": 3} and b.copy() == b.snapshot()
    assert b.popitem() == ("c", 3)
    del b[1]
    b.clear()
    assert len(b) == 0 and b == {}
    with pytest.raises(KeyError):
        b.popitem()
    assert isinstance(b, LockedDictView) and "locked view" in repr(b)


def test_unhashable_key_refused_before_the_lock(ctx: DecodeCompatContext) -> None:
    for call in (
        lambda: ctx.room_bootstrap.get([1]),
        lambda: ctx.room_bootstrap.__setitem__([1], 1),
        lambda: ctx.room_receivers.pop([1], None),
        lambda: ctx.purge_room([1]),
        lambda: ctx.register_room({}, 1, 2),
        lambda: ctx.room_entry([1]),
    ):
        with pytest.raises(TypeError):
            call()
        assert not ctx.lock.locked()


def test_rebinding_and_deleting_refused(ctx: DecodeCompatContext) -> None:
    with pytest.raises(TypeError, match="purge_room"):
        ctx.room_bootstrap = {}  # type: ignore[assignment]
    with pytest.raises(TypeError, match="purge_room"):
        ctx.room_receivers = {}  # type: ignore[assignment]
    with pytest.raises(TypeError):
        del ctx.room_receivers
    ctx.room_bootstrap = ctx.room_bootstrap  # the same view stored back: allowed
    ctx.allocator = "anything"  # type: ignore[attr-defined]  # other attributes are plain


def test_pairs_register_read_purge(ctx: DecodeCompatContext) -> None:
    ctx.register_room(3, ["b"], "r")
    assert ctx.room_entry(3) == (["b"], "r") and ctx.rooms() == ({3}, {3})
    assert ctx.purge_room(3) == (["b"], "r")
    assert ctx.purge_room(3) == (None, None)  # idempotent
    assert ctx.room_entry(3) == (None, None) and ctx.rooms() == (frozenset(), frozenset())
    assert "bootstrap=0" in repr(ctx)


def test_replaced_value_released_after_the_lock(ctx: DecodeCompatContext) -> None:
    """A finaliser of a value a write drops may touch the context: it runs after the lock
    is released (else it would deadlock on the non-reentrant lock)."""
    seen: list[bool] = []

    class Value:
        def __del__(self) -> None:
            seen.append(ctx.lock.locked())

    for drop in (
        lambda: ctx.room_receivers.__setitem__(1, "new"),
        lambda: ctx.room_receivers.__delitem__(1),
        lambda: ctx.room_receivers.clear(),
        lambda: ctx.register_room(1, None, "new"),
        lambda: ctx.purge_room(1),
    ):
        ctx.room_receivers[1] = Value()
        drop()
        gc.collect()
    assert seen == [False] * 5


# ---------------------------------------------------------------------- one instant


def _setup() -> DecodeCompatContext:
    ctx = DecodeCompatContext()
    ctx.register_room(5, ["bootstrap"], "receiver")
    return ctx


def _whole(entry: tuple[Any, Any]) -> bool:
    return entry in ((["bootstrap"], "receiver"), (None, None))


@pytest.mark.slow
def test_purge_vs_reader_sees_both_or_neither() -> None:
    """The purge stopped at each of its scheduling points while a reader reads the room's
    pair: the reader sees both entries or neither, in every schedule (and the purge took
    both)."""
    seen: list[tuple[Any, Any]] = []
    taken: list[tuple[Any, Any]] = []

    def purge(c: DecodeCompatContext) -> None:
        taken.append(c.purge_room(5))

    def reader(c: DecodeCompatContext) -> None:
        seen.append(c.room_entry(5))

    def check(c: DecodeCompatContext) -> str | None:
        entry, purged = seen[-1], taken[-1]
        if not _whole(entry):
            return f"reader saw half a room: {entry}"
        if purged != (["bootstrap"], "receiver") or c.rooms() != (frozenset(), frozenset()):
            return f"purge took {purged}, left {c.rooms()}"
        return None

    result = explore(_setup, purge, reader, check)
    print(f"purge-vs-reader: {result.schedules} schedules, {result.blocked} blocked")
    assert result.schedules >= 2 and not result.failures, result.failures[:3]


@pytest.mark.slow
def test_reader_vs_purge_sees_both_or_neither() -> None:
    """The reader stopped at each of its points while the purge runs: both or neither."""
    seen: list[tuple[Any, Any]] = []

    def reader(c: DecodeCompatContext) -> None:
        seen.append(c.room_entry(5))

    def purge(c: DecodeCompatContext) -> None:
        c.purge_room(5)

    def check(c: DecodeCompatContext) -> str | None:
        return None if _whole(seen[-1]) else f"reader saw half a room: {seen[-1]}"

    result = explore(_setup, reader, purge, check)
    assert result.schedules >= 2 and not result.failures, result.failures[:3]


@pytest.mark.slow
def test_register_vs_reader_sees_both_or_neither() -> None:
    seen: list[tuple[Any, Any]] = []

    def register(c: DecodeCompatContext) -> None:
        c.register_room(6, ["bootstrap"], "receiver")

    def reader(c: DecodeCompatContext) -> None:
        seen.append(c.room_entry(6))

    def check(c: DecodeCompatContext) -> str | None:
        return None if _whole(seen[-1]) else f"reader saw half a room: {seen[-1]}"

    result = explore(DecodeCompatContext, register, reader, check)
    assert result.schedules >= 2 and not result.failures, result.failures[:3]


# ---------------------------------------------------------------------- real threads


# `fast_switch` (switch interval 1 µs) is the suite's fixture, in tests/conftest.py.


def _race(
    make: Callable[[], Any], seed: int, rooms: int = 300
) -> tuple[list[BaseException], int, Any]:
    """A scheduler thread registering and purging rooms (the released code's single dict
    operations, in its order) while a reader iterates, reads and snapshots the dicts."""
    rng = random.Random(seed)
    ctx = make()
    errors: list[BaseException] = []
    done = threading.Event()
    reads = [0]

    def scheduler() -> None:
        try:
            live: list[int] = []
            for room in range(rooms):
                ctx.room_bootstrap[room] = [room]
                ctx.room_receivers[room] = room
                live.append(room)
                if len(live) > 8 or rng.random() < 0.3:
                    old = live.pop(rng.randrange(len(live)))
                    ctx.room_receivers.pop(old, None)
                    ctx.room_bootstrap.pop(old, None)
            for old in live:
                ctx.room_receivers.pop(old, None)
                ctx.room_bootstrap.pop(old, None)
        except BaseException as exc:  # reported
            errors.append(exc)
        finally:
            done.set()

    def reader() -> None:
        try:
            while not done.is_set():
                for room in list(ctx.room_receivers):
                    value = ctx.room_receivers.get(room)
                    assert value is None or value == room
                for room, infos in ctx.room_bootstrap.items():
                    assert infos == [room]
                reads[0] += 1
        except BaseException as exc:  # reported
            errors.append(exc)

    threads = [threading.Thread(target=f, daemon=True) for f in (scheduler, reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
    return errors, reads[0], ctx


class _BareDicts:
    """The released shape: two plain dicts (the detector's control)."""

    def __init__(self) -> None:
        self.room_bootstrap: dict[int, Any] = {}
        self.room_receivers: dict[int, Any] = {}


@pytest.mark.usefixtures("fast_switch")
def test_iteration_under_writes_never_raises() -> None:
    """At switch interval 1 µs, 20 seeded runs: a reader iterating the views while the
    scheduler writes and pops never sees "dictionary changed size"; every room is gone
    at the end. The same reader on bare dicts must hit the error in some run (the
    detector works)."""
    for seed in range(20):
        errors, _, ctx = _race(DecodeCompatContext, seed)
        assert not errors, f"seed {seed}: {errors[:2]!r}"
        assert ctx.rooms() == (frozenset(), frozenset()), f"seed {seed}"
    bare = 0
    for seed in range(200):  # until it fires (a few runs here)
        errors, _, _ = _race(_BareDicts, seed, rooms=2000)
        bare += any("changed" in str(e) and "during iteration" in str(e) for e in errors)
        if bare:
            break
    print(f"bare dicts: 'changed size' seen after {seed + 1} runs")
    assert bare, "the detector never fired on bare dicts"


# ---------------------------------------------------------------------- the plugin's class


def test_plugin_class_on_a_dataclass_of_the_released_shape() -> None:
    """The plugin's REPLACE of SGLang's ``DecodeStagingContext`` (``staging.sglang.hooks``),
    on a dataclass of the released shape (an ``allocator`` and the two dict fields):
    the dicts become our views, ``allocator`` stays a plain field; a class without the two
    fields is refused (the plugin then registers nothing)."""
    import dataclasses

    from staging.sglang import hooks

    @dataclasses.dataclass
    class DecodeStagingContext:
        allocator: object = None
        room_bootstrap: dict[int, Any] = dataclasses.field(default_factory=dict)
        room_receivers: dict[int, Any] = dataclasses.field(default_factory=dict)

    cls = hooks.decode_staging_class(DecodeStagingContext)
    assert issubclass(cls, DecodeCompatContext) and cls.__qualname__.endswith("Context")
    assert [f.name for f in dataclasses.fields(cls)] == ["allocator"]
    ctx = cls()
    ctx.allocator = "ring"
    ctx.room_bootstrap[1] = ["b"]
    ctx.room_receivers[1] = "r"
    assert ctx.purge_room(1) == (["b"], "r") and ctx.allocator == "ring"
    with pytest.raises(TypeError):
        ctx.room_bootstrap = {}

    @dataclasses.dataclass
    class Other:
        allocator: object = None

    with pytest.raises(ValueError, match="room_bootstrap"):
        hooks.decode_staging_class(Other)
