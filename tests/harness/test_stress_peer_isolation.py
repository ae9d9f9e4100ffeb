"""``python -m stress peer-isolation`` (issue 33, item 5): while one decode peer is hung
(SIGSTOP, its deadline far away), every room to a healthy peer concludes ``Success`` while
the hung peer's rooms are still in flight (``healthy-isolated``, judged by order, not by the
clock). With the planted bug ``worker-waits-on-its-chunk`` (the manager's transport waits
on each write it posts: a worker holds on to its own chunk, as before issue 33) the healthy
rooms conclude only after the hung rooms' deadline, and the invariant fires.

Each run is a subprocess with a bounded timeout; seeds are fixed and printed (``seed: N`` is
the report's first line), so a failure replays with the same command.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from stress.framework import registered
from tests.fixtures_nixl import requires_nixl

pytestmark = [pytest.mark.nixl, requires_nixl]

ROOT = Path(__file__).resolve().parents[2]
SEED = "7"


def run_stress(tmp_path: Path, *args: str, timeout_s: float = 120.0) -> tuple[int, dict[str, Any]]:
    """Run ``python -m stress peer-isolation --quick ARGS --json``; (exit status, scenario)."""
    out = tmp_path / "stress.json"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "stress", "peer-isolation", "--quick", "--seed", SEED,
         "--progress", "off", *args, "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s, check=False,
    )  # fmt: skip
    print(proc.stdout[-6000:])
    print(proc.stderr[-4000:], file=sys.stderr)
    assert proc.stdout.startswith(f"seed: {SEED}")
    doc = json.loads(out.read_text())
    (scenario,) = doc["scenarios"]
    return proc.returncode, scenario


def test_peer_isolation_is_part_of_the_default_run() -> None:
    """``python -m stress --quick`` runs every registered scenario: this one included."""
    assert "peer-isolation" in registered()


@pytest.mark.slow  # a subprocess with three decode peer processes: 6-10 s
@pytest.mark.timeout(150)
def test_quick_peer_isolation_holds(tmp_path: Path) -> None:
    rc, scenario = run_stress(tmp_path)
    violations = {name: inv["violations"] for name, inv in scenario["invariants"].items()}
    assert rc == 0, {k: scenario["invariants"][k]["examples"] for k, v in violations.items() if v}
    assert {"healthy-isolated", "no-leak", "bytes-verified", "chunks-once"} <= set(violations)
    assert all(v == 0 for v in violations.values())
    extra = scenario["extra"]
    assert extra["planted"] is False
    assert [p["workers"] for p in extra["phases"]] == [1, 4]
    for phase in extra["phases"]:
        # The hung chunks held as many workers as there are, and every healthy room still
        # concluded while they were in flight; the hung rooms succeeded once continued.
        assert phase["hung_in_flight_at_start"] >= phase["workers"]
        assert phase["healthy_while_hung"] > 0
        assert phase["healthy_after_hung_ended"] == phase["healthy_failed"] == 0
        assert set(phase["hung_outcomes"]) == {"Success"}
    assert extra["verified"] > 0


@pytest.mark.slow  # under the plant each phase waits for the hung rooms' 8 s deadline: ~22 s
@pytest.mark.timeout(150)
def test_a_worker_that_waits_on_its_chunk_breaks_isolation(tmp_path: Path) -> None:
    rc, scenario = run_stress(tmp_path, "--plant-bug", "worker-waits-on-its-chunk")
    assert rc == 1
    invariants = scenario["invariants"]
    assert invariants["healthy-isolated"]["violations"] > 0
    assert "concluded only after a room of the hung peer had ended" in "\n".join(
        invariants["healthy-isolated"]["examples"]
    )
    others = {k: v["violations"] for k, v in invariants.items() if k != "healthy-isolated"}
    assert all(v == 0 for v in others.values()), others  # the plant breaks only isolation
    for phase in scenario["extra"]["phases"]:
        # Every worker held by a hung chunk: no healthy room concluded while they were.
        assert phase["healthy_while_hung"] == 0
        assert phase["healthy_after_hung_ended"] > 0
