"""The decode side: ``DecodeStagingContext`` replaced by our locked context, and upstream's
own code that touches its two dicts run in the two threads that touch them.

* After SGLang's ``load_plugins()`` the class in ``staging_handler`` (and in Mooncake's
  module, which imported the name) is ours, on
  :class:`~staging.decode_compat.DecodeCompatContext`, with upstream's ``allocator`` field
  kept; upstream's own ``NixlKVManager._init_staging_decode_ctx`` makes one of ours (its
  allocator step, which registers GPU memory, is stubbed on the instance).
* The race, switch interval 1 µs, seeded runs per configuration: a decode scheduler thread
  runs upstream's real ``NixlKVManager.register_staging_room_bootstrap`` for each new room
  and upstream's real ``DecodeStagingHandler.unregister_decode_req`` to pop it (rooms live
  a random while, a few at once), while the decode listener thread runs upstream's real
  ``handle_staging_req`` for a random recent room (the chunk is already allocated on the
  receiver, so no allocation code runs; the receiver's bootstrap connection is ours and
  records each ``STAGING_RSP``), and a monitoring loop of ours iterates ``room_receivers``
  (what a metrics or debug thread would do; upstream itself never iterates the dicts).
  Counted: exceptions in either thread ("dictionary changed size/keys changed during
  iteration" among them), responses
  sent for the wrong room, rooms left in either dict at the end, and upstream's own torn
  read (a request that found the receiver but, the bootstrap entry popped before its second
  ``get``, sent no response -- the window of docs/ADOPTING.md, "The decode side").
  Plugin on: 0 exceptions, 0 wrong rooms, 0 rooms left. Plugin off (the released
  dataclass): the monitoring loop must hit "changed size" in some run (the detector works;
  seeds go on past ``RUNS``, up to 100, until it has: about one run in three hits it).
"""

from __future__ import annotations

import dataclasses
import os
import random
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from tools.sglang import drive

