"""Mutants of the decode staging context (``staging/decode_compat.py``): races that the
one-instant checks of ``tests/staging/test_decode_compat.py`` must kill (single-preemption
schedules, ``tests/interleave.py``).

Each mutant names a site tag (``# mutant-site: NAME``) in its file; see
:mod:`tools.mutant_sites`. A missing or duplicated tag makes it stale.
"""

from __future__ import annotations

from tools.mutants_spec import Mutant

DECODE = "staging/decode_compat.py"
DECODE_TESTS = ("tests/staging/test_decode_compat.py",)

MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        id="decode-purge-split",
        file=DECODE,
        site="purge-room",
        statements=2,
        replacement="""\
with self._lock:
    bootstrap = self._bootstrap.pop(k, None)
# MUTANT: the receiver is popped in a second critical section; a reader in between
# sees the room's receiver without its bootstrap infos
with self._lock:
    receiver = self._receivers.pop(k, None)
return bootstrap, receiver
""",
        kind="race",
        description="purge_room pops the two dicts under two acquisitions: a reader between "
        "them sees half a room (preemption purge-vs-reader)",
        tests=DECODE_TESTS,
    ),
    Mutant(
        id="decode-entry-split",
        file=DECODE,
        site="room-entry",
        replacement="""\
with self._lock:
    bootstrap = self._bootstrap.get(k)
# MUTANT: the two reads in two critical sections; a purge between them is torn
with self._lock:
    return bootstrap, self._receivers.get(k)
""",
        kind="race",
        description="room_entry reads the two dicts under two acquisitions: a purge between "
        "them gives half a room (preemption reader-vs-purge)",
        tests=DECODE_TESTS,
    ),
)
