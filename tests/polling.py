"""Bounded polling loops the tests share: wait for a condition, or for a sender to conclude.

Each returns at its bound instead of hanging (the bound is the caller's, derived from what
it waits for); what the caller asserts about the result is its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from sender.nixl_sender import NixlKVSender
from sender.poll import KVPoll

CONCLUDED = (KVPoll.Success, KVPoll.Failed)


def wait_until(cond: Callable[[], bool], timeout_s: float, interval_s: float = 0.001) -> bool:
    """Poll ``cond`` every ``interval_s`` until it holds (``True``) or ``timeout_s`` passed
    (its last value)."""
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() >= end:
            return cond()
        time.sleep(interval_s)
    return True


def conclude(s: NixlKVSender, timeout_s: float, interval_s: float = 0.001) -> KVPoll:
    """Poll ``s`` until Success/Failed or ``timeout_s``; the last status seen."""
    end = time.monotonic() + timeout_s
    while True:
        st = s.poll()
        if st in CONCLUDED or time.monotonic() >= end:
            return st
        time.sleep(interval_s)
