"""Mutants of the transport's concurrency (``sender/transport.py``): each breaks a sentence
of its contract in ``docs/THREADING.md`` somewhere other than where its check is written.

Each mutant names a site tag (``# mutant-site: NAME``) in its file; see
:mod:`tools.mutant_sites`. A missing or duplicated tag makes it stale.
"""

from __future__ import annotations

from tools.mutants_spec import ISSUE_16_TESTS, Mutant

TRANSPORT = "sender/transport.py"
DPOR_TRANSPORT = "tests/sender/test_dpor_transport.py"
TRANSPORT_TESTS = ("tests/sender/test_transport.py", *ISSUE_16_TESTS, DPOR_TRANSPORT)

MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        id="transport-write-skips-recheck",
        file=TRANSPORT,
        site="write-pages-if-2",
        statements=2,
        replacement="""\
if self._regions.get(src_region) is not local:  # MUTANT: peer not re-checked
    raise TransportParamError(f"local region {src_region!r} was deregistered")
""",
        kind="race",
        description="write_pages trusts its lock-free peer look-up: a write that looked the "
        "peer up before remove_peer() posts to it after remove_peer() returned",
        tests=TRANSPORT_TESTS,
    ),
    Mutant(
        id="transport-close-lists-live-late",
        file=TRANSPORT,
        site="close",
        replacement="""\
with self._lock:
    if self._closed:
        return
    transfers = list(self._live)
with self._lock:  # MUTANT: closed only after the live transfers were listed
    self._closed = True
    remote_agents = list(self._remote_refs)
    regions = [*self._regions.values(), *self._retiring]
    peers = [*self._peers.values(), *self._retired_peers]
    prepped = [h for p in peers for h in p.prepped.values()]
    prepped += [r.prepped for r in regions]
    agent = self._agent
    last_notif = self._last_notif_at
""",
        kind="race",
        description="close() lists the live transfers before it refuses new writes (two "
        "critical sections): a write registered in between is never released by close()",
        tests=TRANSPORT_TESTS,
    ),
)
