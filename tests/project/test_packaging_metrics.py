"""The optional ``metrics`` extra: ``prometheus-client`` as a range, pinned in
``requirements.lock``, outside the core and the ``sender`` extra, plus the ``sender`` extra
itself (``nixl-staging[sender]``); without it,
``sender.metrics`` fails with one line naming the extra and ``sender.events`` still imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.version import Version

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]


def _project() -> dict[str, object]:
    doc = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project = doc["project"]
    assert isinstance(project, dict)
    return project


def test_metrics_extra_is_a_range_pinned_in_the_lock_and_not_in_the_core() -> None:
    project = _project()
    extras = project["optional-dependencies"]
    assert isinstance(extras, dict)
    reqs = {Requirement(r).name: Requirement(r) for r in extras["metrics"]}
    assert set(reqs) == {"prometheus-client", "nixl-staging"}, sorted(reqs)
    # The metrics are a sender's: the extra implies the sender extra (pip resolves the
    # self-reference), so `pip install 'nixl-staging[metrics]'` alone is enough.
    assert reqs["nixl-staging"].extras == {"sender"} and not reqs["nixl-staging"].specifier
    req = reqs["prometheus-client"]
    ops = {s.operator for s in req.specifier}
    assert ops & {">=", ">"} and ops & {"<", "<="}, f"{req}: want both bounds"
    pins = {}
    for raw in (ROOT / "requirements.lock").read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            r = Requirement(line)
            pins[r.name.lower().replace("_", "-")] = Version(next(iter(r.specifier)).version)
    assert req.specifier.contains(pins["prometheus-client"])
    core = [Requirement(r).name for r in project["dependencies"]]  # type: ignore[union-attr]
    sender = [Requirement(r).name for r in extras["sender"]]
    assert "prometheus-client" not in core + sender


def test_without_prometheus_client_metrics_names_the_extra_and_events_import() -> None:
    prelude = "import sys\nsys.modules['prometheus_client'] = None\n"
    proc = subprocess.run(
        [sys.executable, "-c", prelude + "import sender.events\nimport sender.metrics"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    assert proc.returncode == 1
    assert proc.stderr.splitlines()[-1] == (
        "ModuleNotFoundError: sender.metrics needs the 'metrics' extra (no module "
        "'prometheus_client'): pip install '.[metrics]' in a clone of nixl-staging (it is not "
        "on a package index yet; README, Install)"
    ), proc.stderr
