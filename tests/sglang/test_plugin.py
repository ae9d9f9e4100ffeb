"""The plugin as a user gets it: our wheel installed into the release's venv, found by
SGLang's own ``load_plugins()`` through its entry point, all or nothing, and loud.

* ``load_plugins()`` (run once for the session by :func:`tools.sglang.drive.load`) applied
  every hook of this release's table entry and logged ONE INFO line, no WARNING; ``staging``
  was imported from the installed wheel, not from the checkout.
* An unknown release (its version faked in a child interpreter): no hook registered, ONE
  WARNING naming the installed release, the supported ones and what is missing.
* The two opt-outs: ``NIXL_STAGING_SGLANG_PLUGIN=0`` (no hook, one INFO line) and SGLang's
  ``SGLANG_PLUGINS`` whitelist without us (our function is never called).
* ``python -m staging.sglang --check`` says the truth in each case, with its exit status.

One child interpreter (one import of SGLang) runs all of them, in a scratch directory with
no ``PYTHONPATH``: what it imports of ours is the installed wheel.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.sglang import drive

pytestmark = pytest.mark.timeout(600)

EXPECT = os.environ.get("NIXL_STAGING_SGLANG_EXPECT")
_OURS_ENV = ("PYTHONPATH", "SGLANG_PLUGINS", "NIXL_STAGING_SGLANG_PLUGIN")


def _child(code: str, tmp: Path, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in _OURS_ENV}
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )


def test_load_plugins_applied_every_hook(up: drive.Upstream, figures: list[str]) -> None:
    import importlib.metadata

    import staging
    from staging.compat import CompatStagingContext
    from staging.sglang.releases import RELEASES

    warnings = [r for r in up.plugin_log if r.levelname == "WARNING"]
    infos = [r.getMessage() for r in up.plugin_log if r.levelname == "INFO"]
    assert not warnings, [w.getMessage() for w in warnings]
    assert len(infos) == 1, infos
    assert issubclass(up.staging_class, CompatStagingContext)
    assert up.staging_class is not up.released_staging_class
    assert up.released, "the release's table entry hooks nothing?"
    for owner, name, released in up.released:
        now = owner.__dict__[name]
        assert now is not released and getattr(now, "__wrapped__", None) is released, name
    eps = [
        ep
        for ep in importlib.metadata.entry_points(group="sglang.srt.plugins")
        if ep.name == "nixl_staging"
    ]
    assert len(eps) == 1 and eps[0].value == "staging.sglang:register"
    where = Path(staging.__file__).resolve()
    if EXPECT:  # under make sglang: the wheel's copy, not the checkout's
        assert Path(sys.prefix).resolve() in where.parents, where
    hooked = [t.path for t in RELEASES[up.version] if t.hook]
    figures.append(f"load_plugins(): {len(hooked)} hooks applied; staging from {where.parent}")
    figures.append(f"plugin INFO line: {infos[0]}")


_CASES = r"""
import json, logging, os
records = []
class H(logging.Handler):
    def emit(self, r): records.append((r.levelname, r.getMessage()))
logging.getLogger("staging.sglang").addHandler(H())
logging.getLogger("staging.sglang").setLevel(logging.DEBUG)
import staging.sglang.plugin as ours
from sglang.srt import plugins
from sglang.srt.plugins.hook_registry import HookRegistry
out = {}
def case(name, env, fake=None):
    records.clear()
    for k in ("SGLANG_PLUGINS", "NIXL_STAGING_SGLANG_PLUGIN"):
        os.environ.pop(k, None)
    os.environ.update(env)
    real = ours.installed_release
    if fake:
        ours.installed_release = lambda: fake
    plugins._plugins_loaded = False
    HookRegistry.reset()
    try:
        plugins.load_plugins()
    finally:
        ours.installed_release = real
    out[name] = {"log": list(records), "hooks": sorted(HookRegistry._hooks)}
case("unknown release", {}, fake="0.5.99")
case("NIXL_STAGING_SGLANG_PLUGIN=0", {"NIXL_STAGING_SGLANG_PLUGIN": "0"})
case("SGLANG_PLUGINS=someone_else", {"SGLANG_PLUGINS": "someone_else"})
from sglang.srt.disaggregation.common import staging_handler
import dataclasses
out["fields"] = [f.name for f in dataclasses.fields(staging_handler.PrefillStagingContext)]
# python -m staging.sglang --check, in this same interpreter (one import of SGLang for all):
import contextlib, io
from staging.sglang.__main__ import main
def check(env, fake=None):
    for k in ("SGLANG_PLUGINS", "NIXL_STAGING_SGLANG_PLUGIN"):
        os.environ.pop(k, None)
    os.environ.update(env)
    real = ours.installed_release
    if fake:
        ours.installed_release = lambda: fake
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            code = main(["--check"])
    finally:
        ours.installed_release = real
    return {"exit": code, "out": buf.getvalue()}
out["check"] = check({})
out["check fake"] = check({}, fake="0.5.99")
out["check off"] = check({"NIXL_STAGING_SGLANG_PLUGIN": "0"})
print("JSON" + json.dumps(out))
"""


def test_unknown_release_opt_outs_and_check(
    up: drive.Upstream, figures: list[str], tmp_path: Path
) -> None:
    from staging.sglang.releases import RELEASES

    done = _child(_CASES, tmp_path)
    line = next((x for x in done.stdout.splitlines() if x.startswith("JSON")), None)
    assert done.returncode == 0 and line, done.stderr[-3000:]
    out = json.loads(line[4:])
    unknown = out["unknown release"]
    assert unknown["hooks"] == []
    assert [lvl for lvl, _ in unknown["log"]] == ["WARNING"], unknown["log"]
    message = unknown["log"][0][1]
    assert "0.5.99" in message and all(r in message for r in RELEASES)
    assert "missing target" in message
    off = out["NIXL_STAGING_SGLANG_PLUGIN=0"]
    assert off["hooks"] == [] and [lvl for lvl, _ in off["log"]] == ["INFO"], off["log"]
    skipped = out["SGLANG_PLUGINS=someone_else"]
    assert skipped["hooks"] == [] and skipped["log"] == []
    assert "prefetch_requested" in out["fields"]  # upstream's class, untouched
    figures.append(f"unknown release (faked 0.5.99): no hook; WARNING: {message}")
    figures.append(f"NIXL_STAGING_SGLANG_PLUGIN=0: no hook; INFO: {off['log'][0][1]}")
    figures.append("SGLANG_PLUGINS=someone_else: no hook, the plugin is not called")
    # --check tells the truth: applies (0), does not apply (1), turned off (2).
    real, fake, off_ = out["check"], out["check fake"], out["check off"]
    assert real["exit"] == 0, real
    assert f"sglang installed: {up.version}" in real["out"] and "plugin: APPLIES" in real["out"]
    assert fake["exit"] == 1 and "does NOT apply" in fake["out"], fake
    assert off_["exit"] == 2 and "plugin: OFF" in off_["out"], off_
    figures.append("--check (installed release), exit 0:")
    figures.extend(f"  {x}" for x in real["out"].splitlines())
    figures.append("--check (version faked 0.5.99), exit 1:")
    figures.extend(f"  {x}" for x in fake["out"].splitlines())
    figures.append(
        f"--check (NIXL_STAGING_SGLANG_PLUGIN=0), exit 2: {off_['out'].splitlines()[-1]}"
    )
