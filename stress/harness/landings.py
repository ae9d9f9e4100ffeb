"""A decode peer's log of the stamped writes that landed in its pool (an investigation aid).

NIXL writes are one-sided: the decode process is never told that bytes landed. With stamped
sources (:mod:`stress.harness.stamps`) the first bytes of every page name the write that put them
there, so a thread that scans the pool's page headers and records every change sees each
landing: ``(time.monotonic(), page, stamp)``. Two landings on one page within one scan
interval show as the last one only (the log says how often it scanned). The monotonic clock
is the machine's, shared by the sender's process (network namespaces do not change it), so
the log lines up with the sender's own records.

Off by default (``python -m stress.harness.peer --watch-stamps SECONDS``): the scan costs a few tens
of microseconds of CPU per period.

Thread-safety: :meth:`LandingLog.records`, :meth:`LandingLog.close` from any thread.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from stress.harness.stamps import STAMP_BYTES, read_stamp


class Landing(NamedTuple):
    """One change of a page's header: what landed there (``room == -1``: no stamp, e.g. the
    page was zeroed), by its stamp."""

    seq: int
    at: float
    page: int
    room: int
    generation: int
    chunk: int
    dst_page: int


class LandingLog:
    """Scans ``pool``'s page headers every ``interval_s`` on a daemon thread.

    Args:
        pool: the decode pool (``[pages, page_bytes]`` uint8, page_bytes >= STAMP_BYTES).
        interval_s: scan period (> 0).
        max_records: records kept (oldest dropped; ``dropped`` counts them).

    Raises:
        ValueError: bad arguments.
    """

    def __init__(
        self, pool: npt.NDArray[np.uint8], interval_s: float, max_records: int = 200_000
    ) -> None:
        if (
            pool.ndim != 2
            or pool.shape[1] < STAMP_BYTES
            or pool.shape[1] % 8
            or not pool.flags.c_contiguous
            or not interval_s > 0
        ):
            raise ValueError("need a C-contiguous [pages, >= 32 (x 8)] pool and interval_s > 0")
        self._pool = pool
        # The headers as 4 uint64 words per page: one cheap compare per scan.
        self._words = pool.view(np.uint64)[:, : STAMP_BYTES // 8]
        self._interval = float(interval_s)
        self._last = self._words.copy()  # scanner thread only
        self._lock = threading.Lock()
        self._records: deque[Landing] = deque(maxlen=max_records)  # guarded by _lock
        self._seq = 0  # guarded by _lock
        self.scans = 0  # written by the scanner only
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="landing-log", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            now = time.monotonic()
            head = self._words
            changed = np.nonzero((head != self._last).any(axis=1))[0]
            self.scans += 1
            if not changed.size:
                continue
            self._last[changed] = head[changed]
            rows = self._pool[changed, :STAMP_BYTES]
            with self._lock:
                for page, row in zip(changed.tolist(), rows, strict=True):
                    st = read_stamp(row.tobytes())
                    self._seq += 1
                    if st is None:
                        self._records.append(Landing(self._seq, now, page, -1, -1, -1, -1))
                    else:
                        self._records.append(
                            Landing(
                                self._seq, now, page, st.room, st.generation, st.chunk, st.dst_page
                            )
                        )

    def records(self, since: int = 0) -> list[Landing]:
        """Records with ``seq > since``, oldest first. Thread-safe."""
        with self._lock:
            return [r for r in self._records if r.seq > since]

    def close(self) -> None:
        """Stop and join the scanner (bounded: one period). Idempotent; thread-safe."""
        self._stop.set()
        self._thread.join(timeout=max(1.0, 10 * self._interval))


__all__ = ["Landing", "LandingLog"]
