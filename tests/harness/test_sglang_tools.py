"""The machinery of ``make sglang`` and the SGLang plugin on their own, without SGLang (runs
in the normal suite): the worker-block lifting on toy code of ours shaped like the upstream
forms, the plugin's staging class on a toy dataclass, the plugin where SGLang is missing
(one WARNING, nothing registered, ``--check`` exit 1) and without torch/nixl/sglang
importable, ``lift_tombstone``, the torchvision stub, and the runner's verdict for a
release it cannot install."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import threading
import types
from pathlib import Path
from typing import Any

import pytest

from staging import CompatStagingContext
from staging.sglang import hooks, plugin
from staging.sglang.releases import RELEASES
from tools.sglang import adopt, torchvision_stub, venvs

pytestmark = pytest.mark.timeout(120)


# Toy code in the shape of the released worker's clean-up (written for this test).
def _worker(self: Any, queue: list[int]) -> None:
    for room in queue:
        self.done.append(room)
        if self.ctx is not None:
            for key in list(self.ctx.prefetch_requested):
                if key[0] == room:
                    self.ctx.prefetch_requested.discard(key)
            self.ctx.prefetched_rooms.discard(room)  # the other order: still one site


def _no_site(ctx: Any, room: int) -> None:
    ctx.prefetched_rooms.discard(room)


def _filled() -> CompatStagingContext:
    ctx = CompatStagingContext()
    ctx.prefetch_requested.update([(1, 0, "s"), (1, 1, "s"), (2, 0, "s")])
    ctx.prefetched_rooms.update([1, 2])
    return ctx


def test_purge_block_lifts_the_worker_block_as_is_or_adopted() -> None:
    for adopted in (False, True):
        block, rec = adopt.purge_block(_worker, ("self", "room"), adopted=adopted)
        owner = type("Owner", (), {})()
        owner.ctx = _filled()
        block(owner, 1)
        assert owner.ctx.prefetch_requested.snapshot() == {(2, 0, "s")}
        assert owner.ctx.stats().tombstones == (1 if adopted else 0)
        assert "list(prefetch_requested)" in rec.replaced and rec.lines_removed == 4


def test_purge_block_refuses_code_of_another_shape() -> None:
    with pytest.raises(adopt.AdoptionError, match="found 0"):
        adopt.purge_block(_no_site, ("ctx", "room"), adopted=True)


@dataclasses.dataclass
class _Upstreamish:
    buffers: list[int] = dataclasses.field(default_factory=list)
    cv: threading.Condition = dataclasses.field(default_factory=threading.Condition)
    prefetch_requested: set[Any] = dataclasses.field(default_factory=set)
    prefetched_rooms: set[int] = dataclasses.field(default_factory=set)
    sockets: dict[str, Any] = dataclasses.field(default_factory=dict)


def test_plugin_staging_class_on_a_toy_dataclass() -> None:
    cls = hooks.staging_class(_Upstreamish)
    assert cls.__name__ == "_Upstreamish" and dataclasses.is_dataclass(cls)
    assert cls.__module__ == _Upstreamish.__module__
    a, b = cls(), cls()
    names = [f.name for f in dataclasses.fields(cls)]
    assert names == ["buffers", "cv", "sockets"]
    assert a == a and a != b  # each has its own Condition, compared by identity
    a.prefetch_requested.add((1, 0, "s"))
    a.prefetch_requested |= {(1, 1, "s")}  # in place: stored back, accepted
    a.prefetched_rooms.add(1)
    with pytest.raises(TypeError, match="purge_room"):
        a.prefetch_requested = set()
    assert a.purge_room(1).requests == {(0, "s"), (1, "s")}
    assert not a.prefetch_requested and not b.prefetch_requested
    assert isinstance(a, CompatStagingContext)
    with pytest.raises(ValueError):
        hooks.staging_class(CompatStagingContext)


def test_lift_tombstone_drops_nothing_reopen_room_does() -> None:
    ctx = _filled()
    assert ctx.lift_tombstone(1) is False  # live: no tombstone, keys kept
    assert {k for k in ctx.prefetch_requested if k[0] == 1} == {(1, 0, "s"), (1, 1, "s")}
    ctx.purge_room(1)
    ctx.prefetch_requested.add((1, 5, "s"))  # a late write: refused
    assert (1, 5, "s") not in ctx.prefetch_requested
    assert ctx.lift_tombstone(1) is True and ctx.lift_tombstone(1) is False
    ctx.prefetch_requested.add((1, 5, "s"))  # a new request's write: accepted
    assert (1, 5, "s") in ctx.prefetch_requested and ctx.stats().reopens == 1
    ctx.reopen_room(1)  # the other call drops what a live id holds
    assert (1, 5, "s") not in ctx.prefetch_requested


_NO_SGLANG = """
import sys
for name in ("sglang", "torch", "nixl", "numpy"):
    sys.modules[name] = None  # importing any of them raises ImportError