RUNS = max(4, int(os.environ.get("NIXL_STAGING_SGLANG_RUNS", "20")) // 10)
ROOMS = 400
LIVE = 32  # rooms live at once, at most
JOIN_S = 60.0

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def fast_switch() -> Iterator[None]:
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def test_decode_class_is_ours(up: drive.Upstream, figures: list[str]) -> None:
    import importlib

    from staging.decode_compat import DecodeCompatContext

    cls = up.decode_class
    assert issubclass(cls, DecodeCompatContext) and cls is not up.released_decode_class
    assert [f.name for f in dataclasses.fields(cls)] == ["allocator"]
    mooncake = importlib.import_module("sglang.srt.disaggregation.mooncake.conn")
    assert mooncake.DecodeStagingContext is cls  # propagated to the name Mooncake imported
    mgr = up.conn.NixlKVManager.__new__(up.conn.NixlKVManager)
    mgr._init_staging_allocator = lambda: None  # registers GPU memory upstream
    up.conn.NixlKVManager._init_staging_decode_ctx(mgr)  # upstream's own constructor step
    ctx = mgr._staging_ctx
    assert isinstance(ctx, DecodeCompatContext) and ctx.allocator is None
    with pytest.raises(TypeError):
        ctx.room_receivers = {}
    figures.append(
        f"decode: {cls.__module__}.{cls.__qualname__} is ours after load_plugins() "
        "(NIXL's _init_staging_decode_ctx makes one; Mooncake's imported name is ours)"
    )


class _Socket:
    def __init__(self, sent: list[tuple[int, int]], room: int) -> None:
        self.sent, self.room = sent, room

    def send_multipart(self, frames: list[bytes]) -> None:
        self.sent.append((self.room, int(frames[1])))


class _Receiver:
    """Upstream's receiver as ``handle_staging_req`` reads it: chunk 0 already allocated,
    and the connection to a prefill peer's bootstrap server (ours: records responses)."""

    def __init__(self, room: int, sent: list[tuple[int, int]]) -> None:
        self.room = room
        self.chunk_staging_infos = [(0, 0, 1, 4096, 4)]
        self._sock = _Socket(sent, room)
        self._lock = threading.Lock()

    def _connect_to_bootstrap_server(self, info: dict[str, Any]) -> tuple[_Socket, Any]:
        assert info["room"] == self.room, (info, self.room)
        return self._sock, self._lock


@dataclass
class _Counts:
    runs: int = 0
    errors: list[str] = field(default_factory=list)
    changed_size_runs: int = 0
    wrong_room: int = 0
    left_rooms: int = 0
    handled: int = 0
    torn: int = 0  # receiver found, bootstrap entry gone: no STAGING_RSP

    def line(self) -> str:
        return (
            f"{self.runs} runs, {self.handled} STAGING_REQ handled: exceptions "
            f"{len(self.errors)} (runs with 'dictionary ... changed during iteration': "
            f"{self.changed_size_runs}), "
            f"responses for a wrong room {self.wrong_room}, rooms left {self.left_rooms}, "
            f"upstream's torn read (receiver, no bootstrap: no response) {self.torn}"
        )


def _changed(exc: BaseException) -> bool:
    """CPython's "dictionary changed size during iteration" or, when a pop and an insert
    kept the size, "dictionary keys changed during iteration"."""
    return isinstance(exc, RuntimeError) and "changed" in str(exc) and "iteration" in str(exc)


def _run(up: drive.Upstream, cls: type, seed: int, counts: _Counts) -> None:
    rng = random.Random(seed)
    conn, handler_mod = up.conn, up.handler
    mgr = conn.NixlKVManager.__new__(conn.NixlKVManager)
    mgr._staging_ctx = ctx = cls()
    handler = handler_mod.DecodeStagingHandler.__new__(handler_mod.DecodeStagingHandler)
    handler._room_to_decode_req, handler._room_to_receiver = {}, {}
    handler._writer_counts, handler.kv_manager = {}, mgr
    register = conn.NixlKVManager.register_staging_room_bootstrap
    unregister = handler_mod.DecodeStagingHandler.unregister_decode_req
    handle = handler_mod.handle_staging_req
    sent: list[tuple[int, int]] = []
    errors: list[BaseException] = []
    newest = [0]
    done = threading.Event()
    # The scheduler goes on past its first room only once the listener handled a request:
    # on a loaded machine the listener thread was not scheduled before the scheduler had
    # registered and removed every room, and the run then exercised no race at all.
    listening = threading.Event()

    def scheduler() -> None:
        try:
            live: list[int] = []
            for room in range(1, ROOMS + 1):
                register(mgr, room, [{"pp_rank": 0, "room": room}], _Receiver(room, sent))
                newest[0] = room
                live.append(room)
                if room == 1:
                    listening.wait(JOIN_S)
                while len(live) > LIVE or (live and rng.random() < 0.1):
                    unregister(handler, live.pop(rng.randrange(len(live))))
            for room in live:
                unregister(handler, room)
        except BaseException as exc:  # reported
            errors.append(exc)
        finally:
            done.set()

    def listener() -> None:
        try:
            while not done.is_set():
                room = max(1, newest[0] - rng.randrange(LIVE))
                before = len(sent)
                msg = [b"STAGING_REQ", str(room).encode(), b"0", b"4", b"s", b"0"]
                found = ctx.room_receivers.get(room) is not None
                handle(msg, object(), None, 1, 1, None, ctx.room_receivers, ctx.room_bootstrap)
                counts.handled += 1
                listening.set()
                counts.torn += found and len(sent) == before and room not in ctx.room_bootstrap
                for r in ctx.room_receivers:  # a monitoring loop of ours
                    ctx.room_bootstrap.get(r)
        except BaseException as exc:  # reported
            errors.append(exc)
        finally:
            listening.set()  # never leave the scheduler waiting

    threads = [threading.Thread(target=f, daemon=True) for f in (scheduler, listener)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
    assert not any(t.is_alive() for t in threads), f"seed {seed}: a thread did not finish"
    counts.runs += 1
    counts.errors.extend(f"seed {seed}: {e!r}" for e in errors)
    counts.changed_size_runs += any(_changed(e) for e in errors)
    counts.wrong_room += sum(1 for recv_room, msg_room in sent if recv_room != msg_room)
    counts.left_rooms += len(set(ctx.room_receivers) | set(ctx.room_bootstrap))


@pytest.fixture
def quiet_upstream() -> Iterator[None]:
    """Upstream logs a WARNING for every request of a room already popped: not shown."""
    import logging

    logger = logging.getLogger("sglang.srt.disaggregation.common.staging_handler")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@pytest.mark.usefixtures("fast_switch", "quiet_upstream")
def test_register_and_pop_vs_listener(up: drive.Upstream, figures: list[str]) -> None:
    assert up.released_decode_class is not None
    on, off = _Counts(), _Counts()
    for seed in range(RUNS):
        _run(up, up.decode_class, seed, on)
    for seed in range(max(RUNS, 100)):  # until the detector fired (a few runs), >= RUNS
        _run(up, up.released_decode_class, seed, off)
        if off.changed_size_runs and seed + 1 >= RUNS:
            break
    figures.append(f"decode race [plugin off (as released)]: {off.line()}")
    figures.append(f"decode race [plugin on (load_plugins)]: {on.line()}")
    assert not on.errors and on.wrong_room == 0 and on.left_rooms == 0, on.errors[:3]
    assert on.handled > 0
    assert off.changed_size_runs > 0, off.line()  # the detector works on bare dicts
    assert all("changed" in e and "during iteration" in e for e in off.errors), off.errors[:3]
