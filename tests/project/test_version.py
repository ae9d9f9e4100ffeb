"""``__version__`` of ``staging``, ``sender`` and ``stress``: the installed distribution's
version from its package metadata (and a clear placeholder for a never-installed tree)."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import pytest
import tomllib

import sender
import staging
import stress
from staging import _version

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_exports_the_distribution_version() -> None:
    try:
        installed = metadata.version("nixl-staging")
    except metadata.PackageNotFoundError:
        pytest.skip("nixl-staging is not installed here (no package metadata to compare)")
    assert staging.__version__ == sender.__version__ == stress.__version__ == installed
    assert "__version__" in staging.__all__ and "__version__" in stress.__all__
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert installed == declared, "the installed metadata is stale: reinstall (pip install -e .)"


def test_a_tree_without_metadata_reads_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(_version.metadata, "version", missing)
    assert _version.read_version() == _version.UNKNOWN == "0+unknown"
