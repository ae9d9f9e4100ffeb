"""A :class:`PeerProcess` that fails to start says why: its exit status and its own last
stderr lines, whatever ``stderr`` the caller gave (``DEVNULL``, as the stress rig and the
benchmarks pass, included). Every peer here really fails to start (a bad argument, UCX with
no transport, too short a start-up bound); none is a fake."""

from __future__ import annotations

import io
import os
import subprocess
import tempfile

import pytest

from stress.harness.peer import PeerError, PeerProcess, PeerStartError
from tests.fixtures_nixl import requires_nixl

pytestmark = [pytest.mark.nixl, requires_nixl, pytest.mark.timeout(90)]


def test_a_bad_argument_is_reported_with_the_childs_own_words() -> None:
    with pytest.raises(PeerStartError) as info:
        PeerProcess(8, 4096, device="nonsense", stderr=subprocess.DEVNULL)
    exc = info.value
    assert exc.status == 2  # argparse's usage error
    assert "--device 'nonsense' is not usable here" in exc.stderr_tail
    text = str(exc)
    assert "peer exited before listening (exit status 2)" in text
    assert "its last stderr lines:" in text and "--device 'nonsense'" in text


def test_a_peer_whose_nixl_agent_cannot_be_made_reports_the_cause() -> None:
    """UCX with no transport at all (``UCX_TLS=""``): the child's NixlTransport fails in
    NIXL; its traceback's last line (the AgentSetupError naming the UCX environment) is in
    the error, with the exit status."""
    with pytest.raises(PeerStartError) as info:
        PeerProcess(8, 4096, env={"UCX_TLS": ""}, stderr=subprocess.DEVNULL)
    exc = info.value
    assert exc.status == 1
    assert "AgentSetupError" in exc.stderr_tail and "UCX_TLS=''" in exc.stderr_tail, exc


def test_a_peer_not_listening_in_time_is_reaped_and_reported() -> None:
    """No interpreter imports NIXL within 50 ms: the bound passes, the child is reaped (by
    our SIGTERM, hence a negative status) and the error says so."""
    with pytest.raises(PeerStartError) as info:
        PeerProcess(8, 4096, start_timeout_s=0.05, stderr=subprocess.DEVNULL)
    exc = info.value
    assert exc.status is not None and exc.status < 0
    assert "did not print LISTENING in time" in str(exc)


@pytest.mark.slow
def test_a_started_peer_writes_its_stderr_where_it_was_asked() -> None:
    """What the child wrote while starting (here: Python's import-time profile, on stderr)
    is copied to the caller's file, and once it listens its own stderr and stdout *are*
    that file (same inode). File descriptors and ``None`` (inherit) start as well."""
    with tempfile.TemporaryFile("w+b") as err:
        with PeerProcess(8, 4096, stderr=err, env={"PYTHONPROFILEIMPORTTIME": "1"}) as peer:
            assert peer.ping()
            mine = os.fstat(err.fileno()).st_ino
            for fd in (1, 2):
                assert os.stat(f"/proc/{peer.pid}/fd/{fd}").st_ino == mine, fd
        err.seek(0)
        assert b"import time:" in err.read()
    fd = os.open(os.devnull, os.O_WRONLY)
    try:
        with PeerProcess(8, 4096, stderr=fd) as peer:
            assert peer.ping()
    finally:
        os.close(fd)
    with PeerProcess(8, 4096) as peer:
        assert peer.ping()


def test_bad_stderr_kinds_are_refused_before_anything_starts() -> None:
    for bad in (subprocess.PIPE, subprocess.STDOUT, io.StringIO(), -7, "err.log"):
        with pytest.raises(ValueError, match="stderr must be"):
            PeerProcess(8, 4096, stderr=bad)  # type: ignore[arg-type]
    assert issubclass(PeerStartError, PeerError)
