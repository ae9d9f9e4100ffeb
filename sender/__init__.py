"""NIXL KV sender: transport, manager and per-room sender (see docs/THREADING.md).

Needs the ``sender`` extra (torch, numpy, nixl); without it, importing this package raises a
one-line :class:`ModuleNotFoundError` naming the extra. The public names (``from sender
import KVManager, NixlKVSender, ...``) are imported lazily, so ``import sender`` is cheap.
"""

from __future__ import annotations

import importlib
import importlib.util
import warnings
from typing import TYPE_CHECKING, Any

from staging._version import __version__, install_extra_hint

if TYPE_CHECKING:
    from sender.errors import TRANSPORT_ERRORS, KVTransferError, RoomNotFailedError, TransportError
    from sender.manager import KVManager, ManagerStats, TransferInfo, make_transfer_info
    from sender.nixl_sender import NixlKVSender
    from sender.poll import KVPoll
    from sender.transport import NixlTransport

_EXPORTS = {
    name: module
    for module, names in (
        ("sender.manager", ("KVManager", "ManagerStats", "TransferInfo", "make_transfer_info")),
        ("sender.nixl_sender", ("NixlKVSender",)),
        ("sender.poll", ("KVPoll",)),
        ("sender.transport", ("NixlTransport",)),
        ("sender.errors", ("TRANSPORT_ERRORS", "KVTransferError", "RoomNotFailedError",
                           "TransportError")),
    )
    for name in names
}
"""Public name -> the module that defines it (imported lazily by :func:`__getattr__`)."""

_MOVED = {"DecodePeer": "stress.harness.peer", "PeerProcess": "stress.harness.peer"}
"""Deprecated names -> their module now (resolved with a :class:`DeprecationWarning`)."""

__all__ = [  # a literal, for linters; == the two constants, __version__ and _EXPORTS
    "EXTRA_MODULES", "NIXL_BACKENDS", "TRANSPORT_ERRORS", "KVManager", "KVPoll", "KVTransferError",
    "ManagerStats", "NixlKVSender", "NixlTransport", "RoomNotFailedError", "TransferInfo",
    "TransportError", "__version__", "make_transfer_info",
]


def __getattr__(name: str) -> Any:
    """The exported name ``name``, imported from its module on first use (PEP 562).

    Raises:
        AttributeError: not an exported name.
    """
    if name in _MOVED:
        module = _MOVED[name]
        message = f"sender.{name} moved to {module}.{name} (the decode peer is test harness)"
        warnings.warn(message, DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(module), name)
    if name not in _EXPORTS:
        raise AttributeError(f"module 'sender' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})

EXTRA_MODULES = ("torch", "numpy", "nixl")
"""The top-level modules that only the ``sender`` extra installs."""

NIXL_BACKENDS = ("nixl_cu13", "nixl_cu12")
"""NIXL's backend modules; either stands for ``nixl`` where the meta package is not
installed (the ``sender-cu13``/``sender-cu12`` extras install one backend only)."""


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None  # locates it, does not import it
    except ValueError:  # in sys.modules without a __spec__: it is there
        return True


_missing = [
    m
    for m in EXTRA_MODULES
    if not _installed(m) and not (m == "nixl" and any(_installed(b) for b in NIXL_BACKENDS))
]
if _missing:
    raise ModuleNotFoundError(
        f"the sender needs the 'sender' extra (missing: {', '.join(_missing)}): "
        + install_extra_hint("sender"),
        name=_missing[0],
    )
