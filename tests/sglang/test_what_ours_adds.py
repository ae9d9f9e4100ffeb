"""What the compat context adds over the release's own code, shown on that code.

* **Purge cost.** The staging part of the released ``clear()`` walks every key of every
  room (0.5.21 rebuilds the set, 0.5.23 lists it and discards); the adopted ``clear()``
  calls ``purge_room``, O(keys of the room). Both are timed side by side, in the same run,
  at 1,000 / 10,000 / 100,000 live rooms of 4 keys, and the ratio is printed. Nothing about
  time is asserted; what is asserted is that both purged the room and nothing else.
* **A late write after clear() is refused.** A chunk of a request whose sender was already
  cleared reaches upstream's ``add_transfer_request`` (on another thread here), whose first
  statement is the staging prefetch. On bare sets the room comes back into
  ``prefetched_rooms`` and stays there for good (its transfer info is gone, so nothing will
  clear it again); on ours the write is refused, counted and logged.
* **A reused id** (a new request with the id of a cleared one): refused like a late writer
  unless the adopter's optional ``reopen_room`` line runs where the request is admitted;
  refused, upstream's prefetch re-sends its ``STAGING_REQ`` messages on every call.
"""

from __future__ import annotations

import logging
import random
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from tools.sglang import drive

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("scheduled")]

SIZES = (1_000, 10_000, 100_000)
ROUNDS = {1_000: 9, 10_000: 7, 100_000: 5}
BARE = {"context": "bare", "clear": False, "worker": False}
OURS = {"context": "compat", "clear": True, "worker": True}


def _filled(
    up: drive.Upstream, how: drive.Adoption, sink: drive.StagingRequests, rooms: int
) -> drive.Prefill:
    """A prefill side with ``rooms`` live rooms of CHUNKS keys each (the state their prefetch
    leaves, written in one update per set instead of one zmq message per key)."""
    side = drive.Prefill(up, how, sink)
    ids = range(10**12, 10**12 + rooms)
    side.staging.prefetch_requested.update(
        (room, chunk, drive.SESSION) for room in ids for chunk in range(drive.CHUNKS)
    )
    side.staging.prefetched_rooms.update(ids)
    return side


def _timed_clear(side: drive.Prefill, room: int, clear: Callable[[Any], None]) -> int:
    """ns of thread CPU time for one clear() of a fresh room (its setup not timed)."""
    sender = side.admit(room)
    side.staging.prefetch_requested.update((room, c, drive.SESSION) for c in range(drive.CHUNKS))
    side.staging.prefetched_rooms.add(room)
    t0 = time.thread_time_ns()
    clear(sender)
    elapsed = time.thread_time_ns() - t0
    assert room not in side.staging.prefetched_rooms
    assert all(
        (room, c, drive.SESSION) not in side.staging.prefetch_requested for c in range(drive.CHUNKS)
    )
    return elapsed


def test_purge_cost_side_by_side(
    up: drive.Upstream, sink: drive.StagingRequests, figures: list[str]
) -> None:
    bare_how, ours_how = drive.adoption(up, **BARE), drive.adoption(up, **OURS)
    rng = random.Random(0)
    for size in SIZES:
        bare_side = _filled(up, bare_how, sink, size)
        ours_side = _filled(up, ours_how, sink, size)
        times: dict[str, list[int]] = {"bare": [], "ours": []}
        for i in range(ROUNDS[size]):
            order = [("bare", bare_side, bare_how), ("ours", ours_side, ours_how)]
            rng.shuffle(order)
            for name, side, how in order:
                times[name].append(_timed_clear(side, 1 + i, how.clear))
        live = size * drive.CHUNKS
        assert len(bare_side.staged()) == len(ours_side.staged()) == live  # only the room went
        bare_us = statistics.median(times["bare"]) / 1e3
        ours_us = statistics.median(times["ours"]) / 1e3
        figures.append(
            f"purge cost [{size:,} live rooms x {drive.CHUNKS} keys]: released clear() "
            f"{bare_us:,.1f} us, adopted clear() {ours_us:,.1f} us, ratio "
            f"{bare_us / max(ours_us, 1e-3):,.0f}x (medians of {ROUNDS[size]}, thread CPU time, "
            "not asserted)"
        )


def test_late_prefetch_after_clear_is_refused_on_ours(
    up: drive.Upstream,
    sink: drive.StagingRequests,
    figures: list[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    room = 424242
    seen: dict[str, Any] = {}
    for name, cfg in (("bare", BARE), ("ours", OURS)):
        how = drive.adoption(up, **cfg)
        side = drive.Prefill(up, how, sink)
        sender = side.admit(room)
        side.prefetch(room)
        assert room in side.marked() and len(side.staged()) == drive.CHUNKS
        how.clear(sender)
        assert not side.staged() and not side.marked()
        errors: list[BaseException] = []

        def late(side: drive.Prefill = side, errors: list[BaseException] = errors) -> None:
            try:
                assert side.send_chunk(room) is None  # not queued: the room is cleared
            except BaseException as exc:  # reported below
                errors.append(exc)

        with caplog.at_level(logging.WARNING, logger="staging.compat"):
            t = threading.Thread(target=late, name="late-chunk", daemon=True)
            t.start()
            t.join(60)
        assert not t.is_alive() and not errors, errors
        seen[name] = (set(side.marked()), len(side.staged()), side.compat)
    marked, keys, _ = seen["bare"]
    assert marked == {room} and keys == 0  # resurrected into prefetched_rooms, for good
    marked, keys, ctx = seen["ours"]
    assert marked == set() and keys == 0
    assert ctx.stats().refused_late_writes == 1 and ctx.stats().open_rooms == 0
    logged = [r.getMessage() for r in caplog.records if r.name == "staging.compat"]
    assert len(logged) == 1 and f"room {room}" in logged[0]
    sink.drain(0.05)
    figures.append(
        "late chunk after clear() (upstream add_transfer_request on another thread): bare sets "
        "resurrect the room in prefetched_rooms (never cleared again); ours refuse it (counted, "
        "logged once)"
    )


def test_reused_id_needs_reopen_room(
    up: drive.Upstream, sink: drive.StagingRequests, figures: list[str]
) -> None:
    room = 515151
    sent: dict[str, int] = {}
    for name, cfg, reopen in (
        ("bare", BARE, False),
        ("ours, no reopen_room", OURS, False),
        ("ours, reopen_room at admission", OURS, True),
    ):
        how = drive.adoption(up, **cfg)
        side = drive.Prefill(up, how, sink)
        how.clear(side.admit(room))  # an earlier request with this id, cleared
        sink.drain(0.2)
        side.admit(room, reopen=reopen)  # the new request reuses the id
        side.prefetch(room)  # two chunks of it: the prefetch runs for each
        side.prefetch(room)
        sent[name] = sink.drain().get(room, 0)
        recorded = len(side.staged())
        if name == "ours, no reopen_room":
            assert recorded == 0 and room not in side.marked()
            assert side.compat.stats().refused_late_writes == 2 * (drive.CHUNKS + 1)
        else:
            assert recorded == drive.CHUNKS and room in side.marked()
    assert sent["bare"] == sent["ours, reopen_room at admission"] == drive.CHUNKS
    assert sent["ours, no reopen_room"] == 2 * drive.CHUNKS  # re-sent: nothing was recorded
    figures.append(
        "reused id: STAGING_REQ messages for 2 prefetch calls: "
        + ", ".join(f"{k} {v}" for k, v in sent.items())
    )
