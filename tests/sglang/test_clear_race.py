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

Plugin off (the released objects, as before SGLang's ``load_plugins()`` ran) may show them
(the counts are printed, per release); plugin on (what ``load_plugins()`` left: our
context, our ``clear()`` hook, upstream's worker as released) must show none -- the
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

CONFIGS = {"plugin off (as released)": False, "plugin on (load_plugins)": True}


def _counts(
    up: drive.Upstream, how: drive.Adoption, sink: drive.StagingRequests, runs: int = RUNS
) -> drive.RaceCounts:
    counts = drive.RaceCounts()
    with drive.installed(up, how):
        for seed in range(runs):
            counts.merge(*drive.race_run(up, how, sink, seed))
            sink.drain(0.01)
    return counts


def _rebinds(up: drive.Upstream) -> bool:
    """Whether the released clear() rebinds prefetch_requested (0.5.21)."""
    return any(
        name == "clear" and "prefetch_requested =" in inspect.getsource(fn)
        for _, name, fn in up.released
    )


@pytest.mark.parametrize("config", CONFIGS, ids=list(CONFIGS))
def test_clear_while_workers_clean_up(
    up: drive.Upstream, sink: drive.StagingRequests, figures: list[str], config: str
) -> None:
    how = drive.adoption(up, plugin=CONFIGS[config])
    counts = _counts(up, how, sink)
    figures.append(f"clear() race [{config}]: {counts.line()}")
    assert counts.runs == RUNS
    assert not counts.other_errors, counts.other_errors[:3]
    if how.plugin:  # the regression: with the plugin, none of them, ever
        assert counts.clear_calls_raised == 0
        assert counts.resurrected_rooms == 0
        assert counts.lost_keys == 0
    elif _rebinds(up):  # the detector works on upstream's rebinding clear()
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


def _released_clear(up: drive.Upstream) -> Any:
    """The released clear() of NixlKVSender (its own, or the one it inherits)."""
    for klass in up.conn.NixlKVSender.__mro__:
        for owner, name, fn in up.released:
            if owner is klass and name == "clear":
                return fn
    return up.conn.NixlKVSender.clear


def test_detector_catches_a_rebinding_clear(
    up: drive.Upstream, sink: drive.StagingRequests, figures: list[str]
) -> None:
    how = drive.adoption(up, plugin=False)
    planted = _planted_rebinding_clear(_released_clear(up))
    how.restore = [*how.restore, (up.conn.NixlKVSender, "clear", planted)]
    counts = _counts(up, how, sink, PLANTED_RUNS)
    figures.append(f"clear() race [planted rebinding clear(), bare sets]: {counts.line()}")
    assert counts.runs_with_changed_size > 0 or counts.resurrected_rooms > 0, counts.line()
