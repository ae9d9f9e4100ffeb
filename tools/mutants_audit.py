"""Mutants of the decode page audit and of stamped source pages (issue 23, section 1).

A planted real overwrite must stay caught, and a stamp must name one write: each mutant here
breaks one of those, and ``tests/harness/test_page_attribution.py`` must kill it.
"""

from __future__ import annotations

from tools.mutants_spec import Mutant

MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        id="audit-allows-stale",
        file="stress/scenarios/_page_audit.py",
        site="judge",
        replacement="""\
allowed = {u.digest for u in history}
""",
        kind="lifecycle",
        description=(
            "the page audit accepts the bytes of any room ever given the page, also one given "
            "it before the last verified room: violates 'a page holds the last verified "
            "room's bytes or a later room's' (a stale write landing after the page was handed "
            "on and verified goes unreported)"
        ),
        tests=("tests/harness/test_page_attribution.py",),
    ),
    Mutant(
        id="stamps-src-back-early",
        file="stress/harness/driver.py",
        site="hold",
        replacement=(
            """\
pool.held.append(_Held(handle, pages, release_at, None))
if self.sources is not None and src is not None:
    self.sources.give_back(src.tolist())
"""
        ),
        kind="lifecycle",
        description=(
            "a held room's stamped source pages go back at once, not with its decode pages "
            "(the drain rule): a page is re-stamped while the old room's write may still read "
            "it, so a stamp no longer names one write (its late write carries another room's "
            "stamp to its own page: the audit reports a misdirected write)"
        ),
        tests=("tests/harness/test_page_attribution.py",),
    ),
)
