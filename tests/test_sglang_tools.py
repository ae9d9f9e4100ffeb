"""The machinery of ``make sglang`` on its own, without SGLang (runs in the normal suite):
the syntax-tree patch on toy code of ours shaped like the two upstream forms, the dataclass
routes, the torchvision stub, and the runner's verdict for a release it cannot install."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from staging import CompatStagingContext
from tools.sglang import adopt, torchvision_stub, venvs

pytestmark = pytest.mark.timeout(120)


# Toy code in the two shapes the adopter change recognises (written for this test).
class _Base:
    def clear(self) -> None:
        self.base_cleared = True


class _RebuildingSender(_Base):
    def __init__(self, ctx: Any, room: int) -> None:
        self.ctx, self.room = ctx, room

    def clear(self) -> None:
        super().clear()
        if self.ctx is not None:
            self.ctx.prefetched_rooms.discard(self.room)
            self.ctx.prefetch_requested = {
                k for k in self.ctx.prefetch_requested if k[0] != self.room
            }


def _worker(self: Any, queue: list[int]) -> None:
    for room in queue:
        self.done.append(room)
        if self.ctx is not None:
            for key in list(self.ctx.prefetch_requested):
                if key[0] == room:
                    self.ctx.prefetch_requested.discard(key)
            self.ctx.prefetched_rooms.discard(room)  # the other order: still one site


def _two_sites(ctx: Any, room: int) -> None:
    ctx.prefetched_rooms.discard(room)
    ctx.prefetch_requested = {k for k in ctx.prefetch_requested if k[0] != room}
    ctx.prefetched_rooms.discard(room)
    ctx.prefetch_requested = {k for k in ctx.prefetch_requested if k[0] != room}


def _no_site(ctx: Any, room: int) -> None:
    ctx.prefetched_rooms.discard(room)


def _filled() -> CompatStagingContext:
    ctx = CompatStagingContext()
    ctx.prefetch_requested.update([(1, 0, "s"), (1, 1, "s"), (2, 0, "s")])
    ctx.prefetched_rooms.update([1, 2])
    return ctx


def test_patch_purge_replaces_the_rebuild_and_keeps_super() -> None:
    sender = _RebuildingSender(_filled(), 1)
    with pytest.raises(TypeError, match="purge_room"):
        sender.clear()  # as written: the view refuses the rebind
    patched, rec = adopt.patch_purge(_RebuildingSender.__dict__["clear"], _RebuildingSender)
    patched(sender)
    assert sender.base_cleared  # super() still reaches the base class
    assert sender.ctx.prefetch_requested.snapshot() == {(2, 0, "s")}
    assert sender.ctx.prefetched_rooms.snapshot() == {2}
    assert sender.ctx.stats().tombstones == 1  # it went through purge_room
    first = _RebuildingSender.clear.__code__.co_firstlineno
    assert rec.first_line == first + 3 and rec.last_line > rec.first_line
    assert rec.lines_removed == rec.last_line - rec.first_line + 1 and rec.lines_added == 1
    assert "set comprehension" in rec.replaced
    assert rec.function == "_RebuildingSender.clear"


def test_purge_block_lifts_the_worker_block_as_is_or_adopted() -> None:
    for adopted in (False, True):
        block, rec = adopt.purge_block(_worker, ("self", "room"), adopted=adopted)
        owner = type("Owner", (), {})()
        owner.ctx = _filled()
        block(owner, 1)
        assert owner.ctx.prefetch_requested.snapshot() == {(2, 0, "s")}
        assert owner.ctx.stats().tombstones == (1 if adopted else 0)
        assert "list(prefetch_requested)" in rec.replaced and rec.lines_removed == 4


def test_patch_refuses_code_of_another_shape() -> None:
    with pytest.raises(adopt.AdoptionError, match="found 2"):
        adopt.patch_purge(_two_sites, None)
    with pytest.raises(adopt.AdoptionError, match="found 0"):
        adopt.patch_purge(_no_site, None)
    with pytest.raises(adopt.AdoptionError, match="found 0"):
        adopt.purge_block(_no_site, ("ctx", "room"), adopted=True)
    with pytest.raises(adopt.AdoptionError):
        adopt.find_purge_owner(_Base, "clear")
    assert adopt.find_purge_owner(_RebuildingSender, "clear") is _RebuildingSender


@dataclasses.dataclass
class _Upstreamish:
    buffers: list[int] = dataclasses.field(default_factory=list)
    cv: threading.Condition = dataclasses.field(default_factory=threading.Condition)
    prefetch_requested: set[Any] = dataclasses.field(default_factory=set)
    prefetched_rooms: set[int] = dataclasses.field(default_factory=set)
    sockets: dict[str, Any] = dataclasses.field(default_factory=dict)


@pytest.mark.parametrize("route", adopt.ROUTES)
def test_compat_dataclass_routes(route: str) -> None:
    cls = adopt.compat_dataclass(_Upstreamish, route, tombstones=8)
    assert cls.__name__ == "_Upstreamish" and dataclasses.is_dataclass(cls)
    a, b = cls(), cls()
    names = [f.name for f in dataclasses.fields(cls)]
    assert "prefetch_requested" not in names and "prefetched_rooms" not in names
    assert a == a and a != b  # each has its own Condition, compared by identity
    a.prefetch_requested.add((1, 0, "s"))
    a.prefetch_requested |= {(1, 1, "s")}  # in place: stored back, accepted
    a.prefetched_rooms.add(1)
    with pytest.raises(TypeError, match="purge_room"):
        a.prefetch_requested = set()
    assert "prefetch_requested" not in repr(a).split("staging=")[0]
    assert a.purge_room(1).requests == {(0, "s"), (1, "s")}
    assert not a.prefetch_requested and not b.prefetch_requested
    assert isinstance(a, CompatStagingContext) is (route == "subclass")
    ctx = a if route == "subclass" else a.staging
    assert ctx.stats().tombstone_capacity == 8
    with pytest.raises(ValueError):
        adopt.compat_dataclass(_Upstreamish, "mixin")
    with pytest.raises(adopt.AdoptionError):
        adopt.compat_dataclass(CompatStagingContext, route)


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
