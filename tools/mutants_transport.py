"""Mutants of the transport's concurrency (``sender/transport.py``): each breaks a sentence
of its contract in ``docs/THREADING.md`` somewhere other than where its check is written.

Each snippet must match the current source exactly once (``make mutants`` stops with "stale
mutant" otherwise).
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
        original="""\
                if self._peers.get(session_id) is not peer:
                    raise PeerNotFoundError(session_id)
                if self._regions.get(src_region) is not local:""",
        replacement="""\
                if self._regions.get(src_region) is not local:  # MUTANT: peer not re-checked""",
        kind="race",
        description="write_pages trusts its lock-free peer look-up: a write that looked the "
        "peer up before remove_peer() posts to it after remove_peer() returned",
        tests=TRANSPORT_TESTS,
    ),
    Mutant(
        id="transport-close-lists-live-late",
        file=TRANSPORT,
        original="""\
                self._closed = True
                transfers = list(self._live)""",
        replacement="""\
                transfers = list(self._live)
            with self._lock:  # MUTANT: closed only after the live transfers were listed
                self._closed = True""",
        kind="race",
        description="close() lists the live transfers before it refuses new writes (two "
        "critical sections): a write registered in between is never released by close()",
        tests=TRANSPORT_TESTS,
    ),
)
