"""``make sglang``: one venv per supported SGLang release, and ``tests/sglang`` run in each.

For every release in :data:`RELEASES` (each has ``tools/sglang/requirements-<version>.lock``):

1. a venv under ``build/sglang/<version>/`` made without pip (``.venv``'s pip installs into it
   with ``--python``), holding exactly the lock's distributions, installed with ``--no-deps``;
2. a ``.pth`` file naming ``.venv``'s site-packages, so that torch, nixl, numpy, pytest and
   the rest of ``requirements.lock`` are the very versions the rest of CI tests (the lock
   files say this too); the checkout itself comes first on ``PYTHONPATH``;
3. the ``torchvision`` stub (:mod:`tools.sglang.torchvision_stub`; why: see there);
4. **our built wheel**, installed ``--no-deps`` as a user's ``pip install nixl-staging``
   would: its ``sglang.srt.plugins`` entry point is found by SGLang's own ``load_plugins()``
   through ``importlib.metadata``, and ``staging`` is imported from the venv's
   site-packages, not from the checkout (the checkout comes *after* site-packages, for
   ``tools`` and ``tests`` only; pytest runs with ``-P`` and ``--import-mode=importlib`` so
   that neither puts it first). No SGLang source is changed;
5. ``pytest tests/sglang`` with that venv's interpreter, told which release it must find
   (``NIXL_STAGING_SGLANG_EXPECT``): there, an SGLang that does not import, or is another
   version, fails the run instead of skipping.

A venv is reused while its lock, the stub and the interpreter are unchanged (a stamp file).
Every release runs, whatever happened to the one before; the summary names each one with
PASS or FAIL and what its tests printed, and the exit status is 1 if any failed (a release
that cannot be installed is a FAIL, never a skip).

Usage: ``python -m tools.sglang [--release V ...] [--runs N] [--rebuild] [--root DIR]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import site
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tools.sglang import torchvision_stub

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
RELEASES = ("0.5.21", "0.5.23")
"""The SGLang releases CI runs against: the first with the staging dataclass and the newest
the package index served when this was written (a newer one gets its own lock file)."""
DEFAULT_ROOT = REPO / "build" / "sglang"
DEFAULT_RUNS = 100
STAMP = ".nixl-staging-stamp"
PTH = "_nixl_staging_base.pth"
REPO_PTH = "zz_nixl_staging_checkout.pth"  # after every other path: tools/, tests/ only
INSTALL_TIMEOUT_S = 900
TEST_TIMEOUT_S = 1200
# Never inherited by the test run: they would turn the plugin off, or put the checkout's
# `staging` before the installed wheel's.
_PLUGIN_ENV = ("PYTHONPATH", "SGLANG_PLUGINS", "NIXL_STAGING_SGLANG_PLUGIN")


@dataclass
class Outcome:
    """What happened to one release."""

    release: str
    ok: bool = False
    install: str = ""  # "reused", "installed in N s", or why it failed
    tests_s: float = 0.0
    summary: str = ""  # pytest's last line
    report: dict[str, Any] = field(default_factory=dict)
    problem: str = ""


def lock_file(release: str) -> Path:
    return HERE / f"requirements-{release}.lock"


def _site_packages(venv: Path) -> Path:
    return (
        venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    )


def _stamp(release: str) -> str:
    digest = hashlib.sha256()
    digest.update(lock_file(release).read_bytes())
    digest.update(Path(torchvision_stub.__file__).read_bytes())
    digest.update(sys.version.encode())
    digest.update("\n".join(site.getsitepackages()).encode())
    return digest.hexdigest()


def build(release: str, venv: Path, *, rebuild: bool) -> str:
    """Make (or reuse) the venv of ``release``; return how.

    Raises:
        RuntimeError: the lock file is missing, or creating or installing failed (the
            message carries the tail of pip's output).
    """
    lock = lock_file(release)
    if not lock.is_file():
        raise RuntimeError(f"no lock file {lock.relative_to(REPO)} for sglang {release}")
    stamp = _stamp(release)
    stamp_file = venv / STAMP
    if not rebuild and stamp_file.is_file() and stamp_file.read_text() == stamp:
        return "reused"
    t0 = time.monotonic()
    if venv.exists():
        shutil.rmtree(venv)
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], "venv", timeout=120)
    packages = _site_packages(venv)
    (packages / PTH).write_text("".join(f"{p}\n" for p in site.getsitepackages()))
    pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python")]
    _run(
        [*pip, "install", "-q", "--no-deps", "--no-compile", "-r", str(lock)],
        "pip install",
        timeout=INSTALL_TIMEOUT_S,
    )
    torchvision_stub.write_stub(packages)
    stamp_file.write_text(stamp)
    return f"installed in {time.monotonic() - t0:.0f} s ({_du(venv)})"


def _run(cmd: list[str], what: str, *, timeout: float) -> None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{what} did not finish within {timeout:.0f} s") from None
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"{what} failed (exit {done.returncode}):\n{tail}")


def _du(path: Path) -> str:
    total = sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())
    return f"{total / 2**20:.0f} MiB"


def build_wheel(dest: Path) -> Path:
    """Our wheel, built from the tracked (and new, not ignored) files of the checkout copied
    to a scratch directory (as ``.ci/run`` does), so the checkout is not written to.

    Raises:
        RuntimeError: listing the files or building failed.
    """
    if dest.exists():
        shutil.rmtree(dest)
    src = dest / "src"
    src.mkdir(parents=True)
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=REPO,
            capture_output=True,
            check=True,
            timeout=60,
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"git ls-files failed: {exc}") from None
    for name in filter(None, listed.decode().split("\0")):
        path = REPO / name
        if path.is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, src / name)
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(dest),
            str(src),
        ],
        "pip wheel",
        timeout=300,
    )
    wheels = sorted(dest.glob("nixl_staging-*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"pip wheel made {[w.name for w in wheels]}")
    return wheels[0]


def install_wheel(venv: Path, wheel: Path) -> None:
    """Install ``wheel`` into the release's venv as a user would (``--no-deps``: its one
    dependency, readerwriterlock, comes from .venv), and put the checkout on the path after
    site-packages (for ``tools``/``tests``).

    Raises:
        RuntimeError: pip failed.
    """
    pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python")]
    _run(
        [*pip, "install", "-q", "--no-deps", "--no-compile", "--force-reinstall", str(wheel)],
        "pip install (our wheel)",
        timeout=300,
    )
    (_site_packages(venv) / REPO_PTH).write_text(f"{REPO}\n")


def run_tests(release: str, venv: Path, runs: int, extra: Sequence[str]) -> Outcome:
    """``pytest tests/sglang`` in the release's venv, its output streamed with a prefix."""
    out = Outcome(release)
    report = venv / "report.json"
    report.unlink(missing_ok=True)
    env = {
        **{k: v for k, v in os.environ.items() if k not in _PLUGIN_ENV},
        "NIXL_STAGING_SGLANG_EXPECT": release,
        "NIXL_STAGING_SGLANG_REPORT": str(report),
        "NIXL_STAGING_SGLANG_RUNS": str(runs),
        "NIXL_LOG_LEVEL": os.environ.get("NIXL_LOG_LEVEL", "WARN"),
    }
    cmd = [
        str(venv / "bin" / "python"),
        "-P",
        "-m",
        "pytest",
        "--import-mode=importlib",
        "-q",
        "-ra",
        "-p",
        "no:cacheprovider",
        "-W",
        "ignore::UserWarning",
        "-W",
        "ignore::DeprecationWarning",
        "-W",
        "ignore:Unable to find acceptable character detection",
        "tests/sglang",
        *extra,
    ]
    t0 = time.monotonic()
    last = ""
    with subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                print(f"[sglang {release}] {line}", end="", flush=True)
                if line.strip():
                    last = line.strip()
            code = proc.wait(timeout=TEST_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = -9
    out.tests_s = time.monotonic() - t0
    out.summary = last
    if report.is_file():
        out.report = json.loads(report.read_text())
    out.ok = code == 0 and bool(out.report.get("figures"))
    if code != 0:
        out.problem = f"pytest exit {code}"
    elif not out.report.get("figures"):
        out.problem = "the tests wrote no report (did they run?)"
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tools.sglang",
        description="Build a venv per SGLang release and run tests/sglang in each.",
    )
    p.add_argument("--release", action="append", help=f"a release (default: {RELEASES})")
    p.add_argument("--runs", type=int, default=DEFAULT_RUNS, help="threaded runs per config")
    p.add_argument("--rebuild", action="store_true", help="rebuild the venvs")
    p.add_argument("--root", type=Path, default=DEFAULT_ROOT, help="where the venvs live")
    p.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = p.parse_args(argv)
    releases = tuple(args.release or RELEASES)
    t_all = time.monotonic()
    outcomes: list[Outcome] = []
    wheel: Path | None = None
    for release in releases:
        venv = args.root / release
        shown = venv.relative_to(REPO) if venv.is_relative_to(REPO) else venv
        print(f"[sglang {release}] venv {shown}", flush=True)
        try:
            how = build(release, venv, rebuild=args.rebuild)
        except (RuntimeError, OSError) as exc:
            outcome = Outcome(release, install=f"FAILED: {exc}", problem="install failed")
            print(f"[sglang {release}] install FAILED: {exc}", flush=True)
            outcomes.append(outcome)
            continue
        try:
            if wheel is None:  # once, after the first venv exists
                wheel = build_wheel(args.root / "wheel")
                print(f"sglang clients: built {wheel.name}", flush=True)
            install_wheel(venv, wheel)
        except (RuntimeError, OSError) as exc:
            outcome = Outcome(release, install=f"FAILED: {exc}", problem="install failed")
            print(f"[sglang {release}] our wheel: install FAILED: {exc}", flush=True)
            outcomes.append(outcome)
            continue
        print(f"[sglang {release}] venv {how}; {wheel.name} installed", flush=True)
        outcome = run_tests(release, venv, args.runs, args.pytest_args)
        outcome.install = how
        outcomes.append(outcome)
    print(f"\nsglang clients: {len(releases)} releases in {time.monotonic() - t_all:.0f} s")
    for o in outcomes:
        verdict = "PASS" if o.ok else f"FAIL ({o.problem})"
        print(f"  sglang {o.release}: {verdict}; venv {o.install}; tests {o.tests_s:.0f} s")
        print(f"    pytest: {o.summary}")
        for line in o.report.get("figures", []):
            print(f"    {line}")
    return 0 if outcomes and all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
