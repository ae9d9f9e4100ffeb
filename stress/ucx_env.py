"""Which network devices the harness's UCX agents use: ``lo`` only, for loopback runs.

UCX builds every new agent's context from the process's environment at that moment
(``UCX_NET_DEVICES``, ``UCX_TLS``; read again for each agent). Unset, an agent uses every
network device of its namespace — including the veth of a two-host topology that *another*
run made (``stress.netns``): measured on one machine, an unconfined agent chose such a
veth, not ``lo``, for its own self-connection, ranked it best for its messages, and failed
to be made (``NIXL_ERR_BACKEND`` after UCX's "connect(...) failed: Connection refused")
when that run tore the veth down meanwhile. So every loopback agent of the tests, the stress
suite and the benchmarks is confined to ``lo``: :func:`confine_to_loopback` runs at their
entry points (``tests/conftest.py``, ``python -m stress``, ``python -m bench``) before any
agent exists; their children (decode peer processes) inherit it. A two-host run's agents
are confined to their own veth instead (:meth:`stress.netns.TwoHostLink.sender_env` and
``peer_env``, which override this).

Only the network devices are named, not the transports: on one host UCX moves the bytes by
CMA (shared memory) and only its messages go over TCP on ``lo``; restricting ``UCX_TLS``
would also drop CUDA's transports where a GPU is used. A ``UCX_NET_DEVICES`` the user set is
kept. ``NixlTransport`` itself sets nothing: an application's agents use UCX's defaults.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

__all__ = ["LOOPBACK_DEVICES", "confine_to_loopback", "loopback_env"]

LOOPBACK_DEVICES = "lo"
"""``UCX_NET_DEVICES`` of a loopback agent."""


def loopback_env(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """``environ`` (default: this process's) with ``UCX_NET_DEVICES=lo`` unless it names
    devices already; a new dict, ``environ`` is not changed.

    Thread-safety: safe from any thread (reads ``environ``).
    """
    env = dict(os.environ if environ is None else environ)
    env.setdefault("UCX_NET_DEVICES", LOOPBACK_DEVICES)
    return env


def confine_to_loopback() -> str:
    """Set ``UCX_NET_DEVICES=lo`` in this process's environment unless it is set; return
    the value in effect. Call before the first agent is made (UCX reads it per agent).

    Thread-safety: call at start-up, before other threads read the environment.
    """
    return os.environ.setdefault("UCX_NET_DEVICES", LOOPBACK_DEVICES)
