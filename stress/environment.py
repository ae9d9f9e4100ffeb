"""Versions and machine facts of a run, shared by ``python -m stress`` and ``python -m bench``.

Everything is read from package metadata and the interpreter, never by importing torch or
nixl (both are slow or noisy to import), so it works on a core install: a distribution that
is not installed reads ``"not installed"``. ``python -m stress --version`` prints
:func:`versions`; the stress report and ``python -m bench`` print :func:`environment`, and
both ``--json`` documents hold it under ``"environment"``.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping
from importlib import metadata

from staging._version import __version__

NOT_INSTALLED = "not installed"

NIXL_BACKENDS = ("nixl-cu12", "nixl-cu13")
"""The NIXL backend wheels the ``sender-cu12``/``sender-cu13`` extras install instead of the
``nixl`` meta package (pyproject.toml)."""


def installed_version(distribution: str) -> str:
    """The installed version of ``distribution``, or :data:`NOT_INSTALLED`. Raises nothing
    (a missing distribution is not an error here)."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return NOT_INSTALLED


def nixl_version() -> str:
    """The ``nixl`` meta package's version; without it, the first backend wheel found, named
    (``"1.5.1 (nixl-cu13)"``); else :data:`NOT_INSTALLED`. Raises nothing."""
    meta = installed_version("nixl")
    if meta != NOT_INSTALLED:
        return meta
    for backend in NIXL_BACKENDS:
        found = installed_version(backend)
        if found != NOT_INSTALLED:
            return f"{found} ({backend})"
    return NOT_INSTALLED


def versions() -> dict[str, str]:
    """The versions a result depends on: nixl-staging (this install's metadata, ``0+unknown``
    for a tree that was never installed), Python, torch, nixl, readerwriterlock and numpy.
    Imports none of them. Raises nothing."""
    return {
        "nixl-staging": __version__,
        "python": f"{platform.python_version()} ({platform.python_implementation()})",
        "torch": installed_version("torch"),
        "nixl": nixl_version(),
        "readerwriterlock": installed_version("readerwriterlock"),
        "numpy": installed_version("numpy"),
    }


def environment() -> dict[str, str]:
    """:func:`versions` and the machine facts that move timings and schedules: cores (and how
    many this process may use), platform, GIL, switch interval, lock debugging. Raises
    nothing."""
    try:
        usable = str(len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        usable = "?"
    gil_check = getattr(sys, "_is_gil_enabled", None)
    gil = "enabled" if gil_check is None or gil_check() else "disabled"
    return {
        **versions(),
        "cores": f"{os.cpu_count()} ({usable} usable)",
        "platform": platform.platform(),
        "gil": gil,
        "switch_interval_s": f"{sys.getswitchinterval():g}",
        "NIXL_STAGING_DEBUG_LOCKS": os.environ.get("NIXL_STAGING_DEBUG_LOCKS", "(unset)"),
    }


def format_environment(env: Mapping[str, str], indent: str = "  ") -> str:
    """One ``key  value`` line per fact, keys padded to one width. Raises nothing (an empty
    mapping gives ``""``)."""
    if not env:
        return ""
    width = max(len(k) for k in env)
    return "\n".join(f"{indent}{k:<{width}}  {v}" for k, v in env.items())
