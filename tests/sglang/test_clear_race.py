"""``clear()`` on the scheduler thread while four workers run upstream's room clean-up.

Upstream's own code in every thread (see :mod:`tools.sglang.drive`): the scheduler admits
requests and runs ``_prefetch_staging_reqs``, hands each room's chunks to one of four worker
threads, and calls the sender's ``clear()`` on every room a worker reports done; the worker
that takes a room's last chunk runs the transfer worker's clean-up block. 256 background
rooms stay live throughout. Switch interval 1 µs. Counted per configuration, over
``NIXL_STAGING_SGLANG_RUNS`` runs (seeds 0..N-1, replayable):

* ``clear()`` calls that raised "Set changed size during iteration" (on the scheduler
  thread: in SGLang that exception escapes into the scheduler loop);
* finished rooms whose keys or mark are back at the end (resurrected by a rebind);
* background keys missing at the end (lost to a rebind).

Bare sets may show them (the counts are printed, per release); ours must show none -- the
regression. The detector itself is shown to work: upstream 0.5.21's clear() on bare sets
must show "Set changed size" in some run, and for a release whose clear() no longer rebinds,
a planted rebinding clear() of ours must.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import pytest

from tools.sglang import drive

RUNS = int(os.environ.get("NIXL_STAGING_SGLANG_RUNS", "20"))
PLANTED_RUNS = max(10, RUNS // 4)

pytestmark = [pytest.mark.timeout(900), pytest.mark.usefixtures("scheduled")]

CONFIGS: dict[str, dict[str, Any]] = {
    "bare sets, as released": {"context": "bare", "clear": False, "worker": False},
    "ours, clear() changed": {"context": "compat", "clear": True, "worker": False},
    "ours, clear() and worker changed": {"context": "compat", "clear": True, "worker": True},
}


def _counts(
    up: drive.Upstream, how: drive.Adoption, sink: drive.StagingRequests, runs: int = RUNS
) -> drive.RaceCounts:
    counts = drive.RaceCounts()
    with drive.installed(up, how):
        for seed in range(runs):
            counts.merge(*drive.race_run(up, how, sink, seed))
            sink.drain(0.01)
    return counts


def _rebinds(how: drive.Adoption) -> bool:
    return "prefetch_requested =" in inspect.getsource(how.clear_owner.__dict__["clear"])


@pytest.mark.parametrize("config", CONFIGS, ids=list(CONFIGS))
def test_clear_while_workers_clean_up(
    up: drive.Upstream, sink: drive.StagingRequests, figures: list[str], config: str
) -> None:
    how = drive.adoption(up, **CONFIGS[config])
    counts = _counts(up, how, sink)
    figures.append(f"clear() race [{config}]: {counts.line()}")
    assert counts.runs == RUNS
    assert not counts.other_errors, counts.other_errors[:3]
    if config.startswith("ours"):  # the regression: ours never shows any of them
        assert counts.clear_calls_raised == 0
        assert counts.resurrected_rooms == 0
        assert counts.lost_keys == 0
    elif _rebinds(how):  # the detector works on upstream's rebinding clear()
        assert counts.runs_with_changed_size > 0, counts.line()


def _planted_rebinding_clear(released: Any) -> Any:
    """PLANTED: the released clear(), then the staging purge as a rebuild by set
    comprehension (the form 0.5.21 has), so that the detector is shown to work on every
    release, including those whose clear() no longer rebinds."""

    def clear(self: Any) -> None:
        released(self)
        ctx = self.kv_mgr._staging_ctx
        ctx.prefetch_requested = {k for k in ctx.prefetch_requested if k[0] != self.bootstrap_room}

    return clear


def test_detector_catches_a_rebinding_clear(
    up: drive.Upstream, sink: drive.StagingRequests, figures: list[str]
) -> None:
    how = drive.adoption(up, context="bare", clear=False, worker=False)
    how.clear = _planted_rebinding_clear(how.clear)
    counts = _counts(up, how, sink, PLANTED_RUNS)
    figures.append(f"clear() race [planted rebinding clear(), bare sets]: {counts.line()}")
    assert counts.runs_with_changed_size > 0 or counts.resurrected_rooms > 0, counts.line()
