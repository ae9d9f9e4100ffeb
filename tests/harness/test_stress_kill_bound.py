"""The measured parts of peer-faults' derived ``rooms-concluded`` bound for a killed peer's
rooms (``stress/scenarios/peer_faults.py``): the scheduling delay the lag probe sees, and
the time the harness held the scheduler (``SenderRig.harness_wait``). Real threads; no
elapsed-time assertion: what is checked is that a delay *planted* here is seen, at least
its known size, never more than what happened."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from tests.fixtures_nixl import requires_nixl

pytestmark = [requires_nixl, pytest.mark.timeout(60)]


def test_the_lag_probe_sees_a_thread_kept_from_running() -> None:
    """The main thread holds the GIL in a pure-Python loop with a 0.2 s switch interval:
    the probe's wake-up is late by a good part of that (it cannot run meanwhile)."""
    from stress.scenarios._lag_probe import LagProbe

    probe = LagProbe()
    stop = threading.Event()
    t = threading.Thread(target=probe.run, args=(lambda: not stop.is_set(),), daemon=True)
    old = sys.getswitchinterval()
    t.start()
    time.sleep(0.1)  # the probe is sleeping its period
    start = time.monotonic()
    sys.setswitchinterval(0.2)
    try:
        spin_until = time.monotonic() + 0.6
        while time.monotonic() < spin_until:
            pass
    finally:
        sys.setswitchinterval(old)
    end = time.monotonic()
    time.sleep(0.1)
    stop.set()
    t.join(5)
    assert not t.is_alive()
    worst = probe.worst(start, end)
    assert worst >= 0.05, worst  # held up by the GIL holder: seen
    assert probe.worst(end + 10, end + 20) == 0.0  # nothing is invented outside a window


def test_harness_wait_counts_only_the_threads_own_waits_in_the_window() -> None:
    """``harness_wait`` (a SenderRig method; no rig needed to check its arithmetic on real
    lock waits): a thread waiting 0.3 s for ``peer_lock`` while another holds it has at
    least those 0.3 s in a window that covers them, none in a window before, and another
    thread has none."""
    from stress.scenarios._sender_rig import SenderRig

    class _Rig:
        def __init__(self) -> None:
            self.peer_lock = threading.Lock()
            self._waits_lock = threading.Lock()
            self._waits: list[tuple[int, float, float]] = []
            self.peers = {"s": self}

        def page_digest(self, pages: object) -> list[str]:
            return []

    rig = _Rig()
    digest = SenderRig.digest.__get__(rig)  # the real method on the stand-in's fields
    waits = SenderRig.harness_wait.__get__(rig)
    ident: list[int] = []
    t0 = time.monotonic()
    rig.peer_lock.acquire()

    def reader() -> None:
        ident.append(threading.get_ident())
        digest("s", [0])

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    time.sleep(0.3)
    rig.peer_lock.release()
    t.join(5)
    t1 = time.monotonic()
    assert not t.is_alive()
    assert waits(ident[0], t0, t1) >= 0.25
    assert waits(ident[0], t0 - 10, t0 - 5) == 0.0
    assert waits(threading.get_ident(), t0, t1) == 0.0
