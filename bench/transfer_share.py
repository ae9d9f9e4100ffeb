"""Benchmark ``transfer-share``: placeholder until the NIXL sender lands.

To fill it in: keep the signature ``run(quick: bool) -> BenchResult``, measure the compared
variants with :func:`bench._harness.interleave` (rounds interleaved, medians reported), put
the medians in ``rows``, the side-by-side ratios in ``ratios`` and the goal as a
:class:`bench._harness.Goal` line. Keep the full preset inside the suite's 10-minute budget
(benchmarks 1 and 2 take about 3 minutes together) and ``quick`` to a few seconds.
"""

from __future__ import annotations

from bench._harness import BenchResult, pending_result

NAME = "transfer-share"
TITLE = "Share of a KV transfer's wall time spent in staging bookkeeping (sender + NIXL)"


def run(quick: bool) -> BenchResult:
    """Not written yet: reports ``pending``."""
    return pending_result(NAME, TITLE, "needs the NIXL sender")
