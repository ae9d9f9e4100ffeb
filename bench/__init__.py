"""Benchmarks: ``python -m bench [NAMES ...] [--quick] [--json PATH]`` (``make bench``).

Every benchmark measures its variants side by side in one run (rounds interleaved), prints
medians, ratios and goal lines, and asserts nothing: speed is reported, never tested.

* ``bench._harness`` -- result objects (:class:`~bench._harness.BenchResult`), interleaved
  median-of-rounds timing, tables (the environment block, versions included, is
  :mod:`stress.environment`'s, shared with the stress report).
* ``bench._registry`` -- the registered benchmarks, by name, in run order.
* ``bench.purge_scaling``, ``bench.lifecycle`` -- benchmarks 1 and 2.
* ``bench.transfer_share``, ``bench.throughput``, ``bench.curves``, ``bench.stress_rooms`` --
  over real NIXL to a decode peer process (``curves``: per-room cost as chunks, sessions and
  rooms in flight grow, against bare prepped NIXL, with growth exponents).
* ``bench.instructions`` -- instructions per room of the sender's bookkeeping on a no-op
  transport, counted by valgrind's callgrind (``make bench-instructions``; not in ``--quick``).
* ``bench._noop`` (a transport that moves nothing), ``bench._bare_room`` (the Lock + dicts
  reference room), ``bench._callgrind_child`` (the program callgrind counts).
* ``python -m bench.lifecycle_profile [--quick]`` -- where a lifecycle's time goes
  (ablation, micro costs, cProfile, what-if, threads and convoys); a diagnostic, not part
  of ``make bench``.
"""
