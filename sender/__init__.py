"""NIXL KV sender: transport, manager and per-room sender (see docs/THREADING.md).

The sender needs the ``sender`` extra (torch, numpy and nixl):
``pip install 'nixl-staging[sender]'``. The core install (the staging layer) does not bring
them; without them, importing this package raises :class:`ModuleNotFoundError` whose message is
one line naming the extra, before any submodule fails on its own imports.
"""

from __future__ import annotations

import importlib.util

from staging._version import __version__

__all__ = ["EXTRA_MODULES", "__version__"]

EXTRA_MODULES = ("torch", "numpy", "nixl")
"""The top-level modules that only the ``sender`` extra installs."""


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None  # locates it, does not import it
    except ValueError:  # in sys.modules without a __spec__: it is there
        return True


_missing = [m for m in EXTRA_MODULES if not _installed(m)]
if _missing:
    raise ModuleNotFoundError(
        f"the sender needs the 'sender' extra (missing: {', '.join(_missing)}): "
        "pip install 'nixl-staging[sender]'",
        name=_missing[0],
    )
