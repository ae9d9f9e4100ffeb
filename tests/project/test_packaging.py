"""Packaging, checked without building a wheel (.ci/run builds and installs one).

* the core install needs only ``readerwriterlock``; torch, numpy and nixl come with the
  ``sender`` extra, as version ranges, and ``requirements.lock`` pins versions inside them;
* every package directory ships, except ``bench``, ``tests`` and ``tools``;
* an SPDX license string, its LICENSE file, and a build backend that reads them;
* with torch, numpy or nixl missing (blocked in ``sys.modules`` of a child interpreter),
  ``import staging`` and the staging stress scenario still work, and ``import sender`` or a
  sender scenario fails with one line that names the extra.
"""

from __future__ import annotations

import fnmatch
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.version import Version

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
EXTRA_MODULES = ("torch", "numpy", "nixl")
NOT_SHIPPED = {"bench", "tests", "tools"}  # run from a checkout (python -m bench, ...)
RANGE_OPERATORS = {">=", ">", "<", "<=", "!=", "~="}


def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def requirements(lines: list[str]) -> dict[str, Requirement]:
    reqs = [Requirement(line) for line in lines]
    return {r.name.lower(): r for r in reqs}


def lock_pins() -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for raw in (ROOT / "requirements.lock").read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        (spec,) = req.specifier  # exactly one clause ...
        assert spec.operator == "==", f"requirements.lock must pin exactly: {line!r}"  # ... ==
        pins[req.name.lower().replace("_", "-")] = Version(spec.version)
    return pins


def test_core_dependencies_are_readerwriterlock_only() -> None:
    deps = requirements(pyproject()["project"]["dependencies"])
    assert set(deps) == {"readerwriterlock"}, f"core dependencies: {sorted(deps)}"
    for req in deps.values():
        assert all(s.operator in RANGE_OPERATORS for s in req.specifier), f"pinned: {req}"


def test_sender_extra_brings_torch_numpy_nixl_as_ranges() -> None:
    extra = requirements(pyproject()["project"]["optional-dependencies"]["sender"])
    assert set(extra) == set(EXTRA_MODULES)
    for req in extra.values():
        operators = {s.operator for s in req.specifier}
        assert operators <= RANGE_OPERATORS, f"{req}: a range, not a pin"
        assert operators & {">=", ">"} and operators & {"<", "<="}, f"{req}: want both bounds"


def test_lock_pins_versions_inside_the_declared_ranges() -> None:
    project = pyproject()["project"]
    pins = lock_pins()
    declared = [*project["dependencies"], *project["optional-dependencies"]["sender"]]
    backend = pyproject()["build-system"]["requires"]
    for req in requirements([*declared, *backend]).values():
        assert req.name.lower() in pins, f"requirements.lock does not pin {req.name}"
        assert req.specifier.contains(pins[req.name.lower()], prereleases=True), (
            f"requirements.lock pins {req.name}=={pins[req.name.lower()]}, outside {req}"
        )


def _package_dirs(directory: Path, prefix: str = "") -> set[str]:
    """Dotted names of the directories with an ``__init__.py`` (not descending elsewhere)."""
    found: set[str] = set()
    for child in sorted(directory.iterdir()):
        if child.is_dir() and (child / "__init__.py").is_file():
            name = prefix + child.name
            found |= {name} | _package_dirs(child, name + ".")
    return found


def _shipped(names: set[str]) -> set[str]:
    config = pyproject()["tool"]["setuptools"]
    packages = config.get("packages", {})
    if isinstance(packages, list):
        return set(packages) & names
    find = packages["find"]
    assert find.get("namespaces") is False, "namespaces = false: a package has an __init__.py"
    include, exclude = find.get("include", ["*"]), find.get("exclude", [])
    return {
        n
        for n in names
        if any(fnmatch.fnmatchcase(n, p) for p in include)
        and not any(fnmatch.fnmatchcase(n, p) for p in exclude)
    }


def test_every_package_ships_except_bench_tests_and_tools() -> None:
    names = _package_dirs(ROOT)
    assert {
        "staging", "sender", "stress", "stress.scenarios", "stress.harness", "bench", "tests"
    } <= names
    shipped = _shipped(names)
    wanted = {n for n in names if n.split(".")[0] not in NOT_SHIPPED}
    assert shipped == wanted, f"missing {wanted - shipped}, extra {shipped - wanted}"
    package_data = pyproject()["tool"]["setuptools"]["package-data"]
    for top in {n.split(".")[0] for n in shipped}:
        if (ROOT / top / "py.typed").is_file():
            assert "py.typed" in package_data.get(top, []), f"{top}/py.typed is not shipped"
    assert not NOT_SHIPPED & set(package_data)


