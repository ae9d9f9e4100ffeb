"""``python -m stress sender-audit`` end to end, as a subprocess with a bounded timeout.

The scenario runs the sender's failure paths one fault kind per phase (aborts with writes in
flight, a starved slot pool, transport-initiated release, ``lock_timeout`` with a long reader,
two inline pollers, late and short transfer infos, ``close()`` racing ``open_room``) against a
real decode peer process, and ends every phase with a full drain, the leak checks and the
decode page audit. On the fixed sender it reports 0 violations; with the planted old fixed
quarantine (``--plant-bug quarantine``: a failed room's pages are reused while its delayed
writes are still in flight) the page audit reports cross-room overwrites.
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

# Each test but the first runs the scenario as a subprocess (18-37 s each at load 12): `slow`.
pytestmark = [pytest.mark.nixl, requires_nixl]

ROOT = Path(__file__).resolve().parents[2]


def run_stress(
    tmp_path: Path, *args: str, phases: str | None = None, timeout_s: float = 90.0
) -> tuple[int, dict[str, Any]]:
    """Run ``python -m stress sender-audit ARGS --json``; (exit status, its one scenario)."""
    out = tmp_path / "stress.json"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("STRESS_SENDER_AUDIT_PHASES", None)
    if phases is not None:
        env["STRESS_SENDER_AUDIT_PHASES"] = phases
    proc = subprocess.run(
        [sys.executable, "-m", "stress", "sender-audit", *args, "--progress", "off",
         "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s, check=False,
    )  # fmt: skip
    print(proc.stdout[-6000:])
    print(proc.stderr[-4000:], file=sys.stderr)
    doc = json.loads(out.read_text())
    (scenario,) = doc["scenarios"]
    return proc.returncode, scenario


def test_sender_audit_is_part_of_the_default_run() -> None:
    """``python -m stress --quick`` runs every registered scenario: this one included."""
    assert "sender-audit" in registered()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_quick_sender_audit_holds_every_invariant(tmp_path: Path) -> None:
    rc, scenario = run_stress(tmp_path, "--quick", "--seed", "5")
    violations = {name: inv["violations"] for name, inv in scenario["invariants"].items()}
    assert rc == 0, {k: scenario["invariants"][k]["examples"] for k, v in violations.items() if v}
    assert set(violations) >= {
        "decode-page-audit", "failure-contract", "chunks-once", "close-atomic", "no-leak",
        "rooms-concluded", "bytes-verified", "no-resurrection", "no-escaped-exception",
    }  # fmt: skip
    assert all(v == 0 for v in violations.values())
    extra = scenario["extra"]
    phases = extra["per_phase"]
    assert extra["phases"] == [
        "abort-in-flight", "starved-pool", "transport-release", "lock-timeout",
        "inline-progress", "late-info", "close-race",
    ]  # fmt: skip
    # Every phase did what it is there for.
    assert extra["pages_audited"] > 0 and extra["verified"] > 0
    assert extra["writes_delayed"] > 0  # aborts found writes in flight
    for name in extra["phases"]:
        assert phases[name]["succeeded"] + phases[name]["failed"] > 0, name
    assert phases["transport-release:peer_removals"] > 0
    assert phases["lock-timeout:snapshots"] > 0
    assert phases["lock-timeout:footprint_retries"] >= 0  # refused reads, retried: no fault
    assert phases["inline-progress:second_thread_polls"] > 0
    assert phases["late-info:late_infos"] > 0 and phases["late-info:short_infos"] > 0
    assert phases["close-race:cycles"] > 0


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_planted_quarantine_is_caught_by_the_page_audit(tmp_path: Path) -> None:
    """The old fixed quarantine (0 s here) reuses an aborted room's pages while its writes
    are still in flight: they land on pages a later room was verified on."""
    rc, scenario = run_stress(
        tmp_path, "--duration", "5", "--seed", "4", "--plant-bug", "quarantine",
        phases="abort-in-flight",
    )  # fmt: skip
    assert rc == 1
    audit = scenario["invariants"]["decode-page-audit"]
    assert audit["violations"] > 0
    assert any("cross-room overwrite" in text for text in audit["examples"])
    # (The same phase on the drain rule is clean: test_quick_sender_audit_holds_every_invariant.)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_writes_outliving_their_deadline_never_corrupt_a_reused_page(tmp_path: Path) -> None:
    """``--plant-bug slow-network`` plants nothing in our code: the network holds aborted
    rooms' writes past their transfer deadline (0.7 s > 0.5 s), as a hung peer that resumes
    would. A chunk past its deadline that NIXL still has in progress is *hung*, not ended:
    its room fails at once, but its slot and the room's decode pages stay held until the
    write settles. When a deadline counted as "drained" (the first version of the drain
    rule), this run reported 3-4 decode pages holding bytes of no room (seeds 1 and 2)."""
    _, scenario = run_stress(
        tmp_path, "--quick", "--seed", "1", "--plant-bug", "slow-network",
        phases="abort-in-flight",
    )  # fmt: skip
    invariants = scenario["invariants"]
    for name in ("decode-page-audit", "no-leak", "chunks-once", "failure-contract"):
        assert invariants[name]["violations"] == 0, (name, invariants[name]["examples"])
    assert scenario["extra"]["writes_delayed"] > 0


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_planted_lock_hold_is_reported_as_a_deadlock(tmp_path: Path) -> None:
    """The ``lock-timeout`` phase retries a refused ``footprint()`` until the run's deadline
    instead of a fixed 5 x 10 ms (which a loaded machine missed 3 runs in 6): so a lock held
    for good must still fail the run. ``--plant-bug lock-hold`` takes the staging lock for
    writing and keeps it until the watchdog stops the run: nothing progresses (timed-out
    ``snapshot()`` calls are not progress), and ``no-deadlock`` reports it."""
    rc, scenario = run_stress(
        tmp_path, "--duration", "2", "--watchdog", "3", "--seed", "3",
        "--plant-bug", "lock-hold", phases="lock-timeout",
    )  # fmt: skip
    assert rc == 1
    deadlock = scenario["invariants"]["no-deadlock"]
    assert deadlock["violations"] >= 1, scenario["invariants"]
    assert any("no progress" in text for text in deadlock["examples"])
