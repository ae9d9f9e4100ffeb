"""The versions a stress or bench result depends on: ``python -m stress --version``, the
stress report's header and ``--json``, bench's environment block; one helper for all
(:mod:`stress.environment`), working without the ``sender`` extra."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

import stress
from stress import environment as env_mod

ROOT = Path(__file__).resolve().parents[2]
KEYS = ("nixl-staging", "python", "torch", "nixl", "readerwriterlock", "numpy")


def _without(monkeypatch: pytest.MonkeyPatch, *missing: str) -> None:
    """Make ``metadata.version`` report ``missing`` distributions as not installed."""
    real = metadata.version

    def version(name: str) -> str:
        if name in missing:
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(env_mod.metadata, "version", version)


def test_stress_version_prints_every_version() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "stress", "--version"],
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"nixl-staging {stress.__version__}"
    named = [line.split()[0] for line in lines[1:]]
    assert named == list(KEYS[1:])
    assert f"python            {sys.version.split()[0]}" in proc.stdout


def test_versions_without_the_sender_extra_say_not_installed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _without(monkeypatch, "torch", "nixl", "nixl-cu12", "nixl-cu13", "numpy")
    found = env_mod.versions()
    assert list(found) == list(KEYS)
    assert found["torch"] == found["nixl"] == found["numpy"] == "not installed"
    from stress.cli import version_text

    text = version_text()
    assert "torch             not installed" in text and "nixl              not installed" in text


def test_nixl_from_a_backend_wheel_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sender-cu13 extra installs ``nixl-cu13`` without the ``nixl`` meta package."""
    real = metadata.version

    def version(name: str) -> str:
        if name in ("nixl", "nixl-cu12"):
            raise metadata.PackageNotFoundError(name)
        return "1.5.1" if name == "nixl-cu13" else real(name)

    monkeypatch.setattr(env_mod.metadata, "version", version)
    assert env_mod.nixl_version() == "1.5.1 (nixl-cu13)"


def test_the_stress_report_header_and_json_hold_the_versions(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import stress.cli as cli
    from stress.framework import skipped_result

    def fake_run(scenario: Any, config: Any, **_: Any) -> Any:
        return skipped_result(scenario.name, "stubbed by the test", config)

    monkeypatch.setattr(cli, "run_scenario", fake_run)
    out = tmp_path / "run.json"
    argv = ["staging-race", "--native-stderr", "pass", "--sender-log", "show", "--json", str(out)]
    assert cli.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("seed: ") and lines[1] == "environment:"
    assert lines[2].split()[:2] == ["nixl-staging", stress.__version__]
    doc = json.loads(out.read_text())
    assert list(doc["environment"])[: len(KEYS)] == list(KEYS)
    assert doc["environment"]["nixl-staging"] == stress.__version__
    assert doc["environment"]["python"].startswith(sys.version.split()[0])


def test_bench_uses_the_same_environment_block() -> None:
    """bench/ is not installed: its header comes from the installed stress.environment."""
    import bench._harness
    import bench.cli

    assert bench.cli.environment is env_mod.environment
    assert bench.cli.format_environment is env_mod.format_environment
    assert not hasattr(bench._harness, "environment")  # not written twice
    stream = io.StringIO()
    assert bench.cli.main(["--list"], out=stream) == 0  # no header for a list
    text = env_mod.format_environment(env_mod.environment())
    assert text.splitlines()[0].split()[:2] == ["nixl-staging", stress.__version__]
