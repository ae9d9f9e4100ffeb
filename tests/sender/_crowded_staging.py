"""A staging context crowded with filler rooms (the module-scoped ``crowded_staging``
fixture in tests/sender/conftest.py makes one: ``FILLER_KEYS`` keys) and a thread reading
it back to back (``long_reader``)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from staging.context import StagingContext

FILLER_KEYS = 200_000


@contextlib.contextmanager
def long_reader(ctx: StagingContext) -> Iterator[list[int]]:
    """A daemon thread calling ``ctx.snapshot()`` back to back until the block ends."""
    stop = threading.Event()
    count = [0]
    errors: list[BaseException] = []

    def run() -> None:
        try:
            while not stop.is_set():
                ctx.snapshot()
                count[0] += 1
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=run, name="long-reader", daemon=True)
    t.start()
    while count[0] == 0 and not errors and t.is_alive():  # one done: the next one runs
        time.sleep(0.001)
    try:
        yield count
    finally:
        stop.set()
        t.join(10)
        assert not t.is_alive(), "the long reader did not stop"
    assert errors == [], errors