import logging
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s %(message)s")
import staging.sglang.plugin as ours
ours.installed_release = lambda: None if len(sys.argv) < 2 else sys.argv[1]
import staging.sglang
result = staging.sglang.register()
assert not result.applies and not result.hooks
from staging.sglang.__main__ import main
raise SystemExit(main(["--check"]))
"""


@pytest.mark.parametrize("release", [None, "0.5.23"], ids=["not installed", "unimportable"])
def test_plugin_without_sglang_registers_nothing_and_says_so(release: str | None) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _NO_SGLANG, *([release] if release else [])],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    warnings = [x for x in done.stderr.splitlines() if x.startswith("WARNING staging.sglang")]
    assert len(warnings) == 1, done.stderr
    assert "0.5.21, 0.5.23" in warnings[0]
    if release:  # the release is in the table but its first target cannot be imported
        assert "missing target sglang.srt.disaggregation" in warnings[0]
    else:
        assert "not installed" in warnings[0]
        assert "To use the plugin, run a supported release" in done.stdout
    assert "does NOT apply" in done.stdout


def test_check_on_an_unsupported_release_says_which_releases_to_use(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--check` on an unsupported SGLang named the supported releases only as a list;
    it now says what to install (the newest supported release first) and the route for any
    other SGLang."""
    import staging.sglang.plugin as plugin
    from staging.sglang.__main__ import main
    from staging.sglang.releases import RELEASES

    monkeypatch.delenv("NIXL_STAGING_SGLANG_PLUGIN", raising=False)
    monkeypatch.setattr(plugin, "installed_release", lambda: "0.5.99")
    assert main(["--check"]) == 1
    out = capsys.readouterr().out
    verdict = next(x for x in out.splitlines() if x.startswith("plugin: does NOT apply"))
    newest = list(RELEASES)[-1]
    assert "sglang 0.5.99 is not a supported release" in verdict
    assert f"run a supported release: pip install 'sglang=={newest}'" in verdict
    assert all(r in verdict for r in RELEASES) and "docs/ADOPTING.md" in verdict


def test_the_entry_point_is_declared() -> None:
    import tomllib

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    group = project["project"]["entry-points"]["sglang.srt.plugins"]
    assert group == {"nixl_staging": "staging.sglang:register"}
    assert plugin.ENTRY_POINT == "nixl_staging"
    for targets in RELEASES.values():
        assert all(len(t.fingerprint) == 16 for t in targets)
        assert {t.hook_type for t in targets} <= {"REPLACE", "AROUND", "AFTER", None}


