"""What a new user meets first (issue 25, section 2, ergonomics): ``import sender`` exports
the names of the basic example, ``print(poll())`` names the status, both kinds of decode peer
give their metadata as ``peer.metadata()``, ``help()`` on a constructor points at its
arguments, and every logger of the library is in docs/LOGGING.md."""

from __future__ import annotations

import pydoc
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]


def test_kvpoll_prints_its_name_and_still_compares_as_an_int() -> None:
    from sender.poll import KVPoll

    status = KVPoll.Success
    assert str(status) == f"{status}" == "%s" % status == "KVPoll.Success"  # noqa: UP031 (logging)
    assert repr(status) == "<KVPoll.Success: 4>"
    assert f"{status:d}" == "4" and f"{KVPoll.Failed:>3}" == "  0"
    assert status == 4 and status > KVPoll.Transferring and int(status) == 4
    assert min(KVPoll.Failed, status) is KVPoll.Failed  # the MIN all-reduce
    assert {4: "x"}[status] == "x" and KVPoll(4) is status
    out = subprocess.run(
        [sys.executable, "-c", "from sender.poll import KVPoll; print(KVPoll.Failed)"],
        capture_output=True, text=True, timeout=50, check=True, cwd=ROOT,
    )  # fmt: skip
    assert out.stdout == "KVPoll.Failed\n"


def test_import_sender_exports_the_basic_names_lazily() -> None:
    code = (
        "import sys\n"
        "import sender\n"
        "heavy = [m for m in ('torch', 'sender.manager', 'sender.transport') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "from sender import (TRANSPORT_ERRORS, KVManager, KVPoll, NixlKVSender,\n"
        "                    NixlTransport, make_transfer_info)\n"
        "from sender.manager import KVManager as K\n"
        "assert KVManager is K and isinstance(TRANSPORT_ERRORS, tuple)\n"
        "want = {'EXTRA_MODULES', 'NIXL_BACKENDS', '__version__', *sender._EXPORTS}\n"
        "assert set(sender.__all__) == want, set(sender.__all__) ^ want\n"
        "assert all(hasattr(sender, n) for n in sender.__all__)\n"
        "assert 'NixlKVSender' in dir(sender)\n"
        "try:\n"
        "    sender.no_such_name\n"
        "except AttributeError as e:\n"
        "    assert 'no_such_name' in str(e)\n"
        "else:\n"
        "    raise AssertionError('no AttributeError')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=50, cwd=ROOT)


def test_the_decode_peer_moved_to_the_harness_with_a_deprecation() -> None:
    import sender
    from stress.harness.peer import DecodePeer, PeerProcess

    for name, cls in (("DecodePeer", DecodePeer), ("PeerProcess", PeerProcess)):
        with pytest.warns(DeprecationWarning, match=f"stress.harness.peer.{name}"):
            assert getattr(sender, name) is cls
        assert name not in sender.__all__


def test_peer_process_metadata_reads_as_bytes_and_calls_like_decode_peer() -> None:
    from stress.harness.peer import DecodePeer, MetadataBytes, PeerProcess

    blob = MetadataBytes(b"NXSTG\x01...")
    assert blob == b"NXSTG\x01..." and isinstance(blob, bytes)
    assert blob() == blob and type(blob()) is bytes
    assert callable(DecodePeer.metadata)  # the method, unchanged
    assert "peer.metadata()" in (PeerProcess.__doc__ or "")


@pytest.mark.nixl
@pytest.mark.slow
def test_both_peers_hand_metadata_to_add_peer_the_same_way() -> None:
    from sender import _nixl

    if not _nixl.AVAILABLE:
        pytest.skip(f"NIXL not importable: {_nixl.IMPORT_ERROR!r}")
    from sender import NixlTransport
    from stress.harness.peer import DecodePeer, PeerProcess

    with (
        NixlTransport("surface-tx") as tx,
        DecodePeer("surface-in", 8, 1024) as local,
        PeerProcess(8, 1024, name="surface-child") as child,
    ):
        tx.add_peer("in-process", local.metadata())
        tx.add_peer("child", child.metadata())  # the same spelling
        assert child.metadata() == child.metadata  # the attribute still reads as bytes
        assert tx.has_peer("in-process") and tx.has_peer("child")


MAIN_CLASSES = [
    ("sender.manager", "KVManager"),
    ("sender.nixl_sender", "NixlKVSender"),
    ("sender.transport", "NixlTransport"),
    ("stress.harness.peer", "DecodePeer"),
    ("stress.harness.peer", "PeerProcess"),
    ("staging.context", "StagingContext"),
    ("staging.compat", "CompatStagingContext"),
    ("staging.buffers", "StagingBufferPool"),
]


@pytest.mark.parametrize(("module", "name"), MAIN_CLASSES, ids=[n for _, n in MAIN_CLASSES])
def test_help_on_a_constructor_names_its_arguments(module: str, name: str) -> None:
    import importlib

    cls = getattr(importlib.import_module(module), name)
    text = pydoc.render_doc(cls, renderer=pydoc.plaintext)
    assert "Initialize self" not in text
    assert "Args:" in text and "Raises:" in text
    init_doc = cls.__init__.__doc__ or ""
    assert f"help({name})" in init_doc


def _library_loggers() -> set[str]:
    names: set[str] = set()
    for package in ("staging", "sender"):
        for path in sorted((ROOT / package).glob("*.py")):
            text = path.read_text(encoding="utf-8")
            names |= set(re.findall(r'getLogger\("([\w.]+)"\)', text))
            if "getLogger(__name__)" in text:
                names.add(f"{package}.{path.stem}")
    return names


def test_every_logger_of_the_library_is_in_logging_md() -> None:
    doc = (ROOT / "docs" / "LOGGING.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"^\| `([\w.]+)` \|", doc, re.MULTILINE))
    loggers = _library_loggers()
    assert "staging.compat" in loggers
    assert loggers <= documented, f"not in docs/LOGGING.md: {sorted(loggers - documented)}"
