"""Lift the released transfer worker's staging clean-up out of the installed SGLang, to run it.

The test harness (:mod:`tools.sglang.drive`) runs upstream's worker clean-up block in its
worker threads; the rest of ``NixlKVManager.transfer_worker`` needs GPUs and a decode peer.
:func:`purge_block` finds, in the installed function's syntax tree (``inspect``), the one
``if`` block holding the staging purge pair (``<ctx>.prefetched_rooms.discard(<room>)`` next
to a rebuild or a ``for k in list(<ctx>.prefetch_requested): ... .discard(k)`` loop) and
compiles it on its own, in the installed module's namespace, as released (or, for a
comparison, with the pair as ``<ctx>.purge_room(<room>)``). No SGLang source is kept here.

Adoption itself is the plugin's (:mod:`staging.sglang`): this module no longer patches
``clear()`` or builds the staging dataclass (the retired source-patch route); a release
whose worker has another shape raises :class:`AdoptionError`, which fails the run.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any


class AdoptionError(Exception):
    """The installed release does not have the code shape the adopter change expects."""


@dataclasses.dataclass(frozen=True)
class Replacement:
    """One change to upstream code: where, and how many lines."""

    file: str  # relative to the installed ``sglang`` package's parent directory
    function: str  # qualified name
    first_line: int  # 1-based, in the installed file
    last_line: int
    lines_removed: int
    lines_added: int
    replaced: str  # what the removed statements did, in our words

    def describe(self) -> str:
        return (
            f"{self.file}:{self.first_line}-{self.last_line} in {self.function}(): "
            f"{self.replaced} -> purge_room ({self.lines_removed} lines removed, "
            f"{self.lines_added} added)"
        )


# ---------------------------------------------------------------------- finding the pair


def _is_view(node: ast.AST, view: str) -> ast.expr | None:
    """``X`` if ``node`` is ``X.<view>``."""
    if isinstance(node, ast.Attribute) and node.attr == view:
        return node.value
    return None


def _discard_of_rooms(stmt: ast.stmt) -> tuple[ast.expr, ast.expr] | None:
    """``(X, R)`` for ``X.prefetched_rooms.discard(R)``."""
    if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)):
        return None
    call = stmt.value
    if not (isinstance(call.func, ast.Attribute) and call.func.attr == "discard"):
        return None
    ctx = _is_view(call.func.value, "prefetched_rooms")
    if ctx is None or len(call.args) != 1 or call.keywords:
        return None
    return ctx, call.args[0]


def _purge_of_keys(stmt: ast.stmt) -> tuple[ast.expr, str] | None:
    """``(X, how)`` for a rebuild or a list-and-discard loop of ``X.prefetch_requested``."""
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
        ctx = _is_view(stmt.targets[0], "prefetch_requested")
        if ctx is not None and isinstance(stmt.value, ast.SetComp):
            return ctx, "discard + rebuild of prefetch_requested by a set comprehension"
    if isinstance(stmt, ast.For) and isinstance(stmt.iter, ast.Call):
        it = stmt.iter
        if isinstance(it.func, ast.Name) and it.func.id == "list" and len(it.args) == 1:
            ctx = _is_view(it.args[0], "prefetch_requested")
            discards = [
                n
                for n in ast.walk(stmt)
                if isinstance(n, ast.Call)
                and isinstance(n.func, ast.Attribute)
                and n.func.attr == "discard"
                and _is_view(n.func.value, "prefetch_requested") is not None
            ]
            if ctx is not None and discards:
                return ctx, "discard + a loop over list(prefetch_requested) discarding its keys"
    return None


@dataclasses.dataclass
class _Site:
    body: list[ast.stmt]  # the statement list holding the pair
    index: int  # of the first statement of the pair
    owner: ast.AST  # the node whose body it is
    ctx: ast.expr
    room: ast.expr
    how: str


def _find_sites(tree: ast.AST) -> list[_Site]:
    sites: list[_Site] = []
    for owner in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            body = getattr(owner, field, None)
            if not isinstance(body, list):
                continue
            i = 0
            while i < len(body) - 1:
                site = _pair(body, i, owner)
                if site is not None:
                    sites.append(site)
                    i += 2  # a statement belongs to one pair at most
                else:
                    i += 1
    return sites


def _pair(body: list[ast.stmt], i: int, owner: ast.AST) -> _Site | None:
    """The purge pair made of ``body[i]`` and ``body[i + 1]`` (either order), if any."""
    a, b = body[i], body[i + 1]
    for first, second in ((a, b), (b, a)):
        discard = _discard_of_rooms(first)
        keys = _purge_of_keys(second)
        if discard and keys and ast.dump(discard[0]) == ast.dump(keys[0]):
            return _Site(body, i, owner, discard[0], discard[1], keys[1])
    return None


def _purge_stmt(site: _Site) -> ast.stmt:
    first = site.body[site.index]
    call = ast.Call(
        func=ast.Attribute(value=site.ctx, attr="purge_room", ctx=ast.Load()),
        args=[site.room],
        keywords=[],
    )
    return ast.copy_location(ast.Expr(value=call), first)


# ---------------------------------------------------------------------- compiling copies


def _source(fn: Callable[..., Any]) -> tuple[ast.Module, str, int, str]:
    """``fn``'s syntax tree (line numbers as in its file), its file, first line, relative
    file name."""
    fn = inspect.unwrap(fn)
    lines, first = inspect.getsourcelines(fn)
    tree = ast.parse(textwrap.dedent("".join(lines)))
    ast.increment_lineno(tree, first - 1)
    filename = inspect.getsourcefile(fn) or "<unknown>"
    return tree, filename, first, _relative(filename)


def _relative(filename: str) -> str:
    """``sglang/srt/...``: the path inside the installed package."""
    parts = Path(filename).parts
    starts = [i for i, part in enumerate(parts[:-1]) if part == "sglang" and parts[i + 1] == "srt"]
    return "/".join(parts[starts[-1] :]) if starts else filename


def _compile_function(
    fndef: ast.FunctionDef, filename: str, globals_: dict[str, Any], owner: type | None
) -> types.FunctionType:
    """Compile ``fndef`` as a function whose globals are ``globals_`` and whose zero-argument
    ``super()`` refers to ``owner`` (a factory with a ``__class__`` parameter provides the
    cell the compiler looks for)."""
    fndef.decorator_list = []
    factory = ast.FunctionDef(
        name="_nixl_staging_factory",
        args=ast.arguments(
            posonlyargs=[],
            args=[ast.arg(arg="__class__")],
            kwonlyargs=[],
            kw_defaults=[],
            defaults=[],
        ),
        body=[fndef, ast.Return(value=ast.Name(id=fndef.name, ctx=ast.Load()))],
        decorator_list=[],
        returns=None,
        type_comment=None,
    )
    module = ast.Module(body=[factory], type_ignores=[])
    ast.fix_missing_locations(module)
    code = compile(module, filename, "exec")
    factory_code = next(c for c in code.co_consts if isinstance(c, types.CodeType))
    made = types.FunctionType(factory_code, globals_)(owner)
    if not isinstance(made, types.FunctionType):
        raise AdoptionError(f"compiling {fndef.name} gave {made!r}")
    return made


def purge_block(
    fn: Callable[..., Any], params: tuple[str, ...], *, adopted: bool
) -> tuple[types.FunctionType, Replacement]:
    """The ``if`` statement of ``fn`` whose body holds its one staging purge pair, compiled
    on its own as ``block(*params)`` (``params`` name the locals it reads, e.g. ``("self",
    "room")``); with the pair replaced by ``purge_room`` when ``adopted``. The record names
    the lines of the pair.

    Raises:
        AdoptionError: no such ``if``, more than one, or the block reads other locals.
    """
    tree, filename, _, rel = _source(fn)
    sites = [s for s in _find_sites(tree) if isinstance(s.owner, ast.If)]
    if len(sites) != 1:
        raise AdoptionError(
            f"{rel} {fn.__qualname__}: expected one `if` holding the staging purge, "
            f"found {len(sites)}"
        )
    site = sites[0]
    first, second = site.body[site.index], site.body[site.index + 1]
    end = second.end_lineno or second.lineno
    block = site.owner
    assert isinstance(block, ast.If)
    if adopted:
        site.body[site.index : site.index + 2] = [_purge_stmt(site)]
    loaded = {n.id for n in ast.walk(block) if isinstance(n, ast.Name)}
    stored = {
        n.id for n in ast.walk(block) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
    }
    func = getattr(fn, "__func__", fn)
    outer_locals = set(func.__code__.co_varnames) - set(params) - stored
    stray = sorted(loaded & outer_locals)
    if stray:
        raise AdoptionError(f"{rel} {fn.__qualname__}: the block also reads {stray}")
    fndef = ast.FunctionDef(
        name=f"{func.__name__}_staging_block",
        args=ast.arguments(
            posonlyargs=[],
            args=[ast.arg(arg=p) for p in params],
            kwonlyargs=[],
            kw_defaults=[],
            defaults=[],
        ),
        body=[block],
        decorator_list=[],
        returns=None,
        type_comment=None,
    )
    ast.copy_location(fndef, block)
    made = _compile_function(fndef, filename, func.__globals__, None)
    record = Replacement(
        file=rel,
        function=func.__qualname__,
        first_line=first.lineno,
        last_line=end,
        lines_removed=end - first.lineno + 1,
        lines_added=1,
        replaced=site.how,
    )
    return made, record