def test_torchvision_stub_imports_and_tolerates_reads(tmp_path: Path) -> None:
    torchvision_stub.write_stub(tmp_path)
    torchvision_stub.write_stub(tmp_path)  # rewriting our own stub is fine
    code = """
import importlib.metadata, sys
import torchvision
import torchvision.transforms as T
from torchvision.transforms import functional as TF, InterpolationMode
from torchvision.io import decode_jpeg
class Mine(T.Compose):
    pass
assert torchvision.STUB and torchvision.__version__ == "0.0.0"
assert importlib.metadata.version("torchvision") == "0.0.0"
InterpolationMode.BICUBIC, TF.resize, T.Normalize(mean=1).x.y, Mine()(1), decode_jpeg
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
    real = tmp_path / "real"
    (real / "torchvision").mkdir(parents=True)
    (real / "torchvision" / "__init__.py").write_text("# a real one\n")
    with pytest.raises(FileExistsError):
        torchvision_stub.write_stub(real)


def test_runner_fails_a_release_it_cannot_install(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert venvs.main(["--release", "0.0.0-none", "--root", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "sglang 0.0.0-none: FAIL (install failed)" in out and "no lock file" in out


def test_every_release_has_a_lock_pinning_itself() -> None:
    for release in venvs.RELEASES:
        lines = venvs.lock_file(release).read_text().splitlines()
        pins = [line for line in lines if line and not line.startswith("#")]
        assert f"sglang=={release}" in pins
        assert all("==" in pin for pin in pins), pins
        names = {pin.split("==")[0].lower() for pin in pins}
        assert not names & {"torch", "nixl", "numpy", "torchvision"}, "these come from .venv"


# Toy senders in the two released shapes of clear() (written for this test): the staging
# drop in the middle of the body, as a rebind (0.5.21) or a list() walk (0.5.23).
class _ToyManager:
    def __init__(self, ctx: Any, deferred: object | None = None) -> None:
        self._staging_ctx = ctx
        self.enable_staging = True
        self.deferred_bootstrap = deferred
        self.request_status = {1: "x", 2: "y"}
        self.walked = 0

    def note(self, room: int) -> None:
        self.request_status.pop(room, None)


class _ToyRebinding:
    def __init__(self, mgr: _ToyManager, room: int, owns: bool = True) -> None:
        self.kv_mgr, self.bootstrap_room, self._owns_bootstrap_room = mgr, room, owns
        self.conclude_state = None

    def clear(self) -> None:
        if self.kv_mgr.deferred_bootstrap is not None and not self._owns_bootstrap_room:
            return
        self.kv_mgr.note(self.bootstrap_room)  # a method: bound to the real manager
        ctx = self.kv_mgr._staging_ctx
        if ctx is not None:
            ctx.prefetched_rooms.discard(self.bootstrap_room)
            ctx.prefetch_requested = {
                k for k in ctx.prefetch_requested if k[0] != self.bootstrap_room
            }


class _ToyWalking(_ToyRebinding):
    def clear(self) -> None:
        if self.kv_mgr.deferred_bootstrap is not None and not self._owns_bootstrap_room:
            return
        self.kv_mgr.request_status.pop(self.bootstrap_room, None)
        ctx = self.kv_mgr._staging_ctx
        if ctx is not None:
            ctx.prefetched_rooms.discard(self.bootstrap_room)
            for key in list(ctx.prefetch_requested):
                self.kv_mgr.walked += 1
                if key[0] == self.bootstrap_room:
                    ctx.prefetch_requested.discard(key)


@pytest.mark.parametrize("shape", [_ToyRebinding, _ToyWalking], ids=["rebind", "walk"])
def test_clear_hook_purges_once_and_skips_the_released_drop(shape: type) -> None:
    hook = hooks.purge_then_clear()
    mgr = _ToyManager(_filled())
    sender = shape(mgr, 1)
    hook(shape.clear, sender)
    ctx = mgr._staging_ctx
    assert ctx.prefetch_requested.snapshot() == {(2, 0, "s")}
    assert ctx.prefetched_rooms.snapshot() == {2}
    assert ctx.stats().tombstones == 1 and mgr.walked == 0  # the released drop did not run
    assert mgr.request_status == {2: "y"}  # the rest of the released body did
    assert sender.kv_mgr is mgr  # put back
    # Bare sets (the plugin's class not in place): the released clear() as it is.
    bare = _ToyManager(
        types.SimpleNamespace(prefetch_requested={(1, 0, "s")}, prefetched_rooms={1})
    )
    hook(shape.clear, shape(bare, 1))
    assert not bare._staging_ctx.prefetch_requested and not bare._staging_ctx.prefetched_rooms


def test_clear_hook_leaves_a_duplicates_room_and_restores_on_error() -> None:
    hook = hooks.purge_then_clear()
    mgr = _ToyManager(_filled(), deferred=object())
    hook(_ToyWalking.clear, _ToyWalking(mgr, 1, owns=False))  # a duplicate (0.5.23)
    assert len(mgr._staging_ctx.prefetch_requested) == 3  # the live first's keys stay

    def failing(self: Any) -> None:
        assert self.kv_mgr._staging_ctx is None and self.kv_mgr.request_status
        raise RuntimeError("released clear() failed")

    sender = _ToyWalking(mgr, 1)
    with pytest.raises(RuntimeError):
        hook(failing, sender)
    assert sender.kv_mgr is mgr and mgr._staging_ctx.stats().tombstones == 1


def test_lift_hook_lifts_only_for_a_new_owner() -> None:
    hook = hooks.lift_on_new_sender()
    mgr = _ToyManager(_filled())
    mgr._staging_ctx.purge_room(1)
    dup = _ToyWalking(mgr, 1, owns=False)
    hook(None, dup)
    failed = _ToyWalking(mgr, 1)
    failed.conclude_state = "Failed"
    hook(None, failed)
    assert mgr._staging_ctx.stats().tombstones == 1  # neither lifted it
    hook(None, _ToyWalking(mgr, 1))
    assert mgr._staging_ctx.stats().tombstones == 0
    hook(None, _ToyWalking(mgr, None))  # type: ignore[arg-type]  # no id: nothing, no raise
