"""The installed distribution's version (``nixl-staging``), read from its package metadata.

``staging``, ``sender`` and ``stress`` all export it as ``__version__``. A source tree that
was never installed (run through ``PYTHONPATH``) has no metadata: its version reads
:data:`UNKNOWN`.
"""

from __future__ import annotations

from importlib import metadata

DISTRIBUTION = "nixl-staging"
UNKNOWN = "0+unknown"


def read_version(distribution: str = DISTRIBUTION) -> str:
    """The installed version of ``distribution``, or :data:`UNKNOWN` when it is not
    installed. Thread-safe; raises nothing (any metadata error reads as :data:`UNKNOWN`)."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return UNKNOWN


__version__ = read_version()


def install_extra_hint(extra: str) -> str:
    """The command that installs ``extra`` today, for an error message: nixl-staging is not
    on a package index yet, so ``pip install 'nixl-staging[extra]'`` finds nothing; it is
    installed from a clone (README, "Install"). Raises: nothing."""
    return (
        f"pip install '.[{extra}]' in a clone of nixl-staging (it is not on a package index "
        "yet; README, Install)"
    )