def test_spdx_license_string_license_file_and_a_backend_that_reads_them() -> None:
    project = pyproject()["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "classifiers" not in project or not any(
        c.startswith("License ::") for c in project["classifiers"]
    ), "an SPDX license string excludes license classifiers"
    (backend,) = requirements(pyproject()["build-system"]["requires"]).values()
    assert backend.name == "setuptools"
    assert not backend.specifier.contains("76.9"), "SPDX license strings need setuptools>=77"


def run_blocked(blocked: tuple[str, ...], code: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a child interpreter where importing any of ``blocked`` fails, as if not
    installed (``sys.modules[name] = None`` makes ``import name`` raise ModuleNotFoundError)."""
    prelude = f"import sys\nfor _m in {blocked!r}:\n    sys.modules[_m] = None\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )


NIXL_BACKENDS = ("nixl_cu13", "nixl_cu12")


@pytest.mark.parametrize("missing", EXTRA_MODULES)
def test_import_sender_without_the_extra_names_it(missing: str) -> None:
    # "nixl" is missing only when no backend wheel stands in for the meta package either.
    blocked = (missing, *NIXL_BACKENDS) if missing == "nixl" else (missing,)
    proc = run_blocked(blocked, "import sender")
    assert proc.returncode == 1
    assert proc.stderr.splitlines()[-1] == (
        f"ModuleNotFoundError: the sender needs the 'sender' extra (missing: {missing}): "
        "pip install '.[sender]' in a clone of nixl-staging (it is not on a package index "
        "yet; README, Install)"
    ), proc.stderr


def test_stress_without_the_extra_runs_staging_and_names_it_for_sender_scenarios() -> None:
    main = "from stress.cli import main\nsys.exit(main({}))"
    proc = run_blocked(EXTRA_MODULES, main.format(["sender-lifecycle", "--quick"]))
    assert (proc.returncode, proc.stdout) == (2, ""), proc.stderr
    assert proc.stderr == (
        "python -m stress: error: scenario 'sender-lifecycle' needs the 'sender' extra "
        "(no module 'torch'): pip install '.[sender]' in a clone of nixl-staging (it is not on "
        "a package index yet; README, Install)\n"
    )
    proc = run_blocked(EXTRA_MODULES, main.format(["--help"]))
    assert proc.returncode == 0, proc.stderr
    epilog = proc.stdout[proc.stdout.index("scenarios:") :]
    assert "staging-race " in epilog
    assert "sender-lifecycle   (not available: needs the 'sender' extra" in epilog
    run = ["staging-race", "--duration", "0.2", "--threads", "2", "--progress", "off"]
    code = "import staging\n" + main.format(run)
    proc = run_blocked(EXTRA_MODULES, code)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "result: PASS" in proc.stdout


def test_single_backend_extras_are_the_sender_extra_with_one_nixl_wheel() -> None:
    """``sender-cu13``/``sender-cu12``: the ``sender`` extra with one backend wheel in place
    of the ``nixl`` meta package (which installs both): 1.2 GB instead of 1.5 GB in a fresh
    venv with CPU torch (README). Ranges, pinned inside by requirements.lock."""
    extras = pyproject()["project"]["optional-dependencies"]
    sender = requirements(extras["sender"])
    pins = lock_pins()
    for variant in ("cu13", "cu12"):
        extra = requirements(extras[f"sender-{variant}"])
        assert set(extra) == {"torch", "numpy", f"nixl-{variant}"}, sorted(extra)
        assert extra["torch"].specifier == sender["torch"].specifier
        assert extra["numpy"].specifier == sender["numpy"].specifier
        backend = extra[f"nixl-{variant}"]
        assert backend.specifier == sender["nixl"].specifier
        assert backend.specifier.contains(pins[f"nixl-{variant}"])
    from sender import NIXL_BACKENDS as declared

    assert declared == NIXL_BACKENDS


def test_without_the_meta_package_the_sender_imports_its_backend() -> None:
    """An install of one backend wheel has no ``nixl`` module: ``sender._nixl`` imports the
    backend itself (the meta package would pick the same one without CUDA)."""
    import importlib.util

    present = [b for b in NIXL_BACKENDS if importlib.util.find_spec(b) is not None]
    if not present:
        pytest.skip("no NIXL backend wheel installed")
    code = (
        "import sender\n"
        "from sender import _nixl\n"
        "print(_nixl.AVAILABLE, _nixl.BACKEND_MODULE)\n"
        "from sender.transport import NixlTransport\n"
        "NixlTransport('no-meta').close()\n"
    )
    proc = run_blocked(("nixl",), code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", present[0]], proc.stdout
