"""Arguments of ``python -m stress.harness.peer``, parsed without NIXL, torch or numpy.

``stress.harness.peer`` imports NIXL (whose backend probe imports torch: 2-4 s) at module level.
Run as ``python -m stress.harness.peer``, it parses its arguments with :func:`parse_args` *before*
those imports, so ``--help`` and bad arguments answer at once. Only the standard library is
imported here.
"""

from __future__ import annotations

import argparse
import socket
from collections.abc import Sequence

HOST = "127.0.0.1"
"""The only address of the control channel unless ``--allow-host`` names another."""

PROG = "python -m stress.harness.peer"


def is_ipv4(text: str) -> bool:
    """True for a dotted-quad IPv4 address. Pure; thread-safe."""
    try:
        socket.inet_pton(socket.AF_INET, text)
    except OSError:
        return False
    return True


def positive_int(text: str) -> int:
    """argparse type: an int >= 1.

    Raises:
        argparse.ArgumentTypeError: not an integer, or < 1.
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


class _HelpFormatter(argparse.HelpFormatter):
    """Shows an option's default only where there is one worth showing: not for required
    options, flags, or options whose default is "none" (their help says what happens)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            action.required
            or action.default in (None, False, argparse.SUPPRESS)
            or "%(default)" in text
            or not action.option_strings
        ):
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m stress.harness.peer``. Pure; thread-safe."""
    ap = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "Run a decode peer: a KV pool registered with NIXL that remote senders write "
            f"into. Once ready it prints one line, 'LISTENING {HOST}:<port>', on stdout "
            "(its control channel); everything else goes to stderr. SIGTERM/SIGINT stop it."
        ),
        formatter_class=_HelpFormatter,
    )
    ap.add_argument(
        "--listen",
        default=f"{HOST}:0",
        help=f"ADDR:PORT of the control channel (0 = any free port); ADDR must be {HOST} "
        "unless --allow-host names it",
    )
    ap.add_argument(
        "--allow-host",
        default=None,
        metavar="ADDR",
        help="also allow this local IPv4 address for --listen (e.g. the peer's address in its "
        "own network namespace); the control channel is then reachable wherever ADDR is",
    )
    ap.add_argument(
        "--pages", type=positive_int, required=True, metavar="N", help="pages in the KV pool"
    )
    ap.add_argument(
        "--page-bytes", type=positive_int, required=True, metavar="B", help="bytes per KV page"
    )
    ap.add_argument("--name", default=None, help="NIXL agent name (unique if not given)")
    ap.add_argument("--device", default="cpu", help="torch device of the pool: cpu or cuda[:N]")
    ap.add_argument(
        "--parent-pid", type=int, default=0, help="exit when this process is gone (0 = never)"
    )
    ap.add_argument(
        "--stderr-fd",
        type=int,
        default=None,
        metavar="FD",
        help="once listening, write stderr (and stdout) to this inherited descriptor instead "
        "(PeerProcess keeps what came before, to report a failed start)",
    )
    ap.add_argument(
        "--watch-stamps",
        type=float,
        default=None,
        metavar="SECONDS",
        help="log every stamped write that lands in the pool (its page headers scanned this "
        "often; the 'landings' command returns the log): an investigation aid, off by default",
    )
    return ap


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """Parse and check ``argv`` (``None``: ``sys.argv[1:]``); returns the parser (for
    later errors, e.g. an unusable ``--device``) and the arguments, with ``host`` and
    ``port`` (int) split from ``--listen``.

    Raises:
        SystemExit: ``--help`` (status 0) or bad arguments (status 2, one line on stderr).
    """
    ap = build_parser()
    args = ap.parse_args(None if argv is None else list(argv))
    host, _, port_s = args.listen.rpartition(":")
    if args.allow_host is not None and not is_ipv4(args.allow_host):
        ap.error(f"--allow-host: not an IPv4 address: {args.allow_host!r}")
    if host != HOST and host != args.allow_host:
        ap.error(f"--listen: only {HOST} (or the address given to --allow-host) may be used")
    if not port_s.isdigit() or int(port_s) > 65535:
        ap.error(f"--listen: bad port {port_s!r}")
    args.host, args.port = host, int(port_s)
    return ap, args
