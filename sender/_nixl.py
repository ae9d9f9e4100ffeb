"""The one place in the package that imports NIXL, containing its process-wide side effects.

* ``NIXL_LOG_LEVEL`` defaults to ``WARN`` before the import (else NIXL logs INFO to stdout).
* ``logging.raiseExceptions``, which the import sets to False, is restored afterwards.
* ``NIXL_STAGING_NIXL_BACKEND`` (set by ``PeerProcess`` for its children) names the backend
  module to import directly, skipping the meta package's CUDA probe (~2 s with torch).
* Without the ``nixl`` meta package, the first installed of :data:`sender.NIXL_BACKENDS`.

When NIXL cannot be imported the names below are ``None``, ``AVAILABLE`` is False and
:data:`IMPORT_ERROR` holds the reason; :class:`sender.transport.NixlTransport` then raises.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import re
from types import ModuleType
from typing import Any

from sender import NIXL_BACKENDS

__all__ = [
    "AVAILABLE",
    "BACKEND_ENV",
    "BACKEND_MODULE",
    "IMPORT_ERROR",
    "bindings",
    "nixl_agent",
    "nixl_agent_config",
    "nixl_thread_sync_t",
    "require",
]

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

BACKEND_ENV = "NIXL_STAGING_NIXL_BACKEND"
_BACKEND_RE = re.compile(r"nixl_(cu[0-9]+|rocm)")

bindings: ModuleType | None
nixl_agent: Any
nixl_agent_config: Any
nixl_thread_sync_t: Any
IMPORT_ERROR: BaseException | None

def _installed_backend(missing: ModuleNotFoundError) -> str:
    """The first installed of :data:`sender.NIXL_BACKENDS`. Raises: ``missing`` when none is."""
    for name in NIXL_BACKENDS:
        try:
            if importlib.util.find_spec(name) is not None:
                return name
        except ValueError:  # in sys.modules without a __spec__: it is there
            return name
    raise missing


_saved_raise_exceptions = logging.raiseExceptions
try:
    _named = os.environ.get(BACKEND_ENV, "")
    _package = _named if _BACKEND_RE.fullmatch(_named) else "nixl"
    try:
        _bindings_mod = importlib.import_module(f"{_package}._bindings")
    except ModuleNotFoundError as _missing:
        if _package != "nixl" or _missing.name not in ("nixl", "nixl._bindings"):
            raise
        _package = _installed_backend(_missing)  # no meta package: its backend, directly
        _bindings_mod = importlib.import_module(f"{_package}._bindings")
    _api_mod = importlib.import_module(f"{_package}._api")
except ImportError as _exc:  # NIXL not installed or no backend wheel for this platform
    bindings = nixl_agent = nixl_agent_config = nixl_thread_sync_t = None
    IMPORT_ERROR = _exc
else:
    bindings = _bindings_mod
    nixl_agent = _api_mod.nixl_agent
    nixl_agent_config = _api_mod.nixl_agent_config
    nixl_thread_sync_t = _api_mod.nixl_thread_sync_t
    IMPORT_ERROR = None
finally:
    logging.raiseExceptions = _saved_raise_exceptions

AVAILABLE: bool = bindings is not None
# The backend package actually in use (e.g. "nixl_cu13"); "" when NIXL is unavailable.
BACKEND_MODULE: str = bindings.__name__.rpartition(".")[0] if bindings is not None else ""


def require() -> ModuleType:
    """Return the NIXL bindings module. Safe from any thread.

    Raises:
        ImportError: NIXL could not be imported in this process; chained to the original error.
    """
    if bindings is None:
        raise ImportError(f"NIXL is not available: {IMPORT_ERROR!r}") from IMPORT_ERROR
    return bindings
