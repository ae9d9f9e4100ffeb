"""The installed version of ``nixl-staging``, read from its package metadata.

``staging``, ``sender`` and ``stress`` all export it as ``__version__``. A source tree that
was never installed (run through ``PYTHONPATH``) has no metadata: its version reads
:data:`UNKNOWN`.
"""

from __future__ import annotations

from importlib import metadata

UNKNOWN = "0+unknown"


def read_version() -> str:
    """The installed version of nixl-staging, or :data:`UNKNOWN` when it is not installed.
    Thread-safe; raises nothing (a missing distribution reads as :data:`UNKNOWN`)."""
    try:
        return metadata.version("nixl-staging")
    except metadata.PackageNotFoundError:
        return UNKNOWN


__version__ = read_version()


def install_extra_hint(extra: str) -> str:
    """The command that installs ``extra`` today, for an error message (nixl-staging is not on
    a package index yet, so ``pip install 'nixl-staging[extra]'`` finds nothing). Raises:
    nothing."""
    return (
        f"pip install '.[{extra}]' in a clone of nixl-staging (it is not on a package index "
        "yet; README, Install)"
    )
