"""Benchmarks: ``python -m bench [NAMES ...] [--quick] [--json PATH]`` (``make bench``).

Every benchmark measures its variants side by side in one run (rounds interleaved), prints
medians, ratios and goal lines, and asserts nothing: speed is reported, never tested.

* ``bench._harness`` -- result objects (:class:`~bench._harness.BenchResult`), interleaved
  median-of-rounds timing, tables, the environment block.
* ``bench._registry`` -- the registered benchmarks, by name, in run order.
* ``bench.purge_scaling``, ``bench.lifecycle`` -- benchmarks 1 and 2.
* ``bench.transfer_share``, ``bench.throughput``, ``bench.stress_rooms`` -- benchmarks 3-5,
  over real NIXL to a decode peer process.
* ``python -m bench.lifecycle_profile [--quick]`` -- where a lifecycle's time goes
  (ablation, micro costs, cProfile, what-if, threads and convoys); a diagnostic, not part
  of ``make bench``.
"""
