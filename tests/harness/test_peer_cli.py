"""``python -m stress.harness.peer``'s command line, and ``DecodePeer.metadata()`` after
``close()``.

* ``--help`` and bad arguments are answered before NIXL, torch or numpy are imported (checked
  with ``-X importtime``, which lists every module a process imports: no clock involved);
* the help shows no ``(default: None)``, and no default on a required option;
* a closed peer's metadata is refused with a clear error, not handed out stale.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from stress.harness._peer_args import build_parser
from tests.fixtures_nixl import requires_nixl

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "nixl", "numpy")


def _peer_cli(*args: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """Run ``python -X importtime -m stress.harness.peer ARGS``; returns the process and the set of
    top-level modules it imported."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "stress.harness.peer", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    imported = set()
    for line in proc.stderr.splitlines():
        m = re.match(r"import time:\s+\d+ \|\s+\d+ \|(\s*)(\S+)", line)
        if m:
            imported.add(m.group(2).split(".")[0])
    return proc, imported


def test_help_imports_neither_torch_nor_nixl() -> None:
    proc, imported = _peer_cli("--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage: python -m stress.harness.peer" in proc.stdout
    assert imported, "no -X importtime lines: the check would prove nothing"
    assert "stress" in imported  # the import lines were parsed
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))


def test_bad_arguments_are_refused_before_the_heavy_imports() -> None:
    proc, imported = _peer_cli("--pages", "0", "--page-bytes", "4096")
    assert proc.returncode == 2
    assert "--pages: must be >= 1, got 0" in proc.stderr
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))


def test_help_shows_no_default_none_and_none_on_required_options() -> None:
    parser = build_parser()
    text = parser.format_help()
    assert "(default: None)" not in text
    required = [a for a in parser._actions if a.required]
    assert {a.dest for a in required} == {"pages", "page_bytes"}
    for action in required:
        line = next(
            i
            for i, ln in enumerate(text.splitlines())
            if action.option_strings[0] in ln and not ln.lstrip().startswith("usage")
        )
        chunk = "\n".join(text.splitlines()[line : line + 2])
        assert "default" not in chunk, chunk
    assert "(default: 127.0.0.1:0)" in text  # real defaults still shown


@requires_nixl
@pytest.mark.nixl
def test_metadata_after_close_raises_a_clear_error() -> None:
    from sender.errors import TransportClosedError
    from stress.harness.peer import DecodePeer

    peer = DecodePeer("decode-metadata-close", 4, 4096)
    try:
        blob = peer.metadata()
        assert isinstance(blob, bytes) and blob
        assert peer.metadata() == blob  # stable while open
    finally:
        peer.close()
    with pytest.raises(TransportClosedError, match=r"decode-metadata-close.*closed.*stale"):
        peer.metadata()
    peer.close()  # still idempotent
    with pytest.raises(TransportClosedError):
        peer.metadata()
