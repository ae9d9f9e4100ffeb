"""The benchmarks ``python -m bench`` knows, by name, in run order.

Each entry names a module with a ``run(quick: bool) -> BenchResult`` function. Modules are
imported only when their benchmark runs, so ``python -m bench purge-scaling`` never imports
torch or nixl. To add a benchmark: write the module (see ``bench/purge_scaling.py`` for the
shape) and add a :class:`BenchSpec` here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Protocol

from bench._harness import BenchResult


class BenchFn(Protocol):
    """A benchmark: ``quick`` selects the short preset (whole ``--quick`` run < 1 minute)."""

    def __call__(self, quick: bool) -> BenchResult: ...


@dataclass(frozen=True)
class BenchSpec:
    """A registered benchmark: its CLI name, module and one-line summary."""

    name: str
    module: str
    summary: str
    host_network: bool = False
    """It changes this host's network (namespaces, veths, ``tc``): ``python -m bench`` runs
    it only when it is named or ``--two-hosts`` is given."""

    def load(self) -> BenchFn:
        """Import the module and return its ``run``.

        Raises:
            ImportError: the module cannot be imported.
            TypeError: the module has no callable ``run``.
        """
        module = importlib.import_module(self.module)
        run = getattr(module, "run", None)
        if not callable(run):
            raise TypeError(f"{self.module} has no callable run(quick)")
        fn: BenchFn = run
        return fn


BENCHMARKS: tuple[BenchSpec, ...] = (
    BenchSpec(
        "purge-scaling",
        "bench.purge_scaling",
        "purge_room cost vs live rooms: StagingContext vs the upstream bare-set pattern",
    ),
    BenchSpec(
        "lifecycle",
        "bench.lifecycle",
        "room lifecycle bookkeeping, 1-8 threads: rw / mutex / threading.Lock reference",
    ),
    BenchSpec(
        "compat",
        "bench.compat",
        "compat views: `in` and purge_room vs bare sets, is_requested and the upstream rebind",
    ),
    BenchSpec(
        "transfer-share",
        "bench.transfer_share",
        "bookkeeping share of a real 8 x 1 MiB room over NIXL to a peer process",
    ),
    BenchSpec(
        "throughput",
        "bench.throughput",
        "cross-process NIXL (our transport) vs torch copy_ of the same bytes, GB/s",
    ),
    BenchSpec(
        "curves",
        "bench.curves",
        "per-room sender cost as chunks, sessions and rooms in flight grow, vs bare NIXL",
    ),
    BenchSpec(
        "instructions",
        "bench.instructions",
        "instructions per room of the sender's bookkeeping (callgrind; not in --quick)",
    ),
    BenchSpec(
        "stress-rooms",
        "bench.stress_rooms",
        "sender-lifecycle rooms/s over NIXL: mutex (the default) vs rw vs debug locks",
    ),
    BenchSpec(
        "isolation",
        "bench.isolation",
        "healthy peers' room p50/p99 with one decode peer hung (SIGSTOP) vs none",
    ),
    BenchSpec(
        "fail-fast",
        "bench.fail_fast",
        "a room's SIGKILL/SIGSTOP -> Failed latency vs its goal (2 deadlines / deadline + 100 ms)",
    ),
    BenchSpec(
        "two-hosts",
        "bench.two_hosts",
        "GB/s over a tbf-shaped veth link to a peer in its own netns (UCX/TCP) vs the rate",
        host_network=True,
    ),
)

BY_NAME: dict[str, BenchSpec] = {spec.name: spec for spec in BENCHMARKS}
